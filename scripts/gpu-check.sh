#!/usr/bin/env bash
# Every GPU figure geofed needs, in one run of about 8 minutes (docs/gpu.md):
#   scripts/gpu-check.sh [--out DIR] [--only STEP,...] [--cpu]
# PYTHON names the interpreter (default python3, the GPU image's own).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m benchmarks.gpu_check "$@"
