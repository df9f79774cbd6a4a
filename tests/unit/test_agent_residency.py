"""The region's own residency gate: asked before training and before every upload."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

from geofed.codec import ErrorFeedback
from geofed.codec_params import CodecParams
from geofed.params import parameters_vector_hash, state_to_fp32
from policies import PolicySet, load_policies
from regional_agent.credentials import Credentials
from regional_agent.handoff.directory import HandoffDir
from regional_agent.metrics import AgentMetrics
from regional_agent.rounds.delta import DeltaOrigin, delta_manifest, encode_delta, sign_delta
from regional_agent.rounds.pipeline import PipelineRegion, RetryLater, RoundPipeline
from regional_agent.rounds.residency import export_decision
from regional_agent.state import AgentState, DeltaMeta
from regional_agent.transfer.sync import ResyncFailed
from tests.support.agent_credentials import agent_credentials
from tests.support.agent_schedule import REGION, announce
from tests.support.pki import make_federation
from tests.support.tiny_task import TinyTask

REPO = Path(__file__).resolve().parents[2]
OWN_DATASETS = ("eu-parliament-proceedings",)
#: A dataset eu-west does not declare: its policy lets no delta trained on it leave.
FOREIGN_DATASETS = ("us-public-domain-books",)


@pytest.fixture(scope="module")
def policies() -> PolicySet:
    return load_policies([REPO / "configs" / "policies"])


@pytest.fixture(scope="module")
def credentials(tmp_path_factory: pytest.TempPathFactory) -> Credentials:
    fed = make_federation(tmp_path_factory.mktemp("pki"))
    principal = fed.region(REGION)
    return agent_credentials(fed, principal)


class Recorder:
    """Stands in for the worker group, the synchronizer and the uploader: records calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.handoff: HandoffDir | None = None  # the worker group's, set by pipeline()

    async def run_round(self, *args: Any) -> Any:
        self.calls.append("train")
        raise AssertionError("a round whose delta may not leave must not be trained")

    async def sync(self, *args: Any) -> Any:
        self.calls.append("sync")
        raise ResyncFailed("stopped here: the round went past the residency gate")

    async def upload(self, *args: Any) -> Any:
        self.calls.append("upload")
        raise AssertionError("a delta the policy refuses must not be uploaded")


class Status:
    def update(self, state: str, **fields: Any) -> None:
        pass


def pipeline(
    root: Path,
    credentials: Credentials,
    policies: PolicySet,
    datasets: tuple[str, ...],
    recorder: Recorder,
) -> tuple[RoundPipeline, AgentMetrics]:
    metrics = AgentMetrics(CollectorRegistry(), REGION)
    recorder.handoff = HandoffDir(root / "workers")
    built = RoundPipeline(
        PipelineRegion(credentials, policies, datasets),
        AgentState(root),
        cast(Any, recorder),
        cast(Any, recorder),
        cast(Any, recorder),
        cast(Any, Status()),
        metrics=metrics,
        train_timeout_s=5.0,
        clock=lambda: datetime.now(UTC),
    )
    return built, metrics


def denials(metrics: AgentMetrics) -> float:
    value = metrics.registry.get_sample_value(
        "geofed_agent_policy_denials_total", {"region": REGION, "kind": "model_delta"}
    )
    return value or 0.0


def test_the_own_policy_decides_where_deltas_may_go(policies: PolicySet) -> None:
    allowed = export_decision(policies, "eu-west", ["eu-parliament-proceedings"])
    assert allowed.allowed
    assert "eu-west:exports.model_delta[0]" in str(allowed)
    unknown = export_decision(policies, "eu-west", ["us-public-domain-books"])
    assert not unknown.allowed
    assert "eu-west declares no dataset us-public-domain-books" in unknown.reason


async def test_a_refused_export_never_starts_training(
    tmp_path: Path, credentials: Credentials, policies: PolicySet
) -> None:
    recorder = Recorder()
    rounds, metrics = pipeline(tmp_path, credentials, policies, FOREIGN_DATASETS, recorder)
    end = await rounds.run(announce(round_=0))
    assert end.outcome == "refused"
    assert "own policy" in end.detail
    assert "eu-west declares no dataset us-public-domain-books" in end.detail
    assert recorder.calls == []  # neither synced nor trained nor uploaded
    assert denials(metrics) == 1


async def test_an_allowed_export_goes_on_to_the_round(
    tmp_path: Path, credentials: Credentials, policies: PolicySet
) -> None:
    recorder = Recorder()
    rounds, metrics = pipeline(tmp_path, credentials, policies, OWN_DATASETS, recorder)
    end = await rounds.run(announce(round_=0))
    assert (end.outcome, recorder.calls) == ("failed", ["sync"])
    assert denials(metrics) == 0


def spool_delta(root: Path, credentials: Credentials, round_: int) -> None:
    """A delta of ``round_`` spooled by an earlier run, under an earlier policy."""
    base = state_to_fp32(TinyTask().build_model(seed=1))
    local = {name: t + 0.01 for name, t in base.items()}
    encoded = encode_delta(base, local, ErrorFeedback(), CodecParams())
    origin = DeltaOrigin(
        job="llm",
        round=round_,
        base_round=round_,
        base_hash=parameters_vector_hash(base),
        tokens=32,
        producer=credentials.identity,
        jurisdiction="EU",
        datasets=OWN_DATASETS,
    )
    signed = sign_delta(delta_manifest(origin, encoded.stream, now=datetime.now(UTC)), credentials)
    meta = DeltaMeta(train_loss=1.0, tokens=32, params_hash=origin.base_hash)
    job = AgentState(root).job("llm")
    job.write_spool(round_, signed.to_bytes(), encoded.frames, encoded.feedback, meta)


@pytest.mark.parametrize(
    ("spooled_round", "refusals"),
    # A delta of an earlier round is refused while settling it; this round is then
    # refused before training.
    [(1, 1), (0, 2)],
    ids=["this round", "an earlier round"],
)
async def test_a_spooled_delta_is_checked_again_before_it_is_uploaded(
    tmp_path: Path,
    credentials: Credentials,
    policies: PolicySet,
    spooled_round: int,
    refusals: int,
) -> None:
    spool_delta(tmp_path, credentials, spooled_round)
    recorder = Recorder()
    rounds, metrics = pipeline(tmp_path, credentials, policies, FOREIGN_DATASETS, recorder)
    end = await rounds.run(announce(round_=1))
    assert end.outcome == "refused"
    assert "own policy" in end.detail
    assert "upload" not in recorder.calls
    assert "train" not in recorder.calls
    assert AgentState(tmp_path).job("llm").spooled_rounds() == []
    assert denials(metrics) == refusals


async def test_a_damaged_spooled_delta_is_made_again_not_sent(
    tmp_path: Path, credentials: Credentials, policies: PolicySet, caplog: pytest.LogCaptureFixture
) -> None:
    spool_delta(tmp_path, credentials, 1)
    stream = AgentState(tmp_path).job("llm").spool_dir(1) / "stream.bin"
    data = bytearray(stream.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit flipped on disk since it was spooled
    stream.write_bytes(bytes(data))
    recorder = Recorder()
    rounds, _ = pipeline(tmp_path, credentials, policies, OWN_DATASETS, recorder)
    end = await rounds.run(announce(round_=1))
    # Checked against its manifest first: dropped, and the round goes on to make its
    # delta again (here it stops at the sync).
    assert "upload" not in recorder.calls
    assert recorder.calls == ["sync"]
    assert "stopped here" in end.detail, end
    assert AgentState(tmp_path).job("llm").spooled_rounds() == []
    assert "the spooled delta is damaged" in caplog.text
    assert "sha256" in caplog.text


class VanishingSpool(Recorder):
    """An uploader under which the spooled stream file is removed (a hand's rm, a disk
    replaced) as it starts reading it."""

    async def upload(self, job: str, delta: Any, *args: Any) -> Any:
        self.calls.append("upload")
        delta.stream_path.unlink()
        return delta.read_frame(0)


async def test_a_spool_removed_under_the_upload_is_retried_not_fatal(
    tmp_path: Path, credentials: Credentials, policies: PolicySet
) -> None:
    spool_delta(tmp_path, credentials, 1)
    recorder = VanishingSpool()
    rounds, _ = pipeline(tmp_path, credentials, policies, OWN_DATASETS, recorder)
    with pytest.raises(RetryLater, match=r"local storage: .*No such file or directory"):
        await rounds.run(announce(round_=1))
    assert recorder.calls == ["upload"]
    # What is left of the spool is dropped: the next try makes the delta again.
    assert AgentState(tmp_path).job("llm").spooled_rounds() == []
