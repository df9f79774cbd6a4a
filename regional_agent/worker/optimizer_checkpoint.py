"""The inner optimizer state of a regional checkpoint: sharded, each rank writing its part.

Under FSDP/HSDP every rank saves its own shards of the inner optimizer state with
``torch.distributed.checkpoint`` (DCP) into ``optimizer-round-<r>/`` beside the job's
regional checkpoint record (:class:`~regional_agent.handoff.messages.RegionalCheckpoint`);
nothing is gathered to rank 0. Under DDP, where every rank holds the same state, rank 0
writes it alone (no gather either) and, to resume, reads it and broadcasts it tensor by
tensor, so a region of several nodes needs no shared filesystem for it. A checkpoint
exists once its ``.metadata`` does (DCP writes it last, by rename), and counts once the
record names its round: rank 0 writes the record after the save, and the directories the
record does not name are removed before the next save, so a crash at any point leaves a
record naming a complete checkpoint.

Loading reshards: a group of another size, or restarted, loads what it holds from the
same files. Under FSDP/HSDP the ranks of a region of several nodes write and read their
parts under the same path on their own node; resuming the sharded state exactly across
nodes needs that path on a shared filesystem (without one, a rank that cannot read a
part fails the load on every rank and the state starts afresh, as after a crash between
checkpoints).

:func:`save_due` is the pure cadence: a save at the first round, then every
``training.regional_checkpoint_every`` rounds, and at once when the coordinator asks (a
round announcement naming the region, for its hardware risk: the agent leaves the ask in
the hand-off directory); the worker also saves when it parks a job for another and when
the group stops, so only a crash costs inner optimizer state. A save writes the
error-feedback residual's tensors only when the coordinator asked for it (see
:func:`save_due`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from regional_agent.handoff.directory import HandoffDir

#: A replicated state rank 0 read, broadcast tensor by tensor, each rank keeping its own.
FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)


@dataclass(frozen=True, slots=True)
class SaveDecision:
    """Whether to save the optimizer state at the end of a round, and why; ``residual``:
    whether the error-feedback residual's tensors are written with it (only when the
    coordinator asked, see :func:`save_due`)."""

    save: bool
    reason: str
    residual: bool = False


def save_due(
    round_: int, saved_round: int | None, every: int, asked: int | None = None
) -> SaveDecision:
    """Whether the optimizer state of round ``round_`` is to be saved.

    ``saved_round`` is the round whose state the current checkpoint holds (None: none);
    ``asked``: the round from which the coordinator asked for a checkpoint (its hardware
    risk; None: never), honoured once a state of that round or a later one is saved.

    Only an asked save writes the residual's tensors too: the agent's feedback file names
    a round's residual until the next round's delta is accepted, so a residual written
    with every save would serve only a crash in the round after it, for 4 B a parameter;
    where a crash is likely, that round is worth it. (Parking a job and stopping the
    group write the residual out whatever this says.)
    """
    asked_now = (
        asked is not None and asked <= round_ and (saved_round is None or saved_round < asked)
    )
    if saved_round is None:
        return SaveDecision(True, "no inner optimizer state is saved yet", residual=asked_now)
    if asked_now:
        why = f"asked for from round {asked} (the region's hardware risk)"
        return SaveDecision(True, why, residual=True)
    behind = round_ - saved_round
    if behind >= every:
        return SaveDecision(True, f"{behind} rounds since the last save (every {every})")
    return SaveDecision(False, f"{behind} of {every} rounds since the last save")


class ShardedCheckpointError(Exception):
    """A sharded save or load failed (on every rank alike); the message says where.

    DCP raises ``CheckpointException``, a ``BaseException``: converted here so that a
    failed checkpoint is a failed step, never a crashed worker.
    """


def _first_line(exc: CheckpointException) -> str:
    """The gist of a DCP failure: each rank's error, one line each."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, failure in sorted(failures.items()):
            error = failure[0] if isinstance(failure, tuple) else failure
            text = str(error).splitlines()[0] if str(error) else ""
            parts.append(f"rank {rank}: {type(error).__name__}: {text}")
        return "; ".join(parts)
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def save_sharded(
    state: dict[str, Any],
    path: Path,
    group: dist.ProcessGroup | None = None,
    *,
    replicated: bool = False,
) -> None:
    """Save ``state`` (each rank its own shards of it) into ``path`` (a collective; one
    process alone when no process group is initialized).

    ``replicated``: every rank holds the same state (DDP), and rank 0 writes it alone, so
    resuming it needs no other node's files; the outcome is shared with every rank.
    """
    if replicated and dist.is_initialized():
        _on_rank0(lambda: _dcp("save", dcp_save, state, path, None, alone=True), group)
        return
    _dcp("save", dcp_save, state, path, group)


def load_sharded(
    state: dict[str, Any] | None,
    path: Path,
    group: dist.ProcessGroup | None = None,
    *,
    replicated: bool = False,
) -> None:
    """Load what :func:`save_sharded` saved at ``path`` into ``state``'s tensors, in place
    (a collective). A failure is raised on every rank alike, as
    :class:`ShardedCheckpointError`: DCP gathers each rank's errors.

    ``replicated``: rank 0 alone reads, into its ``state`` (the others pass None); the
    caller then broadcasts it from rank 0.
    """
    if replicated and dist.is_initialized():
        if dist.get_rank() == 0 and state is None:
            raise ValueError("rank 0 reads a replicated state into a template it passes")
        _on_rank0(lambda: _dcp("load", dcp_load, state or {}, path, None, alone=True), group)
        return
    if state is None:
        raise ValueError("every rank loads its shards into a template it passes")
    _dcp("load", dcp_load, state, path, group)


def _dcp(
    verb: str,
    call: Callable[..., object],
    state: dict[str, Any],
    path: Path,
    group: dist.ProcessGroup | None,
    *,
    alone: bool = False,
) -> None:
    no_dist = alone or not dist.is_initialized()
    try:
        with _alone_is_meant():
            call(state, checkpoint_id=path, process_group=group, no_dist=no_dist)
    except CheckpointException as exc:
        raise ShardedCheckpointError(f"cannot {verb} {path}: {_first_line(exc)}") from exc


def _on_rank0(action: Callable[[], None], group: dist.ProcessGroup | None) -> None:
    """Run ``action`` on rank 0 alone and raise its failure on every rank (a collective)."""
    box: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            action()
        except ShardedCheckpointError as exc:
            box[0] = str(exc)
        except Exception as exc:  # a write that failed before DCP: still every rank's news
            box[0] = f"{type(exc).__name__}: {exc}"
    dist.broadcast_object_list(box, src=0, group=group)
    if box[0] is not None:
        raise ShardedCheckpointError(box[0])


def save_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    path: Path,
    group: dist.ProcessGroup | None = None,
    *,
    replicated: bool = False,
) -> None:
    """Save this rank's part of ``optimizer``'s state into ``path`` (a collective;
    ``replicated``: rank 0 saves the whole, which every rank holds)."""
    if replicated and dist.is_initialized() and dist.get_rank() != 0:
        save_sharded({}, path, group, replicated=True)
        return
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    save_sharded(state, path, group, replicated=replicated)


def load_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    path: Path,
    group: dist.ProcessGroup | None = None,
    *,
    replicated: bool = False,
) -> None:
    """Load the state saved at ``path`` into ``optimizer``, each rank its part (a
    collective; ``replicated``: rank 0 reads the whole and broadcasts it, tensor by tensor).

    A failure is raised on every rank alike; the optimizer may then be partly loaded, so
    the caller builds a fresh one.
    """
    if replicated and dist.is_initialized():
        rank0 = dist.get_rank() == 0
        state = {"optimizer": get_optimizer_state_dict(model, optimizer)} if rank0 else None
        load_sharded(state, path, group, replicated=True)
        set_optimizer_state_dict(
            model, optimizer, state["optimizer"] if state is not None else {}, options=FROM_RANK0
        )
        return
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    load_sharded(state, path, group)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


@contextlib.contextmanager
def _alone_is_meant() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process: without a group, that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def read_whole(path: Path, scratch: Path) -> dict[str, object]:
    """The whole optimizer state saved at ``path``, unsharded, in this process (no group).

    For inspection and tests: it holds the whole state in memory. ``scratch`` is a file
    path the conversion may write (removed after).
    """
    try:
        dcp_to_torch_save(path, scratch)
        whole = torch.load(scratch, map_location="cpu", weights_only=True)
    finally:
        scratch.unlink(missing_ok=True)
    state = whole["optimizer"]
    if not isinstance(state, dict):
        raise TypeError(f"{path}: not an optimizer state")
    return state


def read_optimizer_state(handoff: HandoffDir, job: str) -> dict[str, Any] | None:
    """``job``'s saved inner optimizer state, whole, in this process (for inspection).

    None when its regional checkpoint names none. Holds the whole state in memory: never
    on a path that scales with the model.
    """
    checkpoint = handoff.read_checkpoint(job)
    if checkpoint is None:
        return None
    if checkpoint.optimizer_state is not None:
        return checkpoint.optimizer_state
    if checkpoint.optimizer_round is None:
        return None
    path = handoff.optimizer_path(job, checkpoint.optimizer_round)
    return read_whole(path, handoff.job_dir(job) / f".{path.name}.whole.tmp")
