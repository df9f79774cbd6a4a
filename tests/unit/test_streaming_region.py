"""overlap: streaming on the region's side: which tensors a round deals in, what crosses
the hand-off, the partial fold and the partial quantized delta with its error feedback."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from geofed.codec import quantize_tensors
from geofed.codec_params import CodecParams
from geofed.fragments import FragmentError, fragment_plan
from geofed.params import shapes_of
from regional_agent.handoff.delta_terms import UnusableDelta
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.errors import InvalidHandoffData
from regional_agent.handoff.messages import (
    DeltaRequest,
    RoundInstruction,
    RoundResult,
    RoundSummary,
)
from regional_agent.handoff.overlap import (
    apply_correction,
    next_instruction,
    round_names,
    speculate_next,
    speculation_unusable,
    take_snapshot,
)
from regional_agent.handoff.residual_file import Residual, read_residual, write_residual
from regional_agent.rounds.delta import check_worker_delta
from regional_agent.rounds.overlap_pipeline import DelayedRounds
from regional_agent.rounds.pipeline import RoundFragments
from regional_agent.worker.device_delta import quantize_round_delta
from tests.support.agent_schedule import announce
from tests.support.handoff_samples import stream_file

CODEC = CodecParams(scheme="int8", block_size=16)
# Four tensors of distinct sizes, in θ's order; F = 2 splits them {w1, b2} / {w2, b1}.
THETA = {
    "w1": torch.linspace(-1, 1, 96).reshape(8, 12),
    "b1": torch.linspace(0, 1, 8),
    "w2": torch.linspace(1, -1, 90).reshape(9, 10),
    "b2": torch.linspace(-0.5, 0.5, 4),
}
TRAINED = {name: t * 0.9 + 0.01 for name, t in THETA.items()}
F = 2


def names_of(round_: int) -> tuple[str, ...]:
    return fragment_plan({n: tuple(t.shape) for n, t in THETA.items()}, F).names(round_)


def streaming_instruction(round_: int, **overrides: Any) -> RoundInstruction:
    fields: dict[str, Any] = {
        "job": "job-a",
        "round": round_,
        "base_params": f"/state/params/round-{round_}.pt",
        "inner_steps": 5,
        "task": "tests.support.tiny_task:TinyTask",
        "task_options": {},
        "seed": 1,
        "region": "eu-west",
        "region_index": 0,
        "num_regions": 2,
        "overlap": "streaming",
        "delta": DeltaRequest(CODEC, "/state/jobs/job-a/feedback.pt", 64, names_of(round_)),
    }
    fields.update(overrides)
    return RoundInstruction(**fields)


# -- which tensors -----------------------------------------------------------------------


def test_a_rounds_names_are_its_fragment_in_thetas_order() -> None:
    assert names_of(0) == ("w1", "b2")
    assert names_of(1) == ("b1", "w2")
    assert round_names("streaming", F, THETA, 0) == ("w1", "b2")
    assert round_names("streaming", F, THETA, 3) == ("b1", "w2")
    # θ's order, not the plan's: reversed θ gives the names reversed.
    reordered = dict(reversed(list(THETA.items())))
    assert round_names("streaming", F, reordered, 0) == ("b2", "w1")
    assert round_names("delayed", None, THETA, 0) is None
    assert round_names("none", None, THETA, 0) is None
    with pytest.raises(FragmentError, match="cannot be split"):
        round_names("streaming", 5, THETA, 0)
    with pytest.raises(ValueError, match="must say its fragments"):
        round_names("streaming", None, THETA, 0)


def test_the_pipeline_takes_this_rounds_the_next_rounds_and_the_folded_fragment() -> None:
    shapes = shapes_of(THETA)  # as the held θ file's header gives them
    fragments = RoundFragments.of(announce(round_=3, overlap="streaming", fragments=F), shapes)
    assert fragments == RoundFragments(names_of(3), names_of(4), names_of(2))
    first = RoundFragments.of(announce(round_=0, overlap="streaming", fragments=F), shapes)
    assert first.fold is None  # round 0 loads θ_0 whole
    assert RoundFragments.of(announce(round_=3, overlap="delayed"), shapes) == RoundFragments()


# -- the hand-off ------------------------------------------------------------------------


def test_names_and_fold_round_trip_through_the_instruction_file() -> None:
    spec = next_instruction(streaming_instruction(3), "/state/params/round-4.pt", names=names_of(4))
    assert spec.fold == names_of(3)
    assert spec.delta is not None
    assert spec.delta.names == names_of(4)
    assert RoundInstruction.from_json(spec.to_json()) == spec
    data = json.loads(spec.to_json())
    assert data["fold"] == list(names_of(3))
    assert data["delta"]["names"] == list(names_of(4))


def test_an_instruction_written_without_names_or_fold_still_parses() -> None:
    delayed = replace(
        streaming_instruction(3), overlap="delayed", delta=DeltaRequest(CODEC, "/f.pt", 64)
    )
    data = json.loads(delayed.to_json())
    del data["fold"]
    del data["delta"]["names"]
    parsed = RoundInstruction.from_json(json.dumps(data).encode())
    assert parsed == delayed
    assert parsed.fold is None
    assert parsed.delta is not None
    assert parsed.delta.names is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"fold": ("w1",)}, "fold is for the speculative rounds"),  # not base_pending
        ({"fold": (), "base_pending": True}, "fold must be a non-empty tuple"),
        ({"fold": ("w1", "w1"), "base_pending": True}, r"fold repeats \['w1'\]"),
        ({"delta": None}, "needs a delta request naming"),
        ({"delta": DeltaRequest(CODEC, "/f.pt", 64)}, "needs a delta request naming"),
    ],
)
def test_bad_streaming_fields_are_refused(change: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidHandoffData, match=message):
        streaming_instruction(4, **change)


def test_fold_is_only_for_streaming_jobs() -> None:
    with pytest.raises(InvalidHandoffData, match="fold is for"):
        streaming_instruction(
            4,
            overlap="delayed",
            base_pending=True,
            fold=("w1",),
            delta=DeltaRequest(CODEC, "/f.pt", 64),
        )


@pytest.mark.parametrize(
    ("names", "message"),
    [
        ((), "non-empty tuple"),
        (("w1", ""), "non-empty string"),
        (("b1", "b1"), "repeats"),
        (["w1"], "non-empty tuple"),
    ],
)
def test_bad_request_names_are_refused(names: object, message: str) -> None:
    with pytest.raises(InvalidHandoffData, match=message):
        DeltaRequest(CODEC, "/f.pt", 64, cast(Any, names))


def test_bad_names_in_an_instruction_file_are_refused_by_name() -> None:
    data = json.loads(streaming_instruction(3).to_json())
    data["delta"]["names"] = "w1"
    with pytest.raises(InvalidHandoffData, match=r"round-3\.instruction\.json: delta\.names"):
        RoundInstruction.from_json(json.dumps(data).encode(), "round-3.instruction.json")


# -- speculation -------------------------------------------------------------------------


def test_streaming_speculates_like_delayed() -> None:
    assert speculate_next("streaming", 0, 5)
    assert not speculate_next("streaming", 4, 5)
    assert speculate_next("streaming", 4, None)


def test_a_speculative_streaming_round_stands_for_the_announced_one_with_the_same_fragments() -> (
    None
):
    spec = next_instruction(streaming_instruction(3), "/state/params/round-4.pt", names=names_of(4))
    assert (spec.overlap, spec.base_pending, spec.round) == ("streaming", True, 4)
    wanted = replace(streaming_instruction(4), evaluate_base=True)
    assert speculation_unusable(spec, wanted, resync=False, fold=names_of(3)) is None
    # θ changed in other tensors than it would fold in.
    reason = speculation_unusable(spec, wanted, resync=False, fold=names_of(4))
    assert reason is not None
    assert "folds in" in reason
    assert speculation_unusable(spec, wanted, resync=False) is not None  # θ changed wholly
    # The announced round's delta is another fragment.
    other = replace(wanted, delta=replace(wanted.delta, names=names_of(3)))  # type: ignore[type-var]
    reason = speculation_unusable(spec, other, resync=False, fold=names_of(3))
    assert reason is not None
    assert "delta" in reason
    # A delayed speculation never stands for a streaming round, nor the reverse.
    delayed = replace(
        wanted, overlap="delayed", delta=DeltaRequest(CODEC, "/state/jobs/job-a/feedback.pt", 64)
    )
    assert speculation_unusable(spec, delayed, resync=False, fold=names_of(3)) is not None


def test_the_next_instruction_of_a_streaming_round_needs_the_next_fragment() -> None:
    with pytest.raises(ValueError, match="fragments"):
        next_instruction(streaming_instruction(3), "/p/round-4.pt")


class _Workers:
    """The worker group's hand-off directory; collect_round records what it was asked."""

    def __init__(self, root: Path) -> None:
        self.handoff = HandoffDir(root)
        self.collected: list[int] = []

    async def collect_round(self, job: str, round_: int, timeout_s: float) -> RoundResult:
        self.collected.append(round_)
        summary = RoundSummary(
            job=job,
            round=round_,
            steps=5,
            tokens=10,
            mean_loss=1.0,
            cursor=25,
            base_params_hash="h" * 64,
            params_hash="p" * 64,
            world_size=1,
            train_seconds=1.0,
            base_folded_at_step=2,
        )
        return RoundResult(summary)


async def test_the_speculative_round_is_used_only_if_it_folds_what_theta_changed(
    tmp_path: Path,
) -> None:
    workers = _Workers(tmp_path)
    rounds = DelayedRounds(cast(Any, workers), "eu-west", 5.0)
    promised = "/state/params/round-4.pt"
    spec = next_instruction(streaming_instruction(3), promised, names=names_of(4))
    workers.handoff.write_instruction(spec)
    wanted = streaming_instruction(4, base_params=promised)
    assert await rounds.train(wanted, "h" * 64, names_of(3)) is not None
    assert workers.collected == [4]
    assert workers.handoff.read_base_ready("job-a", 4) is not None

    # Round 5's speculation folds round 4's fragment; the agent expects another one.
    spec = next_instruction(wanted, "/state/params/round-5.pt", names=names_of(5))
    workers.handoff.write_instruction(spec)
    answered = asyncio.create_task(_answer_cancel(workers.handoff, 5))
    wanted = streaming_instruction(5, base_params="/state/params/round-5.pt")
    assert await rounds.train(wanted, "h" * 64, names_of(5)) is None
    await answered
    assert workers.collected == [4]
    assert workers.handoff.read_base_ready("job-a", 5) is None


async def _answer_cancel(handoff: HandoffDir, round_: int) -> None:
    """What the workers do with a cancel: an error marker for the round."""
    for _ in range(500):
        if handoff.cancel_requested("job-a", round_):
            break
        await asyncio.sleep(0.01)
    handoff.write_error("job-a", round_, "the delayed round was cancelled by the agent")


async def test_the_agent_writes_the_speculative_round_with_its_fragment_and_fold(
    tmp_path: Path,
) -> None:
    workers = _Workers(tmp_path)
    rounds = DelayedRounds(cast(Any, workers), "eu-west", 5.0)
    announcement = announce(job="job-a", round_=3, overlap="streaming", fragments=F, total_rounds=9)
    promised = Path("/state/params/round-4.pt")
    await rounds.speculate(announcement, streaming_instruction(3), promised, names=names_of(4))
    spec = workers.handoff.read_instruction("job-a", 4)
    assert spec.base_pending
    assert spec.fold == names_of(3)
    assert spec.delta is not None
    assert spec.delta.names == names_of(4)


# -- the fold ----------------------------------------------------------------------------


def _state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(t.shape, generator=generator) for name, t in THETA.items()}


def test_a_fold_of_a_fragment_leaves_every_other_tensor_bit_identical() -> None:
    fold = names_of(0)
    y, theta_next, progress = _state(1), _state(2), _state(3)
    snapshot = take_snapshot(y, fold)
    assert set(snapshot) == set(fold)  # S holds the fragment only
    for name in y:
        y[name].add_(progress[name])  # steps taken before θ came
    before = {name: t.clone() for name, t in y.items()}
    ids = {name: id(t) for name, t in y.items()}
    # θ holds only the fragment's tensors here: the others are not needed.
    apply_correction(y, {n: theta_next[n] for n in fold}, snapshot, fold)
    for name in y:
        assert id(y[name]) == ids[name]
        if name in fold:
            torch.testing.assert_close(y[name], theta_next[name] + progress[name])
        else:
            assert torch.equal(y[name], before[name]), name


def test_a_fold_naming_a_tensor_the_model_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match="no tensors"):
        take_snapshot(_state(1), ("w1", "w9"))


# -- the delta and its error feedback ----------------------------------------------------


def _save(path: Path, state: dict[str, torch.Tensor]) -> Path:
    torch.save(state, path)
    return path


def _quantize(
    tmp_path: Path, round_: int, names: tuple[str, ...] | None, base: Path
) -> tuple[Any, dict[str, torch.Tensor]]:
    request = DeltaRequest(CODEC, str(tmp_path / "feedback.pt"), 64, names)
    residual_path = tmp_path / f"round-{round_}.residual.pt"
    quantized, _ = quantize_round_delta(
        request,
        job="job-a",
        round_=round_,
        region="eu-west",
        base_path=str(base),
        local=TRAINED,
        residual_path=residual_path,
        kept=None,
    )
    written = read_residual(residual_path)
    assert isinstance(written, Residual)
    return quantized, {name: t.clone() for name, t in written.tensors.items()}


def test_the_delta_holds_only_the_fragment_and_carries_the_others_residual(
    tmp_path: Path,
) -> None:
    base = _save(tmp_path / "theta.pt", THETA)
    feedback = tmp_path / "feedback.pt"
    # Round 0: no residual yet; the fragment's delta alone, in θ's order.
    quantized, after0 = _quantize(tmp_path, 0, names_of(0), base)
    assert [spec.name for spec in quantized.specs] == list(names_of(0))
    want, want_residual = quantize_tensors(
        {n: THETA[n] - TRAINED[n] for n in names_of(0)}, CODEC, chunk_elements=64
    )
    assert [p.tolist() for p in quantized.payloads] == [p.tolist() for p in want.payloads]
    assert after0.keys() == set(names_of(0))  # only tensors that have a residual
    for name in names_of(0):
        assert torch.equal(after0[name], want_residual[name])

    # Round 1 (the other fragment), the agent holding round 0's residual: that residual
    # is carried unchanged, the new fragment's starts from zero.
    write_residual(feedback, 0, after0)
    quantized, after1 = _quantize(tmp_path, 1, names_of(1), base)
    assert [spec.name for spec in quantized.specs] == list(names_of(1))
    zero = {n: torch.zeros_like(THETA[n]) for n in names_of(1)}
    want, want_residual = quantize_tensors(
        {n: THETA[n] - TRAINED[n] for n in names_of(1)}, CODEC, chunk_elements=64, residual=zero
    )
    assert [p.tolist() for p in quantized.payloads] == [p.tolist() for p in want.payloads]
    assert list(after1) == list(THETA)  # every tensor that has one, in θ's order
    for name in names_of(0):
        assert torch.equal(after1[name], after0[name]), name
    for name in names_of(1):
        assert torch.equal(after1[name], want_residual[name]), name

    # Round 2 (fragment 0 again): its residual is used and replaced; fragment 1's kept.
    write_residual(feedback, 1, after1)
    quantized, after2 = _quantize(tmp_path, 2, names_of(2), base)
    want, want_residual = quantize_tensors(
        {n: THETA[n] - TRAINED[n] for n in names_of(2)},
        CODEC,
        chunk_elements=64,
        residual={n: after1[n] for n in names_of(2)},
    )
    assert [p.tolist() for p in quantized.payloads] == [p.tolist() for p in want.payloads]
    for name in names_of(1):
        assert torch.equal(after2[name], after1[name]), name
    for name in names_of(2):
        assert torch.equal(after2[name], want_residual[name]), name


def test_a_request_naming_a_tensor_the_model_lacks_is_unusable(tmp_path: Path) -> None:
    base = _save(tmp_path / "theta.pt", THETA)
    with pytest.raises(UnusableDelta, match="lacks"):
        _quantize(tmp_path, 0, ("w1", "w9"), base)
    assert not (tmp_path / "round-0.residual.pt").exists()


def test_the_agent_takes_only_a_delta_naming_exactly_the_rounds_tensors(tmp_path: Path) -> None:
    names = names_of(0)
    quantized, _ = quantize_tensors({n: THETA[n] - TRAINED[n] for n in names}, CODEC)
    fragment = stream_file(tmp_path / "fragment.bin", quantized)
    assert check_worker_delta(THETA, fragment, CODEC, names).specs == quantized.specs
    with pytest.raises(UnusableDelta, match="asks for exactly"):
        check_worker_delta(THETA, fragment, CODEC, names_of(1))
    with pytest.raises(UnusableDelta, match="asks for exactly"):
        check_worker_delta(THETA, fragment, CODEC, tuple(reversed(names)))  # order counts
    all_of_it, _ = quantize_tensors({n: THETA[n] - TRAINED[n] for n in THETA}, CODEC)
    whole = stream_file(tmp_path / "whole.bin", all_of_it)
    with pytest.raises(UnusableDelta, match="asks for exactly"):
        check_worker_delta(THETA, whole, CODEC, names)
    with pytest.raises(UnusableDelta, match="not in θ"):
        check_worker_delta(THETA, fragment, CODEC, ("w1", "w9"))
    # Without names, the whole θ as before.
    with pytest.raises(UnusableDelta, match="differ in tensors"):
        check_worker_delta(THETA, fragment, CODEC)
