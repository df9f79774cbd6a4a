"""Applying an update that names some of θ's tensors (a streaming round's fragment).

Everyone who applies a global update goes through
:func:`geofed.artifact_check.apply_verified_update`: the named tensors get the update
added, every other tensor stays bit for bit, a name θ does not have is refused, and the
result must still hash to the manifest's ``parameters_hash``.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest
import torch

from geofed.artifact_check import (
    ArtifactRefused,
    FileFrames,
    VerifiedArtifact,
    apply_update_to_file,
    apply_verified_update,
    verify_artifact,
    verify_artifact_file,
)
from geofed.codec import decode, encode_stream
from geofed.deltas import DeltaError, add_update_in_place, apply_partial_update, apply_update
from geofed.params import parameters_vector_hash
from geofed.theta_file import hash_theta, map_theta, write_theta
from geofed.types import ArtifactKind
from tests.support.global_updates import INT8, signed_update, small_theta
from tests.support.pki import Federation, make_federation


def _update(names: tuple[str, ...], seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    theta = small_theta()
    return {name: 0.01 * torch.randn(theta[name].shape, generator=gen) for name in names}


def test_a_partial_update_adds_to_its_tensors_and_keeps_the_others() -> None:
    theta = small_theta()
    update = _update(("layer.bias", "embed"))
    result = apply_partial_update(theta, update)
    assert list(result) == list(theta)  # θ's order, whatever the update's
    for name in ("layer.bias", "embed"):
        assert torch.equal(result[name], torch.add(theta[name], update[name]))
    for name in ("layer.weight", "head"):
        assert result[name] is theta[name]
    # Nothing was written to.
    assert all(torch.equal(theta[name], small_theta()[name]) for name in theta)


def test_a_partial_update_naming_every_tensor_is_the_full_update() -> None:
    theta = small_theta()
    update = _update(tuple(theta))
    partial, full = apply_partial_update(theta, update), apply_update(theta, update)
    assert parameters_vector_hash(partial) == parameters_vector_hash(full)


def test_a_partial_update_refuses_unknown_names_and_no_names_and_wrong_shapes() -> None:
    theta = small_theta()
    with pytest.raises(DeltaError, match=r"do not have: \['ghost'\]"):
        apply_partial_update(theta, {**_update(("head",)), "ghost": torch.zeros(2)})
    with pytest.raises(DeltaError, match="names no tensor"):
        apply_partial_update(theta, {})
    with pytest.raises(DeltaError, match=r"'head' has shapes \(3, 6\) and \(6, 3\)"):
        apply_partial_update(theta, {"head": torch.zeros(6, 3)})


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Federation:
    return make_federation(tmp_path_factory.mktemp("fed"))


def _verified(
    fed: Federation,
    update: dict[str, torch.Tensor],
    base_hash: str,
    parameters_hash: str,
    *,
    decode_now: bool = True,
    max_decoded_bytes: int | None = None,
) -> VerifiedArtifact:
    """``update`` published as round 4's signed update, downloaded and verified
    (``decode_now`` False: its frames kept for decoding where it is applied)."""
    data, now = _bundle(fed, update, base_hash, parameters_hash)
    return verify_artifact(
        data,
        fed.bundle(),
        kind=ArtifactKind.GLOBAL_UPDATE,
        job="job-1",
        round_=4,
        now=now,
        decode_now=decode_now,
        max_decoded_bytes=max_decoded_bytes,
    )


def _bundle(
    fed: Federation, update: dict[str, torch.Tensor], base_hash: str, parameters_hash: str
) -> tuple[bytes, datetime]:
    """``update`` as round 4's signed update bundle, and when it was signed."""
    return signed_update(
        fed, update, job="job-1", round_=4, base_hash=base_hash, parameters_hash=parameters_hash
    )


@pytest.mark.parametrize(
    "names", [("layer.weight", "head"), ("embed", "layer.weight", "layer.bias", "head")]
)
def test_an_update_decoded_piece_by_piece_into_theta_gives_the_same_bits(
    fed: Federation, names: tuple[str, ...]
) -> None:
    theta = small_theta()
    base = parameters_vector_hash(theta)
    update = _update(names)
    published = apply_partial_update(
        theta, decode(encode_stream(update, INT8, chunk_elements=32).frames())
    )
    verified = _verified(fed, update, base, parameters_vector_hash(published), decode_now=False)
    assert verified.tensors == {}  # nothing decoded yet
    assert len(verified.frames) > len(names) + 2  # tensors of several chunks each
    held = {name: tensor.clone() for name, tensor in theta.items()}
    same_tensors = dict(held)

    result, found = apply_verified_update(held, 4, base, verified, in_place=True)

    assert found == parameters_vector_hash(published)
    assert result is held
    assert all(result[name] is same_tensors[name] for name in theta)  # written in place
    assert all(torch.equal(result[name], published[name]) for name in theta)
    with pytest.raises(TypeError, match="applied in place"):
        apply_verified_update(theta, 4, base, verified)
    # Undecoded, its decoded size is still bounded: by what the manifest declares.
    size = 4 * sum(update[name].numel() for name in names)
    with pytest.raises(ArtifactRefused, match=f"declares {size} decoded bytes, above"):
        _verified(fed, update, base, base, decode_now=False, max_decoded_bytes=size - 1)


def test_an_undecoded_update_that_does_not_fit_theta_writes_nothing(fed: Federation) -> None:
    theta = small_theta()
    base = parameters_vector_hash(theta)
    update = {**_update(("head",)), "ghost.weight": torch.zeros(4)}
    verified = _verified(fed, update, base, base, decode_now=False)
    held = {name: tensor.clone() for name, tensor in theta.items()}
    with pytest.raises(ArtifactRefused, match=r"do not have: \['ghost.weight'\]"):
        apply_verified_update(held, 4, base, verified, in_place=True)
    misshapen = _verified(
        fed, {"head": torch.ones(small_theta()["head"].numel())}, base, base, decode_now=False
    )
    with pytest.raises(ArtifactRefused, match="'head' has shapes"):
        apply_verified_update(held, 4, base, misshapen, in_place=True)
    assert all(torch.equal(held[name], theta[name]) for name in theta)


def test_a_verified_partial_update_gives_the_published_parameters(fed: Federation) -> None:
    theta = small_theta()
    base = parameters_vector_hash(theta)
    update = _update(("layer.weight", "head"))
    # What the coordinator publishes: θ_r plus the decoded update, hashed over all of θ.
    stream = encode_stream(update, INT8, chunk_elements=32)
    published = apply_partial_update(theta, decode(stream.frames()))
    verified = _verified(fed, update, base, parameters_vector_hash(published))
    assert [t.name for t in verified.manifest.tensors] == ["layer.weight", "head"]

    result, found = apply_verified_update(theta, 4, base, verified)

    assert found == parameters_vector_hash(published)
    assert all(torch.equal(result[name], published[name]) for name in theta)
    assert result["embed"] is theta["embed"]
    assert result["layer.bias"] is theta["layer.bias"]


def test_a_verified_update_naming_a_tensor_theta_lacks_is_refused(fed: Federation) -> None:
    theta = small_theta()
    base = parameters_vector_hash(theta)
    update = {**_update(("head",)), "ghost.weight": torch.zeros(4)}
    verified = _verified(fed, update, base, base)
    with pytest.raises(ArtifactRefused, match=r"update job-1/4: .*do not have: \['ghost.weight'\]"):
        apply_verified_update(theta, 4, base, verified)


def test_a_partial_update_whose_result_does_not_hash_as_declared_is_refused(
    fed: Federation,
) -> None:
    theta = small_theta()
    base = parameters_vector_hash(theta)
    # The declared hash is θ_r's own: the update would change nothing, but it does.
    verified = _verified(fed, _update(("embed",)), base, base)
    with pytest.raises(ArtifactRefused, match=r"parameters hash \w+, the manifest says"):
        apply_verified_update(theta, 4, base, verified)
    with pytest.raises(ArtifactRefused, match="has base_hash"):
        apply_verified_update(theta, 4, "cd" * 32, verified)


def test_an_update_added_in_place_gives_the_same_bits_and_consumes_the_update() -> None:
    gen = torch.Generator().manual_seed(3)
    theta = {"a": torch.randn(5, 3, generator=gen), "b": torch.randn(7, generator=gen)}
    update = {"b": torch.randn(7, generator=gen) * 1e-3}
    expected = apply_partial_update(theta, update)
    held = {name: tensor.clone() for name, tensor in theta.items()}
    untouched = held["a"]
    add_update_in_place(held, update)
    assert update == {}  # each tensor dropped once added
    assert held["a"] is untouched
    for name, tensor in expected.items():
        assert torch.equal(held[name], tensor), name


def test_an_update_that_does_not_fit_writes_nothing() -> None:
    theta = {"a": torch.zeros(4), "b": torch.zeros(3)}
    bad = {"a": torch.ones(4), "b": torch.ones(2)}
    with pytest.raises(DeltaError, match="'b' has shapes"):
        add_update_in_place(theta, bad)
    assert torch.equal(theta["a"], torch.zeros(4))  # checked before anything is written
    with pytest.raises(DeltaError, match="names tensors the parameters do not have"):
        add_update_in_place(theta, {"c": torch.ones(1)})
    with pytest.raises(DeltaError, match="must be float32"):
        add_update_in_place(theta, {"a": torch.ones(4, dtype=torch.float64)})


def test_an_update_downloaded_to_a_file_patches_theta_file_bit_for_bit(
    fed: Federation, tmp_path: Path
) -> None:
    theta = small_theta()
    base = parameters_vector_hash(theta)
    update = _update(("layer.weight", "head"))
    published = apply_partial_update(
        theta, decode(encode_stream(update, INT8, chunk_elements=32).frames())
    )
    data, now = _bundle(fed, update, base, parameters_vector_hash(published))
    downloaded, held, target = (tmp_path / n for n in ("u.bundle", "4.st", "5.st"))
    downloaded.write_bytes(data)
    write_theta(held, theta)

    def verified(path: Path) -> VerifiedArtifact:
        return verify_artifact_file(
            path, fed.bundle(), kind=ArtifactKind.GLOBAL_UPDATE, job="job-1", round_=4, now=now
        )

    update_file = verified(downloaded)
    assert isinstance(update_file.frames, FileFrames)  # read from the file as used
    found = apply_update_to_file(held, target, 4, base, update_file)
    assert found == parameters_vector_hash(published) == hash_theta(target)
    assert all(torch.equal(map_theta(target)[n], published[n]) for n in theta)
    with pytest.raises(ArtifactRefused, match="has base_hash"):
        apply_update_to_file(held, tmp_path / "x.st", 4, "0" * 64, update_file)

    flipped = bytearray(data)
    flipped[-40] ^= 1  # inside the last frame
    downloaded.write_bytes(bytes(flipped))
    with pytest.raises(ArtifactRefused, match="sha256"):
        verified(downloaded)
    downloaded.write_bytes(data[:-10])
    with pytest.raises(ArtifactRefused, match="the manifest declares"):
        verified(downloaded)
    downloaded.write_bytes(data[:20])
    with pytest.raises(ArtifactRefused, match="truncated inside the manifest"):
        verified(downloaded)


def test_an_update_that_does_not_fit_theta_file_writes_no_file(
    fed: Federation, tmp_path: Path
) -> None:
    theta = small_theta()
    base = parameters_vector_hash(theta)
    held = tmp_path / "4.st"
    write_theta(held, theta)
    ghost = _verified(fed, {"ghost.weight": torch.zeros(4)}, base, base, decode_now=False)
    with pytest.raises(ArtifactRefused, match=r"does not have: \['ghost.weight'\]"):
        apply_update_to_file(held, tmp_path / "5.st", 4, base, ghost)
    misshapen = _verified(fed, {"head": torch.ones(18)}, base, base, decode_now=False)
    with pytest.raises(ArtifactRefused, match=r"\['head'\] differ in shape"):
        apply_update_to_file(held, tmp_path / "5.st", 4, base, misshapen)
    wrong_hash = _verified(fed, _update(("head",)), base, base, decode_now=False)
    with pytest.raises(ArtifactRefused, match="parameters hash"):
        apply_update_to_file(held, tmp_path / "5.st", 4, base, wrong_hash)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4.st"]
    assert hash_theta(held) == base
