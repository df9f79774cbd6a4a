"""The one gate every downloaded global artifact passes before any of its values is used.

:func:`verify_artifact`: the bundle parses, the manifest's signature verifies against the
federation trust bundle, its signer is a ``coordinator`` of the federation, kind, job and
round are the expected ones, every frame matches its chunk record, and the stream decodes
(strictly, bounded) into exactly the float32 tensors the manifest declares. Then
:func:`snapshot_params` and :func:`apply_verified_update` check the parameters they give
against the manifest's ``parameters_hash`` (and an update's ``base_hash``).

A regional agent resyncing (``regional_agent.transfer.sync``) and ``geofed export`` rebuilding a
published model share it, so both trust exactly the same things. Pure and blocking.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

import torch
from torch import Tensor

from geofed.artifact_bundle import BundleError, split_bundle
from geofed.codec import CodecError, StreamDecoder, decode
from geofed.deltas import (
    DeltaError,
    add_piece_in_place,
    add_update_in_place,
    apply_partial_update,
    check_update_layout,
)
from geofed.manifest import Manifest, ManifestError, SignedManifest, verify_chunks
from geofed.params import parameters_vector_hash
from geofed.pki import TrustBundle
from geofed.types import ArtifactKind, Role

__all__ = [
    "ArtifactRefused",
    "VerifiedArtifact",
    "apply_verified_update",
    "snapshot_params",
    "verify_artifact",
]

Params = dict[str, Tensor]


class ArtifactRefused(ValueError):
    """A global update or snapshot failed verification; none of it may be used."""


@dataclass(frozen=True)
class VerifiedArtifact:
    """A verified manifest and the tensors its stream decodes to, or (verified without
    decoding) its frames, decoded where they are applied."""

    manifest: Manifest
    tensors: Params
    manifest_digest: str
    """sha256 of the signed manifest bytes (what announcements call ``update_digest``)."""
    signed: SignedManifest
    frames: tuple[memoryview, ...] = ()
    """The stream's frames, checked against the manifest's digests; set when ``tensors``
    is empty because decoding was left to :func:`apply_verified_update`."""


def verify_artifact(
    data: bytes | bytearray | memoryview,
    bundle: TrustBundle,
    *,
    kind: ArtifactKind,
    job: str,
    round_: int,
    now: datetime,
    max_decoded_bytes: int | None = None,
    decode_now: bool = True,
) -> VerifiedArtifact:
    """Verify an artifact bundle (see the module docstring); raise :class:`ArtifactRefused`.

    The stream's frames are read where ``data`` holds them (views, not copies): a snapshot
    is as large as the model, and its decoded tensors are too. ``decode_now`` False (an
    update applied in place): the frames are checked against the manifest's digests and
    kept; :func:`apply_verified_update` decodes them piece by piece into θ, checking that
    the stream holds the tensors the manifest declares before it writes any, so no decoded
    copy of the update is ever whole.
    """
    what = f"{kind.value} {job}/{round_}"
    try:
        manifest_view, stream = split_bundle(memoryview(data))
        manifest_bytes = bytes(manifest_view)
        signed = SignedManifest.from_bytes(manifest_bytes)
        signer = signed.verify(bundle, now=now)
    except (BundleError, ManifestError) as exc:
        raise ArtifactRefused(f"{what}: {exc}") from None
    manifest = signed.manifest
    if signer.role is not Role.COORDINATOR:
        raise ArtifactRefused(f"{what}: signed by {signer}, not by a coordinator")
    found = (manifest.kind, manifest.job, manifest.round)
    if found != (kind, job, round_):
        raise ArtifactRefused(f"{what}: the manifest is for {found[0].value} {job}/{found[2]}")
    frames = _frames(manifest, stream, what)
    if not decode_now:
        size = 4 * sum(math.prod(t.shape) for t in manifest.tensors)
        if max_decoded_bytes is not None and size > max_decoded_bytes:
            raise ArtifactRefused(
                f"{what}: declares {size} decoded bytes, above the limit {max_decoded_bytes}"
            )
        try:
            verify_chunks(manifest, frames)
        except ManifestError as exc:
            raise ArtifactRefused(f"{what}: {exc}") from None
        digest = hashlib.sha256(manifest_bytes).hexdigest()
        return VerifiedArtifact(manifest, {}, digest, signed, tuple(frames))
    try:
        verify_chunks(manifest, frames)
        tensors = decode(
            frames,
            expected_header_digest=manifest.chunks[0].sha256,
            expected_digests=[record.sha256 for record in manifest.chunks[1:-1]],
            max_decoded_bytes=max_decoded_bytes,
        )
    except (ManifestError, CodecError) as exc:
        raise ArtifactRefused(f"{what}: {exc}") from None
    declared = [(t.name, t.dtype, tuple(t.shape)) for t in manifest.tensors]
    actual = [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()]
    if declared != actual:
        raise ArtifactRefused(f"{what}: the stream's tensors differ from the manifest's")
    if any(t.dtype != torch.float32 for t in tensors.values()):
        raise ArtifactRefused(f"{what}: parameters and updates must be float32")
    return VerifiedArtifact(manifest, tensors, hashlib.sha256(manifest_bytes).hexdigest(), signed)


def _frames(manifest: Manifest, stream: memoryview, what: str) -> list[memoryview]:
    if len(manifest.chunks) < 2 or len(stream) != manifest.total_size:
        raise ArtifactRefused(
            f"{what}: stream of {len(stream)} bytes, the manifest declares "
            f"{manifest.total_size} in {len(manifest.chunks)} frames"
        )
    frames, offset = [], 0
    for record in manifest.chunks:
        frames.append(stream[offset : offset + record.size])
        offset += record.size
    return frames


def apply_verified_update(
    params: Mapping[str, Tensor],
    round_: int,
    params_hash: str,
    update: VerifiedArtifact,
    *,
    in_place: bool = False,
) -> tuple[Params, str]:
    """θ_{r+1} = θ_r + û and its hash, checked against the update's base and parameters hashes.

    ``round_`` and ``params_hash`` say which θ ``params`` is. An update that names only
    some of θ's tensors (a streaming round's fragment, :mod:`geofed.fragments`) adds to
    those and keeps every other tensor bit for bit (:func:`geofed.deltas.apply_partial_update`);
    one naming a tensor θ does not have is refused.

    ``in_place``: ``params`` is the caller's own dict, and θ_{r+1} is built in it (the
    update's tensors consumed as they are added: no second copy of θ); after a refusal
    of the result's hash it holds θ_r plus the update, and is not to be used.
    """
    manifest = update.manifest
    where = f"update {manifest.job}/{manifest.round}"
    if manifest.round != round_:
        raise ArtifactRefused(f"{where} applies to θ_{manifest.round}; θ_{round_} is held")
    if manifest.base_hash != params_hash:
        raise ArtifactRefused(f"{where} has base_hash {manifest.base_hash}, θ is {params_hash}")
    try:
        if in_place:
            if not isinstance(params, dict):
                raise TypeError("an update applied in place needs the caller's own dict")
            if update.frames:
                _add_frames_in_place(params, update, where)
            else:
                add_update_in_place(params, update.tensors)
            result = params
        else:
            if update.frames:
                raise TypeError("an update verified without decoding is applied in place")
            result = apply_partial_update(params, update.tensors)
    except DeltaError as exc:
        raise ArtifactRefused(f"{where}: {exc}") from None
    found = parameters_vector_hash(result)
    if found != manifest.parameters_hash:
        raise ArtifactRefused(
            f"{where}: parameters hash {found}, the manifest says {manifest.parameters_hash}"
        )
    return result, found


def _add_frames_in_place(params: Params, update: VerifiedArtifact, where: str) -> None:
    """θ += the update its frames decode to, piece by piece into θ's own tensors (one
    chunk's values at a time); nothing is written before the stream's header is known to
    declare the manifest's float32 tensors, each of θ's shape."""
    manifest = update.manifest
    declared = [(t.name, t.dtype, tuple(t.shape)) for t in manifest.tensors]
    if any(dtype != "float32" for _, dtype, _ in declared):
        raise ArtifactRefused(f"{where}: parameters and updates must be float32")
    check_update_layout("add_update_in_place", params, {n: s for n, _, s in declared})
    buffer = torch.empty(0, dtype=torch.float32)

    def buffer_for(_name: str, _offset: int, count: int) -> Tensor:
        nonlocal buffer
        if buffer.numel() < count:
            buffer = torch.empty(count, dtype=torch.float32)
        return buffer[:count]

    decoder = StreamDecoder(
        expected_header_digest=manifest.chunks[0].sha256,
        expected_digests=[record.sha256 for record in manifest.chunks[1:-1]],
        max_decoded_bytes=4 * sum(math.prod(shape) for _, _, shape in declared),
        buffer_for=buffer_for,
    )
    header, *rest = update.frames
    try:
        for _ in decoder.feed(header):
            pass
        found = [(s.name, s.dtype, tuple(s.shape)) for s in decoder.specs]
        if found != declared:
            raise ArtifactRefused(f"{where}: the stream's tensors differ from the manifest's")
        for frame in rest:
            for piece in decoder.feed(frame):
                add_piece_in_place(params, piece.name, piece.offset, piece.values)
        decoder.finish()
    except CodecError as exc:
        raise ArtifactRefused(f"{where}: {exc}") from None


def snapshot_params(snapshot: VerifiedArtifact) -> tuple[Params, str]:
    """θ of a verified snapshot and its hash, checked against its ``parameters_hash``."""
    manifest = snapshot.manifest
    found = parameters_vector_hash(snapshot.tensors)
    if found != manifest.parameters_hash:
        raise ArtifactRefused(
            f"snapshot {manifest.job}/{manifest.round}: parameters hash {found}, "
            f"the manifest says {manifest.parameters_hash}"
        )
    return snapshot.tensors, found
