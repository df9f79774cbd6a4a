"""A small θ and global updates of it signed by a throwaway federation's coordinator, for
the tests that apply updates to θ (in memory, to a θ file, or chained after one), updates
verified from their files as an agent verifies them, and a θ held as a chain of one
verified update, as an agent holds it."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import torch

from geofed.artifact_bundle import pack_bundle
from geofed.artifact_check import verify_artifact_file
from geofed.codec import decode, encode_stream
from geofed.codec_params import CodecParams
from geofed.deltas import apply_partial_update
from geofed.manifest import ArtifactProvenance, build_manifest, sign_manifest
from geofed.params import parameters_vector_hash
from geofed.theta_chain import StoredUpdate, ThetaChain
from geofed.theta_file import write_theta
from geofed.types import ArtifactKind
from tests.support.pki import Federation

#: The codec of the updates :func:`signed_update` signs.
INT8 = CodecParams(scheme="int8", block_size=32, zstd_level=1)


def small_theta() -> dict[str, torch.Tensor]:
    """Four float32 tensors of a few dozen elements (a few chunks each at 32 a chunk)."""
    gen = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(10, 6, generator=gen),
        "layer.weight": torch.randn(6, 6, generator=gen),
        "layer.bias": torch.randn(6, generator=gen),
        "head": torch.randn(3, 6, generator=gen),
    }


def signed_update(
    fed: Federation,
    update: dict[str, torch.Tensor],
    *,
    job: str,
    round_: int,
    base_hash: str,
    parameters_hash: str,
    chunk_elements: int = 32,
) -> tuple[bytes, datetime]:
    """``update`` as round ``round_``'s global update bundle of ``job``, signed by the
    federation's coordinator (from θ of ``base_hash`` to θ of ``parameters_hash``), and
    when it was signed."""
    coordinator = fed.coordinator()
    stream = encode_stream(update, INT8, chunk_elements=chunk_elements)
    now = datetime.now(UTC)
    manifest = build_manifest(
        kind=ArtifactKind.GLOBAL_UPDATE,
        job=job,
        round=round_,
        producer=coordinator.identity,
        stream=stream,
        provenance=(ArtifactProvenance(region="eu-west", jurisdiction="EU", datasets=("a",)),),
        created_at=now,
        base_round=round_,
        base_hash=base_hash,
        parameters_hash=parameters_hash,
        tokens=10,
    )
    cred = coordinator.credential
    signed = sign_manifest(manifest, cred.private_key, cred.certificate)
    return pack_bundle(signed.to_bytes(), stream.frames()), now


def chained_theta(
    fed: Federation, theta: dict[str, torch.Tensor], root: Path, *, job: str
) -> tuple[Path, StoredUpdate, dict[str, torch.Tensor]]:
    """θ_1 of ``job`` held as an agent holds it: θ_0 = ``theta``'s file under ``root`` and
    round 0's update (small, seeded), signed, verified from its file and chained after it.
    Returns the chain's description file, the stored update and θ_1's tensors."""
    write_theta(root / "theta-0.st", theta)
    stored, after = stored_update(fed, theta, root, job=job, round_=0, seed=5)
    chain = root / "round-1.chain.json"
    ThetaChain(root / "theta-0.st", 0, (stored,)).save(chain)
    return chain, stored, after


def stored_update(
    fed: Federation,
    before: dict[str, torch.Tensor],
    root: Path,
    *,
    job: str,
    round_: int,
    seed: int,
) -> tuple[StoredUpdate, dict[str, torch.Tensor]]:
    """Round ``round_``'s update of θ ``before`` (small, drawn from ``seed``), signed,
    written under ``root`` and verified from its file as an agent verifies it; and θ after
    it."""
    gen = torch.Generator().manual_seed(seed)
    update = {name: 0.01 * torch.randn(t.shape, generator=gen) for name, t in before.items()}
    after = apply_partial_update(before, decode(encode_stream(update, INT8).frames()))
    data, now = signed_update(
        fed,
        update,
        job=job,
        round_=round_,
        base_hash=parameters_vector_hash(before),
        parameters_hash=parameters_vector_hash(after),
    )
    bundle = root / f"update-{round_}.bundle"
    bundle.write_bytes(data)
    artifact = verify_artifact_file(
        bundle, fed.bundle(), kind=ArtifactKind.GLOBAL_UPDATE, job=job, round_=round_, now=now
    )
    return StoredUpdate.of(artifact), after
