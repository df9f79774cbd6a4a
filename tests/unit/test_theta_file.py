"""θ files (:mod:`geofed.theta_file`): written, patched, filled and hashed piece by piece,
bit for bit what the same tensors in memory give, and refused when they are anything else."""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from geofed.deltas import add_update_in_place
from geofed.params import HashingReads, parameters_vector_hash
from geofed.theta_file import (
    CHUNK_BYTES,
    ThetaFileError,
    fill_theta,
    hash_theta,
    map_theta,
    patch_theta,
    read_layout,
    read_theta,
    write_theta,
)


def theta() -> dict[str, torch.Tensor]:
    """Tensors in model order, not name order, one above a chunk, one empty."""
    generator = torch.Generator().manual_seed(7)
    return {
        "tok.weight": torch.randn(CHUNK_BYTES // 4 + 5, generator=generator),
        "layers.0.w": torch.randn(3, 5, generator=generator),
        "bias": torch.randn(7, generator=generator),
        "empty": torch.zeros(0, 4),
    }


def test_written_theta_maps_and_hashes_as_the_tensors_do(tmp_path: Path) -> None:
    tensors = theta()
    path = tmp_path / "round-0.safetensors"
    assert write_theta(path, tensors) == parameters_vector_hash(tensors)
    assert hash_theta(path) == parameters_vector_hash(tensors)
    mapped = map_theta(path)
    assert list(mapped) == list(tensors)  # θ's order: streaming fragments follow it
    for name, tensor in tensors.items():
        assert torch.equal(mapped[name], tensor), name
        assert mapped[name].shape == tensor.shape
    assert read_layout(path).shapes() == {n: tuple(t.shape) for n, t in tensors.items()}
    assert path.stat().st_mode & 0o777 == 0o600  # θ never leaves the region
    # Any safetensors reader takes it.
    loaded = load_file(path)
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())


def test_a_patched_theta_is_the_in_place_sum_bit_for_bit(tmp_path: Path) -> None:
    tensors = theta()
    source, target = tmp_path / "round-0.safetensors", tmp_path / "round-1.safetensors"
    write_theta(source, tensors)
    generator = torch.Generator().manual_seed(8)
    update = {
        "tok.weight": torch.randn(CHUNK_BYTES // 4 + 5, generator=generator),
        "bias": torch.randn(7, generator=generator),
    }
    pieces = [
        ("bias", 0, update["bias"][:3]),
        ("tok.weight", 0, update["tok.weight"][:100]),
        ("bias", 3, update["bias"][3:]),
        ("tok.weight", 100, update["tok.weight"][100:]),
    ]
    found = patch_theta(source, target, pieces)
    expected = {n: t.clone() for n, t in tensors.items()}
    add_update_in_place(expected, update)
    assert found == parameters_vector_hash(expected) == hash_theta(target)
    assert hash_theta(source) == parameters_vector_hash(tensors)  # θ_r is left as it was
    mapped = map_theta(target)
    for name, tensor in expected.items():
        assert torch.equal(mapped[name], tensor), name


def test_a_filled_theta_is_the_pieces_written(tmp_path: Path) -> None:
    tensors = theta()
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    flat = tensors["tok.weight"].reshape(-1)
    pieces = [
        ("layers.0.w", 0, tensors["layers.0.w"].reshape(-1)),
        ("tok.weight", 10, flat[10:]),
        ("bias", 0, tensors["bias"]),
        ("tok.weight", 0, flat[:10]),
    ]
    path = tmp_path / "snapshot.safetensors"
    assert fill_theta(path, shapes, pieces) == parameters_vector_hash(tensors)
    assert list(map_theta(path)) == list(tensors)


def test_a_piece_outside_theta_leaves_the_target_as_it_was(tmp_path: Path) -> None:
    tensors = theta()
    source, target = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    write_theta(source, tensors)
    target.write_bytes(b"before")
    with pytest.raises(ThetaFileError, match="passes its 7 elements"):
        patch_theta(source, target, [("bias", 5, torch.ones(3))])
    with pytest.raises(ThetaFileError, match="no tensor 'nope'"):
        patch_theta(source, target, [("nope", 0, torch.ones(1))])

    def failing() -> object:
        yield ("bias", 0, torch.ones(1))
        raise RuntimeError("the stream broke")

    with pytest.raises(RuntimeError, match="the stream broke"):
        patch_theta(source, target, failing())  # type: ignore[arg-type]
    assert target.read_bytes() == b"before"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.safetensors"]


def test_files_of_other_layouts_are_refused(tmp_path: Path) -> None:
    tensors = theta()
    pickled = tmp_path / "theta.pt"
    torch.save(tensors, pickled)
    with pytest.raises(ThetaFileError, match=r"a torch\.save file"):
        read_layout(pickled)
    # The format before is still mapped, for the workers of an older instruction.
    assert all(torch.equal(map_theta(pickled)[n], t) for n, t in tensors.items())

    half = tmp_path / "half.safetensors"
    save_file({"w": torch.ones(2, dtype=torch.float16)}, str(half))
    with pytest.raises(ThetaFileError, match="'w' is not float32"):
        read_layout(half)

    good = tmp_path / "good.safetensors"
    write_theta(good, tensors)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-4])
    with pytest.raises(ThetaFileError, match="its header declares"):
        hash_theta(truncated)

    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    unpadded = tmp_path / "unpadded.safetensors"
    unpadded.write_bytes(struct.pack("<Q", len(header) + 1) + header + b"\x00" * 4)
    with pytest.raises(ThetaFileError):
        read_layout(unpadded)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(ThetaFileError, match="a header of"):
        read_layout(huge)
    with pytest.raises(ThetaFileError, match="No such file"):
        read_layout(tmp_path / "missing.safetensors")


def test_only_float32_tensors_are_written(tmp_path: Path) -> None:
    with pytest.raises(ThetaFileError, match="float32 tensors only"):
        write_theta(tmp_path / "t.safetensors", {"w": torch.ones(2, dtype=torch.bfloat16)})
    assert not (tmp_path / "t.safetensors").exists()


def test_tensors_read_one_at_a_time_are_new_and_equal(tmp_path: Path) -> None:
    tensors = theta()
    path = tmp_path / "round-0.safetensors"
    write_theta(path, tensors)
    read = read_theta(path)
    assert list(read) == list(tensors)
    assert len(read) == len(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(read[name], tensor), name
    first = read["bias"]
    first.add_(1.0)  # the reader's own tensor: neither the file nor the next read change
    assert torch.equal(read["bias"], tensors["bias"])
    assert hash_theta(path) == parameters_vector_hash(tensors)
    pickled = tmp_path / "theta.pt"
    torch.save(tensors, pickled)  # the format before is mapped instead
    assert all(torch.equal(read_theta(pickled)[n], t) for n, t in tensors.items())


class CountedReads(dict[str, torch.Tensor]):
    """A θ read from its file, counting the tensors read (each a read of the file)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.source = read_theta(path)
        self.reads: list[str] = []

    def __getitem__(self, name: str) -> torch.Tensor:
        self.reads.append(name)
        return self.source[name]


@pytest.mark.parametrize("first", ["load", "hash", "one out of order"])
def test_theta_read_in_its_hash_order_is_hashed_without_a_second_read(
    tmp_path: Path, first: str
) -> None:
    tensors = theta()
    path = tmp_path / "round-0.safetensors"
    write_theta(path, tensors)
    counted = CountedReads(path)
    reads = HashingReads(counted, read_layout(path).shapes())
    assert list(reads) == sorted(tensors)  # the hash's order, which a load follows
    if first == "hash":
        assert reads.hexdigest() == hash_theta(path)
        assert counted.reads == sorted(tensors)
    if first == "one out of order":
        assert torch.equal(reads["layers.0.w"], tensors["layers.0.w"])  # not hashed yet
    loaded = {name: reads[name] for name in reads}
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())
    before = len(counted.reads)
    assert reads.hexdigest() == hash_theta(path) == parameters_vector_hash(tensors)
    assert len(counted.reads) == before  # hashed while loaded: nothing read again
    extra = {"load": 0, "hash": len(tensors), "one out of order": 1}[first]
    assert len(counted.reads) == len(tensors) + extra


def test_a_tensor_read_other_than_declared_is_refused(tmp_path: Path) -> None:
    tensors = theta()
    path = tmp_path / "round-0.safetensors"
    write_theta(path, tensors)
    shapes = {**read_layout(path).shapes(), "bias": (8,)}
    with pytest.raises(ValueError, match="'bias' reads as"):
        HashingReads(read_theta(path), shapes).hexdigest()


@pytest.mark.parametrize("order", ["file", "reversed", "none"])
def test_pieces_in_any_order_give_the_same_theta(tmp_path: Path, order: str) -> None:
    """In file order each byte is written once (copied just ahead of its piece); out of
    order, pieces are written over the copy; with none, θ_r is copied whole: the same
    bytes every way."""
    tensors = theta()
    source = tmp_path / "round-0.safetensors"
    write_theta(source, tensors)
    generator = torch.Generator().manual_seed(9)
    pieces = [  # each element once: a third of each tensor a piece, and what is left
        (name, start, torch.randn(min(step, t.numel() - start), generator=generator))
        for name, t in tensors.items()
        for step in [max(1, t.numel() // 3)]
        for start in range(0, t.numel(), step)
    ]
    expected = {n: t.clone().reshape(-1) for n, t in tensors.items()}
    for name, start, values in pieces:
        expected[name][start : start + values.numel()] += values
    if order == "reversed":
        pieces.reverse()
    target = tmp_path / "round-1.safetensors"
    chosen = [] if order == "none" else pieces
    found = patch_theta(source, target, chosen)
    want = {
        n: (expected[n] if chosen else t.reshape(-1)).reshape(t.shape) for n, t in tensors.items()
    }
    assert found == parameters_vector_hash(want) == hash_theta(target)
    assert target.stat().st_size == source.stat().st_size


@pytest.mark.parametrize("refusal", [errno.EXDEV, errno.ENOSYS, None])
def test_without_a_kernel_copy_theta_is_copied_through_a_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: int | None
) -> None:
    """Where ``copy_file_range`` is refused (another filesystem, an old kernel) or copies
    nothing, the same bytes are copied by reading and writing them."""

    def refused(*_: object) -> int:  # a fake at the outer edge: the kernel's answer
        if refusal is None:
            return 0
        raise OSError(refusal, os.strerror(refusal))

    monkeypatch.setattr(os, "copy_file_range", refused)
    tensors = theta()
    source, target = tmp_path / "round-0.safetensors", tmp_path / "round-1.safetensors"
    write_theta(source, tensors)
    bias = torch.ones(7)
    expected = {n: t.clone() for n, t in tensors.items()}
    add_update_in_place(expected, {"bias": bias.clone()})
    assert patch_theta(source, target, [("bias", 0, bias)]) == hash_theta(target)
    assert hash_theta(target) == parameters_vector_hash(expected)
