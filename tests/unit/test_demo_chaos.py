"""``geofed demo --chaos``: the plan, the verdict (also on an audit log the coordinator's own
transactions wrote), and finding a region's workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from coordinator.state.sqlite import SqliteStore
from coordinator.state.transactions import DeltaOffer, accept_delta, record_publication
from geofed.blobstore import sha256_hex
from geofed.types import Identity, Role
from geofed_cli.demo.chaos import FAULTS, InjectedFault, judge_chaos, plan_chaos, worker_pids


def test_the_faults_are_spread_over_the_job_one_of_each() -> None:
    plan = plan_chaos(10, ["eu-west", "us-east", "ap-south"])
    assert [f.kind for f in plan] == list(FAULTS)
    assert [f.after_round for f in plan] == [2, 4, 5, 7, 9]
    assert [f.target for f in plan] == [
        "agent-eu-west",
        "agent-us-east",
        "coordinator",
        "broker",
        "ap-south",
    ]
    # A short job: faults share rounds, never after the last one.
    assert [f.after_round for f in plan_chaos(3, ["eu-west"])] == [1, 1, 2, 2, 2]
    assert {f.after_round for f in plan_chaos(1, ["eu-west"])} == {0}
    with pytest.raises(ValueError, match="at least one round"):
        plan_chaos(0, ["eu-west"])


def _entry(action: str, round_: int, region: str | None = None, **details: Any) -> dict[str, Any]:
    return {
        "action": action,
        # As the coordinator records them: an acceptance is a decision, a publication done.
        "verdict": "allow" if action == "delta.accept" else "ok",
        "job": "j",
        "round": round_,
        "region": region,
        "details": details,
    }


AUDIT = [
    _entry("delta.accept", 0, "eu-west"),
    _entry("delta.accept", 0, "us-east"),
    _entry("round.publish", 0, included=["eu-west", "us-east"], params_hash="a" * 64),
    _entry("delta.accept", 1, "eu-west"),
    _entry("round.publish", 1, included=["eu-west"], params_hash="b" * 64),
]
FAULT = InjectedFault("kill-agent", "agent-eu-west", 1, 12.5, "SIGKILL to pid 7")


def test_nothing_lost_and_every_region_agreeing_is_a_clean_run() -> None:
    statuses: list[dict[str, Any]] = [
        {"region": "eu-west", "job": "j", "round": 2, "params_hash": "b" * 64},
        {"region": "us-east", "job": "j", "round": 1, "params_hash": "a" * 64},
        {"region": "ap-south", "state": "offline"},  # not in the job: not judged
    ]
    report = judge_chaos("j", ["eu-west", "us-east"], AUDIT, statuses, [FAULT])
    assert report.lost == []
    assert report.regions["eu-west"].startswith("agrees with θ_2")
    assert report.regions_agree
    assert report.ok
    assert report.to_json()["injected"][0]["detail"] == "SIGKILL to pid 7"
    assert report.to_json()["accepted"] == 3


def test_a_lost_delta_a_double_publication_and_a_stray_region_are_named() -> None:
    audit = [
        *AUDIT,
        _entry("delta.accept", 1, "us-east"),  # accepted, but round 1 left it out
        _entry("round.publish", 1, included=["eu-west"], params_hash="b" * 64),
        _entry("delta.accept", 2, "eu-west"),  # accepted; round 2 never published
        {**_entry("delta.accept", 3, "eu-west"), "verdict": "deny"},  # not accepted
    ]
    statuses = [
        {"region": "eu-west", "job": "j", "round": 2, "params_hash": "c" * 64},
        {"region": "us-east", "job": "other", "round": 9},
        {"region": "ap-south", "job": "j", "round": 7, "params_hash": "d" * 64},
    ]
    report = judge_chaos("j", ["eu-west", "us-east", "ap-south", "sa-east"], audit, statuses, [])
    assert report.lost == [
        "round 1 was published 2 times",
        "us-east's accepted delta of round 1 was not included",
        "eu-west's accepted delta of round 2: never published",
    ]
    assert report.regions["eu-west"].startswith("differs: θ_2 is cccccccccccc there")
    assert report.regions["us-east"] == "reports no state of job j"
    assert report.regions["ap-south"] == "reports θ_7 without a hash to compare"
    assert report.regions["sa-east"] == "reports no state of job j"
    assert report.accepted == 5  # the refused one is not counted
    assert not report.ok


def _process(proc: Path, pid: int, ppid: int, command: str) -> None:
    entry = proc / str(pid)
    entry.mkdir()
    (entry / "stat").write_text(f"{pid} (python3 (x)) S {ppid} {pid} {pid} 0 -1")
    (entry / "cmdline").write_bytes(command.replace(" ", "\0").encode())


def test_a_regions_workers_are_found_by_descent_not_by_session(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    _process(proc, 100, 1, "python -m geofed_cli agent --config agent-eu-west.yaml")
    _process(proc, 110, 100, "python -m torch.distributed.run -m regional_agent.worker.rank")
    _process(proc, 111, 110, "python -m regional_agent.worker.rank --workdir w")
    _process(proc, 112, 110, "python -m regional_agent.worker.rank --workdir w")
    _process(proc, 200, 1, "python -m geofed_cli agent --config agent-us-east.yaml")
    _process(proc, 211, 200, "python -m regional_agent.worker.rank --workdir v")
    # A launcher that forks its ranks: they have its command line, it has not forked yet.
    forking = "python -m regional_agent.launch.forking_run -m regional_agent.worker.rank"
    _process(proc, 300, 1, "python -m geofed_cli agent --config agent-ap-south.yaml")
    _process(proc, 310, 300, forking)
    _process(proc, 311, 310, forking)
    _process(proc, 312, 310, forking)
    _process(proc, 400, 1, "python -m geofed_cli agent --config agent-sa-east.yaml")
    _process(proc, 410, 400, forking)
    (proc / "self").mkdir()
    assert worker_pids(100, proc) == [111, 112]
    assert worker_pids(200, proc) == [211]
    assert worker_pids(300, proc) == [311, 312]
    assert worker_pids(400, proc) == []
    assert worker_pids(999, proc) == []


def _offer(region: str, round_: int) -> DeltaOffer:
    actor = Identity("acme", Role.REGION, region)
    manifest = sha256_hex(f"{region}/{round_}".encode())
    return DeltaOffer(region, round_, manifest, sha256_hex(manifest.encode()), 1, 100, 2.0, actor)


def test_a_delta_accepted_and_never_published_is_reported_from_a_real_audit_log(
    tmp_path: Path,
) -> None:
    """The audit log as the coordinator's own transactions write it, in SQLite."""
    store = SqliteStore(tmp_path / "state.db")
    store.create_job("j", {}, "running")
    coordinator = Identity("acme", Role.COORDINATOR, "main")
    for region in ("eu-west", "us-east"):
        accept_delta(store, "j", _offer(region, 0), {"phase": "collecting"}, "quorum")
    details = {"included": ["eu-west", "us-east"], "params_hash": "a" * 64}
    record_publication(
        store, "j", 0, {"phase": "published"}, {"version": "1"},
        completed=False, actor=coordinator, details=details,
    )  # fmt: skip
    # Round 1: eu-west's delta is accepted, then the round is never published.
    accept_delta(store, "j", _offer("eu-west", 1), {"phase": "collecting"}, "quorum")
    audit = [entry.to_dict() for entry in store.audit_entries(0, 1000, "j")]
    store.close()
    assert {(e["action"], e["verdict"]) for e in audit} == {
        ("delta.accept", "allow"),
        ("round.publish", "ok"),
    }
    statuses = [
        {"region": "eu-west", "job": "j", "round": 1, "params_hash": "a" * 64},
        {"region": "us-east", "job": "j", "round": 1, "params_hash": "a" * 64},
    ]
    report = judge_chaos("j", ["eu-west", "us-east"], audit, statuses, [])
    assert report.lost == ["eu-west's accepted delta of round 1: never published"]
    assert report.regions_agree
