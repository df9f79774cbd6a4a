"""Rebuilding a published global model from its signed chain, for ``geofed export``.

A job's θ_N is a snapshot θ_s and the updates s .. N-1 after it (protocol: "Download").
:func:`rebuild` takes those artifact bundles in order, passes each through the agents'
own gate (:mod:`geofed.artifact_check`: signature by a federation coordinator, chunk
digests, strict decode, parameter hashes), checks each bundle's sha256 against the digest
it was listed under, applies the updates with the shared arithmetic and checks the end
against the published ``parameters_hash``: the result is θ_N bit for bit.

:func:`export_metadata` says where the model came from as ``str -> str`` entries (what
safetensors metadata holds): the job, the version and its hash, every region that
contributed with its jurisdiction and datasets, the signed chain it was rebuilt from and
the lineage when the coordinator has one. :func:`safetensors_bytes` and
:func:`torch_checkpoint` give the two file formats; neither needs geofed to be read
(``safetensors.torch.load_file``; ``torch.load(f, weights_only=True)["state_dict"]``).
Pure: fetching and writing are the caller's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Literal

from torch import Tensor

from geofed.artifact_check import (
    ArtifactRefused,
    VerifiedArtifact,
    apply_verified_update,
    snapshot_params,
    verify_artifact,
)
from geofed.pki import TrustBundle
from geofed.types import ArtifactKind, validate_name

__all__ = [
    "EXPORT_FORMAT",
    "FORMATS",
    "ChainPart",
    "ExportError",
    "ExportPlan",
    "Rebuilt",
    "export_metadata",
    "parse_plan",
    "plan_parts",
    "rebuild",
    "safetensors_bytes",
    "torch_checkpoint",
]

#: The ``format`` entry of an export's metadata.
EXPORT_FORMAT: Final = "geofed-export-1"
FORMATS: Final = ("safetensors", "torch")
Format = Literal["safetensors", "torch"]
Params = dict[str, Tensor]


class ExportError(Exception):
    """The chain cannot be rebuilt into the published model; the message says why."""


@dataclass(frozen=True, slots=True)
class ChainPart:
    """One artifact of the chain: where to get it and the digests it must have."""

    kind: ArtifactKind  # GLOBAL_CHECKPOINT (the snapshot) or GLOBAL_UPDATE
    round: int
    payload_digest: str  # sha256 of the whole bundle
    manifest_digest: str | None  # sha256 of its signed manifest bytes, when listed
    url: str | None = None  # where the coordinator serves it


@dataclass(frozen=True, slots=True)
class ExportPlan:
    """θ_round of ``job``: a snapshot and the contiguous updates that reach it."""

    job: str
    round: int
    parameters_hash: str | None  # as published; None when the source does not say
    snapshot: ChainPart
    updates: tuple[ChainPart, ...]

    def __post_init__(self) -> None:
        rounds = [part.round for part in self.updates]
        expected = list(range(self.snapshot.round, self.round))
        if rounds != expected:
            raise ExportError(
                f"the chain of {self.job} from the snapshot of θ_{self.snapshot.round} has "
                f"updates {rounds}; θ_{self.round} needs {expected}"
            )

    @property
    def parts(self) -> tuple[ChainPart, ...]:
        return (self.snapshot, *self.updates)


@dataclass(frozen=True)
class Rebuilt:
    """θ_round rebuilt and verified, with the manifests it came from."""

    job: str
    round: int
    params: dict[str, Tensor]
    params_hash: str
    artifacts: tuple[VerifiedArtifact, ...]  # snapshot first, in application order

    @property
    def final_manifest(self) -> VerifiedArtifact:
        return self.artifacts[-1]


def parse_plan(job: str, listing: Mapping[str, Any]) -> ExportPlan:
    """The plan an export grant lists (``POST /v1/jobs/{job}/exports``'s answer)."""
    try:

        def part(entry: Mapping[str, Any], kind: ArtifactKind) -> ChainPart:
            manifest = entry.get("manifest_digest")
            return ChainPart(
                kind,
                int(entry["round"]),
                str(entry["payload_digest"]),
                None if manifest is None else str(manifest),
                str(entry["url"]),
            )

        snapshot = part(listing["snapshot"], ArtifactKind.GLOBAL_CHECKPOINT)
        updates = tuple(
            sorted(
                (part(e, ArtifactKind.GLOBAL_UPDATE) for e in listing["updates"]),
                key=lambda p: p.round,
            )
        )
        published = listing.get("parameters_hash")
        round_ = int(listing["round"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ExportError(f"export of {job}: malformed chain listing ({exc!r})") from None
    return ExportPlan(job, round_, None if published is None else str(published), snapshot, updates)


def rebuild(
    plan: ExportPlan,
    bundles: Iterable[bytes],
    trust: TrustBundle,
    *,
    now: datetime,
) -> Rebuilt:
    """Verify ``bundles`` (the plan's parts, in order) and rebuild θ_plan.round exactly.

    Raise :class:`ExportError` naming the first part that fails any check.
    """
    parts = plan.parts
    verified: list[VerifiedArtifact] = []
    params: dict[str, Tensor] = {}
    params_hash = ""
    for part, data in zip(parts, bundles, strict=False):
        try:
            artifact = _verified(plan.job, part, data, trust, now, params)
            if part.kind is ArtifactKind.GLOBAL_CHECKPOINT:
                params, params_hash = snapshot_params(artifact)
            else:
                params, params_hash = apply_verified_update(
                    params, part.round, params_hash, artifact
                )
        except ArtifactRefused as exc:
            raise ExportError(f"refused: {exc}") from None
        verified.append(artifact)
    count = len(verified)
    if count != len(parts):
        raise ExportError(f"export of {plan.job}: {count} of {len(parts)} artifacts given")
    if plan.parameters_hash is not None and params_hash != plan.parameters_hash:
        raise ExportError(
            f"θ_{plan.round} of {plan.job} rebuilt with hash {params_hash}; the coordinator "
            f"published {plan.parameters_hash}"
        )
    return Rebuilt(plan.job, plan.round, params, params_hash, tuple(verified))


def _verified(
    job: str, part: ChainPart, data: bytes, trust: TrustBundle, now: datetime, params: Params
) -> VerifiedArtifact:
    """One part through the gate, its bundle and manifest digests checked as listed."""
    what = f"{part.kind.value} {job}/{part.round}"
    found = hashlib.sha256(data).hexdigest()
    if found != part.payload_digest:
        raise ArtifactRefused(f"{what}: bundle sha256 {found}, listed as {part.payload_digest}")
    artifact = verify_artifact(
        data,
        trust,
        kind=part.kind,
        job=job,
        round_=part.round,
        now=now,
        # An update decodes to at most θ's float32 size.
        max_decoded_bytes=4 * sum(t.numel() for t in params.values()) if params else None,
    )
    if part.manifest_digest is not None and artifact.manifest_digest != part.manifest_digest:
        raise ArtifactRefused(
            f"{what}: manifest digest {artifact.manifest_digest}, listed as {part.manifest_digest}"
        )
    return artifact


def export_metadata(
    rebuilt: Rebuilt,
    *,
    exported_at: datetime,
    destination: str | None = None,
    lineage: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Where the model came from, as ``str -> str`` (JSON for the structured entries)."""
    final = rebuilt.final_manifest.manifest
    provenance = [
        {"region": p.region, "jurisdiction": p.jurisdiction, "datasets": list(p.datasets)}
        for p in final.provenance
    ]
    chain = [
        {
            "kind": a.manifest.kind.value,
            "round": a.manifest.round,
            "manifest_digest": a.manifest_digest,
            "producer": a.manifest.producer,
            "created_at": a.manifest.created_at.isoformat(),
            "codec": dataclasses.asdict(a.manifest.codec),
            "tokens": a.manifest.tokens,
            "parameters_hash": a.manifest.parameters_hash,
        }
        for a in rebuilt.artifacts
    ]
    meta = {
        "format": EXPORT_FORMAT,
        "job": validate_name("job", rebuilt.job),
        "round": str(rebuilt.round),
        "parameters_hash": rebuilt.params_hash,
        "parameters_hash_scheme": "geofed.params.parameters_vector_hash",
        "producer": final.producer,
        "provenance": _json(provenance),
        "chain": _json(chain),
        "exported_at": exported_at.isoformat(),
    }
    if destination is not None:
        meta["destination"] = destination
    # What made θ_round, as the coordinator signed it into the last update's manifest.
    lineage = lineage if lineage is not None else final.lineage
    if lineage is not None:
        meta["lineage"] = _json(lineage)
    return meta


def safetensors_bytes(params: Mapping[str, Tensor], metadata: Mapping[str, str]) -> bytes:
    """The safetensors file of ``params`` with ``metadata`` in its header."""
    from safetensors.torch import save

    tensors = {name: t.detach().to("cpu").contiguous() for name, t in sorted(params.items())}
    data: bytes = save(tensors, metadata=dict(metadata))
    return data


def torch_checkpoint(
    params: Mapping[str, Tensor], metadata: Mapping[str, str]
) -> dict[str, dict[str, Any]]:
    """What ``torch.save`` writes: ``{"state_dict": ..., "metadata": ...}``.

    Both entries load with ``torch.load(f, weights_only=True)``; ``state_dict`` goes
    straight into ``model.load_state_dict``.
    """
    state = {name: t.detach().to("cpu").clone() for name, t in sorted(params.items())}
    return {"state_dict": state, "metadata": dict(metadata)}


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def plan_parts(
    job: str, round_: int, parts: Sequence[ChainPart], published: str | None
) -> ExportPlan:
    """An :class:`ExportPlan` from a snapshot followed by its updates (a local store's chain)."""
    if not parts or parts[0].kind is not ArtifactKind.GLOBAL_CHECKPOINT:
        raise ExportError(f"the chain of {job} does not start with a snapshot")
    return ExportPlan(job, round_, published, parts[0], tuple(parts[1:]))
