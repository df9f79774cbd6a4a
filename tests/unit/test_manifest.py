"""Signed manifests: round trip, tampering, chunk digests, signers the bundle refuses."""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding

from geofed.manifest import (
    BadSignature,
    ChunkDigestMismatch,
    ChunkRecord,
    MalformedManifest,
    Manifest,
    ManifestTensor,
    ProducerMismatch,
    SignedManifest,
    UnknownChunk,
    UntrustedSigner,
    sign_manifest,
    verify_chunk,
    verify_chunks,
)
from geofed.types import ArtifactKind
from tests.support.manifests import CHUNKS, make_manifest
from tests.support.pki import Federation, Principal, make_federation

NOW = datetime.now(UTC)


@pytest.fixture(autouse=True, scope="module")
def _fresh_now() -> None:
    """Take NOW when the module runs, not when it is imported: the certificates are issued
    then, and a long suite may collect this module minutes before running it."""
    global NOW
    NOW = datetime.now(UTC)


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Federation:
    federation = make_federation(
        tmp_path_factory.mktemp("manifest") / "fed",
        "acme",
        authorities={"org-a": ["coordinator/*", "region/eu-*"], "org-b": ["region/us-*"]},
    )
    federation.add_untrusted_authority("rogue")
    return federation


@pytest.fixture(scope="module")
def producer(fed: Federation) -> Principal:
    return fed.region("eu-west")


def signed(producer: Principal, manifest: Manifest | None = None) -> SignedManifest:
    manifest = manifest or make_manifest(producer)
    return sign_manifest(manifest, producer.credential.private_key, producer.credential.certificate)


def test_round_trip_through_the_wire_form(fed, producer):
    original = signed(producer)
    wire = original.to_bytes()
    parsed = SignedManifest.from_bytes(wire)
    assert parsed.manifest == original.manifest
    assert parsed.to_bytes() == wire
    assert parsed.verify(fed.bundle(), now=NOW) == producer.identity
    document = json.loads(wire)
    assert sorted(document) == ["certificate", "manifest", "signature"]
    assert document["manifest"]["created_at"] == "2030-01-02T03:04:05.678000Z"


def test_canonical_form_is_sorted_compact_and_stable(producer):
    manifest = make_manifest(producer)
    canonical = manifest.canonical_bytes()
    assert b" " not in canonical
    assert (
        canonical
        == json.dumps(json.loads(canonical), sort_keys=True, separators=(",", ":")).encode()
    )
    reordered = Manifest.model_validate_json(
        json.dumps(dict(reversed(list(json.loads(canonical).items()))), indent=2)
    )
    assert reordered.canonical_bytes() == canonical
    assert reordered.digest() == manifest.digest()
    assert make_manifest(producer, round=8).digest() != manifest.digest()


def _set(path: tuple[str | int, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        target: Any = doc
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = value

    return mutate


def _grow_last_chunk(doc: dict[str, Any]) -> None:
    doc["chunks"][-1]["size"] += 1
    doc["total_size"] += 1


# One valid change per field: the signature is the only thing that catches it.
TAMPERS: dict[str, Callable[[dict[str, Any]], None]] = {
    "kind": _set(("kind",), "global_update"),
    "job": _set(("job",), "other-job"),
    "round": _set(("round",), 8),
    "producer": _set(("producer",), "spiffe://acme/region/eu-north"),
    "codec": _set(("codec", "block_size"), 64),
    "tensors": _set(("tensors", 0, "shape"), [32, 64]),
    "chunks": _set(("chunks", 1, "sha256"), "00" * 32),
    "total_size": _grow_last_chunk,
    "provenance": _set(("provenance", 0, "datasets"), ["c4-eu", "c4-us"]),
    "created_at": _set(("created_at",), "2030-01-02T03:04:06Z"),
    "base_round": _set(("base_round",), 5),
    "base_hash": _set(("base_hash",), "cd" * 32),
    "tokens": _set(("tokens",), 1 << 20),
    "parameters_hash": _set(("parameters_hash",), "ef" * 32),
    "training": _set(("training", "lr_schedule", "warmup_steps"), 11),
    "base_eval": _set(("base_eval", "val_loss"), 2.25),
    "software": _set(("software", "task", "fingerprint"), "34" * 32),
    "lineage": _set(("lineage", "contributors", 0, "tokens"), 8192),
    "data_fingerprints": _set(("data_fingerprints", "c4-eu"), "6f" * 32),
}


def test_every_field_has_a_tamper_case():
    assert set(TAMPERS) | {"format_version"} == set(Manifest.model_fields)


@pytest.mark.parametrize("field", sorted(TAMPERS))
def test_tampering_with_any_field_is_detected(fed, producer, field):
    document = json.loads(signed(producer).to_bytes())
    TAMPERS[field](document["manifest"])
    tampered = SignedManifest.from_bytes(json.dumps(document).encode())
    with pytest.raises(BadSignature):
        tampered.verify(fed.bundle(), now=NOW)


def test_the_manifest_records_the_training_section(fed, producer):
    document = json.loads(signed(producer).to_bytes())
    assert document["manifest"]["training"] == {
        "parallelism": "ddp",
        "precision": "bf16",
        "grad_clip_norm": 1.0,
        "grad_accumulation": 1,
        "activation_checkpointing": False,
        "lr_schedule": {"kind": "warmup_cosine", "warmup_steps": 10, "min_lr_ratio": 0.1},
    }
    del document["manifest"]["training"]
    stripped = SignedManifest.from_bytes(json.dumps(document).encode())
    with pytest.raises(BadSignature):
        stripped.verify(fed.bundle(), now=NOW)


def test_a_manifest_without_training_keeps_the_form_it_was_signed_in(fed, producer):
    # Manifests signed before the field existed carry no "training" key and verify still.
    manifest = make_manifest(producer, training=None)
    canonical = json.loads(manifest.canonical_bytes())
    assert "training" not in canonical
    assert canonical == {
        key: value for key, value in manifest.model_dump(mode="json").items() if key != "training"
    }
    wire = signed(producer, manifest).to_bytes()
    assert b"training" not in wire
    parsed = SignedManifest.from_bytes(wire)
    assert parsed.manifest.training is None
    assert parsed.verify(fed.bundle(), now=NOW) == producer.identity
    document = json.loads(wire)
    document["manifest"]["training"] = None  # an explicit null means the same
    again = SignedManifest.from_bytes(json.dumps(document).encode())
    assert again.verify(fed.bundle(), now=NOW) == producer.identity


def test_the_manifest_carries_the_base_evaluation_signed(fed, producer):
    document = json.loads(signed(producer).to_bytes())
    assert document["manifest"]["base_eval"] == {"val_loss": 2.5, "val_bits_per_byte": 3.6067}
    del document["manifest"]["base_eval"]
    stripped = SignedManifest.from_bytes(json.dumps(document).encode())
    with pytest.raises(BadSignature):
        stripped.verify(fed.bundle(), now=NOW)
    # Signed before the field existed, or by a region that did not evaluate: no key at all.
    wire = signed(producer, make_manifest(producer, base_eval=None)).to_bytes()
    assert b"base_eval" not in wire
    assert SignedManifest.from_bytes(wire).verify(fed.bundle(), now=NOW) == producer.identity


@pytest.mark.parametrize(
    "bad",
    [{"val_loss": float("nan")}, {"val_loss": "2.5"}, {"bad name": 1.0}, {"val_loss": True}],
)
def test_a_base_evaluation_holds_finite_named_numbers(producer, bad):
    with pytest.raises(ValueError, match="base_eval"):
        make_manifest(producer, base_eval=bad)


def test_unknown_format_version_is_malformed(producer):
    document = json.loads(signed(producer).to_bytes())
    document["manifest"]["format_version"] = 2
    with pytest.raises(MalformedManifest, match="format_version"):
        SignedManifest.from_bytes(json.dumps(document).encode())


def test_tampered_signature_bytes_are_detected(fed, producer):
    original = signed(producer)
    flipped = bytearray(original.signature)
    flipped[-1] ^= 0x01
    with pytest.raises(BadSignature):
        SignedManifest(original.manifest, bytes(flipped), original.certificate).verify(
            fed.bundle(), now=NOW
        )


def test_flipped_bit_in_a_chunk_is_detected(producer):
    manifest = make_manifest(producer)
    verify_chunks(manifest, CHUNKS)
    for index, chunk in enumerate(CHUNKS):
        verify_chunk(manifest, index, memoryview(chunk))
        for bit in (0, len(chunk) * 8 - 1):
            corrupted = bytearray(chunk)
            corrupted[bit // 8] ^= 1 << (bit % 8)
            with pytest.raises(ChunkDigestMismatch, match=f"chunk {index} has sha256"):
                verify_chunk(manifest, index, corrupted)


def test_truncated_extra_and_missing_chunks(producer):
    manifest = make_manifest(producer)
    with pytest.raises(ChunkDigestMismatch, match="chunk 2 has 3 bytes; the manifest records 4"):
        verify_chunk(manifest, 2, CHUNKS[2][:-1])
    with pytest.raises(UnknownChunk, match="chunk 3 does not exist"):
        verify_chunk(manifest, 3, b"")
    with pytest.raises(UnknownChunk):
        verify_chunk(manifest, -1, CHUNKS[-1])
    with pytest.raises(ChunkDigestMismatch, match="stream has 2 chunks"):
        verify_chunks(manifest, CHUNKS[:2])
    with pytest.raises(ChunkDigestMismatch, match="chunk 0"):
        verify_chunks(manifest, [CHUNKS[1], CHUNKS[0], CHUNKS[2]])


def test_another_principal_cannot_sign_for_the_producer(fed, producer):
    other = fed.region("eu-north")
    claim = make_manifest(producer)
    with pytest.raises(ProducerMismatch):
        sign_manifest(claim, other.credential.private_key, other.credential.certificate)
    # Signed with the other principal's key and certificate, claiming the producer's name.
    signature = other.credential.private_key.sign(claim.canonical_bytes(), _ecdsa())
    forged = SignedManifest(claim, signature, other.credential.certificate)
    with pytest.raises(ProducerMismatch, match="eu-north signed it"):
        SignedManifest.from_bytes(forged.to_bytes()).verify(fed.bundle(), now=NOW)
    # Signed with the other principal's key, presenting the producer's certificate.
    forged = SignedManifest(claim, signature, producer.credential.certificate)
    with pytest.raises(BadSignature):
        SignedManifest.from_bytes(forged.to_bytes()).verify(fed.bundle(), now=NOW)


@pytest.mark.parametrize(
    ("make_signer", "reason"),
    [
        (lambda fed: fed.region("eu-west", authority="rogue"), "unknown_authority"),
        (lambda fed: fed.region("eu-west", authority="org-b"), "outside_grant"),
        (
            lambda fed: fed.region(
                "eu-west", not_before=NOW - timedelta(days=9), not_after=NOW - timedelta(days=1)
            ),
            "expired",
        ),
    ],
)
def test_signers_the_bundle_refuses(fed, make_signer, reason):
    signer = make_signer(fed)
    wire = signed(signer).to_bytes()
    with pytest.raises(UntrustedSigner) as caught:
        SignedManifest.from_bytes(wire).verify(fed.bundle(), now=NOW)
    assert caught.value.reason == reason


def test_revoked_signer(tmp_path, producer):
    fed = make_federation(tmp_path / "fed", "acme")
    signer = fed.region("eu-west")
    wire = signed(signer).to_bytes()
    SignedManifest.from_bytes(wire).verify(fed.bundle(), now=NOW)
    fed.revoke(signer)
    with pytest.raises(UntrustedSigner) as caught:
        SignedManifest.from_bytes(wire).verify(fed.bundle(), now=NOW)
    assert caught.value.reason == "revoked"


def test_sign_refuses_a_key_of_another_certificate(fed, producer):
    other = fed.region("eu-north")
    with pytest.raises(ValueError, match="does not belong"):
        sign_manifest(
            make_manifest(producer), other.credential.private_key, producer.credential.certificate
        )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"kind": ArtifactKind.RAW_DATA}, "has no manifest"),
        ({"total_size": 1}, "chunks add up to"),
        ({"job": "Tiny LM"}, "invalid job"),
        ({"producer": "https://acme/region/eu-west"}, "not a SPIFFE URI"),
        ({"round": True}, "valid integer"),
        ({"round": -1}, "greater than or equal to 0"),
        ({"created_at": datetime(2030, 1, 1)}, "timezone"),
        ({"base_hash": "AB" * 32}, "pattern"),
        (
            {"tensors": (ManifestTensor(name="w", dtype="float32", shape=(1,)),) * 2},
            "appears twice",
        ),
    ],
)
def test_manifest_validation(producer, changes, message):
    with pytest.raises(ValueError, match=message):
        make_manifest(producer, **changes)


def test_optional_fields_and_empty_chunks_are_valid(producer):
    manifest = make_manifest(
        producer,
        kind=ArtifactKind.GLOBAL_UPDATE,
        chunks=(ChunkRecord(sha256="0" * 64, size=0),),
        total_size=0,
        base_round=None,
        base_hash=None,
        tokens=None,
        parameters_hash="12" * 32,
    )
    assert manifest.total_size == 0
    assert manifest.producer_identity == producer.identity


def _wire_with(producer: Principal, mutate: Callable[[dict[str, Any]], None]) -> bytes:
    document = json.loads(signed(producer).to_bytes())
    mutate(document)
    return json.dumps(document).encode()


def _pem_twice(doc: dict[str, Any]) -> None:
    doc["certificate"] = doc["certificate"] * 2


def _negative_serial(doc: dict[str, Any]) -> None:
    """Set the sign bit of the certificate's serial number (signature left as it was)."""
    pem = doc["certificate"]
    body = "".join(line for line in pem.splitlines() if not line.startswith("-----"))
    der = bytearray(base64.b64decode(body))
    version = der.index(b"\xa0\x03\x02\x01\x02")  # [0] EXPLICIT INTEGER 2 (v3)
    serial = version + 5
    assert der[serial] == 0x02  # INTEGER
    # 0x80 first: negative, and minimally encoded whatever followed (a sign bit set on
    # 0x7f before a byte with its top bit set would be a DER error, not a negative serial).
    der[serial + 2] = 0x80
    encoded = base64.encodebytes(bytes(der)).decode()
    doc["certificate"] = f"-----BEGIN CERTIFICATE-----\n{encoded}-----END CERTIFICATE-----\n"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda doc: doc["manifest"].update(extra=1), "Extra inputs"),
        (lambda doc: doc.update(comment="hi"), "Extra inputs"),
        (lambda doc: doc.pop("signature"), "signature: Field required"),
        (lambda doc: doc["manifest"].update(round="7"), "valid integer"),
        (lambda doc: doc.update(signature="not base64!"), "not base64"),
        (lambda doc: doc.update(signature=""), "signature of 0 bytes"),
        (lambda doc: doc.update(certificate="-----BEGIN CERTIFICATE-----\nxx"), "not PEM"),
        (_pem_twice, "expected one certificate, found 2"),
        (_negative_serial, "serial number is not positive"),
    ],
)
def test_malformed_documents(producer, mutate, message):
    with pytest.raises(MalformedManifest, match=message):
        SignedManifest.from_bytes(_wire_with(producer, mutate))


def test_malformed_bytes(producer):
    wire = signed(producer).to_bytes()
    with pytest.raises(MalformedManifest, match="duplicate key 'signature'"):
        SignedManifest.from_bytes(wire[:-1] + b',"signature":"AAAA"}')
    with pytest.raises(MalformedManifest, match="NaN"):
        SignedManifest.from_bytes(wire.replace(b'"round":7', b'"round":NaN'))
    with pytest.raises(MalformedManifest, match="exceeds 100"):
        SignedManifest.from_bytes(wire, max_size=100)
    with pytest.raises(MalformedManifest, match="not valid JSON"):
        SignedManifest.from_bytes(b"[" * 100_000)
    with pytest.raises(MalformedManifest, match="not valid JSON"):
        SignedManifest.from_bytes(b"\xff\xfe")
    with pytest.raises(MalformedManifest, match="expected bytes"):
        SignedManifest.from_bytes("{}")  # type: ignore[arg-type]


def test_certificate_travels_as_pem(producer):
    document = json.loads(signed(producer).to_bytes())
    pem = producer.credential.certificate.public_bytes(Encoding.PEM).decode()
    assert document["certificate"] == pem
    assert base64.b64decode(document["signature"], validate=True)


def test_documents_are_not_mutated_by_parsing(producer):
    document = json.loads(signed(producer).to_bytes())
    before = copy.deepcopy(document)
    SignedManifest.from_bytes(json.dumps(document).encode())
    assert document == before


def _ecdsa() -> ec.ECDSA:
    return ec.ECDSA(hashes.SHA256())
