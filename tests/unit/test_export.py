"""Rebuilding a published model from its signed chain (:mod:`geofed.export`), and its files."""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest
import torch
from safetensors.torch import load

from geofed.artifact_bundle import pack_bundle, split_bundle
from geofed.codec import decode, encode_stream
from geofed.codec_params import CodecParams
from geofed.deltas import apply_update
from geofed.export import (
    EXPORT_FORMAT,
    ChainPart,
    ExportError,
    ExportPlan,
    export_metadata,
    parse_plan,
    plan_parts,
    rebuild,
    safetensors_bytes,
    torch_checkpoint,
)
from geofed.manifest import ArtifactProvenance, build_manifest, sign_manifest
from geofed.params import parameters_vector_hash, state_to_fp32
from geofed.pki import TrustBundle
from geofed.types import ArtifactKind
from tests.support.pki import Federation, Principal, make_federation
from tests.support.tiny_task import TinyTask

JOB = "tiny"
Params = dict[str, torch.Tensor]
PROVENANCE = (
    ArtifactProvenance(region="eu-west", jurisdiction="EU", datasets=("eu-parliament",)),
    ArtifactProvenance(region="us-east", jurisdiction="US", datasets=()),
)


def _now() -> datetime:
    """The time of the check: after the test's own certificates were issued."""
    return datetime.now(UTC)


@dataclass
class Chain:
    """θ_0..θ_n, the signed bundles between them, and the plan that lists them."""

    thetas: list[Params]
    hashes: list[str]
    bundles: list[bytes]
    plan: ExportPlan


def bundle(
    signer: Principal, kind: ArtifactKind, round_: int, tensors: Params, **fields: object
) -> bytes:
    codec = CodecParams("fp32") if kind is ArtifactKind.GLOBAL_CHECKPOINT else CodecParams("int8")
    stream = encode_stream(tensors, codec)
    manifest = build_manifest(
        kind=kind,
        job=JOB,
        round=round_,
        producer=signer.identity,
        stream=stream,
        provenance=PROVENANCE,
        created_at=_now(),
        base_round=round_ if kind is ArtifactKind.GLOBAL_UPDATE else None,
        **fields,  # type: ignore[arg-type]
    )
    signed = sign_manifest(manifest, signer.credential.private_key, signer.credential.certificate)
    return pack_bundle(signed.to_bytes(), stream.frames())


def part(kind: ArtifactKind, round_: int, data: bytes) -> ChainPart:
    manifest = hashlib.sha256(split_bundle(data)[0]).hexdigest()
    return ChainPart(kind, round_, hashlib.sha256(data).hexdigest(), manifest)


def build_chain(signer: Principal, rounds: int = 2) -> Chain:
    theta = state_to_fp32(TinyTask().build_model(seed=3))
    thetas, hashes = [theta], [parameters_vector_hash(theta)]
    bundles = [bundle(signer, ArtifactKind.GLOBAL_CHECKPOINT, 0, theta, parameters_hash=hashes[0])]
    gen = torch.Generator().manual_seed(11)
    for r in range(rounds):
        intended = {n: 0.01 * torch.randn(t.shape, generator=gen) for n, t in theta.items()}
        theta = apply_update(theta, decode(encode_stream(intended, CodecParams("int8")).frames()))
        thetas.append(theta)
        bundles.append(
            bundle(
                signer,
                ArtifactKind.GLOBAL_UPDATE,
                r,
                intended,
                base_hash=hashes[-1],
                parameters_hash=parameters_vector_hash(theta),
            )
        )
        hashes.append(parameters_vector_hash(theta))
    kinds = [ArtifactKind.GLOBAL_CHECKPOINT] + [ArtifactKind.GLOBAL_UPDATE] * rounds
    parts = [part(k, max(i - 1, 0), b) for i, (k, b) in enumerate(zip(kinds, bundles, strict=True))]
    return Chain(thetas, hashes, bundles, plan_parts(JOB, rounds, parts, hashes[-1]))


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Federation:
    return make_federation(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def trust(federation: Federation) -> TrustBundle:
    return federation.bundle()


@pytest.fixture(scope="module")
def chain(federation: Federation) -> Chain:
    return build_chain(federation.coordinator())


def test_rebuild_gives_the_published_parameters_bit_for_bit(
    chain: Chain, trust: TrustBundle
) -> None:
    rebuilt = rebuild(chain.plan, chain.bundles, trust, now=_now())
    assert rebuilt.round == 2
    assert rebuilt.params_hash == chain.hashes[-1]
    assert rebuilt.params.keys() == chain.thetas[-1].keys()
    for name, tensor in chain.thetas[-1].items():
        assert torch.equal(rebuilt.params[name], tensor), name
    assert [a.manifest.round for a in rebuilt.artifacts] == [0, 0, 1]


def test_an_older_version_stops_early(chain: Chain, trust: TrustBundle) -> None:
    plan = plan_parts(JOB, 1, list(chain.plan.parts[:2]), chain.hashes[1])
    rebuilt = rebuild(plan, chain.bundles[:2], trust, now=_now())
    assert rebuilt.params_hash == chain.hashes[1]


def test_a_changed_byte_is_refused_even_under_its_new_digest(
    chain: Chain, trust: TrustBundle
) -> None:
    tampered = bytearray(chain.bundles[2])
    tampered[-5] ^= 0x01
    data = bytes(tampered)
    # Listed under the tampered bytes' own digest: the signed chunk digests still refuse it.
    parts = list(chain.plan.parts)
    parts[2] = part(ArtifactKind.GLOBAL_UPDATE, 1, data)
    plan = plan_parts(JOB, 2, parts, chain.hashes[-1])
    with pytest.raises(ExportError, match="refused: global_update tiny/1"):
        rebuild(plan, [*chain.bundles[:2], data], trust, now=_now())
    # Under the listed digest, the bundle's own hash refuses it first.
    with pytest.raises(ExportError, match="bundle sha256"):
        rebuild(chain.plan, [*chain.bundles[:2], data], trust, now=_now())


def test_a_bundle_signed_by_a_region_is_refused(federation: Federation, trust: TrustBundle) -> None:
    forged = build_chain(federation.issue("region", "eu-west"), rounds=1)
    with pytest.raises(ExportError, match="not by a coordinator"):
        rebuild(forged.plan, forged.bundles, trust, now=_now())


def test_a_chain_out_of_order_or_short_is_refused(chain: Chain, trust: TrustBundle) -> None:
    swapped = [chain.bundles[0], chain.bundles[2], chain.bundles[1]]
    with pytest.raises(ExportError, match="bundle sha256"):
        rebuild(chain.plan, swapped, trust, now=_now())
    with pytest.raises(ExportError, match="2 of 3 artifacts"):
        rebuild(chain.plan, chain.bundles[:2], trust, now=_now())
    with pytest.raises(ExportError, match="needs"):
        plan_parts(JOB, 3, list(chain.plan.parts), None)


def test_a_published_hash_that_differs_is_refused(chain: Chain, trust: TrustBundle) -> None:
    plan = plan_parts(JOB, 2, list(chain.plan.parts), "0" * 64)
    with pytest.raises(ExportError, match="published"):
        rebuild(plan, chain.bundles, trust, now=_now())


def test_the_grant_listing_parses_into_a_plan(chain: Chain) -> None:
    def entry(p: ChainPart) -> dict[str, object]:
        return {
            "round": p.round,
            "url": f"/x/{p.payload_digest}",
            "payload_digest": p.payload_digest,
            "manifest_digest": p.manifest_digest,
        }

    listing = {
        "round": 2,
        "parameters_hash": chain.hashes[-1],
        "snapshot": entry(chain.plan.snapshot),
        "updates": [entry(p) for p in reversed(chain.plan.updates)],
    }
    plan = parse_plan(JOB, listing)
    assert [p.round for p in plan.updates] == [0, 1]
    assert plan.parameters_hash == chain.hashes[-1]
    with pytest.raises(ExportError, match="malformed"):
        parse_plan(JOB, {"round": 2})


def test_metadata_and_both_files_load_without_geofed(chain: Chain, trust: TrustBundle) -> None:
    rebuilt = rebuild(chain.plan, chain.bundles, trust, now=_now())
    meta = export_metadata(
        rebuilt, exported_at=_now(), destination="storage:eu-ckpt", lineage={"round": 2}
    )
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    assert meta["format"] == EXPORT_FORMAT
    assert meta["parameters_hash"] == chain.hashes[-1]
    assert json.loads(meta["provenance"])[0] == {
        "region": "eu-west",
        "jurisdiction": "EU",
        "datasets": ["eu-parliament"],
    }
    assert [c["round"] for c in json.loads(meta["chain"])] == [0, 0, 1]
    assert json.loads(meta["lineage"]) == {"round": 2}

    data = safetensors_bytes(rebuilt.params, meta)
    assert parameters_vector_hash(load(data)) == chain.hashes[-1]
    header_size = int.from_bytes(data[:8], "little")
    assert json.loads(data[8 : 8 + header_size])["__metadata__"] == meta
    buffer = io.BytesIO()
    torch.save(torch_checkpoint(rebuilt.params, meta), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded["metadata"] == meta
    assert parameters_vector_hash(loaded["state_dict"]) == chain.hashes[-1]
    model = TinyTask().build_model(seed=0)
    model.load_state_dict(loaded["state_dict"])
    assert parameters_vector_hash(model) == chain.hashes[-1]
