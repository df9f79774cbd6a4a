"""Handing over a quantized delta: the instruction's request, the result file, the
residual file both sides share, the agent's check before it frames, and the spool."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from geofed.codec import (
    EncodeError,
    ErrorFeedback,
    QuantizedTensors,
    decode,
    quantize_tensors,
    seal_quantized,
)
from geofed.codec_params import CodecParams
from regional_agent.handoff.delta_stream import (
    DeltaStreamWriter,
    open_delta_stream,
    write_delta_stream,
)
from regional_agent.handoff.delta_terms import UnusableDelta
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.errors import HandoffError, InvalidHandoffData
from regional_agent.handoff.messages import (
    DeltaRequest,
    RoundInstruction,
    RoundSummary,
)
from regional_agent.handoff.residual_file import (
    HeldResidual,
    Residual,
    ResidualFileError,
    ResidualWriter,
    read_residual,
    read_residual_id,
    write_held_residual,
    write_residual,
)
from regional_agent.rounds.delta import check_worker_delta, encode_delta
from regional_agent.state import DeltaMeta, JobDirectory, StateError
from regional_agent.worker.device_delta import (
    RoundDeltaQuantizer,
    payloads_hash,
    quantize_round_delta,
)
from regional_agent.worker.residual_shards import DeviceResidual
from tests.support.handoff_samples import stream_file

CODEC = CodecParams(scheme="int8", block_size=16)
THETA = {"w": torch.linspace(-1, 1, 300).reshape(10, 30), "b": torch.linspace(0, 1, 7)}
TRAINED = {name: t * 0.9 + 0.01 for name, t in THETA.items()}
INSTRUCTION = RoundInstruction(
    job="job-a",
    round=3,
    base_params="/data/base.pt",
    inner_steps=5,
    task="tests.support.tiny_task:TinyTask",
    task_options={},
    seed=1,
    region="eu-west",
    region_index=0,
    num_regions=2,
    delta=DeltaRequest(CODEC, "/state/jobs/job-a/feedback.pt", 64),
)
SUMMARY = RoundSummary(
    job="job-a",
    round=3,
    steps=5,
    tokens=40,
    mean_loss=0.5,
    cursor=5,
    base_params_hash="b" * 64,
    params_hash="p" * 64,
    world_size=1,
    train_seconds=0.1,
)


def test_an_instruction_with_a_delta_request_round_trips_through_json() -> None:
    assert RoundInstruction.from_json(INSTRUCTION.to_json()) == INSTRUCTION
    assert RoundInstruction.from_json(replace(INSTRUCTION, delta=None).to_json()).delta is None


@pytest.mark.parametrize(
    ("delta", "message"),
    [
        ({"codec": {"scheme": "int9"}, "feedback": "/f", "chunk_elements": 64}, "delta.codec"),
        ({"codec": {}, "feedback": "relative/f", "chunk_elements": 64}, "absolute path"),
        ({"codec": {}, "feedback": "/f", "chunk_elements": 200}, "not a multiple"),
        ({"codec": {}, "feedback": "/f"}, "must hold codec, feedback and chunk_elements"),
        ("int8", "must hold codec"),
    ],
)
def test_a_bad_delta_request_is_refused_by_name(delta: object, message: str) -> None:
    body = json.loads(INSTRUCTION.to_json())
    body["delta"] = delta
    with pytest.raises(InvalidHandoffData, match=message):
        RoundInstruction.from_json(json.dumps(body).encode(), "round-3.instruction.json")


def test_a_result_holds_the_delta_and_names_its_residual_file(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    quantized, residual = quantize_tensors(
        {k: THETA[k] - TRAINED[k] for k in THETA}, CODEC, chunk_elements=64
    )
    with pytest.raises(HandoffError, match="either the parameters or the delta"):
        handoff.write_result(SUMMARY, TRAINED, quantized)
    handoff.write_result(SUMMARY, delta=quantized)
    with pytest.raises(InvalidHandoffData, match=r"residual file .* is missing"):
        handoff.read_result_file("job-a", 3)
    write_residual(handoff.residual_path("job-a", 3), 3, residual)
    handoff.write_done(SUMMARY)
    result = handoff.read_completed("job-a", 3)
    assert result is not None
    assert result.params == {}
    assert result.delta is not None
    assert result.residual == handoff.residual_path("job-a", 3)
    # Sealed by the worker into the round's stream file: the bytes the agent would frame.
    assert result.delta.path == handoff.delta_stream_path("job-a", 3)
    assert result.delta.path.stat().st_mode & 0o077 == 0  # as private as the spool it joins
    assert result.delta.to_bytes() == seal_quantized(quantized).to_bytes()
    assert result.delta.specs == quantized.specs
    assert result.delta.codec == CODEC
    # Pruned with the rest of the round.
    handoff.prune_rounds("job-a", 4)
    assert not handoff.residual_path("job-a", 3).exists()
    assert not handoff.delta_stream_path("job-a", 3).exists()


def test_a_delta_stream_file_that_does_not_fit_its_result_is_refused(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    quantized, residual = quantize_tensors({"w": torch.ones(300)}, CODEC, chunk_elements=128)
    handoff.write_result(SUMMARY, delta=quantized)
    write_residual(handoff.residual_path("job-a", 3), 3, residual)
    stream_path = handoff.delta_stream_path("job-a", 3)
    whole = stream_path.read_bytes()
    stream_path.write_bytes(whole[:-1])
    with pytest.raises(InvalidHandoffData, match="frames add up to"):
        handoff.read_result_file("job-a", 3)
    stream_path.write_bytes(b"X" + whole[1:])
    with pytest.raises(InvalidHandoffData, match="magic"):
        handoff.read_result_file("job-a", 3)
    stream_path.unlink()
    with pytest.raises(InvalidHandoffData, match="stream file is missing"):
        handoff.read_result_file("job-a", 3)
    with pytest.raises(InvalidHandoffData, match="frame sizes"):
        open_delta_stream(stream_path, [len(whole)])


def test_a_result_of_a_worker_of_the_format_before_reads_as_its_stream(tmp_path: Path) -> None:
    handoff = HandoffDir(tmp_path)
    quantized, residual = quantize_tensors({"w": torch.ones(300)}, CODEC, chunk_elements=128)
    body = {"format": 1, "summary": json.loads(SUMMARY.to_json()), "delta": quantized.to_state()}
    path = handoff.result_path("job-a", 3)
    path.parent.mkdir(parents=True)
    torch.save(body, path)
    write_residual(handoff.residual_path("job-a", 3), 3, residual)
    result = handoff.read_result_file("job-a", 3)
    assert result.delta is not None
    assert result.delta.to_bytes() == seal_quantized(quantized).to_bytes()


def test_a_residual_file_reads_back_with_its_id_and_refuses_what_is_not_one(
    tmp_path: Path,
) -> None:
    path = tmp_path / "feedback.pt"
    assert read_residual(path) is None
    assert read_residual_id(path) is None
    id_ = write_residual(path, 7, {"w": torch.ones(2, 2)})
    read = read_residual(path)
    assert isinstance(read, Residual)
    assert (read.round, read.id) == (7, id_)
    assert torch.equal(read.tensors["w"], torch.ones(2, 2))
    assert read_residual_id(path) == id_
    assert path.stat().st_mode & 0o077 == 0
    # The agent's own error-feedback reader takes the same file.
    directory = JobDirectory(tmp_path / "state", "job-a")
    directory.root.mkdir(parents=True)
    path.rename(directory.feedback_path)
    assert torch.equal(directory.load_feedback().residual["w"], torch.ones(2, 2))

    path.write_bytes(b"garbage")
    with pytest.raises(ResidualFileError, match="unreadable residual"):
        read_residual(path)
    torch.save({"format": 1, "round": 1, "feedback": {"version": 1, "residual": {"w": 1}}}, path)
    with pytest.raises(ResidualFileError, match="not a named tensor"):
        read_residual(path)
    bad = {"w": torch.tensor([float("nan")])}
    torch.save({"format": 1, "round": 1, "feedback": {"version": 1, "residual": bad}}, path)
    with pytest.raises(ResidualFileError, match="NaN or Inf"):
        read_residual(path)


def _by_tensor(quantized: QuantizedTensors) -> list[list[torch.Tensor]]:
    """The payloads of each tensor, in order."""
    counts = [-(-spec.numel // 64) for spec in quantized.specs]  # chunks of 64 elements
    payloads, out = list(quantized.payloads), []
    for count in counts:
        out.append(payloads[:count])
        payloads = payloads[count:]
    return out


def test_a_delta_sealed_as_it_is_quantized_is_the_whole_delta_sealed(tmp_path: Path) -> None:
    quantized, _ = quantize_tensors(
        {k: THETA[k] - TRAINED[k] for k in THETA}, CODEC, chunk_elements=64
    )
    whole = tmp_path / "whole.bin"
    frames = write_delta_stream(whole, quantized)
    path = tmp_path / "round-3.delta.bin"
    writer = DeltaStreamWriter(path, quantized.specs, CODEC, 64)
    for payloads in _by_tensor(quantized):
        writer.add(payloads)
    written = writer.finish()
    assert written.frames == frames
    assert path.read_bytes() == whole.read_bytes()
    assert written.payloads_hash == payloads_hash(quantized)
    assert written.payload_bytes == sum(p.numel() for p in quantized.payloads)
    assert path.stat().st_mode & 0o077 == 0

    # Too few payloads, too many, an abort: the file at the path stays as it was.
    before = path.read_bytes()
    short = DeltaStreamWriter(path, quantized.specs, CODEC, 64)
    short.add(_by_tensor(quantized)[0])
    with pytest.raises(InvalidHandoffData, match="fewer payloads than the stream's chunks"):
        short.finish()
    extra = DeltaStreamWriter(path, quantized.specs, CODEC, 64)
    with pytest.raises(InvalidHandoffData, match="more payloads"):
        extra.add(list(quantized.payloads) * 2)
    extra.abort()
    stopped = DeltaStreamWriter(path, quantized.specs, CODEC, 64)
    stopped.add(_by_tensor(quantized)[0])
    stopped.abort()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, whole.name]


def test_a_residual_file_is_written_a_tensor_at_a_time_and_only_whole(tmp_path: Path) -> None:
    path = tmp_path / "round-2.residual.pt"
    before = write_residual(path, 1, {"w": torch.zeros(2, 3)})
    shapes = {"w": (2, 3), "b": (4,)}
    writer = ResidualWriter(path, 2, shapes)
    writer.put("b", torch.full((4,), 0.25))  # any order: each tensor where its header says
    writer.put("w", torch.ones(2, 3, dtype=torch.float64))
    id_ = writer.commit()
    read = read_residual(path)
    assert isinstance(read, Residual)
    assert (read.round, read.id, list(read.tensors)) == (2, id_, ["w", "b"])
    assert torch.equal(read.tensors["b"], torch.full((4,), 0.25))
    assert read.tensors["w"].dtype == torch.float32

    # One missing, a wrong shape, an abort: the file at the path stays as it was.
    unfinished = ResidualWriter(path, 3, shapes)
    unfinished.put("w", torch.ones(2, 3))
    with pytest.raises(ResidualFileError, match=r"without \['b'\]"):
        unfinished.commit()
    misfit = ResidualWriter(path, 3, shapes)
    with pytest.raises(ResidualFileError, match=r"'w' \(3, 2\) is not \(2, 3\)"):
        misfit.put("w", torch.ones(3, 2))
    misfit.abort()
    assert read_residual_id(path) == id_ != before
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]

    # A non-finite value is refused when its tensor is read, naming it.
    write_residual(path, 4, {"w": torch.zeros(2), "b": torch.tensor([0.0, float("inf")])})
    read = read_residual(path)
    assert isinstance(read, Residual)
    assert torch.equal(read.tensors["w"], torch.zeros(2))
    with pytest.raises(ResidualFileError, match="residual 'b' holds NaN or Inf"):
        read.tensors["b"]


def test_a_residual_file_of_the_format_before_is_still_read(tmp_path: Path) -> None:
    path = tmp_path / "feedback.pt"
    body = {"version": 1, "residual": {"w": torch.ones(3)}}
    torch.save({"format": 1, "round": 5, "id": "old-id", "feedback": body}, path)
    assert read_residual_id(path) == "old-id"
    read = read_residual(path)
    assert isinstance(read, Residual)
    assert (read.round, read.id) == (5, "old-id")
    assert torch.equal(read.tensors["w"], torch.ones(3))
    torch.save({"format": 1, "round": 5, "id": "held-id", "held": True}, path)
    assert read_residual(path) == HeldResidual(5, "held-id")


def test_rank_zeros_delta_is_the_agents_encoding_and_keeps_its_residual(
    tmp_path: Path,
) -> None:
    base = tmp_path / "theta.pt"
    torch.save(THETA, base)
    feedback = tmp_path / "feedback.pt"
    request = DeltaRequest(CODEC, str(feedback), 64)
    ef = ErrorFeedback()
    kept = None
    local = dict(TRAINED)
    for round_ in range(3):
        residual_path = tmp_path / f"round-{round_}.residual.pt"
        quantized, kept = quantize_round_delta(
            request,
            job="job-a",
            round_=round_,
            region="eu-west",
            base_path=str(base),
            local=local,
            residual_path=residual_path,
            kept=kept,
        )
        want = encode_delta(THETA, local, ef, CODEC, chunk_elements=64)
        assert seal_quantized(quantized).to_bytes() == want.stream.to_bytes()
        assert read_residual_id(residual_path) == kept.id
        ef = want.feedback
        residual_path.replace(feedback)  # accepted
        local = {name: t * 1.01 for name, t in local.items()}
    assert len(payloads_hash(quantized)) == 64


def test_the_agent_takes_only_a_delta_of_its_theta_in_the_announced_codec(
    tmp_path: Path,
) -> None:
    quantized, _ = quantize_tensors(
        {k: THETA[k] - TRAINED[k] for k in THETA}, CODEC, chunk_elements=64
    )
    stream = check_worker_delta(THETA, stream_file(tmp_path / "d.bin", quantized), CODEC)
    decoded = decode(stream.frames())
    assert decoded.keys() == THETA.keys()
    assert all(torch.equal(decoded[k], v) for k, v in stream.decode().items())
    with pytest.raises(UnusableDelta, match="quantized with"):
        check_worker_delta(THETA, stream, CodecParams(scheme="int4", block_size=16))
    with pytest.raises(UnusableDelta, match="differ in tensors \\['extra'\\]"):
        check_worker_delta({**THETA, "extra": torch.zeros(1)}, stream, CODEC)
    with pytest.raises(UnusableDelta, match="'b' as float32"):
        check_worker_delta({**THETA, "b": torch.zeros(8)}, stream, CODEC)


def test_the_spool_links_the_workers_residual_and_promotes_it(tmp_path: Path) -> None:
    job = JobDirectory(tmp_path / "state", "job-a")
    job.root.mkdir(parents=True)
    worker_file = tmp_path / "round-3.residual.pt"
    id_ = write_residual(worker_file, 3, {"w": torch.full((2,), 0.5)})
    quantized, _ = quantize_tensors({"w": torch.ones(2)}, CODEC, chunk_elements=64)
    stream = stream_file(tmp_path / "round-3.delta.bin", quantized)
    meta = DeltaMeta(train_loss=1.0, tokens=2, params_hash="h" * 64)
    with pytest.raises(StateError, match="unreadable spooled delta"):  # a bad manifest
        job.write_spool(3, b"not a manifest", stream.path, worker_file, meta)
    assert worker_file.exists()
    assert stream.path.exists()
    assert (job.spool_dir(3) / "residual.pt").stat().st_ino == worker_file.stat().st_ino
    # The worker's stream is not written again: a second name for the same file.
    assert (job.spool_dir(3) / "stream.bin").stat().st_ino == stream.path.stat().st_ino
    job.promote(3)
    assert read_residual_id(job.feedback_path) == id_


def test_a_held_residual_file_names_rank_zeros_copy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "round-4.residual.pt"
    id_ = write_held_residual(path, 4)
    assert read_residual(path) == HeldResidual(4, id_)
    assert read_residual_id(path) == id_
    assert path.stat().st_size < 2048  # a name, not the tensors
    assert path.stat().st_mode & 0o077 == 0
    # The agent's own encoding (a result holding parameters) cannot reach it: none.
    directory = JobDirectory(tmp_path / "state", "job-a")
    directory.root.mkdir(parents=True)
    path.rename(directory.feedback_path)
    assert directory.load_feedback().residual == {}
    assert "names a residual the workers hold" in caplog.text
    torch.save({"format": 1, "round": 4, "held": True}, path)
    with pytest.raises(ResidualFileError, match="without its round and id"):
        read_residual(path)


def _quantize(
    tmp_path: Path,
    round_: int,
    local: dict[str, torch.Tensor],
    kept: DeviceResidual | None,
    *,
    write_tensors: bool,
) -> tuple[QuantizedTensors, DeviceResidual]:
    base = tmp_path / "theta.pt"
    if not base.exists():
        torch.save(THETA, base)
    return quantize_round_delta(
        DeltaRequest(CODEC, str(tmp_path / "feedback.pt"), 64),
        job="job-a",
        round_=round_,
        region="eu-west",
        base_path=str(base),
        local=local,
        residual_path=tmp_path / f"round-{round_}.residual.pt",
        kept=kept,
        held_path=tmp_path / "residual-held.pt",
        write_tensors=write_tensors,
    )


def test_between_checkpoints_rank_zero_holds_the_residual_and_the_delta_is_the_same(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ef, local = ErrorFeedback(), dict(TRAINED)
    kept: DeviceResidual | None = None
    for round_ in range(3):
        held = None if kept is None else dict(kept.slices)
        quantized, kept = _quantize(tmp_path, round_, local, kept, write_tensors=round_ == 0)
        if held is not None:  # the new residual took the old one's place: one copy held
            assert all(kept.slices[name] is tensor for name, tensor in held.items())
        want = encode_delta(THETA, local, ef, CODEC, chunk_elements=64)
        assert seal_quantized(quantized).to_bytes() == want.stream.to_bytes()
        written = read_residual(tmp_path / f"round-{round_}.residual.pt")
        assert isinstance(written, Residual if round_ == 0 else HeldResidual)
        assert kept.written is (round_ == 0)
        ef = want.feedback
        (tmp_path / f"round-{round_}.residual.pt").replace(tmp_path / "feedback.pt")
        local = {name: t * 1.01 for name, t in local.items()}
    assert "starting it anew" not in caplog.text


def _round_zero_accepted(tmp_path: Path) -> tuple[DeviceResidual, dict[str, torch.Tensor]]:
    """Round 0 quantized with its residual held, its delta accepted; round 1's trained state."""
    _, kept = _quantize(tmp_path, 0, dict(TRAINED), None, write_tensors=False)
    (tmp_path / "round-0.residual.pt").replace(tmp_path / "feedback.pt")
    return kept, {name: t * 1.01 for name, t in TRAINED.items()}


def test_a_held_residual_rank_zero_lost_starts_anew_and_one_written_out_is_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kept, local = _round_zero_accepted(tmp_path)

    # Rank 0 restarted: the residual the agent's file names is gone.
    quantized, _ = _quantize(tmp_path, 1, local, None, write_tensors=False)
    fresh = encode_delta(THETA, local, ErrorFeedback(), CODEC, chunk_elements=64)
    assert seal_quantized(quantized).to_bytes() == fresh.stream.to_bytes()
    assert "residual of round 0 was held by the workers only and is gone" in caplog.text

    # Written out when the group parked the job or stopped: read back, same delta as kept.
    whole = {name: kept.slices[name].view(shape) for name, shape in kept.shapes.items()}
    write_residual(tmp_path / "residual-held.pt", 0, whole, id_=kept.id)
    caplog.clear()
    from_file, _ = _quantize(tmp_path, 1, local, None, write_tensors=False)
    from_kept, _ = _quantize(tmp_path, 1, local, kept, write_tensors=False)
    assert seal_quantized(from_file).to_bytes() == seal_quantized(from_kept).to_bytes()
    assert seal_quantized(from_file).to_bytes() != fresh.stream.to_bytes()
    assert "starting it anew" not in caplog.text


def test_a_delta_the_coordinator_did_not_take_costs_the_held_residual(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kept, local = _round_zero_accepted(tmp_path)
    _, kept = _quantize(tmp_path, 1, local, kept, write_tensors=False)  # refused: not promoted
    quantized, _ = _quantize(tmp_path, 2, local, kept, write_tensors=False)
    fresh = encode_delta(THETA, local, ErrorFeedback(), CODEC, chunk_elements=64)
    assert seal_quantized(quantized).to_bytes() == fresh.stream.to_bytes()
    assert "residual of round 0 was held by the workers only" in caplog.text


def test_a_delta_failing_after_part_of_the_residual_was_overwritten_says_so(
    tmp_path: Path,
) -> None:
    kept, local = _round_zero_accepted(tmp_path)
    request = DeltaRequest(CODEC, str(tmp_path / "feedback.pt"), 64)
    quantizer = RoundDeltaQuantizer(
        request,
        job="job-a",
        round_=1,
        region="eu-west",
        base_path=str(tmp_path / "theta.pt"),
        shapes={name: tensor.shape for name, tensor in local.items()},
        device=torch.device("cpu"),
        kept=kept,
        residual_path=tmp_path / "round-1.residual.pt",
        write_tensors=False,
    )
    first, second = quantizer.wanted
    quantizer.add(first, local[first])
    assert quantizer.altered_kept  # so hand_over_delta drops the residual it held
    with pytest.raises(EncodeError, match="must be finite"):
        quantizer.add(second, torch.full_like(local[second], float("nan")))
