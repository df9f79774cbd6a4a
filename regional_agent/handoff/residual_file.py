"""The error-feedback residual file, as the agent keeps it and the workers write it.

One format for both sides: the agent's ``feedback.pt`` (the residual after its last
accepted delta) and a spooled delta's ``residual.pt`` are the same file as the one rank 0
writes next to a quantized delta (``round-<r>.residual.pt``), which the agent moves into
its spool unread. The file is a θ file (:mod:`geofed.theta_file`: float32 tensors back to
back after a safetensors header) whose header's metadata says it is a residual, of which
round, and its ``id``, so that the workers can tell from the header alone whether the file
the agent holds is the residual they still hold (:func:`read_residual_id`). It is written
a tensor at a time (:class:`ResidualWriter`): the workers keep the residual sharded, and
rank 0 writes each tensor as it gathers it, never holding the whole. Its tensors are read
one at a time too, each checked when it is read. Under ``overlap: streaming`` a residual
may name only some of the model's tensors (those whose fragment has been sent); each round
replaces its fragment's and carries the others'.

The workers write the residual's tensors only with the regional checkpoint (every
``regional_checkpoint_every`` rounds): in the rounds between, the file is a *held* one (no
tensors, ``held`` in its metadata) naming the residual the workers keep on their devices
(:func:`write_held_residual`, read back as a :class:`HeldResidual`), so a round writes a
few hundred bytes where it wrote 4 per parameter. The agent keeps and moves either kind
alike. When the workers no longer hold the residual a held file names (the group
restarted, or the coordinator did not take the delta it came with), error feedback starts
anew; when the group parks the job or stops, the residual is written out in full first
(the job's ``residual-held.pt`` in the hand-off directory). A residual file of the format
before (a ``torch.save``-d body) is still read.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from geofed.fsutil import AtomicFile
from geofed.theta_file import ThetaFileError, ThetaLayout, ThetaReads, read_layout

FORMAT_VERSION = 2
_KIND = "error-feedback-residual"
_TORCH_SAVE_VERSION = 1  # the format before: a torch.save-d body
_FEEDBACK_VERSION = 1
_ZIP_MAGIC = b"PK\x03\x04"


class ResidualFileError(ValueError):
    """A residual file is unreadable or malformed; the message names it."""


@dataclass(frozen=True, slots=True)
class Residual:
    """A residual read from its file: after the delta of ``round``, named ``id``; its
    tensors each read (and checked) when asked for."""

    round: int
    id: str
    tensors: Mapping[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class HeldResidual:
    """A held residual file: the workers keep residual ``id`` of ``round`` on their devices."""

    round: int
    id: str


class ResidualWriter:
    """A residual file written a tensor at a time: :meth:`put` each tensor of ``shapes``
    (any order), then :meth:`commit`; :meth:`abort` (or a commit with tensors missing)
    leaves the file at ``path`` as it was."""

    def __init__(
        self,
        path: Path,
        round_: int,
        shapes: Mapping[str, torch.Size | tuple[int, ...]],
        *,
        id_: str | None = None,
        held: bool = False,
    ) -> None:
        self.id = uuid.uuid4().hex if id_ is None else id_
        metadata = {"kind": _KIND, "version": str(FORMAT_VERSION), "round": str(round_)}
        metadata["id"] = self.id
        if held:
            metadata["held"] = "true"
        self._layout = ThetaLayout.of_shapes(shapes, metadata)
        self._entries = {entry.name: entry for entry in self._layout.entries}
        self._missing = set(self._entries)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._atomic = AtomicFile(path, private=True)
        self._file = self._atomic.__enter__()
        try:
            self._file.write(self._layout.header)
            self._file.flush()
        except BaseException:
            self.abort()
            raise

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``name``'s values (any device and float dtype, written as float32)."""
        entry = self._entries.get(name)
        if entry is None or tuple(tensor.shape) != entry.shape:
            shape = None if entry is None else entry.shape
            raise ResidualFileError(f"residual {name!r} {tuple(tensor.shape)} is not {shape}")
        flat = tensor.detach().reshape(-1).to(device="cpu", dtype=torch.float32).contiguous()
        os.pwrite(self._file.fileno(), flat.view(torch.uint8).numpy().data, entry.start)
        self._missing.discard(name)

    def commit(self) -> str:
        """Make the file durable at its path; its id."""
        if self._missing:
            missing = sorted(self._missing)[:5]
            self.abort()
            raise ResidualFileError(f"the residual was written without {missing}")
        try:
            self._file.truncate(self._layout.size)  # the tensors' bytes end the file
        except BaseException:
            self.abort()
            raise
        self._atomic.__exit__(None, None, None)
        return self.id

    def abort(self) -> None:
        """Drop what was written: the file at the path stays as it was."""
        error = ResidualFileError("aborted")
        self._atomic.__exit__(type(error), error, None)


def write_residual(
    path: Path, round_: int, tensors: Mapping[str, torch.Tensor], *, id_: str | None = None
) -> str:
    """Write ``tensors`` durably, owner-only; its id (a new one unless ``id_`` names the
    residual being written out)."""
    writer = ResidualWriter(path, round_, {n: t.shape for n, t in tensors.items()}, id_=id_)
    try:
        for name, tensor in tensors.items():
            writer.put(name, tensor)
    except BaseException:
        writer.abort()
        raise
    return writer.commit()


def write_held_residual(path: Path, round_: int) -> str:
    """Write a held residual file for round ``round_`` durably, owner-only; its new id."""
    return ResidualWriter(path, round_, {}, held=True).commit()


def read_residual_id(path: Path) -> str | None:
    """The id of the residual at ``path`` (its header read, no tensor); None: no file,
    or a file from before ids were recorded."""
    if not path.exists():
        return None
    if _torch_saved(path):
        id_ = _load_torch_saved(path).get("id")
        return id_ if isinstance(id_, str) else None
    return _metadata(path)[0][1]


def read_residual(path: Path) -> Residual | HeldResidual | None:
    """The residual at ``path`` (None: no file; a :class:`HeldResidual` for a held file).
    Its tensors are float32, read when asked for and checked then
    (:class:`ResidualFileError` for NaN or Inf); copy them where they are used."""
    if not path.exists():
        return None
    if _torch_saved(path):
        return _read_torch_saved(path)
    (round_, id_, held), layout = _metadata(path)
    if held:
        return HeldResidual(round_, id_)
    return Residual(round_, id_, _CheckedReads(path, ThetaReads(path, layout)))


class _CheckedReads(Mapping[str, torch.Tensor]):
    """A residual file's tensors, each read when asked for and refused if not finite."""

    def __init__(self, path: Path, reads: ThetaReads) -> None:
        self._path, self._reads = path, reads

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            tensor = self._reads[name]
        except ThetaFileError as exc:
            raise ResidualFileError(f"{self._path}: unreadable residual: {exc}") from None
        if not bool(torch.isfinite(tensor).all()):
            raise ResidualFileError(f"{self._path}: residual {name!r} holds NaN or Inf")
        return tensor

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each tensor's shape, from the header (no value read)."""
        return self._reads.shapes()

    def __iter__(self) -> Iterator[str]:
        return iter(self._reads)

    def __len__(self) -> int:
        return len(self._reads)


def residual_shapes(residual: Residual) -> dict[str, tuple[int, ...]]:
    """The shapes of a residual's tensors, read from its header where it has one."""
    tensors = residual.tensors
    if isinstance(tensors, _CheckedReads):
        return tensors.shapes()
    return {name: tuple(tensor.shape) for name, tensor in tensors.items()}


def _metadata(path: Path) -> tuple[tuple[int, str, bool], ThetaLayout]:
    """The residual's round, id and held flag from its header, and the file's layout (the
    header read once)."""
    try:
        layout = read_layout(path)
    except ThetaFileError as exc:
        raise ResidualFileError(f"{path}: unreadable residual: {exc}") from None
    meta = layout.metadata
    round_, id_ = meta.get("round", ""), meta.get("id", "")
    if meta.get("kind") != _KIND or not round_.isdigit() or not id_:
        raise ResidualFileError(f"{path}: not a format-{FORMAT_VERSION} residual file")
    return (int(round_), id_, meta.get("held") == "true"), layout


def _torch_saved(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == _ZIP_MAGIC
    except OSError as exc:
        raise ResidualFileError(f"{path}: unreadable residual: {exc}") from None


def _load_torch_saved(path: Path) -> dict[str, Any]:
    try:
        body = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise ResidualFileError(f"{path}: unreadable residual: {exc}") from None
    if not isinstance(body, dict) or body.get("format") != _TORCH_SAVE_VERSION:
        raise ResidualFileError(f"{path}: not a residual file")
    return body


def _read_torch_saved(path: Path) -> Residual | HeldResidual:
    """A residual file of the format before, checked whole as it was then."""
    body = _load_torch_saved(path)
    feedback = body.get("feedback")
    round_ = body.get("round")
    if body.get("held") is True:
        id_ = body.get("id")
        if isinstance(round_, bool) or not isinstance(round_, int) or not isinstance(id_, str):
            raise ResidualFileError(f"{path}: a held residual without its round and id")
        return HeldResidual(round_, id_)
    if not isinstance(feedback, dict) or feedback.get("version") != _FEEDBACK_VERSION:
        raise ResidualFileError(f"{path}: no error-feedback state")
    if isinstance(round_, bool) or not isinstance(round_, int):
        raise ResidualFileError(f"{path}: round is {round_!r}")
    tensors = feedback.get("residual")
    if not isinstance(tensors, dict):
        raise ResidualFileError(f"{path}: no residual mapping")
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise ResidualFileError(f"{path}: residual {name!r} is not a named tensor")
        if tensor.dtype != torch.float32:
            raise ResidualFileError(f"{path}: residual {name!r} is {tensor.dtype}")
        if not bool(torch.isfinite(tensor).all()):
            raise ResidualFileError(f"{path}: residual {name!r} holds NaN or Inf")
    id_ = body.get("id")
    return Residual(round_, id_ if isinstance(id_, str) else "", tensors)
