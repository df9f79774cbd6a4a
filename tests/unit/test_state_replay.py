"""The coordinator's working state saved now and then, rebuilt exactly by replaying rounds.

Rounds published without saving their working state move only the version pointers; a
restart loads the saved state and takes the rounds after it again from their kept deltas
(:mod:`coordinator.storage.replay`). The rebuilt θ, momentum and residual must be the
published ones bit for bit, and a replay that cannot be exact must refuse, saying why.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch

from coordinator.aggregation.outer_optimizer import OuterOptimizer, OuterOptimizerConfig
from coordinator.aggregation.outer_round import (
    DeltaSource,
    JobPublishing,
    publish_initial,
    publish_round,
)
from coordinator.publication.snapshot_policy import decide_state_save
from coordinator.rounds.quarantine import Quarantine, QuarantineConfig
from coordinator.rounds.records import RoundRecord
from coordinator.rounds.state import RoundConfig, RoundState
from coordinator.state.store import Receipt
from coordinator.storage.replay import ReplayRound, replay_inputs, replay_rounds
from coordinator.storage.working_state import (
    ParamsError,
    WorkingState,
    read_pointers,
)
from geofed.codec import encode_stream
from geofed.codec_params import CodecParams
from geofed.deltas import pseudo_gradient
from tests.support.publishing import job_publishing

INT8 = CodecParams(scheme="int8", block_size=32, zstd_level=1)
REGIONS = (("us-east", 300), ("eu-west", 100))


def _params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "layer.weight": torch.randn(12, 10, generator=gen),
        "layer.bias": torch.randn(12, generator=gen),
        "head.weight": torch.randn(3, 12, generator=gen),
    }


def _publishing(tmp_path: Path) -> JobPublishing:
    shapes = {name: tuple(t.shape) for name, t in _params().items()}
    return job_publishing(tmp_path, shapes, INT8, snapshot_every=100)


def _round_deltas(job: JobPublishing, state: WorkingState) -> ReplayRound:
    """Both regions' deltas for round ``state.version``, stored; arrival: eu-west first."""
    sources = []
    for index, (region, tokens) in enumerate(REGIONS):
        gen = torch.Generator().manual_seed(100 * state.version + index)
        local = {
            name: t - 0.01 * torch.randn(t.shape, generator=gen) for name, t in state.params.items()
        }
        stream = encode_stream(pseudo_gradient(state.params, local), INT8, chunk_elements=64)
        sources.append(DeltaSource(region, tokens, job.deltas.put(stream.to_bytes())))
    return ReplayRound(state.version, tuple(sources), ("eu-west", "us-east"))


def _run(
    job: JobPublishing, rounds: int, save_at: set[int]
) -> tuple[WorkingState, dict[str, str], list[ReplayRound]]:
    """Publish ``rounds`` rounds, saving the working state only when θ_v has v in
    ``save_at``; the pointers as the commits would leave them."""
    optimizer = OuterOptimizer(OuterOptimizerConfig(lr=0.7, momentum=0.9))
    state, pointers, _ = publish_initial(job, _params(), optimizer, datetime.now(UTC))
    taken = []
    for _ in range(rounds):
        replayed = _round_deltas(job, state)
        taken.append(replayed)
        published = publish_round(
            job,
            state,
            replayed.sources,
            datetime.now(UTC),
            order=replayed.order,
            save_state=state.version + 1 in save_at,
        )
        state = published.state
        pointers.update(published.pointers)
    return state, pointers, taken


def _assert_same(found: WorkingState, expected: WorkingState) -> None:
    assert found.version == expected.version
    assert found.params_hash == expected.params_hash
    for name, tensor in expected.params.items():
        assert torch.equal(found.params[name], tensor)
    assert expected.residual is not None
    assert found.residual is not None
    for name, tensor in expected.residual.items():
        assert torch.equal(found.residual[name], tensor)
    momentum = expected.optimizer_state["momentum_buffers"]
    assert momentum, "the outer optimizer kept no momentum to compare"
    for name, tensor in momentum.items():
        assert torch.equal(found.optimizer_state["momentum_buffers"][name], tensor)
    assert found.optimizer_state["steps"] == expected.optimizer_state["steps"]


def test_rounds_after_the_saved_state_replay_to_the_same_bits(tmp_path: Path) -> None:
    job = _publishing(tmp_path)
    state, pointers, taken = _run(job, rounds=5, save_at={2})
    head = read_pointers(pointers)
    assert (head.version, head.saved.version) == (5, 2)
    saved = job.params_store.load(pointers)
    assert saved.version == 2

    rebuilt = replay_rounds(job, saved, taken[2:], head)

    _assert_same(rebuilt, state)
    assert rebuilt.saved == head.saved


def test_a_replay_that_cannot_be_exact_is_refused(tmp_path: Path) -> None:
    job = _publishing(tmp_path)
    _, pointers, taken = _run(job, rounds=3, save_at=set())
    head = read_pointers(pointers)
    saved = job.params_store.load(pointers)
    assert saved.version == 0

    with pytest.raises(ParamsError, match=r"replaying rounds \[0, 1\], not \[0, 1, 2\]"):
        replay_rounds(job, saved, taken[:2], head)
    # Weighted otherwise the mean is other bits: θ's hash says so.
    first, *others = taken[2].sources
    reweighed = (DeltaSource(first.region, first.tokens + 1, first.blob_digest), *others)
    changed = [*taken[:2], ReplayRound(2, reweighed, taken[2].order)]
    with pytest.raises(ParamsError, match=r"hashes to .*, not the recorded"):
        replay_rounds(job, saved, changed, head)
    job.deltas.delete(taken[1].sources[0].blob_digest)
    with pytest.raises(ParamsError, match="round 1 cannot be replayed: a delta it summed"):
        replay_rounds(job, saved, taken, head)


def _record(published: bool) -> RoundRecord:
    config = RoundConfig(
        round=3, participants=("eu-west", "us-east"), min_regions=2, opened_at=1000.0, deadline_s=60
    )
    state = RoundState.open(config)
    state.on_delta("us-east", 3, 1010.0)
    state.on_delta("eu-west", 3, 1020.0)
    state.tick(1021.0)
    if published:
        state.mark_published(1030.0)
    return RoundRecord(state, 1, 0, "", Quarantine(QuarantineConfig()))


def _receipt(region: str) -> Receipt:
    return Receipt("job-1", 3, region, "ab" * 32, region[:2] * 32, 10, 5, 1000.0)


def test_replay_inputs_come_from_the_published_record_in_arrival_order() -> None:
    receipts = [_receipt("eu-west"), _receipt("us-east")]
    replayed = replay_inputs(3, _record(published=True), receipts)
    assert replayed.order == ("us-east", "eu-west")
    assert replayed.digests == ("eu" * 32, "us" * 32)
    with pytest.raises(ParamsError, match="round 3 has no published record"):
        replay_inputs(3, _record(published=False), receipts)
    with pytest.raises(ParamsError, match="round 3 has no published record"):
        replay_inputs(3, None, receipts)
    with pytest.raises(ParamsError, match=r"receipts of \['eu-west'\], but the round summed"):
        replay_inputs(3, _record(published=True), receipts[:1])


def test_a_merged_late_delta_is_replayed_at_its_place_and_staleness() -> None:
    config = RoundConfig(
        round=3, participants=("eu-west", "us-east"), min_regions=2, opened_at=1000.0, deadline_s=60
    )
    state = RoundState.open(config)
    state.on_delta("us-east", 3, 1010.0)
    state.merge("eu-west", 1, 1015.0)  # its delta for round 1, two rounds late
    state.on_delta("eu-west", 3, 1020.0)
    state.tick(1021.0)
    state.mark_published(1030.0)
    record = RoundRecord(state, 1, 0, "", Quarantine(QuarantineConfig()))
    late = Receipt("job-1", 1, "eu-west", "cd" * 32, "ee" * 32, 10, 6, 900.0)
    replayed = replay_inputs(3, record, [_receipt("eu-west"), _receipt("us-east")], [late])
    assert replayed.order == ("us-east", "eu-west@1", "eu-west")
    merged = next(s for s in replayed.sources if s.round is not None)
    assert (merged.key, merged.staleness, merged.weight) == ("eu-west@1", 2, 2.0)
    assert "ee" * 32 in replayed.digests
    with pytest.raises(ParamsError, match=r"but the round summed \['eu-west', 'eu-west@1'"):
        replay_inputs(3, record, [_receipt("eu-west"), _receipt("us-east")])


def test_pointers_say_which_state_is_saved() -> None:
    base = {"version": "4", "params": "p", "params_hash": "h4", "outer_state": "o"}
    base["ef_residual"] = ""
    # Written before states were saved now and then: the state is version's own.
    old = read_pointers(base)
    assert (old.version, old.saved.version, old.saved.params_hash) == (4, 4, "h4")
    newer = read_pointers({**base, "saved": "2", "saved_hash": "h2"})
    assert (newer.version, newer.params_hash, newer.saved.version) == (4, "h4", 2)
    assert newer.saved.params_hash == "h2"
    with pytest.raises(ParamsError, match=r"saved version 5 is not within 0\.\.4"):
        read_pointers({**base, "saved": "5", "saved_hash": "h5"})
    with pytest.raises(ParamsError, match="saved at version 2 has no recorded hash"):
        read_pointers({**base, "saved": "2"})
    with pytest.raises(ParamsError, match="lacks pointers"):
        read_pointers({"version": "4"})


@pytest.mark.parametrize(
    ("version", "saved", "snapshot", "last", "take", "reason"),
    [
        (5, None, False, False, True, "no saved working state known"),
        (5, 2, True, False, True, "saved with the snapshot"),
        (5, 2, False, True, True, "the job's last round"),
        (12, 2, False, False, True, "10 round(s) since the state saved at 2"),
        (11, 2, False, False, False, "9 round(s) since the state saved at 2, below 10"),
    ],
)
def test_when_the_working_state_is_saved(
    version: int, saved: int | None, snapshot: bool, last: bool, take: bool, reason: str
) -> None:
    decision = decide_state_save(version, saved, snapshot=snapshot, last=last, every=10)
    assert (decision.take, decision.reason) == (take, reason)
