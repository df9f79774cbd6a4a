"""Is this signed manifest a valid delta for this job, round and region? Pure checks.

Each check raises the :class:`~coordinator.errors.ApiError` of the protocol's error table
(``docs/protocol.md``) with a message that says exactly what differs. Signature and
residency checks need the trust bundle and the policies; they are separate functions so
the upload path can count and audit them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime

from coordinator.errors import ApiError, BadRequest, Conflict, Forbidden, TooLarge
from geofed.codec_params import CodecParams
from geofed.lineage import code_mismatch, task_code
from geofed.manifest import (
    BadSignature,
    ManifestError,
    ManifestTensor,
    ProducerMismatch,
    SignedManifest,
    UntrustedSigner,
)
from geofed.pki import TrustBundle
from geofed.training_config import TrainingConfig
from geofed.types import ArtifactKind, Identity, Role
from policies import Provenance

__all__ = [
    "DeltaExpectation",
    "check_delta_manifest",
    "delta_provenance",
    "verify_signature",
]


class DeltaExpectation:
    """What a delta of one region for one round of one job must look like."""

    def __init__(
        self,
        *,
        job: str,
        round: int,
        region: str,
        federation: str,
        base_hash: str,
        tensors: Sequence[ManifestTensor],
        codec: CodecParams,
        datasets: Sequence[str],
        jurisdiction: str | None,
        max_upload_bytes: int,
        max_chunk_bytes: int,
        training: TrainingConfig | None = None,
        max_tokens: int | None = None,
        refuse_code_of: str | None = None,
        scope: str = "the job's model",
    ) -> None:
        self.job = job
        self.round = round
        self.region = region
        self.producer = Identity(federation=federation, role=Role.REGION, name=region)
        self.base_hash = base_hash
        self.tensors = tuple(tensors)
        self.codec = codec
        self.datasets = frozenset(datasets)
        self.jurisdiction = jurisdiction
        self.max_upload_bytes = max_upload_bytes
        self.max_chunk_bytes = max_chunk_bytes
        self.training = training
        self.max_tokens = max_tokens
        #: The job's task spec when it refuses deltas trained with other task code.
        self.refuse_code_of = refuse_code_of
        #: What ``tensors`` are, for messages: the job's model, or a streaming round's
        #: fragment (:meth:`coordinator.jobs.context.JobContext.round_scope`).
        self.scope = scope

    @property
    def max_chunks(self) -> int:
        """Header + trailer + at most one chunk per block of every tensor."""
        blocks = 0
        for spec in self.tensors:
            numel = math.prod(spec.shape)
            blocks += -(-numel // self.codec.block_size)
        return 2 + blocks


def check_delta_manifest(signed: SignedManifest, expect: DeltaExpectation) -> None:
    """Check everything about the manifest but its signature and residency."""
    manifest = signed.manifest
    if manifest.kind is not ArtifactKind.MODEL_DELTA:
        raise BadRequest(
            f"manifest kind is {manifest.kind.value}, expected model_delta", "malformed_manifest"
        )
    if manifest.job != expect.job:
        raise BadRequest(f"manifest is for job {manifest.job}, this URL is job {expect.job}")
    if manifest.round != expect.round:
        raise Conflict(
            f"manifest is for round {manifest.round}, this URL is round {expect.round}",
            "wrong_round",
        )
    if manifest.producer != expect.producer.uri:
        raise Forbidden(
            f"manifest names producer {manifest.producer}; a delta of {expect.region} must be "
            f"produced by {expect.producer.uri}",
            "producer_mismatch",
        )
    if manifest.base_hash != expect.base_hash or manifest.base_round not in (None, expect.round):
        raise Conflict(
            f"delta was trained from parameters {manifest.base_hash} (round "
            f"{manifest.base_round}); round {expect.round} starts from {expect.base_hash}: "
            "resync from the latest checkpoint",
            "base_mismatch",
        )
    _check_tensors(manifest.tensors, expect.tensors, expect.scope)
    if manifest.codec != expect.codec:
        raise BadRequest(
            f"delta is encoded with {manifest.codec.as_dict()}; job {expect.job} uses "
            f"{expect.codec.as_dict()}",
            "codec_mismatch",
        )
    # A manifest without the record comes from an agent that does not write it yet.
    if None not in (expect.training, manifest.training) and manifest.training != expect.training:
        raise BadRequest(
            f"delta was trained with {_record(manifest.training)}; job {expect.job} trains "
            f"with {_record(expect.training)}"
        )
    _check_sizes(signed, expect)
    if manifest.tokens is None or manifest.tokens <= 0:
        raise BadRequest("a delta's manifest must declare tokens > 0 (its averaging weight)")
    if expect.max_tokens is not None and manifest.tokens > expect.max_tokens:
        raise BadRequest(
            f"delta claims {manifest.tokens} tokens; a region may claim at most "
            f"{expect.max_tokens} for a round of job {expect.job}",
            "tokens_out_of_bounds",
        )
    _check_provenance(signed, expect)
    if expect.refuse_code_of is not None:
        # Hashes the task's sources once per process (cached); this runs in a worker thread.
        reason = code_mismatch(expect.region, manifest.software, task_code(expect.refuse_code_of))
        if reason is not None:
            raise Conflict(f"job {expect.job} refuses other task code: {reason}", "code_mismatch")


def _record(training: TrainingConfig | None) -> object:
    return None if training is None else training.record()


def _check_tensors(
    found: Sequence[ManifestTensor], wanted: Sequence[ManifestTensor], scope: str
) -> None:
    if tuple(found) == tuple(wanted):
        return
    found_names = [spec.name for spec in found]
    wanted_names = [spec.name for spec in wanted]
    if found_names != wanted_names:
        missing = sorted(set(wanted_names) - set(found_names))
        extra = sorted(set(found_names) - set(wanted_names))
        detail = (
            f"missing {missing[:5]}, unexpected {extra[:5]}"
            if missing or extra
            else ("tensors are in another order")
        )
        raise BadRequest(f"delta tensors differ from {scope}: {detail}", "shape_mismatch")
    for got, want in zip(found, wanted, strict=True):
        if got != want:
            raise BadRequest(
                f"tensor {want.name!r} is declared {got.dtype}{list(got.shape)}, {scope} "
                f"has {want.dtype}{list(want.shape)}",
                "shape_mismatch",
            )


def _check_sizes(signed: SignedManifest, expect: DeltaExpectation) -> None:
    manifest = signed.manifest
    if manifest.total_size > expect.max_upload_bytes:
        raise TooLarge(
            f"delta declares {manifest.total_size} bytes; the limit is {expect.max_upload_bytes}"
        )
    if not 2 <= len(manifest.chunks) <= expect.max_chunks:
        raise BadRequest(
            f"delta declares {len(manifest.chunks)} frames; a stream of this model has 2 to "
            f"{expect.max_chunks} (header, chunks, trailer)",
            "malformed_manifest",
        )
    biggest = max(record.size for record in manifest.chunks)
    if biggest > expect.max_chunk_bytes:
        raise TooLarge(
            f"delta declares a frame of {biggest} bytes; the limit is {expect.max_chunk_bytes}"
        )


def _check_provenance(signed: SignedManifest, expect: DeltaExpectation) -> None:
    entries = signed.manifest.provenance
    if len(entries) != 1 or entries[0].region != expect.region:
        names = [entry.region for entry in entries]
        raise BadRequest(
            f"a delta of {expect.region} must name only {expect.region} as provenance, not {names}"
        )
    entry = entries[0]
    if expect.jurisdiction is not None and entry.jurisdiction != expect.jurisdiction:
        raise BadRequest(
            f"provenance says {expect.region} is in {entry.jurisdiction}; its policy says "
            f"{expect.jurisdiction}"
        )
    datasets = set(entry.datasets)
    if not datasets or not datasets <= expect.datasets:
        raise BadRequest(
            f"provenance datasets {sorted(datasets)} must be a non-empty subset of those job "
            f"{expect.job} assigns to {expect.region}: {sorted(expect.datasets)}"
        )


def delta_provenance(signed: SignedManifest) -> Provenance:
    """The residency provenance a (checked) delta manifest declares."""
    entry = signed.manifest.provenance[0]
    return Provenance.of({entry.region: entry.datasets})


def verify_signature(signed: SignedManifest, bundle: TrustBundle, now: datetime) -> Identity:
    """Verify signer and signature; map refusals to the protocol's 403 codes."""
    try:
        return signed.verify(bundle, now=now)
    except BadSignature as exc:
        raise Forbidden(str(exc), "bad_signature") from None
    except UntrustedSigner as exc:
        raise Forbidden(str(exc), "untrusted_certificate", {"reason": exc.reason}) from None
    except ProducerMismatch as exc:
        raise Forbidden(str(exc), "producer_mismatch") from None
    except ManifestError as exc:
        raise ApiError(403, "bad_signature", str(exc)) from None
