"""The systemd units in deploy/systemd, checked by systemd's own tools, offline.

PID 1 is not systemd here, but ``systemd-analyze verify`` and ``systemd-analyze
security --offline=yes`` work on unit files alone. ``verify`` insists that ExecStart's
binary exists, so each unit is checked as a copy whose ExecStart points at a fake
install prefix in tmp_path (a stub executable; everything else is the shipped text).
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
UNITS_DIR = REPO / "deploy" / "systemd"
UNITS = ("geofed-coordinator.service", "geofed-agent@.service")
SYSTEMD_ANALYZE = Path("/usr/bin/systemd-analyze")
INSTALLED_GEOFED = "/opt/geofed/venv/bin/geofed"
MAX_EXPOSURE = 2.0
_EXPOSURE = re.compile(r"Overall exposure level for (\S+): (\d+(?:\.\d+)?) (\S+)")


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    if not SYSTEMD_ANALYZE.exists():
        pytest.fail(
            f"{SYSTEMD_ANALYZE} not found: install systemd >= 252 (apt-get install -y systemd); "
            "PID 1 need not be systemd"
        )
    return subprocess.run(
        [str(SYSTEMD_ANALYZE), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "notice", "SYSTEMD_COLORS": "0"},
    )


@dataclass(frozen=True)
class Unit:
    """A unit file's settings: (section, key) -> values in order (keys may repeat)."""

    path: Path
    settings: dict[tuple[str, str], list[str]]

    @classmethod
    def read(cls, path: Path) -> Unit:
        settings: dict[tuple[str, str], list[str]] = {}
        section = ""
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("["):
                section = line.strip("[]")
                continue
            key, _, value = line.partition("=")
            settings.setdefault((section, key), []).append(value)
        return cls(path, settings)

    def get(self, section: str, key: str) -> str:
        values = self.settings.get((section, key), [])
        assert len(values) == 1, f"{self.path.name}: [{section}] {key}= set {len(values)} times"
        return values[0]

    def all(self, section: str, key: str) -> list[str]:
        return self.settings.get((section, key), [])


@pytest.fixture(scope="module")
def fake_prefix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fake install prefix: a stub ``geofed`` for verify's "is it executable" check."""
    prefix = tmp_path_factory.mktemp("fake-opt-geofed")
    stub = prefix / "venv" / "bin" / "geofed"
    stub.parent.mkdir(parents=True)
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    return prefix


def installable_copy(name: str, directory: Path, fake_prefix: Path, *, as_name: str = "") -> Path:
    text = (UNITS_DIR / name).read_text()
    assert text.count(f"ExecStart={INSTALLED_GEOFED} ") == 1, f"{name}: ExecStart moved"
    copy = directory / (as_name or name)
    copy.write_text(text.replace(INSTALLED_GEOFED, str(fake_prefix / "venv" / "bin" / "geofed")))
    return copy


# The template is also checked as an instance, so %i expands to a real region name.
CHECKED = [(name, name) for name in UNITS] + [
    ("geofed-agent@.service", "geofed-agent@eu-west.service")
]


@pytest.mark.parametrize(("name", "as_name"), CHECKED)
def test_unit_verifies_cleanly(name: str, as_name: str, tmp_path: Path, fake_prefix: Path) -> None:
    unit = installable_copy(name, tmp_path, fake_prefix, as_name=as_name)
    result = analyze("verify", "--man=no", str(unit))
    output = (result.stdout + result.stderr).strip()
    # verify exits 0 even for unknown keys and unparsable values, so any output fails.
    assert result.returncode == 0, output
    assert output == "", f"systemd-analyze verify {as_name}:\n{output}"


def test_verify_reports_what_it_should(tmp_path: Path, fake_prefix: Path) -> None:
    """The check above can fail: a misspelt key and a bad value are reported."""
    unit = installable_copy(UNITS[0], tmp_path, fake_prefix)
    text = unit.read_text().replace("ProtectSystem=strict", "ProtectSystm=strict")
    unit.write_text(text.replace("KillMode=mixed", "KillMode=mixd"))
    output = analyze("verify", "--man=no", str(unit)).stderr
    assert "Unknown key 'ProtectSystm'" in output
    assert "mixd" in output


@pytest.mark.parametrize(("name", "as_name"), CHECKED)
def test_unit_exposure_is_ok(name: str, as_name: str, tmp_path: Path) -> None:
    unit = tmp_path / as_name
    shutil.copyfile(UNITS_DIR / name, unit)
    result = analyze("security", "--offline=yes", str(unit))
    assert result.returncode == 0, result.stderr
    match = _EXPOSURE.search(result.stdout)
    assert match, f"no overall exposure line in:\n{result.stdout}\n{result.stderr}"
    score = float(match.group(2))
    print(f"{as_name}: exposure {score} {match.group(3)}")
    assert score <= MAX_EXPOSURE, f"{as_name} exposure {score} > {MAX_EXPOSURE}:\n{result.stdout}"


@pytest.mark.parametrize("name", UNITS)
def test_unit_speaks_the_daemons_contract(name: str) -> None:
    """What verify cannot judge: the settings the daemons and operators rely on."""
    unit = Unit.read(UNITS_DIR / name)
    service = "Service"
    assert unit.get(service, "Type") == "notify"
    assert unit.get(service, "NotifyAccess") == "main"
    assert unit.get(service, "WatchdogSec") == "30s"
    assert unit.get(service, "WatchdogSignal") == "SIGABRT"
    assert unit.get(service, "Restart") == "on-failure"
    assert unit.get(service, "RestartPreventExitStatus") == "2"  # config errors
    assert unit.get(service, "KillMode") == "mixed"
    # StartLimit* in [Service] is a deprecated alias that newer systemd may drop.
    assert unit.get("Unit", "StartLimitIntervalSec")
    assert unit.get("Unit", "StartLimitBurst")
    assert not unit.all(service, "StartLimitIntervalSec")
    assert unit.get(service, "User") == "geofed"
    assert unit.get(service, "ConfigurationDirectory") == "geofed"
    assert unit.get(service, "UMask") == "0077"
    assert unit.get(service, "CapabilityBoundingSet") == ""
    assert unit.get(service, "ProtectSystem") == "strict"
    assert "PYTHONFAULTHANDLER=1" in unit.all(service, "Environment")
    exec_start = unit.get(service, "ExecStart").split()
    assert exec_start[0] == INSTALLED_GEOFED
    if name == "geofed-coordinator.service":
        assert exec_start[1:] == ["coordinator", "--config", "/etc/geofed/coordinator.yaml"]
        assert unit.get(service, "StateDirectory") == "geofed/coordinator"
        assert unit.get(service, "MemoryDenyWriteExecute") == "yes"
        assert "AF_NETLINK" not in unit.get(service, "RestrictAddressFamilies")
    else:
        assert exec_start[1:] == ["agent", "--config", "/etc/geofed/agent-%i.yaml"]
        assert unit.get(service, "StateDirectory") == "geofed/agent-%i"
        assert unit.get(service, "MemoryDenyWriteExecute") == "no"
        assert unit.get(service, "OOMPolicy") == "continue"
        assert "AF_NETLINK" in unit.get(service, "RestrictAddressFamilies")


def _seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(s|min)", value)
    assert match, f"unexpected time span {value!r}"
    return int(match.group(1)) * (60 if match.group(2) == "min" else 1)


def test_stop_timeouts_outlast_the_daemons_own_deadlines() -> None:
    """systemd's SIGKILL must not cut a clean shutdown short."""
    from aiohttp.web import BaseRunner

    from regional_agent.drain import DEFAULT_GRACE_S
    from regional_agent.launch.worker_group import WorkerGroupConfig

    coordinator = Unit.read(UNITS_DIR / "geofed-coordinator.service")
    agent = Unit.read(UNITS_DIR / "geofed-agent@.service")
    # The coordinator's HTTP server waits this long for in-flight requests on SIGTERM.
    graceful_s = inspect.signature(BaseRunner.__init__).parameters["shutdown_timeout"].default
    assert _seconds(coordinator.get("Service", "TimeoutStopSec")) >= graceful_s + 15
    # The agent drains (finishes the round within the default grace), then stops its
    # worker group (then SIGKILLs it) before it exits.
    worker_stop_s = WorkerGroupConfig().stop_timeout_s
    assert _seconds(agent.get("Service", "TimeoutStopSec")) >= (
        DEFAULT_GRACE_S + worker_stop_s + 15
    )


# What the coordinator computes: decode regions' deltas, aggregate, outer step, encode.
_COORDINATOR_WORK = """
import ctypes, mmap, sys
PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) != 0:
    sys.exit(f"prctl(PR_SET_MDWE) failed with errno {ctypes.get_errno()}: needs Linux >= 6.3")
try:
    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
except OSError:
    pass
else:
    sys.exit("a writable and executable mapping was allowed: the restriction is not in force")

import torch
from coordinator.aggregation.weighted import aggregate
from coordinator.aggregation.outer_optimizer import OuterOptimizer
from geofed.codec import decode, decode_pieces, encode

params = {"w": torch.randn(300, 257), "b": torch.randn(257)}
specs = {n: tuple(t.shape) for n, t in params.items()}
streams = {
    region: encode({n: torch.randn_like(t) for n, t in params.items()}, scheme=scheme)
    for region, scheme in (("eu-west", "int8"), ("us-east", "int4"))
}
mean = aggregate(specs, {r: (100.0, lambda b=b: decode_pieces(b)) for r, b in streams.items()})
optimizer = OuterOptimizer()
stepped = optimizer.step(optimizer.step(params, mean), mean)
decode(encode({n: stepped[n] - params[n] for n in params}, scheme="int8"))

# And its evaluation process: the example task's model (GELU) evaluated as it does there.
import io, json
from coordinator.jobs.initial_build import initial_parameters
from coordinator.publication.evaluation_process import evaluate_in_process
from geofed.task import load_task
example, options = "geofed.examples.charlm:CharLMTask", {"d_model": 32, "n_layers": 1}
buffer = io.BytesIO()
torch.save(initial_parameters(load_task(example, options), 0), buffer)
metrics = evaluate_in_process(example, json.dumps(options), 0, buffer.getvalue())
assert "val_loss" in metrics, metrics
print("coordinator tensor work ok")
"""


def test_coordinator_tensor_work_needs_no_writable_executable_memory() -> None:
    """Backs MemoryDenyWriteExecute=yes in the coordinator unit, its evaluation process
    (which inherits it) included.

    systemd 252 enforces it with a seccomp filter; Linux >= 6.3 offers the same rule per
    process (PR_SET_MDWE: no mapping both writable and executable, none made executable
    later), which a child process can apply to itself without systemd.
    """
    result = subprocess.run(
        [sys.executable, "-c", _COORDINATOR_WORK],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "coordinator tensor work ok" in result.stdout
