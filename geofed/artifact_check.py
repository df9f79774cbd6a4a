"""The one gate every downloaded global artifact passes before any of its values is used.

:func:`verify_artifact`: the bundle parses, the manifest's signature verifies against the
federation trust bundle, its signer is a ``coordinator`` of the federation, kind, job and
round are the expected ones, every frame matches its chunk record, and the stream decodes
(strictly, bounded) into exactly the float32 tensors the manifest declares. Then
:func:`snapshot_params` and :func:`apply_verified_update` check the parameters they give
against the manifest's ``parameters_hash`` (and an update's ``base_hash``);
:func:`snapshot_to_file` and :func:`apply_update_to_file` do the same for θ kept in a file
(:mod:`geofed.theta_file`), decoding the stream piece by piece into it.

A regional agent resyncing (``regional_agent.transfer.sync``) and ``geofed export`` rebuilding a
published model share it, so both trust exactly the same things. Pure and blocking.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import overload

import torch
from torch import Tensor

from geofed.artifact_bundle import HEADER_SIZE, BundleError, manifest_length, split_bundle
from geofed.codec import CodecError, StreamDecoder, decode
from geofed.deltas import (
    DeltaError,
    add_piece_in_place,
    add_update_in_place,
    apply_partial_update,
    check_update_layout,
)
from geofed.fsutil import StrPath
from geofed.manifest import Manifest, ManifestError, SignedManifest, verify_chunks
from geofed.params import parameters_vector_hash
from geofed.pki import TrustBundle
from geofed.theta_file import Piece, ThetaFileError, fill_theta, patch_theta, read_layout
from geofed.types import ArtifactKind, Role

__all__ = [
    "ArtifactRefused",
    "VerifiedArtifact",
    "apply_update_to_file",
    "apply_verified_update",
    "decoded_pieces",
    "snapshot_params",
    "snapshot_to_file",
    "verify_artifact",
    "verify_artifact_file",
]

Params = dict[str, Tensor]
Frame = bytes | memoryview


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
    frames: Sequence[Frame] = ()
    """The stream's frames, checked against the manifest's digests; set when ``tensors``
    is empty because decoding was left to :func:`apply_verified_update` (views of the
    bundle in memory, or :class:`FileFrames` read from its file as they are used)."""


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
    except BundleError as exc:
        raise ArtifactRefused(f"{what}: {exc}") from None
    manifest_bytes = bytes(manifest_view)
    signed = _signed(manifest_bytes, bundle, kind, job, round_, now, what)
    manifest = signed.manifest
    frames = _frames(manifest, stream, what)
    if not decode_now:
        return _undecoded(signed, manifest_bytes, frames, max_decoded_bytes, what)
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


def verify_artifact_file(
    path: StrPath,
    bundle: TrustBundle,
    *,
    kind: ArtifactKind,
    job: str,
    round_: int,
    now: datetime,
    max_decoded_bytes: int | None = None,
) -> VerifiedArtifact:
    """:func:`verify_artifact` of a bundle downloaded to a file, without decoding: its
    frames are read from the file one at a time, each time one is used (to check its
    digest, then to decode it), so the artifact is never whole in memory."""
    what = f"{kind.value} {job}/{round_}"
    try:
        with open(path, "rb") as f:
            length = manifest_length(f.read(HEADER_SIZE))
            manifest_bytes = f.read(length)
            size = os.fstat(f.fileno()).st_size
    except BundleError as exc:
        raise ArtifactRefused(f"{what}: {exc}") from None
    except OSError as exc:
        raise ArtifactRefused(f"{what}: {exc.strerror or exc}") from None
    start = HEADER_SIZE + length
    if size < start:
        raise ArtifactRefused(f"{what}: bundle truncated inside the manifest ({size} bytes)")
    signed = _signed(manifest_bytes, bundle, kind, job, round_, now, what)
    manifest = signed.manifest
    _check_stream_size(manifest, size - start, what)
    frames = FileFrames(Path(path), start, [record.size for record in manifest.chunks])
    return _undecoded(signed, manifest_bytes, frames, max_decoded_bytes, what)


class FileFrames(Sequence[bytes]):
    """A stream's frames in a file, each read (whole, from ``start`` on) when asked for."""

    def __init__(self, path: Path, start: int, sizes: Sequence[int]) -> None:
        self._path = path
        self._sizes = list(sizes)
        self._starts = list(itertools.accumulate(self._sizes[:-1], initial=start))

    @property
    def path(self) -> Path:
        return self._path

    @property
    def start(self) -> int:
        """Where the first frame starts in the file."""
        return self._starts[0]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self._sizes)

    def __len__(self) -> int:
        return len(self._sizes)

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[bytes]: ...

    def __getitem__(self, index: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        size = self._sizes[index]
        with open(self._path, "rb", buffering=0) as f:
            data = os.pread(f.fileno(), size, self._starts[index])
        if len(data) != size:
            raise ArtifactRefused(f"{self._path}: ends inside frame {index}")
        return data


def _signed(
    manifest_bytes: bytes,
    bundle: TrustBundle,
    kind: ArtifactKind,
    job: str,
    round_: int,
    now: datetime,
    what: str,
) -> SignedManifest:
    """The manifest, its signature verified, signed by a coordinator, of this artifact."""
    try:
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
    return signed


def _undecoded(
    signed: SignedManifest,
    manifest_bytes: bytes,
    frames: Sequence[Frame],
    max_decoded_bytes: int | None,
    what: str,
) -> VerifiedArtifact:
    """The artifact with its frames checked against the manifest's digests, not decoded."""
    manifest = signed.manifest
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
    return VerifiedArtifact(manifest, {}, digest, signed, frames)


def _check_stream_size(manifest: Manifest, size: int, what: str) -> None:
    if len(manifest.chunks) < 2 or size != manifest.total_size:
        raise ArtifactRefused(
            f"{what}: stream of {size} bytes, the manifest declares "
            f"{manifest.total_size} in {len(manifest.chunks)} frames"
        )


def _frames(manifest: Manifest, stream: memoryview, what: str) -> list[memoryview]:
    _check_stream_size(manifest, len(stream), what)
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
    where = _check_update_base(update, round_, params_hash)
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
    declared = {t.name: tuple(t.shape) for t in update.manifest.tensors}
    check_update_layout("add_update_in_place", params, declared)
    for name, offset, values in decoded_pieces(update, where):
        add_piece_in_place(params, name, offset, values)


def decoded_pieces(artifact: VerifiedArtifact, where: str) -> Iterator[Piece]:
    """The values an artifact verified without decoding holds, piece by piece: (tensor
    name, element offset, values), one chunk's values at a time in a buffer reused for
    the next piece (consume each before asking for the next).

    Nothing is yielded before the stream's header is known to declare the manifest's
    tensors, all float32; a stream that ends short or differs from its digests raises
    :class:`ArtifactRefused` part way (the caller discards what it built).
    """
    manifest = artifact.manifest
    declared = [(t.name, t.dtype, tuple(t.shape)) for t in manifest.tensors]
    if any(dtype != "float32" for _, dtype, _ in declared):
        raise ArtifactRefused(f"{where}: parameters and updates must be float32")
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
    frames = artifact.frames
    if not frames:
        raise ArtifactRefused(f"{where}: verified with its stream decoded, not as frames")
    try:
        for _ in decoder.feed(frames[0]):
            pass
        found = [(s.name, s.dtype, tuple(s.shape)) for s in decoder.specs]
        if found != declared:
            raise ArtifactRefused(f"{where}: the stream's tensors differ from the manifest's")
        for index in range(1, len(frames)):  # one frame in memory at a time
            for piece in decoder.feed(frames[index]):
                yield piece.name, piece.offset, piece.values
        decoder.finish()
    except CodecError as exc:
        raise ArtifactRefused(f"{where}: {exc}") from None


def apply_update_to_file(
    source: StrPath,
    target: StrPath,
    round_: int,
    params_hash: str,
    update: VerifiedArtifact,
) -> str:
    """θ_{r+1} written at ``target`` as the θ file ``source`` (θ_r, of ``round_`` and
    ``params_hash``) plus an update verified without decoding; its hash, checked against
    the update's base and parameters hashes. Neither θ is ever in memory: the file is
    copied and the update's pieces added where they fall (:func:`geofed.theta_file.patch_theta`).
    On a refusal ``target`` is left as it was."""
    manifest = update.manifest
    where = f"update {manifest.job}/{manifest.round}"
    try:
        shapes = read_layout(source).shapes()
    except ThetaFileError as exc:
        raise ArtifactRefused(f"{where}: {exc}") from None
    check_update_fits(update, round_, params_hash, shapes)
    try:
        found = patch_theta(source, target, decoded_pieces(update, where))
    except ThetaFileError as exc:
        raise ArtifactRefused(f"{where}: {exc}") from None
    return _checked_file(target, found, manifest, where)


def _check_update_base(update: VerifiedArtifact, round_: int, params_hash: str) -> str:
    """Refuse an update that is not round ``round_``'s from θ of ``params_hash``; return
    how messages name it."""
    manifest = update.manifest
    where = f"update {manifest.job}/{manifest.round}"
    if manifest.round != round_:
        raise ArtifactRefused(f"{where} applies to θ_{manifest.round}; θ_{round_} is held")
    if manifest.base_hash != params_hash:
        raise ArtifactRefused(f"{where} has base_hash {manifest.base_hash}, θ is {params_hash}")
    return where


def check_update_fits(
    update: VerifiedArtifact, round_: int, params_hash: str, shapes: Mapping[str, tuple[int, ...]]
) -> None:
    """Refuse (:class:`ArtifactRefused`) an update that is not round ``round_``'s from θ of
    ``params_hash``, or that names no tensor, or a tensor θ (of ``shapes``) lacks or has
    in another shape."""
    manifest = update.manifest
    where = _check_update_base(update, round_, params_hash)
    declared = {t.name: tuple(t.shape) for t in manifest.tensors}
    unknown = sorted(set(declared) - set(shapes))
    if unknown:
        raise ArtifactRefused(f"{where}: names tensors θ does not have: {unknown[:5]}")
    if not declared:
        raise ArtifactRefused(f"{where}: names no tensor")
    differ = sorted(n for n in declared if declared[n] != shapes[n])
    if differ:
        raise ArtifactRefused(f"{where}: tensors {differ[:5]} differ in shape from θ's")


def snapshot_to_file(target: StrPath, snapshot: VerifiedArtifact) -> str:
    """θ of a snapshot verified without decoding, written at ``target`` as a θ file (its
    values decoded piece by piece into it, never whole in memory); its hash, checked
    against the snapshot's ``parameters_hash``. On a refusal ``target`` is left as it was."""
    manifest = snapshot.manifest
    where = f"snapshot {manifest.job}/{manifest.round}"
    shapes = {t.name: tuple(t.shape) for t in manifest.tensors}
    try:
        found = fill_theta(target, shapes, decoded_pieces(snapshot, where))
    except ThetaFileError as exc:
        raise ArtifactRefused(f"{where}: {exc}") from None
    return _checked_file(target, found, manifest, where)


def _checked_file(target: StrPath, found: str, manifest: Manifest, where: str) -> str:
    if found != manifest.parameters_hash:
        Path(target).unlink(missing_ok=True)
        raise ArtifactRefused(
            f"{where}: parameters hash {found}, the manifest says {manifest.parameters_hash}"
        )
    return found


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
