#!/usr/bin/env bash
# Install the binaries the integration tests run for real: mosquitto (MQTT broker, mTLS
# and ACL tests) and promtool (alert rule tests, from Debian's prometheus package).
# Idempotent: does nothing when both are already on PATH.
set -euo pipefail

missing=()
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || missing+=(mosquitto)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
    echo "missing system packages: ${missing[*]}" >&2
    echo "install them with: sudo apt-get update && sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
    exit 1
fi
echo "installing system packages: ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
