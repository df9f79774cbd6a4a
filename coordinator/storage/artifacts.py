"""Signed artifacts the coordinator publishes, and where they are kept.

A published global update and a checkpoint snapshot are each one *artifact bundle*
(:mod:`geofed.artifact_bundle`: signed manifest + codec stream), stored as one blob in the job's
checkpoint location and recorded in that location's chain index
(:class:`~coordinator.storage.checkpoints.CheckpointStore`): the payload digest is the bundle's
sha256 (its content address, ``GET /v1/jobs/{job}/artifacts/{sha256}``), the manifest
digest the sha256 of the signed manifest bytes (what announcements carry as
``update_digest``). Storing is idempotent: after a crash the coordinator recomputes the
same stream bit for bit, and an entry already recorded for that round is reused once its
stream is checked to be the same bytes (signatures differ between signings, so the
bundle itself cannot be compared). Blocking: call from a worker thread.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from coordinator.storage.checkpoints import CheckpointEntry, CheckpointStore, EntryKind
from geofed.artifact_bundle import HEADER_SIZE, iter_bundle, manifest_length
from geofed.blobstore import FsBlobStore
from geofed.codec import EncodedStream
from geofed.manifest import Manifest, SignedManifest, sign_manifest
from geofed.types import Identity

__all__ = [
    "ArtifactConflict",
    "Location",
    "Signer",
    "StoredArtifact",
    "chain_at",
    "find_entry",
    "store_artifact",
]

_READ = 1 << 20


class ArtifactConflict(Exception):
    """A different artifact is already recorded for that job, kind and round."""


@dataclass(frozen=True)
class Location:
    """A configured checkpoint location: its chain index and its blobs on disk."""

    name: str
    jurisdiction: str
    region: str | None
    store: CheckpointStore
    blobs: FsBlobStore

    @classmethod
    def open(cls, name: str, jurisdiction: str, region: str | None, root: Path) -> Location:
        blobs = FsBlobStore(root / "blobs")
        return cls(name, jurisdiction, region, CheckpointStore(name, root, blobs=blobs), blobs)

    def path_of(self, digest: str) -> Path:
        return self.blobs.path_of(digest)


@dataclass(frozen=True)
class Signer:
    """The coordinator's identity and key, which sign everything it publishes."""

    identity: Identity
    certificate: x509.Certificate
    private_key: ec.EllipticCurvePrivateKey

    def sign(self, manifest: Manifest) -> SignedManifest:
        return sign_manifest(manifest, self.private_key, self.certificate)


@dataclass(frozen=True, slots=True)
class StoredArtifact:
    """An artifact recorded in a location's chain."""

    kind: EntryKind
    round: int
    bundle_digest: str
    manifest_digest: str
    size: int


def store_artifact(
    location: Location,
    kind: EntryKind,
    job: str,
    round: int,
    signed: SignedManifest,
    stream: EncodedStream,
) -> StoredArtifact:
    """Store the bundle and manifest blobs and record them in the chain (idempotent)."""
    stream_digest = _digest(stream.frames())
    existing = find_entry(location, job, kind, round)
    if existing is not None:
        found = _bundle_stream_digest(location.path_of(existing.payload_digest))
        if found != stream_digest:
            raise ArtifactConflict(
                f"job {job!r} already has a {kind} of round {round} in {location.name} whose "
                f"stream differs from the one computed now (sha256 {found} != {stream_digest})"
            )
        size = location.blobs.size(existing.payload_digest)
        return StoredArtifact(kind, round, existing.payload_digest, existing.manifest_digest, size)
    manifest_bytes = signed.to_bytes()
    bundle = location.blobs.put_stream(iter_bundle(manifest_bytes, stream.frames()))
    manifest = location.blobs.put(manifest_bytes)
    if kind is EntryKind.SNAPSHOT:
        location.store.record_snapshot(job, round, bundle, manifest)
    else:
        location.store.record_update(job, round, bundle, manifest)
    return StoredArtifact(kind, round, bundle, manifest, location.blobs.size(bundle))


def find_entry(location: Location, job: str, kind: EntryKind, round: int) -> CheckpointEntry | None:
    return next(
        (e for e in location.store.entries(job) if e.kind is kind and e.round == round), None
    )


def chain_at(
    location: Location, job: str, version: int
) -> tuple[CheckpointEntry, list[CheckpointEntry]] | None:
    """The newest snapshot at or before ``version`` with every update up to it, or None.

    Entries after ``version`` (written by a publication whose round is not committed
    yet) are ignored, so the chain always restores exactly θ_version.
    """
    entries = location.store.entries(job)
    updates = {e.round: e for e in entries if e.kind is EntryKind.UPDATE and e.round < version}
    snapshots = [e for e in entries if e.kind is EntryKind.SNAPSHOT and e.round <= version]
    for snapshot in reversed(snapshots):
        chain = [updates.get(r) for r in range(snapshot.round, version)]
        if all(entry is not None for entry in chain):
            return snapshot, [entry for entry in chain if entry is not None]
    return None


def _digest(parts: Iterable[bytes]) -> str:
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(part)
    return hasher.hexdigest()


def _bundle_stream_digest(path: Path) -> str:
    """sha256 of the stream part of a stored bundle, read in bounded pieces."""
    with path.open("rb") as file:
        length = manifest_length(file.read(HEADER_SIZE))
        file.seek(HEADER_SIZE + length)
        hasher = hashlib.sha256()
        while piece := file.read(_READ):
            hasher.update(piece)
    return hasher.hexdigest()
