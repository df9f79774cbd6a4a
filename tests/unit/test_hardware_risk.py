"""A region's hardware risk and what it calls for: a snapshot, a regional checkpoint, a drain."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from coordinator.config import ConfigError, parse_config
from coordinator.jobs.spec import parse_job_spec
from coordinator.publication.snapshot_policy import rearmed, risk_snapshot
from coordinator.publication.snapshots import JobSnapshots
from coordinator.scheduling.hardware_risk import (
    REARM_RISK,
    SNAPSHOT_RISK,
    Risk,
    drain_due,
    job_risk,
    region_risk,
)
from geofed.control import HardwareSummary
from tests.support.configs import MINIMAL_COORDINATOR as MINIMAL

NOW = 10_000.0


def node(**figures: object) -> HardwareSummary:
    return HardwareSummary.model_validate({"host": "gpu-node-1", "gpus": 8, **figures})


def test_a_healthy_or_unreported_region_has_no_risk() -> None:
    assert region_risk(node(max_temperature_c=70.0), 0, [], NOW) == Risk(0.0, "no sign of trouble")
    assert region_risk(None, None, [], NOW).score == 0.0
    # Errors the region had when first seen are not new.
    assert region_risk(node(ecc_uncorrected=3), 3, [], NOW).score == 0.0
    assert region_risk(node(ecc_uncorrected=3), None, [], NOW).score == 0.0


@pytest.mark.parametrize(
    ("figures", "first", "failures", "score", "reason"),
    [
        ({"ecc_uncorrected": 1}, 0, [], 0.8, "1 new uncorrectable ECC error(s) (0.80)"),
        ({"ecc_uncorrected": 5}, 2, [], 0.9, "3 new uncorrectable ECC error(s) (0.90)"),
        ({"slowed_gpus": 2}, None, [], 0.4, "2 GPU(s) slowed down (0.40)"),
        ({"max_temperature_c": 86.0}, None, [], 0.3, "a GPU at 86 °C (0.30)"),
        ({"max_temperature_c": 92.0}, None, [], 0.5, "a GPU at 92 °C (0.50)"),
        # Failures of the last hour only (one is older).
        ({}, None, [NOW - 4000, NOW - 600, NOW - 60], 0.4, "2 failure(s) in the last hour (0.40)"),
    ],
)
def test_each_sign_and_its_reason(
    figures: dict[str, object], first: int | None, failures: list[float], score: float, reason: str
) -> None:
    risk = region_risk(node(**figures), first, failures, NOW)
    assert risk.score == pytest.approx(score)
    assert risk.reason == reason


def test_signs_combine_as_independent_chances() -> None:
    risk = region_risk(node(slowed_gpus=2, max_temperature_c=91.0), None, [NOW - 10], NOW)
    assert risk.score == pytest.approx(1 - (1 - 0.4) * (1 - 0.5) * (1 - 0.2))
    assert risk.reason == (
        "2 GPU(s) slowed down (0.40); a GPU at 91 °C (0.50); 1 failure(s) in the last hour (0.20)"
    )
    assert 0.0 <= region_risk(node(ecc_uncorrected=99, slowed_gpus=8), 0, [NOW] * 9, NOW).score <= 1


def test_a_jobs_risk_is_its_riskiest_regions() -> None:
    risks = {"us-east": Risk(0.3, "a GPU at 86 °C (0.30)"), "eu-west": Risk(0.8, "ecc")}
    assert job_risk(risks) == Risk(0.8, "eu-west: ecc", "eu-west")
    assert job_risk({}).score == 0.0


def test_a_risk_snapshot_comes_again_only_at_a_further_rise_or_after_it_fell_back() -> None:
    high = Risk(0.82, "eu-west: 2 new uncorrectable ECC error(s) (0.85)", "eu-west")
    decision = risk_snapshot(high, acted_at=None)
    assert decision is not None
    assert decision.take
    assert decision.reason == (
        f"hardware risk 0.82 reached {SNAPSHOT_RISK}: "
        "eu-west: 2 new uncorrectable ECC error(s) (0.85)"
    )
    assert risk_snapshot(high, acted_at=0.82) is None  # taken already: the interval rules
    assert risk_snapshot(Risk(0.88, "a bit worse"), acted_at=0.82) is None
    assert risk_snapshot(Risk(0.95, "another region"), acted_at=0.82) is not None  # worse
    assert risk_snapshot(Risk(0.69, "below"), acted_at=None) is None
    # A dip that stays above REARM_RISK (a reading missing) does not re-arm it...
    assert rearmed(Risk(0.6, "dip"), 0.82) == 0.82
    # ...falling below it does: the next rise to 0.7 snapshots again.
    assert rearmed(Risk(REARM_RISK - 0.01, "calm"), 0.82) is None


def test_gpus_not_read_against_the_capacity_are_a_sign() -> None:
    risk = region_risk(node(gpus=6), None, [], NOW, gpus_offered=8)
    assert (risk.score, risk.reason) == (0.5, "2 of its 8 GPU(s) not read (0.50)")
    assert region_risk(node(gpus=8), None, [], NOW, gpus_offered=8).score == 0.0
    assert region_risk(node(gpus=0), None, [], NOW, gpus_offered=0).score == 0.0


def test_a_region_is_drained_at_the_threshold_once_a_rise() -> None:
    high = Risk(0.95, "4 new uncorrectable ECC error(s) (0.95)")
    assert drain_due(high, 0.9, drained=False) == (
        "hardware risk 0.95 reached 0.9: 4 new uncorrectable ECC error(s) (0.95)",
        False,
    )
    assert drain_due(high, 0.9, drained=True) == (None, True), "drained already"
    assert drain_due(high, None, drained=False) == (None, False), "drain_at: null never drains"
    assert drain_due(Risk(0.85, "x"), 0.9, drained=False) == (None, False)
    assert drain_due(Risk(0.6, "x"), 0.9, drained=True) == (None, True), "still up: drained"
    assert drain_due(Risk(0.4, "x"), 0.9, drained=True) == (None, False), "fell back: rearmed"


def test_the_drain_threshold_is_configured_never_below_the_snapshot_threshold() -> None:
    assert parse_config(MINIMAL, "c.yaml", base=Path("/")).hardware_risk.drain_at == 0.9
    off = parse_config(MINIMAL + "hardware_risk: {drain_at: null}\n", "c.yaml", base=Path("/"))
    assert off.hardware_risk.drain_at is None
    with pytest.raises(ConfigError) as caught:
        parse_config(MINIMAL + "hardware_risk: {drain_at: 0.5}\n", "c.yaml", base=Path("/"))
    assert caught.value.problems == (
        "c.yaml:9: hardware_risk.drain_at: Input should be greater than or equal to 0.7 (got 0.5)",
    )


class _FakeControlPlane:
    """A fake at the outer edge, the MQTT broker: the region statuses the coordinator
    took in, and the commands it sent out (recorded; refused while not ``delivering``)."""

    def __init__(self, ecc: int) -> None:
        self.regions: dict[str, object] = {}
        self.ecc_first_seen = {("eu-west", "gpu-node-1"): 0}
        self.last_hardware = {"eu-west": node(ecc_uncorrected=ecc)}
        self.commands: list[tuple[str, str, str, str, int | None]] = []
        #: Whether the broker takes the commands (False: as while it is unreachable).
        self.delivering = True

    def on_region_change(self, _: object) -> None:
        pass

    async def command(
        self, region: str, action: str, job: str, reason: str, round: int | None = None
    ) -> bool:
        if self.delivering:
            self.commands.append((region, action, job, reason, round))
        return self.delivering

    async def event(self, *_: object, **__: object) -> None:
        pass


def job_snapshots(
    tmp_path: Path, control: _FakeControlPlane, more_regions: str = ""
) -> JobSnapshots:
    """The snapshot policy of job ``tiny`` in eu-west (and ``more_regions``, spec lines)."""
    spec = parse_job_spec(
        "job: tiny\ntask:\n  spec: tests.support.tiny_task:TinyTask\nregions:\n"
        f"  eu-west: [eu-parliament-proceedings]\n{more_regions}"
        "rounds: 9\ninner_steps: 2\ncheckpoint_storage: [eu-ckpt]\n",
        "job.yaml",
    )
    services: Any = SimpleNamespace(
        config=parse_config(MINIMAL, "c.yaml", base=tmp_path),
        control=control,
        metrics=SimpleNamespace(
            snapshot_interval=SimpleNamespace(labels=lambda **_: SimpleNamespace(set=id))
        ),
        executors=SimpleNamespace(files=_run),
        clock=lambda: NOW,
    )
    no_snapshots = SimpleNamespace(entries=lambda _job: [])
    publishing = SimpleNamespace(location=SimpleNamespace(store=no_snapshots))
    ctx: Any = SimpleNamespace(job="tiny", spec=spec, publishing=publishing)
    return JobSnapshots(services, ctx, lambda _: True, {})


async def test_the_job_asks_the_risky_region_for_a_checkpoint_and_drains_it_once(
    tmp_path: Path,
) -> None:
    control = _FakeControlPlane(ecc=2)
    snapshots = job_snapshots(tmp_path, control, "  us-east: [us-public-domain-books]\n")

    def round_state(round_: int) -> Any:
        config = SimpleNamespace(round=round_, opened_at=NOW - 10, participants=("eu-west",))
        return SimpleNamespace(config=config, ended_at=NOW, stragglers=())

    assert snapshots.decide(round_state(0)).take
    await snapshots.published(round_state(0))
    ask = ("eu-west", "checkpoint", "tiny", "hardware risk: θ_1 was snapshotted for it", 1)
    assert control.commands == [ask], "0.85 asks a checkpoint, below the drain threshold"
    control.last_hardware["eu-west"] = node(ecc_uncorrected=4)
    control.delivering = False  # the broker away: the drain is sent again next round
    await snapshots.published(round_state(1))
    control.delivering = True
    await snapshots.published(round_state(2))
    await snapshots.published(round_state(3))
    drain = "hardware risk 0.95 reached 0.9: 4 new uncorrectable ECC error(s) (0.95)"
    assert control.commands == [ask, ("eu-west", "drain", "tiny", drain, None)], "once"
    control.last_hardware["eu-west"] = node(ecc_uncorrected=0)
    await snapshots.published(round_state(4))
    control.last_hardware["eu-west"] = node(ecc_uncorrected=4)
    await snapshots.published(round_state(5))
    assert len(control.commands) == 3, "again after it fell back below REARM_RISK and rose"


async def test_a_restarted_coordinator_remembers_the_drains_and_the_failures(
    tmp_path: Path,
) -> None:
    """An operator who starts a drained region again is not overruled after a restart of
    the coordinator, and the last hour's failures still count toward the risk."""
    control = _FakeControlPlane(ecc=4)
    config = SimpleNamespace(round=0, opened_at=NOW - 10, participants=("eu-west",))
    missed: Any = SimpleNamespace(config=config, ended_at=NOW, stragglers=("eu-west",))
    await job_snapshots(tmp_path, control).published(missed)
    assert [c[1] for c in control.commands] == ["drain"]

    restarted = job_snapshots(tmp_path, control)
    await restarted.recover()
    assert "1 failure(s) in the last hour" in restarted.risk().reason
    config = SimpleNamespace(round=1, opened_at=NOW - 10, participants=("eu-west",))
    on_time: Any = SimpleNamespace(config=config, ended_at=NOW, stragglers=())
    await restarted.published(on_time)
    assert [c[1] for c in control.commands] == ["drain"], "not drained again"


async def test_missed_deadlines_alone_never_drain_a_region(tmp_path: Path) -> None:
    """Failures raise the risk (and snapshot at 0.7), but only the hardware drains: a
    region that misses deadlines on a slow WAN is not taken out."""
    control = _FakeControlPlane(ecc=0)
    snapshots = job_snapshots(tmp_path, control)
    for round_ in range(6):
        config = SimpleNamespace(round=round_, opened_at=NOW - 10, participants=("eu-west",))
        missed: Any = SimpleNamespace(config=config, ended_at=NOW, stragglers=("eu-west",))
        await snapshots.published(missed)
    assert snapshots.risk().score >= 0.9, snapshots.risk()
    assert [c for c in control.commands if c[1] == "drain"] == []


async def _run(function: Any, *args: Any) -> Any:
    return function(*args)
