"""The daemons' exit codes, and the systemd units that rely on them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from geofed.exit_codes import ExitCode

REPO = Path(__file__).resolve().parents[2]


def test_the_table() -> None:
    assert [(code.name, int(code)) for code in ExitCode] == [
        ("OK", 0),
        ("RUNTIME", 1),
        ("CONFIG", 2),
    ]


@pytest.mark.parametrize("unit", ["geofed-coordinator.service", "geofed-agent@.service"])
def test_the_units_restart_on_failure_but_not_on_a_configuration_error(unit: str) -> None:
    text = (REPO / "deploy" / "systemd" / unit).read_text()
    assert re.search(r"^Restart=on-failure$", text, re.MULTILINE)
    prevent = re.search(r"^RestartPreventExitStatus=(.+)$", text, re.MULTILINE)
    assert prevent is not None
    assert prevent[1].split() == [str(int(ExitCode.CONFIG))]
