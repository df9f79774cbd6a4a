"""Delta manifest checks and commit verification, without sockets."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard

from coordinator.aggregation.outer_round import stored_delta
from coordinator.aggregation.weighted import WeightedSum
from coordinator.errors import ApiError
from coordinator.intake.delta_checks import DeltaExpectation, check_delta_manifest, verify_signature
from coordinator.intake.delta_stream import verify_and_store
from geofed.blobstore import FsBlobStore
from geofed.codec import DigestMismatch, EncodedStream, decode, encode_stream
from geofed.codec.wire import (
    ChunkFields,
    FrameKind,
    TrailerFields,
    chunk_fields,
    seal,
    trailer_body,
)
from geofed.codec_params import CodecParams
from geofed.manifest import (
    ArtifactProvenance,
    Manifest,
    ManifestTensor,
    SignedManifest,
    chunk_records,
    sign_manifest,
)
from geofed.training_config import TrainingConfig
from geofed.types import ArtifactKind
from tests.support.pki import Federation, make_federation

BASE = "ab" * 32
CODEC = CodecParams(scheme="int8", block_size=32)
CHUNK_ELEMENTS = 64
SPECS = (
    ManifestTensor(name="w", dtype="float32", shape=(8, 16)),
    ManifestTensor(name="b", dtype="float32", shape=(8,)),
)


def _encode(tensors: dict[str, torch.Tensor]) -> EncodedStream:
    return encode_stream(tensors, CODEC, chunk_elements=CHUNK_ELEMENTS)


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Federation:
    return make_federation(tmp_path_factory.mktemp("fed"), "acme")


@pytest.fixture(scope="module")
def eu_west(fed: Federation) -> Any:
    return fed.region("eu-west")


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(8, 16, generator=gen), "b": torch.randn(8, generator=gen)}


def _signed(region: Any, stream: EncodedStream, **overrides: Any) -> SignedManifest:
    fields: dict[str, Any] = {
        "kind": ArtifactKind.MODEL_DELTA,
        "job": "job-1",
        "round": 3,
        "producer": region.identity.uri,
        "codec": stream.codec,
        "tensors": tuple(
            ManifestTensor(name=s.name, dtype=s.dtype, shape=s.shape) for s in stream.specs
        ),
        "chunks": chunk_records(stream.frames()),
        "total_size": stream.total_bytes,
        "provenance": (
            ArtifactProvenance(region="eu-west", jurisdiction="EU", datasets=("eu-a",)),
        ),
        "created_at": datetime.now(UTC),
        "base_round": 3,
        "base_hash": BASE,
        "tokens": 64,
    }
    fields.update(overrides)
    cred = region.credential
    return sign_manifest(Manifest(**fields), cred.private_key, cred.certificate)


def _expect(**overrides: Any) -> DeltaExpectation:
    fields: dict[str, Any] = {
        "job": "job-1",
        "round": 3,
        "region": "eu-west",
        "federation": "acme",
        "base_hash": BASE,
        "tensors": SPECS,
        "codec": CodecParams(scheme="int8", block_size=32),
        "datasets": ["eu-a", "eu-b"],
        "jurisdiction": "EU",
        "max_upload_bytes": 1 << 20,
        "max_chunk_bytes": 1 << 16,
    }
    fields.update(overrides)
    return DeltaExpectation(**fields)


def _code(signed: SignedManifest, expect: DeltaExpectation) -> tuple[int, str, str]:
    with pytest.raises(ApiError) as caught:
        check_delta_manifest(signed, expect)
    return caught.value.status, caught.value.code, caught.value.message


def test_a_valid_delta_passes_every_check(eu_west: Any, fed: Federation) -> None:
    signed = _signed(eu_west, _encode(_tensors()))
    check_delta_manifest(signed, _expect())
    assert verify_signature(signed, fed.bundle(), datetime.now(UTC)) == eu_west.identity


@pytest.mark.parametrize(
    ("overrides", "expect", "wanted"),
    [
        ({"kind": ArtifactKind.GLOBAL_UPDATE}, {}, (400, "malformed_manifest", "model_delta")),
        ({"round": 4, "base_round": 4}, {}, (409, "wrong_round", "round 4")),
        ({"base_hash": "cd" * 32}, {}, (409, "base_mismatch", "resync")),
        ({}, {"tensors": SPECS[:1]}, (400, "shape_mismatch", "unexpected ['b']")),
        (
            {},
            {"tensors": (SPECS[0], ManifestTensor(name="b", dtype="float32", shape=(9,)))},
            (400, "shape_mismatch", "float32[9]"),
        ),
        ({}, {"codec": CodecParams(scheme="int4", block_size=32)}, (400, "codec_mismatch", "int4")),
        ({}, {"max_upload_bytes": 100}, (413, "too_large", "limit is 100")),
        ({"tokens": None}, {}, (400, "bad_request", "tokens")),
        ({"tokens": 10**15}, {"max_tokens": 1000}, (400, "tokens_out_of_bounds", "at most 1000")),
        (
            {
                "provenance": (
                    ArtifactProvenance(region="eu-west", jurisdiction="EU", datasets=("x",)),
                )
            },
            {},
            (400, "bad_request", "subset"),
        ),
        (
            {
                "provenance": (
                    ArtifactProvenance(region="eu-west", jurisdiction="US", datasets=("eu-a",)),
                )
            },
            {},
            (400, "bad_request", "policy says EU"),
        ),
        ({"job": "job-2"}, {}, (400, "bad_request", "job job-2")),
        (
            {"training": TrainingConfig(precision="bf16")},
            {"training": TrainingConfig()},
            (400, "bad_request", "'precision': 'bf16'"),
        ),
    ],
)
def test_each_mismatch_is_refused_with_its_code(
    eu_west: Any, overrides: dict[str, Any], expect: dict[str, Any], wanted: tuple[int, str, str]
) -> None:
    signed = _signed(eu_west, _encode(_tensors()), **overrides)
    status, code, message = _code(signed, _expect(**expect))
    assert (status, code) == wanted[:2]
    assert wanted[2] in message


def test_the_training_record_matches_the_jobs_or_is_absent(eu_west: Any) -> None:
    bf16 = TrainingConfig(precision="bf16")
    stream = _encode(_tensors())
    check_delta_manifest(_signed(eu_west, stream, training=bf16), _expect(training=bf16))
    check_delta_manifest(_signed(eu_west, stream), _expect(training=bf16))


def test_another_regions_delta_is_a_producer_mismatch(fed: Federation) -> None:
    signed = _signed(fed.region("us-east"), _encode(_tensors()))
    assert _code(signed, _expect())[:2] == (403, "producer_mismatch")


def test_signature_refusals_map_to_protocol_codes(eu_west: Any, fed: Federation) -> None:
    signed = _signed(eu_west, _encode(_tensors()))
    forged = SignedManifest(signed.manifest, bytes(reversed(signed.signature)), signed.certificate)
    with pytest.raises(ApiError) as caught:
        verify_signature(forged, fed.bundle(), datetime.now(UTC))
    assert (caught.value.status, caught.value.code) == (403, "bad_signature")
    fed.add_untrusted_authority("rogue")
    rogue = fed.region("eu-west", authority="rogue")
    stranger = _signed(rogue, _encode(_tensors()))
    with pytest.raises(ApiError) as caught:
        verify_signature(stranger, fed.bundle(), datetime.now(UTC))
    assert (caught.value.status, caught.value.code) == (403, "untrusted_certificate")


def _spooled(tmp_path: Path, frames: Iterable[bytes]) -> Path:
    """The stream as an upload's spool holds it: its frames in one file."""
    path = tmp_path / "spooled-stream"
    path.write_bytes(b"".join(bytes(frame) for frame in frames))
    return path


def test_verified_stream_is_stored_whole(eu_west: Any, tmp_path: Path) -> None:
    stream = _encode(_tensors())
    blobs = FsBlobStore(tmp_path / "blobs")
    spooled = _spooled(tmp_path, stream.frames())
    digest, size = verify_and_store(spooled, _signed(eu_west, stream), SPECS, blobs, workers=2)
    assert blobs.get(digest) == stream.to_bytes()
    assert not spooled.exists()  # the spooled file became the blob
    assert size == stream.total_bytes


def test_a_stored_stream_folds_again_to_the_values_the_region_sent(
    eu_west: Any, tmp_path: Path
) -> None:
    stream = _encode(_tensors())
    blobs = FsBlobStore(tmp_path / "blobs")
    spooled = _spooled(tmp_path, stream.frames())
    digest, _ = verify_and_store(spooled, _signed(eu_west, stream), SPECS, blobs)
    decoded = decode(stream.frames())
    total = WeightedSum({name: tuple(t.shape) for name, t in decoded.items()})
    # As the engine folds it: its chunks decoded side by side from the blob's file.
    total.add_verified("eu-west", 1.0, stored_delta(blobs, digest, 4 * 10**6))
    folded = total.take_mean()
    for name, tensor in decoded.items():
        assert torch.equal(folded[name], tensor)
    # A blob whose file holds another well-formed stream is refused by its name.
    other = _encode({name: t + 1 for name, t in _tensors().items()})
    blobs.path_of(digest).write_bytes(other.to_bytes())
    again = WeightedSum({name: tuple(t.shape) for name, t in decoded.items()})
    with pytest.raises(DigestMismatch, match=f"blob {digest} reads as"):
        again.add_verified("eu-west", 1.0, stored_delta(blobs, digest, 4 * 10**6))


def test_frames_out_of_order_store_nothing(eu_west: Any, tmp_path: Path) -> None:
    stream = _encode(_tensors())
    frames = list(stream.frames())
    frames[1], frames[2] = frames[2], frames[1]
    blobs = FsBlobStore(tmp_path / "blobs")
    with pytest.raises(ApiError) as caught:
        verify_and_store(_spooled(tmp_path, frames), _signed(eu_west, stream), SPECS, blobs)
    assert caught.value.code == "decode_failed"
    assert "where chunk 0 was expected" in caught.value.message
    assert list(blobs.iter_digests()) == []


def test_a_frame_other_than_the_manifests_is_a_corrupt_chunk(eu_west: Any, tmp_path: Path) -> None:
    stream = _encode(_tensors())
    other = _encode({name: t + 1 for name, t in _tensors().items()})
    frames = [stream.header, other.chunks[0].data, *[c.data for c in stream.chunks[1:]]]
    frames.append(stream.trailer)
    blobs = FsBlobStore(tmp_path / "blobs")
    with pytest.raises(ApiError) as caught:
        verify_and_store(_spooled(tmp_path, frames), _signed(eu_west, stream), SPECS, blobs)
    assert caught.value.code == "corrupt_chunk"
    assert list(blobs.iter_digests()) == []


def test_a_stream_for_another_model_is_a_shape_mismatch(eu_west: Any, tmp_path: Path) -> None:
    stream = _encode({"w": torch.zeros(8, 16), "c": torch.zeros(8)})
    with pytest.raises(ApiError) as caught:
        verify_and_store(
            _spooled(tmp_path, stream.frames()),
            _signed(eu_west, stream),
            SPECS,
            FsBlobStore(tmp_path / "blobs"),
        )
    assert caught.value.code == "shape_mismatch"


def test_a_stream_cut_short_or_with_a_hole_is_refused_and_stores_nothing(
    eu_west: Any, tmp_path: Path
) -> None:
    stream = _encode(_tensors())
    whole = stream.to_bytes()
    blobs = FsBlobStore(tmp_path / "blobs")
    for data in (whole[:-5], whole[:40] + bytes(20) + whole[60:]):
        (tmp_path / "spooled-stream").write_bytes(data)
        with pytest.raises(ApiError) as caught:
            verify_and_store(tmp_path / "spooled-stream", _signed(eu_west, stream), SPECS, blobs)
        assert caught.value.code in ("corrupt_chunk", "decode_failed"), caught.value
        assert list(blobs.iter_digests()) == []


def _forged_fp32_stream(values: torch.Tensor) -> list[bytes]:
    """A well-framed fp32 stream carrying ``values`` as they are (an encoder refuses Inf)."""
    template = encode_stream({"v": torch.zeros(values.numel())}, CodecParams(scheme="fp32"))
    header = template.header
    header_digest = hashlib.sha256(header).digest()
    payload = values.to(torch.float32).numpy().tobytes()
    compressed = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(payload)
    fields = ChunkFields(0, 0, 0, 0, values.numel(), len(payload), header_digest)
    chunk = seal(FrameKind.CHUNK, [chunk_fields(fields), compressed])
    stream_digest = hashlib.sha256(header_digest + chunk.digest).digest()
    trailer = seal(
        FrameKind.TRAILER,
        [
            trailer_body(
                TrailerFields(1, values.numel(), len(header) + len(chunk.data), stream_digest)
            )
        ],
    )
    return [header, chunk.data, trailer.data]


def test_non_finite_values_are_refused(eu_west: Any, tmp_path: Path) -> None:
    frames = _forged_fp32_stream(torch.tensor([1.0, float("inf"), 2.0, 3.0]))
    specs = (ManifestTensor(name="v", dtype="float32", shape=(4,)),)
    manifest = Manifest(
        kind=ArtifactKind.MODEL_DELTA,
        job="job-1",
        round=3,
        producer=eu_west.identity.uri,
        codec=CodecParams(scheme="fp32", block_size=128, zstd_level=1, stochastic_rounding=False),
        tensors=specs,
        chunks=chunk_records(frames),
        total_size=sum(len(f) for f in frames),
        provenance=(ArtifactProvenance(region="eu-west", jurisdiction="EU", datasets=("eu-a",)),),
        created_at=datetime.now(UTC),
        base_hash=BASE,
        tokens=1,
    )
    signed = sign_manifest(manifest, eu_west.credential.private_key, eu_west.credential.certificate)
    blobs = FsBlobStore(tmp_path / "blobs")
    with pytest.raises(ApiError) as caught:
        verify_and_store(_spooled(tmp_path, frames), signed, specs, blobs)
    assert caught.value.code == "non_finite"
    assert list(blobs.iter_digests()) == []
