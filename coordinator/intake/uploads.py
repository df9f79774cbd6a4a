"""The delta upload path: manifest checks, chunk spool, commit verification.

Three-step form (``docs/protocol.md``): the region PUTs its signed manifest, then each
frame, then POSTs commit; the single-shot form sends the artifact bundle in one body and
runs the very same steps. Each step re-checks that the caller is the region, the round
is open and the region takes part. A frame is acknowledged only once it is on disk
(fsync'd spool, SQLite progress row); frames that arrive together share the directory
fsync and the SQLite commit (:mod:`coordinator.intake.chunk_commit`). Commit decodes the whole
stream once (bounded, finite, shapes and codec as declared) while copying it into the
blob store, then offers it to the round, which commits the receipt. Every refusal is
counted by code and audited; bad input changes nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections import OrderedDict
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from aiohttp import StreamReader

from coordinator.api.auth import unknown_job
from coordinator.api.bodies import commit_metrics, read_exactly, read_frame, read_limited
from coordinator.errors import (
    ApiError,
    BadRequest,
    Conflict,
    Forbidden,
    NotFound,
    TooLarge,
    Unavailable,
)
from coordinator.intake.chunk_commit import ChunkCommitter, ChunkWrite
from coordinator.intake.delta_checks import DeltaExpectation
from coordinator.intake.delta_stream import checked_manifest, verify_and_store
from coordinator.intake.spool import Spool
from coordinator.jobs.manager import JobManager
from coordinator.publication.lineage import note_delta
from coordinator.residency import delta_upload
from coordinator.rounds.acceptance import accepted_again
from coordinator.rounds.engine import JobEngine
from coordinator.services import Services
from coordinator.state.audit import AuditEvent, AuditVerdict
from coordinator.state.store import MAX_STORED_INT, Receipt
from coordinator.state.transactions import ROUND_TIMINGS, DeltaOffer, open_upload, upload_pointer
from geofed.artifact_bundle import HEADER_SIZE, BundleError, manifest_length
from geofed.codec.host_threads import usable_cpus
from geofed.manifest import ManifestError, SignedManifest
from geofed.pki.errors import CertificateRefused
from geofed.timeouts import Timeout, wait_for
from geofed.types import ArtifactKind, Identity, Role

__all__ = ["UploadService", "receipt_json"]

log = logging.getLogger(__name__)

_MANIFEST_CACHE = 64
_READ = 1 << 20
#: How long an upload to a job still being recovered waits for it before a 503.
RECOVERY_WAIT_S = 1.0


def receipt_json(receipt: Receipt) -> dict[str, Any]:
    return {
        "job": receipt.job_id,
        "round": receipt.round,
        "region": receipt.region,
        "manifest_digest": receipt.manifest_digest,
        "stream_digest": receipt.blob_digest,
        "size": receipt.size,
        "tokens": receipt.tokens,
        "received_at": datetime.fromtimestamp(receipt.received_at, UTC).isoformat(),
    }


class UploadService:
    """Handles the three upload steps and the single-shot form for every job."""

    def __init__(self, services: Services, jobs: JobManager) -> None:
        self._s = services
        self._jobs = jobs
        self._spool = Spool(services.runtime.spool_dir)
        self.chunks = ChunkCommitter(services.db)
        self._manifests: OrderedDict[str, SignedManifest] = OrderedDict()

    # -- the public steps (each counts and audits its refusals) ---------------------

    async def put_manifest(
        self,
        job: str,
        round: int,
        region: str,
        actor: Identity,
        body: StreamReader,
        declared: int | None = None,
    ) -> dict[str, Any]:
        async def step() -> dict[str, Any]:
            limit = self._s.config.limits.max_manifest_bytes
            data = await read_limited(body, limit, "manifest", declared)
            return await self._manifest(job, round, region, actor, data)

        return await self._counted(job, round, region, actor, "manifest", step())

    async def put_chunk(
        self, job: str, round: int, region: str, index: int, actor: Identity, body: StreamReader
    ) -> dict[str, Any]:
        step = self._chunk_from(job, round, region, index, actor, body)
        return await self._counted(job, round, region, actor, "chunk", step)

    async def commit(
        self,
        job: str,
        round: int,
        region: str,
        actor: Identity,
        body: StreamReader,
        declared: int | None = None,
    ) -> dict[str, Any]:
        async def step() -> dict[str, Any]:
            body_bytes = await read_limited(body, 64 * 1024, "commit body", declared)
            metrics = commit_metrics(body_bytes)
            return await self._commit(job, round, region, actor, metrics)

        return await self._counted(job, round, region, actor, "commit", step())

    async def single_shot(
        self, job: str, round: int, region: str, actor: Identity, body: StreamReader
    ) -> dict[str, Any]:
        step = self._single_shot(job, round, region, actor, body)
        return await self._counted(job, round, region, actor, "bundle", step)

    async def refused_peer(
        self,
        job: str,
        round: int,
        region: str,
        step: str,
        refusal: CertificateRefused,
        remote: str | None,
    ) -> None:
        """Count and audit an upload whose client certificate the TLS identity check refused.

        The caller was answered with the PKI's reason (``revoked``, ``unknown_authority``,
        ...); the counter and the audit log file it under ``untrusted_certificate``.
        """
        error = Forbidden(f"{refusal.code}: {refusal}", "untrusted_certificate")
        actor = f"unverified peer {remote or 'unknown'}"
        await self._reject(job, round, region, actor, step, error)

    async def _counted(
        self,
        job: str,
        round: int,
        region: str,
        actor: Identity,
        step: str,
        work: Any,
    ) -> dict[str, Any]:
        try:
            result: dict[str, Any] = await wait_for(
                work, self._s.config.timeouts.upload_s, f"delta upload ({step}) of {region}"
            )
        except ApiError as exc:
            await self._reject(job, round, region, actor, step, exc)
            raise
        except Timeout as exc:
            error = ApiError(408, "timeout", str(exc))
            await self._reject(job, round, region, actor, step, error)
            raise error from None
        return result

    async def _reject(
        self, job: str, round: int, region: str, actor: Identity | str, step: str, exc: ApiError
    ) -> None:
        self._s.metrics.deltas_rejected.labels(code=exc.code).inc()
        log.info("refused %s %s of job %s round %d: %s", region, step, job, round, exc.message)
        details = {"step": step, "code": exc.code, "message": exc.message[:1000]}
        if round > MAX_STORED_INT:
            # The path's round cannot be stored as one; the entry keeps its text.
            details["round"] = str(round)[:64]
        try:
            await self._s.db.append_audit(
                AuditEvent(
                    actor=actor,
                    action="delta.reject",
                    verdict=AuditVerdict.DENY,
                    job=job,
                    round=round if round <= MAX_STORED_INT else None,
                    region=region,
                    details=details,
                )
            )
        except Exception:
            log.exception("cannot audit a refused upload")

    # -- steps --------------------------------------------------------------------

    async def _engine(self, job: str, region: str, actor: Identity, round: int) -> JobEngine:
        if actor.role is not Role.REGION or actor.name != region:
            raise Forbidden(
                f"{actor} may not upload the delta of region {region}; only region/{region} may"
            )
        try:
            engine = self._jobs.engine(job)
        except ApiError as exc:
            if exc.code == "bad_request":
                raise
            raise unknown_job(job) from None  # an unavailable job answers as unknown too
        # Recovery usually takes a fraction of a second: waited for within the request's time.
        await engine.await_recovered(RECOVERY_WAIT_S)
        if region not in engine.ctx.spec.regions:
            # As a job that does not exist: a region learns nothing of other regions' jobs.
            raise unknown_job(job)
        engine.check_open(region, round)
        return engine

    async def _manifest(
        self, job: str, round: int, region: str, actor: Identity, body: bytes
    ) -> dict[str, Any]:
        engine = await self._engine(job, region, actor, round)
        limits = self._s.config.limits
        if len(body) > limits.max_manifest_bytes:
            raise TooLarge(
                f"manifest of {len(body)} bytes exceeds the limit of {limits.max_manifest_bytes}"
            )
        signed, digest = await self._s.executors.compute(
            checked_manifest,
            body,
            self._expectation(engine, round, region),
            self._s.runtime.trust(),
            limits.max_manifest_bytes,
        )
        await self._s.residency.enforce(
            delta_upload(engine.ctx, region, signed),
            what="this delta",
            actor=actor,
            job=job,
            round=round,
            region=region,
        )
        accepted = await self._s.db.receipt(job, round, region)
        if accepted is not None:
            again = accepted_again(accepted, digest, job=job, round=round, region=region)
            return {"state": "accepted", "receipt": receipt_json(again)}
        fresh = await self._s.executors.files(
            self._spool.save_manifest, job, round, region, digest, body
        )
        received = await self._s.db.run(open_upload, job, round, region, digest, fresh=fresh)
        self._remember(digest, signed)
        return {
            "state": "open",
            "manifest_digest": digest,
            "chunks": len(signed.manifest.chunks),
            "received": sorted(received),
        }

    async def _chunk_from(
        self, job: str, round: int, region: str, index: int, actor: Identity, body: StreamReader
    ) -> dict[str, Any]:
        engine = await self._engine(job, region, actor, round)
        digest, signed = await self._open_upload(engine, round, region)
        size = self._chunk_size(signed, index)
        data = await read_frame(body, size)
        return await self._store_chunk(engine, round, region, digest, signed, index, data)

    async def _store_chunk(
        self,
        engine: JobEngine,
        round: int,
        region: str,
        digest: str,
        signed: SignedManifest,
        index: int,
        data: bytes,
    ) -> dict[str, Any]:
        record = signed.manifest.chunks[index]
        job = engine.job

        offset = sum(chunk.size for chunk in signed.manifest.chunks[:index])

        def check_and_write() -> str:
            actual = hashlib.sha256(data).hexdigest()
            if len(data) != record.size or not hmac.compare_digest(actual, record.sha256):
                raise BadRequest(
                    f"frame {index} has {len(data)} bytes with sha256 {actual}; the manifest "
                    f"records {record.size} bytes with sha256 {record.sha256}",
                    "corrupt_chunk",
                )
            try:
                self._spool.write_chunk(job, round, region, digest, offset, data)
            except FileNotFoundError:
                raise NotFound(
                    f"the open upload of {region} for round {round} lost its spooled stream: "
                    "PUT its manifest again"
                ) from None
            return actual

        actual = await self._s.executors.files(check_and_write)
        # Answered only once the commit covering this frame (and any arriving with it)
        # has recorded it: the frame is durable in the stream file already.
        await self.chunks.commit(ChunkWrite(job, round, region, digest, index, actual, len(data)))
        self._s.metrics.received_bytes.labels(kind=ArtifactKind.MODEL_DELTA.value).inc(len(data))
        return {"index": index}

    async def _commit(
        self,
        job: str,
        round: int,
        region: str,
        actor: Identity,
        metrics: Mapping[str, float],
    ) -> dict[str, Any]:
        engine = await self._engine(job, region, actor, round)
        pointer = await self._s.db.get_pointer(job, upload_pointer(round, region))
        if not pointer:
            accepted = await self._s.db.receipt(job, round, region)
            if accepted is not None:
                return {"state": "accepted", "receipt": receipt_json(accepted)}
        digest, signed = await self._open_upload(engine, round, region)
        received = await self._s.db.uploaded_chunks(job, round, region, digest)
        missing = [i for i in range(len(signed.manifest.chunks)) if i not in received]
        if missing:
            raise Conflict(
                f"{len(missing)} of {len(signed.manifest.chunks)} frames are missing "
                f"(first: {missing[:10]}); send them before committing",
                "incomplete",
                {"missing": missing[:1000]},
            )
        try:
            stream_digest, size = await self._s.executors.compute(
                verify_and_store,
                self._spool.stream_path(job, round, region, digest),
                signed,
                engine.ctx.round_tensor_specs(round),
                engine.ctx.publishing.deltas,
                workers=usable_cpus(),
            )
        except FileNotFoundError:
            # Another commit of the same upload took the stream first, or it was lost.
            accepted = await self._s.db.receipt(job, round, region)
            if accepted is not None and accepted.manifest_digest == digest:
                return {"state": "accepted", "receipt": receipt_json(accepted)}
            raise NotFound(
                f"the open upload of {region} for round {round} lost its spooled stream: "
                "PUT its manifest again"
            ) from None
        await note_delta(self._s, job, engine.ctx.spec.task.spec, region, digest, signed.manifest)
        tokens = signed.manifest.tokens or 0
        offer = DeltaOffer(
            region=region,
            round=round,
            manifest_digest=digest,
            blob_digest=stream_digest,
            size=size,
            tokens=tokens,
            train_loss=metrics.get("train_loss"),
            timings={k: metrics[k] for k in ROUND_TIMINGS if k in metrics and metrics[k] >= 0},
            actor=actor,
            base_eval=signed.manifest.base_eval,
            data_fingerprints=signed.manifest.data_fingerprints,
        )
        receipt = await engine.accept(offer)
        await self._s.executors.files(self._spool.discard, job, round, region)
        self._manifests.pop(digest, None)
        return {"state": "accepted", "receipt": receipt_json(receipt)}

    async def _single_shot(
        self, job: str, round: int, region: str, actor: Identity, body: StreamReader
    ) -> dict[str, Any]:
        await self._engine(job, region, actor, round)
        head = await read_exactly(body, HEADER_SIZE, "bundle header")
        try:
            length = manifest_length(head)
        except BundleError as exc:
            raise BadRequest(str(exc)) from None
        limit = self._s.config.limits.max_manifest_bytes
        if length > limit:
            raise TooLarge(f"bundle manifest of {length} bytes exceeds the limit of {limit}")
        opened = await self._manifest(
            job, round, region, actor, await read_exactly(body, length, "bundle manifest")
        )
        if opened["state"] == "accepted":
            return opened
        engine = self._jobs.engine(job)
        digest, signed = await self._open_upload(engine, round, region)
        received = set(opened["received"])
        for index, record in enumerate(signed.manifest.chunks):
            data = await read_exactly(body, record.size, f"frame {index}")
            if index not in received:
                await self._store_chunk(engine, round, region, digest, signed, index, data)
        if await body.read(1):
            raise BadRequest("the bundle continues after the last frame its manifest lists")
        return await self._commit(job, round, region, actor, {})

    # -- helpers ------------------------------------------------------------------

    def _expectation(self, engine: JobEngine, round: int, region: str) -> DeltaExpectation:
        working = engine.working
        if working is None:
            raise Unavailable(f"job {engine.job} is starting; retry shortly")
        # A late delta (a job that merges them) was trained from an earlier θ.
        base = working.params_hash if round == working.version else engine.past.base_hash(round)
        if base is None:
            raise Unavailable(f"job {engine.job}: θ_{round}'s hash is not at hand; retry shortly")
        return engine.ctx.delta_expectation(self._s.config, round, region, base)

    async def _open_upload(
        self, engine: JobEngine, round: int, region: str
    ) -> tuple[str, SignedManifest]:
        job = engine.job
        digest = await self._s.db.get_pointer(job, upload_pointer(round, region))
        if not digest:
            raise NotFound(
                f"no open upload of {region} for round {round} of job {job}: PUT its manifest first"
            )
        cached = self._manifests.get(digest)
        if cached is not None:
            self._manifests.move_to_end(digest)
            return digest, cached
        data = await self._s.executors.files(self._spool.load_manifest, job, round, region, digest)
        if data is None:
            raise NotFound(
                f"the open upload of {region} for round {round} is gone: PUT its manifest again"
            )
        try:
            signed = SignedManifest.from_bytes(data)
        except ManifestError as exc:
            raise NotFound(f"the spooled manifest is unreadable ({exc}): PUT it again") from None
        self._remember(digest, signed)
        return digest, signed

    def _remember(self, digest: str, signed: SignedManifest) -> None:
        self._manifests[digest] = signed
        self._manifests.move_to_end(digest)
        while len(self._manifests) > _MANIFEST_CACHE:
            self._manifests.popitem(last=False)

    @staticmethod
    def _chunk_size(signed: SignedManifest, index: int) -> int:
        count = len(signed.manifest.chunks)
        if not 0 <= index < count:
            raise BadRequest(f"frame index {index} is outside 0..{count - 1}", "bad_chunk_index")
        return signed.manifest.chunks[index].size
