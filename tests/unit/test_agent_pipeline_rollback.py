"""The round pipeline asks the coordinator before it counts a delivered round as done,
rebuilds a damaged progress record from what the coordinator holds, and drops a held θ the
workers found to be another."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

from policies import PolicySet, load_policies
from regional_agent.credentials import Credentials
from regional_agent.handoff.messages import RoundInstruction, RoundResult
from regional_agent.metrics import AgentMetrics
from regional_agent.rounds.pipeline import PipelineRegion, RoundPipeline
from regional_agent.state import AgentState, ParamsVersion
from regional_agent.transfer.sync import ResyncFailed, Synced
from tests.support.agent_credentials import agent_credentials
from tests.support.agent_schedule import REGION, announce
from tests.support.handoff_samples import SUMMARY
from tests.support.pki import make_federation
from tests.support.tiny_task import TinyTask

REPO = Path(__file__).resolve().parents[2]
JOB = "llm"
ROUND = 3


@pytest.fixture(scope="module")
def policies() -> PolicySet:
    return load_policies([REPO / "configs" / "policies"])


@pytest.fixture(scope="module")
def credentials(tmp_path_factory: pytest.TempPathFactory) -> Credentials:
    fed = make_federation(tmp_path_factory.mktemp("pki"))
    principal = fed.region(REGION)
    return agent_credentials(fed, principal)


class Coordinator:
    """Stands in for the synchronizer (what the coordinator says) and the worker group."""

    def __init__(self, delivered: set[str]) -> None:
        self.delivered_regions = delivered
        self.calls: list[str] = []
        self.handoff = self

    async def coordinator_version(self, job: str) -> ParamsVersion:
        self.calls.append("version")
        return ParamsVersion(ROUND, f"{ROUND:064x}")  # the announced base

    async def delivered(self, job: str, round_: int) -> frozenset[str]:
        self.calls.append("delivered")
        return frozenset(self.delivered_regions)

    async def sync(self, *args: Any) -> Any:
        self.calls.append("sync")
        raise ResyncFailed("stopped here: the round is being run again")

    def pending_instruction(self) -> None:
        return None

    def forget_job(self, job: str) -> None:
        self.calls.append("forget")


class Status:
    def update(self, state: str, **fields: Any) -> None:
        pass


def delivered_round(root: Path) -> None:
    """This region holds θ_ROUND and delivered round ROUND (the coordinator accepted it)."""
    job = AgentState(root).job(JOB)
    params = TinyTask().build_model(seed=1).state_dict()
    job.save_params(ParamsVersion(ROUND, f"{ROUND:064x}"), params)
    job.promote(ROUND)


def pipeline(
    root: Path, credentials: Credentials, policies: PolicySet, fake: Coordinator
) -> RoundPipeline:
    return RoundPipeline(
        PipelineRegion(credentials, policies, ("eu-parliament-proceedings",)),
        AgentState(root),
        cast(Any, fake),
        cast(Any, fake),
        cast(Any, fake),
        cast(Any, Status()),
        metrics=AgentMetrics(CollectorRegistry(), REGION),
        train_timeout_s=5.0,
        clock=lambda: datetime.now(UTC),
    )


async def test_a_round_announced_again_whose_delta_the_coordinator_holds_is_done(
    tmp_path: Path, credentials: Credentials, policies: PolicySet
) -> None:
    delivered_round(tmp_path)
    fake = Coordinator(delivered={REGION})
    end = await pipeline(tmp_path, credentials, policies, fake).run(announce(JOB, ROUND))
    assert end.outcome == "accepted", end
    assert fake.calls == ["version", "delivered"]
    assert AgentState(tmp_path).job(JOB).uploaded_round() == ROUND


async def test_a_delta_the_restored_coordinator_lost_is_delivered_again(
    tmp_path: Path, credentials: Credentials, policies: PolicySet, caplog: pytest.LogCaptureFixture
) -> None:
    delivered_round(tmp_path)
    fake = Coordinator(delivered={"us-east"})
    end = await pipeline(tmp_path, credentials, policies, fake).run(announce(JOB, ROUND))
    # The job's state is discarded, and the round runs again from a resync.
    assert fake.calls == ["version", "delivered", "forget", "sync"]
    assert end.outcome == "failed", end
    assert "stopped here" in end.detail, end
    assert AgentState(tmp_path).job(JOB).progress() == (None, None)
    assert f"coordinator rolled back from round {ROUND} to {ROUND}" in caplog.text


def damage_progress(root: Path) -> None:
    (root / "jobs" / JOB / "progress.json").write_bytes(b'{"uploaded_round": 3')  # cut short


async def test_a_damaged_progress_record_is_rebuilt_from_the_coordinators_receipt(
    tmp_path: Path, credentials: Credentials, policies: PolicySet, caplog: pytest.LogCaptureFixture
) -> None:
    delivered_round(tmp_path)
    damage_progress(tmp_path)
    fake = Coordinator(delivered={REGION})
    end = await pipeline(tmp_path, credentials, policies, fake).run(announce(JOB, ROUND))
    assert end.outcome == "accepted", end
    assert fake.calls[0] == "delivered"
    assert AgentState(tmp_path).job(JOB).uploaded_round() == ROUND
    assert "progress.json: not JSON" in caplog.text
    assert f"which holds this region's delta of round {ROUND}" in caplog.text


async def test_a_damaged_progress_record_without_a_receipt_runs_the_round(
    tmp_path: Path, credentials: Credentials, policies: PolicySet, caplog: pytest.LogCaptureFixture
) -> None:
    delivered_round(tmp_path)
    damage_progress(tmp_path)
    fake = Coordinator(delivered={"us-east"})
    end = await pipeline(tmp_path, credentials, policies, fake).run(announce(JOB, ROUND))
    # Nothing recorded any more: the round is trained again (here: stopped at its sync).
    assert fake.calls[0] == "delivered"
    assert "sync" in fake.calls
    assert "stopped here" in end.detail, end
    assert AgentState(tmp_path).job(JOB).uploaded_round() is None
    assert f"which does not hold this region's delta of round {ROUND}" in caplog.text


class WorkersOfAnotherTheta(Coordinator):
    """The held θ is the announced one (no download), and the workers report that the file
    they trained from hashes otherwise (it changed on disk since the agent recorded it)."""

    async def sync(self, announcement: Any, held: Any, places: Any) -> Synced:
        self.calls.append("sync")
        return Synced(held.path, held.version, "held")

    async def run_round(self, instruction: RoundInstruction, timeout_s: float) -> RoundResult:
        self.calls.append("train")
        summary = replace(
            SUMMARY, job=instruction.job, round=instruction.round, base_params_hash="e" * 64
        )
        return RoundResult(summary)


async def test_a_held_theta_the_workers_found_to_be_another_is_dropped(
    tmp_path: Path, credentials: Credentials, policies: PolicySet
) -> None:
    job = AgentState(tmp_path).job(JOB)
    job.save_params(
        ParamsVersion(ROUND, f"{ROUND:064x}"), TinyTask().build_model(seed=1).state_dict()
    )
    fake = WorkersOfAnotherTheta(delivered=set())
    end = await pipeline(tmp_path, credentials, policies, fake).run(announce(JOB, ROUND))
    assert end.outcome == "failed", end
    assert f"the workers trained from θ {'e' * 64}, not {ROUND:064x}" in end.detail
    assert fake.calls == ["sync", "train"]
    assert job.current_version() is None  # the next sync resyncs instead of trying it again
