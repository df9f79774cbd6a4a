"""The error-feedback residual file, as the agent keeps it and rank 0 writes it.

One format for both sides: the agent's ``feedback.pt`` (the residual after its last
accepted delta) and a spooled delta's ``residual.pt`` are the same file as the one rank 0
writes next to a quantized delta (``round-<r>.residual.pt``), which the agent moves into
its spool unread. The body is ``{"format", "round", "id", "feedback"}``; ``feedback`` is
:meth:`geofed.codec.ErrorFeedback.state_dict`'s form, and ``id`` names this residual so
that rank 0 can tell, without reading its tensors, whether the file the agent holds is
the one it still has on its device (:func:`read_residual_id`). Under ``overlap:
streaming`` a residual may name only some of the model's tensors (those whose fragment
has been sent); each round replaces its fragment's and carries the others'.

Rank 0 writes the residual's tensors only with the regional checkpoint (every
``regional_checkpoint_every`` rounds): in the rounds between, the file it writes is a
*held* one, ``{"format", "round", "id", "held": true}``, naming the residual rank 0 keeps
on its device (:func:`write_held_residual`, read back as a :class:`HeldResidual`), so a
round writes a few hundred bytes where it wrote 4 per parameter. The agent keeps and
moves either kind alike. When rank 0 no longer holds the residual a held file names (the
group restarted, or the coordinator did not take the delta it came with), error feedback
starts anew; when the group parks the job or stops, rank 0 writes the residual it holds
in full first (the job's ``residual-held.pt`` in the hand-off directory).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from geofed.fsutil import AtomicFile

FORMAT_VERSION = 1
_FEEDBACK_VERSION = 1


class ResidualFileError(ValueError):
    """A residual file is unreadable or malformed; the message names it."""


@dataclass(frozen=True, slots=True)
class Residual:
    """A residual read from its file: after the delta of ``round``, named ``id``."""

    round: int
    id: str
    tensors: dict[str, torch.Tensor]


def residual_body(round_: int, tensors: Mapping[str, torch.Tensor], id_: str) -> dict[str, Any]:
    """The file's content for ``tensors`` (float32, on the host)."""
    return {
        "format": FORMAT_VERSION,
        "round": round_,
        "id": id_,
        "feedback": {"version": _FEEDBACK_VERSION, "residual": dict(tensors)},
    }


@dataclass(frozen=True, slots=True)
class HeldResidual:
    """A held residual file: rank 0 keeps residual ``id`` of ``round`` on its device."""

    round: int
    id: str


def write_residual(
    path: Path, round_: int, tensors: Mapping[str, torch.Tensor], *, id_: str | None = None
) -> str:
    """Write ``tensors`` (copied to the host as float32) durably, owner-only; its id (a new
    one unless ``id_`` names the residual being written out)."""
    id_ = uuid.uuid4().hex if id_ is None else id_
    host = {
        name: tensor.detach().to(device="cpu", dtype=torch.float32)
        for name, tensor in tensors.items()
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with AtomicFile(path, private=True) as f:
        torch.save(residual_body(round_, host, id_), f)
    return id_


def write_held_residual(path: Path, round_: int) -> str:
    """Write a held residual file for round ``round_`` durably, owner-only; its new id."""
    id_ = uuid.uuid4().hex
    path.parent.mkdir(parents=True, exist_ok=True)
    with AtomicFile(path, private=True) as f:
        torch.save({"format": FORMAT_VERSION, "round": round_, "id": id_, "held": True}, f)
    return id_


def _load(path: Path) -> dict[str, Any]:
    try:
        body = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise ResidualFileError(f"{path}: unreadable residual: {exc}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT_VERSION:
        raise ResidualFileError(f"{path}: not a format-{FORMAT_VERSION} residual file")
    return body


def read_residual_id(path: Path) -> str | None:
    """The id of the residual at ``path`` (tensors mapped, not read); None: no file, or a
    file from before ids were recorded."""
    try:
        body = _load(path)
    except FileNotFoundError:
        return None
    id_ = body.get("id")
    return id_ if isinstance(id_, str) else None


def read_residual(path: Path) -> Residual | HeldResidual | None:
    """The residual at ``path`` (None: no file; a :class:`HeldResidual` for a held file),
    checked: names map to finite float32 tensors. The tensors are memory-mapped; copy them
    where they are used."""
    try:
        body = _load(path)
    except FileNotFoundError:
        return None
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
