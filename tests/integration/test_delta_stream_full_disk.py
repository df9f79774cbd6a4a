"""Rank 0's delta stream on a disk that fills up: a file size limit (RLIMIT_FSIZE) makes
the writes fail in the middle of the chunks (in the sealing thread) or at the very end
(the last frame, after the end of the payloads was taken, or the final flush); the writer
raises, leaves no file, and never hangs. In a process of its own: the limit applies to a
whole process."""

from __future__ import annotations

import multiprocessing
import resource
import signal
from pathlib import Path

import pytest
import torch

from geofed.codec import QuantizedTensors, quantize_tensors
from geofed.codec_params import CodecParams
from regional_agent.handoff.delta_stream import DeltaStreamWriter, write_delta_stream
from regional_agent.handoff.errors import InvalidHandoffData

pytestmark = pytest.mark.integration

CODEC = CodecParams(scheme="int8", block_size=16)
CHUNK = 64


def _quantized() -> QuantizedTensors:
    generator = torch.Generator().manual_seed(5)
    # Larger than the file's buffer: the thread's writes reach the disk as it seals.
    tensors = {
        "w": torch.randn(200, 300, generator=generator),
        "b": torch.randn(9, generator=generator),
    }
    quantized, _ = quantize_tensors(tensors, CODEC, chunk_elements=CHUNK)
    return quantized


def _write_limited(path: str, limit: int, out: str) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    quantized = _quantized()
    writer = DeltaStreamWriter(Path(path), quantized.specs, CODEC, CHUNK)
    message = "sealed"
    try:
        writer.add(quantized.payloads)
        writer.finish()
    except (InvalidHandoffData, OSError) as exc:
        message = f"{type(exc).__name__}: {exc}"
        writer.abort()  # as rank 0 does with a delta it could not hand over
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
    Path(out).write_text(message)


@pytest.mark.parametrize("short_by", [20_000, 1])
def test_a_stream_that_cannot_be_written_whole_fails_and_leaves_nothing(
    tmp_path: Path, short_by: int
) -> None:
    whole = tmp_path / "whole.bin"
    write_delta_stream(whole, _quantized())
    path, out = tmp_path / "round-3.delta.bin", tmp_path / "outcome.txt"
    context = multiprocessing.get_context("spawn")
    child = context.Process(
        target=_write_limited, args=(str(path), whole.stat().st_size - short_by, str(out))
    )
    child.start()
    child.join(60)
    hung = child.is_alive()
    if hung:
        child.kill()
    assert not hung, "the writer hung when the disk filled up"
    assert child.exitcode == 0
    assert "File too large" in out.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name, whole.name]
