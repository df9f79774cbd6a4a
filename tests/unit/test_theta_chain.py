"""θ held as a base θ file and the verified updates after it (:mod:`geofed.theta_chain`).

Real signed update bundles, verified from their files as an agent verifies a download,
chained after θ_0's file: every tensor, the hash and the file written from the chain are
bit for bit those of θ_3's file built the way the agent builds it today (each update
patched into a copy of the previous θ's file). A streaming round's update naming some
tensors changes only those. A chain whose update file changed on disk, whose rounds do
not follow one another, or whose update does not fit θ is refused, naming the file; a
chain's description survives a save and a load, and a malformed one is refused naming
the key.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from datetime import datetime
from pathlib import Path

import pytest
import torch

from geofed.artifact_check import (
    ArtifactRefused,
    FileFrames,
    VerifiedArtifact,
    apply_update_to_file,
    verify_artifact_file,
)
from geofed.codec import decode, encode_stream
from geofed.deltas import apply_partial_update
from geofed.params import parameters_vector_hash
from geofed.theta_chain import (
    ChainReads,
    StoredUpdate,
    ThetaChain,
    ThetaChainError,
    chain_hash,
    chain_update,
    write_chain,
)
from geofed.theta_file import hash_theta, map_theta, write_theta
from geofed.types import ArtifactKind
from tests.support.global_updates import INT8, signed_update, small_theta
from tests.support.pki import Federation, make_federation

JOB = "job-1"
#: Each round's update names these tensors (round 1 is a streaming round's fragment).
NAMES: tuple[tuple[str, ...], ...] = (
    ("embed", "layer.weight", "layer.bias", "head"),
    ("layer.weight", "head"),
    ("embed", "layer.weight", "layer.bias", "head"),
)


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Federation:
    return make_federation(tmp_path_factory.mktemp("fed"))


def _published(
    fed: Federation,
    round_: int,
    update: dict[str, torch.Tensor],
    theta: dict[str, torch.Tensor],
    chunk_elements: int = 32,
) -> tuple[bytes, dict[str, torch.Tensor], datetime]:
    """Round ``round_``'s signed update bundle from θ ``theta``, and θ_{round_+1}."""
    stream = encode_stream(update, INT8, chunk_elements=chunk_elements)
    after = apply_partial_update(theta, decode(stream.frames()))
    data, now = signed_update(
        fed,
        update,
        job=JOB,
        round_=round_,
        base_hash=parameters_vector_hash(theta),
        parameters_hash=parameters_vector_hash(after),
        chunk_elements=chunk_elements,
    )
    return data, after, now


@pytest.fixture(scope="module")
def rounds(
    fed: Federation, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[VerifiedArtifact], list[Path]]:
    """θ_0's file, the updates of rounds 0..2 verified from their files, and θ_1..θ_3's
    files each patched from the previous one (what the agent writes every round)."""
    root = tmp_path_factory.mktemp("rounds")
    theta = small_theta()
    base = root / "theta-0.st"
    write_theta(base, theta)
    verified, files, held = [], [], base
    for round_, names in enumerate(NAMES):
        gen = torch.Generator().manual_seed(10 + round_)
        update = {n: 0.01 * torch.randn(theta[n].shape, generator=gen) for n in names}
        # Round 2's chunks are twice the others': a range of one is part of one of its.
        data, theta, now = _published(fed, round_, update, theta, 64 if round_ == 2 else 32)
        bundle = root / f"update-{round_}.bundle"
        bundle.write_bytes(data)
        artifact = verify_artifact_file(
            bundle, fed.bundle(), kind=ArtifactKind.GLOBAL_UPDATE, job=JOB, round_=round_, now=now
        )
        verified.append(artifact)
        target = root / f"theta-{round_ + 1}.st"
        apply_update_to_file(held, target, round_, hash_theta(held), artifact)
        files.append(target)
        held = target
    return base, verified, files


def _chain(base: Path, verified: list[VerifiedArtifact], count: int) -> ThetaChain:
    chain = ThetaChain(base, 0)
    for artifact in verified[:count]:
        chain = chain.then(StoredUpdate.of(artifact))
    return chain


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_chain_reads_hashes_and_writes_theta_bit_for_bit(
    rounds: tuple[Path, list[VerifiedArtifact], list[Path]], tmp_path: Path, threads: int
) -> None:
    """On one thread or several, each reading its range of a tensor's elements."""
    base, verified, files = rounds
    for count in range(len(verified) + 1):
        chain = _chain(base, verified, count)
        assert chain.round == count
        reads = ChainReads(chain, threads=threads)
        expected = map_theta(files[count - 1] if count else base)
        assert list(reads) == list(expected)  # θ's order
        assert reads.shapes() == {name: tuple(t.shape) for name, t in expected.items()}
        for name, tensor in expected.items():
            assert torch.equal(reads[name], tensor), (count, name)
        assert chain_hash(reads) == parameters_vector_hash(expected)
    # Round 1 named two tensors: the others are θ_1's, bit for bit.
    after_1, after_2 = map_theta(files[0]), map_theta(files[1])
    for name in ("embed", "layer.bias"):
        assert torch.equal(after_1[name], after_2[name])
    target = tmp_path / "theta-3.st"
    found = write_chain(ChainReads(_chain(base, verified, 3), threads=threads), target)
    assert found == hash_theta(files[2]) == verified[2].manifest.parameters_hash
    assert target.read_bytes() == files[2].read_bytes()


def test_a_chain_reads_one_tensor_at_a_time_and_none_twice(
    rounds: tuple[Path, list[VerifiedArtifact], list[Path]],
) -> None:
    base, verified, _ = rounds
    reads = ChainReads(_chain(base, verified, 3))
    first, again = reads["head"], reads["head"]
    assert torch.equal(first, again)
    assert first.data_ptr() != again.data_ptr()  # a new tensor each time: nothing kept
    first.add_(1.0)
    assert not torch.equal(reads["head"], first)


def test_an_update_file_changed_on_disk_is_refused_when_its_tensor_is_read(
    rounds: tuple[Path, list[VerifiedArtifact], list[Path]], tmp_path: Path
) -> None:
    base, verified, _ = rounds
    stored = StoredUpdate.of(verified[1])
    copy = tmp_path / "update-1.bundle"
    data = bytearray(stored.path.read_bytes())
    # A byte inside the frame of the last chunk (of "head", the last tensor).
    data[stored.start + sum(stored.sizes[:-1]) - 40] ^= 0x01
    copy.write_bytes(bytes(data))
    changed = StoredUpdate(stored.round, copy, stored.start, stored.sizes, stored.digests)
    chain = ThetaChain(base, 0, (StoredUpdate.of(verified[0]), changed))
    reads = ChainReads(chain)
    reads["embed"]  # a tensor the changed chunk does not hold
    with pytest.raises(ThetaChainError, match=rf"update of round 1 at {copy}: tensor 'head'"):
        reads["head"]


def test_a_chain_that_does_not_describe_theta_is_refused(
    rounds: tuple[Path, list[VerifiedArtifact], list[Path]], fed: Federation, tmp_path: Path
) -> None:
    base, verified, _ = rounds
    with pytest.raises(ThetaChainError, match=r"updates of rounds \[1\] do not follow"):
        ThetaChain(base, 0, (StoredUpdate.of(verified[1]),))
    with pytest.raises(ThetaChainError, match=r"updates of rounds \[0, 2\]"):
        _chain(base, verified, 1).then(StoredUpdate.of(verified[2]))
    # An update of another model: a tensor θ lacks, then a shape θ's differs from.
    for update, message in (
        ({"ghost": torch.zeros(4)}, r"names tensors θ does not have: \['ghost'\]"),
        ({"head": torch.zeros(6, 3)}, r"tensors \['head'\] differ in shape"),
    ):
        data, _, now = _published(fed, 0, update, update)
        bundle = tmp_path / "other.bundle"
        bundle.write_bytes(data)
        other = verify_artifact_file(
            bundle, fed.bundle(), kind=ArtifactKind.GLOBAL_UPDATE, job=JOB, round_=0, now=now
        )
        with pytest.raises(ThetaChainError, match=message):
            ChainReads(ThetaChain(base, 0, (StoredUpdate.of(other),)))
    empty = tmp_path / "empty.st"
    empty.write_bytes(b"")
    with pytest.raises(ThetaChainError, match=r"the chain's base: .*too short"):
        ChainReads(ThetaChain(empty, 0))


def test_a_chain_s_description_is_saved_and_loaded_and_checked(
    rounds: tuple[Path, list[VerifiedArtifact], list[Path]], tmp_path: Path
) -> None:
    base, verified, files = rounds
    chain = _chain(base, verified, 3)
    described = tmp_path / "theta-3.chain.json"
    chain.save(described)
    loaded = ThetaChain.load(described)
    assert loaded == chain
    assert chain_hash(ChainReads(loaded)) == hash_theta(files[2])

    document = json.loads(described.read_text())
    broken = {
        "no base": ({k: v for k, v in document.items() if k != "base"}, "no key 'base'"),
        "round": ({**document, "base_round": -1}, r"base_round: -1 is not a natural"),
        "sizes": (
            {**document, "updates": [{**document["updates"][0], "sizes": [1]}]},
            r"updates\[0\]: 1 frame sizes and",
        ),
        "format": ({**document, "format": "other"}, "not a θ chain of format"),
    }
    for label, (content, message) in broken.items():
        path = tmp_path / f"{label}.json"
        path.write_text(json.dumps(content))
        with pytest.raises(ThetaChainError, match=message):
            ThetaChain.load(path)
    not_json = tmp_path / "not.json"
    not_json.write_text("{")
    with pytest.raises(ThetaChainError, match="not JSON"):
        ThetaChain.load(not_json)


def test_an_update_verified_in_memory_cannot_join_a_chain(
    rounds: tuple[Path, list[VerifiedArtifact], list[Path]],
) -> None:
    _, verified, _ = rounds
    in_memory = VerifiedArtifact(
        verified[0].manifest, {}, verified[0].manifest_digest, verified[0].signed, [b""]
    )
    with pytest.raises(ThetaChainError, match="verified in memory"):
        StoredUpdate.of(in_memory)


def _copied(artifact: VerifiedArtifact, into: Path) -> VerifiedArtifact:
    """``artifact`` with its bundle copied into ``into`` (chaining moves the file)."""
    frames = artifact.frames
    assert isinstance(frames, FileFrames)
    copy = into / frames.path.name
    shutil.copyfile(frames.path, copy)
    return dataclasses.replace(artifact, frames=FileFrames(copy, frames.start, frames.sizes))


def test_an_update_is_chained_or_written_whole_and_a_misfit_changes_nothing(
    rounds: tuple[Path, list[VerifiedArtifact], list[Path]], tmp_path: Path
) -> None:
    base, verified, files = rounds
    held = _chain(base, verified, 1)
    held_hash = hash_theta(files[0])
    update = _copied(verified[1], tmp_path)
    downloaded = StoredUpdate.of(update).path
    with pytest.raises(ArtifactRefused, match="has base_hash"):
        chain_update(held, "0" * 64, update, keep_at=tmp_path / "kept.bundle")
    with pytest.raises(ArtifactRefused, match=r"applies to θ_1; θ_0 is held"):
        chain_update(ThetaChain(base, 0), hash_theta(base), update, keep_at=tmp_path / "k")
    assert downloaded.exists()
    assert not (tmp_path / "kept.bundle").exists()

    chained, found = chain_update(held, held_hash, update, keep_at=tmp_path / "kept.bundle")
    assert found == hash_theta(files[1])
    assert chained.round == 2
    assert chained.updates[-1].path == tmp_path / "kept.bundle"
    assert not downloaded.exists()
    assert chain_hash(ChainReads(chained)) == found

    whole = tmp_path / "theta-2.st"
    again = _copied(verified[1], tmp_path)
    written, found = chain_update(held, held_hash, again, keep_at=tmp_path / "x", whole_at=whole)
    assert (written.base, written.base_round, written.updates) == (whole, 2, ())
    assert whole.read_bytes() == files[1].read_bytes()
    assert not (tmp_path / "x").exists()  # the update's file stays where it was downloaded
