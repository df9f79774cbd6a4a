"""Where a benchmark's results go: JSON and markdown side by side, written atomically."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from geofed.fsutil import atomic_write_bytes


def publish(report: dict[str, Any], out: Path, markdown: str) -> None:
    """Write ``out`` (JSON) and ``out`` with ``.md``, print the markdown and say where."""
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, (json.dumps(report, indent=2) + "\n").encode())
    atomic_write_bytes(out.with_suffix(".md"), markdown.encode())
    print(markdown)
    print(f"wrote {out} and {out.with_suffix('.md')}", file=sys.stderr)
