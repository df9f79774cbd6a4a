"""The face imports torch only for the commands that need it.

``geofed --help``, ``geofed status`` and the other commands that only talk to the
coordinator must start quickly on a busy operator's machine; torch alone takes seconds
to import there. Each is run in a fresh interpreter (this one imported torch long ago),
answering ``--help`` so that nothing is contacted, and must leave torch unimported.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

_PROBE = """
import json, sys
from geofed_cli import main
for argv in json.loads(sys.argv[1]):
    try:
        main(argv)
    except SystemExit:
        pass
print(json.dumps(sorted(m for m in ("torch", "numpy") if m in sys.modules)))
"""

_LIGHT = [
    ["--help"],
    ["status", "--help"],
    ["job", "status", "--help"],
    ["jobs", "--help"],
    ["audit", "--help"],
    ["lineage", "--help"],
    ["pki", "--help"],
]


def test_commands_that_only_talk_to_the_coordinator_do_not_import_torch() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(_LIGHT)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
