"""A job's publication on the local disk, for tests and benchmarks of the outer round.

:func:`job_publishing` gives what :func:`coordinator.aggregation.outer_round.publish_round` needs: a
checkpoint location and a working-state store in a directory, signing with a coordinator
certificate of a throw-away CA (:mod:`tests.support.pki`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from coordinator.aggregation.outer_round import JobPublishing
from coordinator.rounds.layout import RoundLayout
from coordinator.storage.artifacts import Location, Signer
from coordinator.storage.working_state import ParamsStore
from geofed.blobstore import FsBlobStore
from geofed.codec_params import CodecParams
from geofed.manifest import ArtifactProvenance
from tests.support.pki import Federation, make_federation

__all__ = ["job_publishing"]


def job_publishing(
    root: Path,
    shapes: Mapping[str, tuple[int, ...]],
    codec: CodecParams,
    *,
    job: str = "job-1",
    snapshot_every: int = 2,
    provenance: tuple[ArtifactProvenance, ...] = (
        ArtifactProvenance(region="eu-west", jurisdiction="EU", datasets=("eu-a",)),
    ),
    federation: Federation | None = None,
) -> JobPublishing:
    """Job ``job``'s publication under ``root`` (``pki/``, ``state/blobs/``, ``ckpt/``)."""
    coordinator = (federation or make_federation(root / "pki", "bench")).coordinator()
    blobs = FsBlobStore(root / "state" / "blobs")
    return JobPublishing(
        job=job,
        codec=codec,
        snapshot_every=snapshot_every,
        provenance=provenance,
        layout=RoundLayout(dict(shapes)),
        location=Location.open("eu-ckpt", "EU", "eu-west", root / "ckpt"),
        signer=Signer(
            coordinator.identity,
            coordinator.credential.certificate,
            coordinator.credential.private_key,
        ),
        params_store=ParamsStore(blobs),
        deltas=blobs,
    )
