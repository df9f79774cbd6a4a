"""The coordinator's side of lineage: what each accepted delta says, and each round's record.

When a delta is about to be accepted, :meth:`ContributionLog.record` keeps what its
signed manifest says of where it came from (region, jurisdiction, datasets, tokens, the
:class:`~geofed.lineage.Software` that trained it) under
``<state_dir>/lineage/<job>/<round>/<region>.json``, keyed by the manifest's digest; the
upload spool is gone by publication time. When the round is published,
:func:`round_record` turns the included regions' entries into the lineage record that
the update's signed manifest carries (:func:`geofed.lineage.round_lineage`); an entry
whose digest is not the accepted delta's (a crash in between) is left out of the
software, never guessed. :func:`code_mismatch_at_first_delta` says, once per region and
job in this process, when a region's task code is not the coordinator's; the job goes on
and the audit log records it (``lineage.code_mismatch``).

:func:`read_lineage` reads θ_N's record back from the update of round N-1 in the job's
checkpoint location. Blocking: run in a worker thread.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import JsonValue, ValidationError

from coordinator.services import Services
from coordinator.state.audit import AuditEvent, AuditVerdict
from coordinator.state.store import Receipt
from coordinator.storage.artifacts import Location, find_entry
from coordinator.storage.checkpoints import EntryKind
from geofed.fsutil import atomic_write_bytes
from geofed.lineage import Software, code_mismatch, contributor, local_software, round_lineage
from geofed.manifest import Manifest, ManifestError, SignedManifest
from geofed.types import validate_name

__all__ = [
    "ContributionLog",
    "StoredLineage",
    "code_mismatch_at_first_delta",
    "note_delta",
    "read_lineage",
    "round_record",
]

log = logging.getLogger(__name__)

# (job, region) pairs already flagged: a mismatch is reported at a region's first delta.
_flagged: set[tuple[str, str]] = set()


class ContributionLog:
    """What each accepted delta's manifest says of its origin, per job, round and region."""

    def __init__(self, root: Path) -> None:
        self._root = root

    def _path(self, job: str, round_: int, region: str) -> Path:
        validate_name("job", job)
        validate_name("region", region)
        return self._root / job / str(int(round_)) / f"{region}.json"

    def record(self, job: str, region: str, digest: str, manifest: Manifest) -> None:
        origin = next((p for p in manifest.provenance if p.region == region), None)
        entry = {
            "delta_manifest": digest,
            "tokens": manifest.tokens or 0,
            "jurisdiction": origin.jurisdiction if origin else "unknown",
            "datasets": list(origin.datasets) if origin else [],
            "software": None
            if manifest.software is None
            else manifest.software.model_dump(mode="json"),
            "data_fingerprints": manifest.data_fingerprints,
        }
        path = self._path(job, manifest.round, region)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write_bytes(path, json.dumps(entry, sort_keys=True).encode(), private=True)

    def load(self, job: str, round_: int, region: str) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads(self._path(job, round_, region).read_bytes())
        except (FileNotFoundError, ValueError):
            return None
        return data

    def discard_round(self, job: str, round_: int, late: Iterable[tuple[str, int]] = ()) -> None:
        """Forget round ``round_``'s entries and those of the ``late`` (region, round)
        deltas it merged."""
        shutil.rmtree(self._root / validate_name("job", job) / str(int(round_)), True)
        for region, earlier in late:
            self._path(job, earlier, region).unlink(missing_ok=True)


def code_mismatch_at_first_delta(
    job: str, region: str, task_spec: str, manifest: Manifest
) -> str | None:
    """Why ``region``'s task code differs from ours, the first time in this process only."""
    if (job, region) in _flagged:
        return None
    reason = code_mismatch(region, manifest.software, local_software(task_spec).task)
    if reason is not None:
        _flagged.add((job, region))
    return reason


def round_record(
    log: ContributionLog,
    *,
    job: str,
    round_: int,
    spec: Mapping[str, Any],
    receipts: Iterable[Receipt],
    included: Sequence[str],
) -> dict[str, JsonValue]:
    """The lineage record of round ``round_`` from its included regions' accepted deltas
    and the late deltas of earlier rounds it merged (``receipts`` of those rounds)."""
    ours = local_software(str(spec["task"]["spec"]))
    regions = set(included)
    taken = [r for r in receipts if (r.round == round_ and r.region in regions) or r.round < round_]
    contributors = []
    for receipt in sorted(taken, key=lambda r: (r.region, r.round)):
        region = receipt.region
        entry = log.load(job, receipt.round, region) or {}
        same = entry.get("delta_manifest") == receipt.manifest_digest
        software = None
        if same and entry.get("software"):
            try:
                software = Software.model_validate(entry["software"])
            except ValidationError:
                software = None
        contributors.append(
            contributor(
                region,
                str(entry.get("jurisdiction", "unknown")),
                [str(d) for d in entry.get("datasets", [])],
                receipt.manifest_digest,
                receipt.tokens,
                software,
                code_mismatch(region, software, ours.task) is None,
                _fingerprints(entry) if same else None,
            )
        )
        if receipt.round < round_:
            contributors[-1]["round"] = receipt.round  # a late delta, merged here
    return round_lineage(
        job=job, round_=round_, spec=spec, coordinator=ours, contributors=contributors
    )


def _fingerprints(entry: Mapping[str, Any]) -> dict[str, str] | None:
    found = entry.get("data_fingerprints")
    if not isinstance(found, dict):
        return None
    return {str(name): str(value) for name, value in found.items()}


@dataclass(frozen=True, slots=True)
class StoredLineage:
    """θ_version's lineage as the signed update manifest of round version-1 holds it."""

    version: int
    update_manifest: str  # sha256 of the signed manifest bytes
    producer: str
    lineage: dict[str, JsonValue] | None


def read_lineage(location: Location, job: str, version: int) -> StoredLineage | None:
    """The lineage of θ_version (version >= 1), or None when its update is not stored."""
    entry = find_entry(location, job, EntryKind.UPDATE, version - 1)
    if entry is None:
        return None
    try:
        signed = SignedManifest.from_bytes(location.path_of(entry.manifest_digest).read_bytes())
    except (OSError, ManifestError):
        return None
    manifest = signed.manifest
    return StoredLineage(version, entry.manifest_digest, manifest.producer, manifest.lineage)


async def note_delta(
    services: Services, job: str, task_spec: str, region: str, digest: str, manifest: Manifest
) -> None:
    """Before a delta is accepted: keep its origin, and flag task code that is not ours.

    A job with ``code_mismatch: refuse`` has refused such a delta already, at its manifest
    (:func:`coordinator.intake.delta_checks.check_delta_manifest`); here it is only flagged. A
    failure here is logged and the upload goes on.
    """
    log_ = ContributionLog(services.config.state_dir / "lineage")
    try:
        await services.executors.files(log_.record, job, region, digest, manifest)
        reason = await services.executors.files(
            code_mismatch_at_first_delta, job, region, task_spec, manifest
        )
    except Exception as exc:  # lineage is a record of the round, not a gate on it
        log.warning("job %s: lineage of %s's delta not recorded: %s", job, region, exc)
        return
    if reason is None:
        return
    log.warning("job %s: %s", job, reason)
    await services.db.append_audit(
        AuditEvent(
            actor=services.actor,
            action="lineage.code_mismatch",
            verdict=AuditVerdict.ALLOW,
            job=job,
            round=manifest.round,
            region=region,
            details={"reason": reason, "delta_manifest": digest, "mode": "warn"},
        )
    )
