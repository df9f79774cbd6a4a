"""A round's inner state, kept when the worker group stops mid-round, and resumed from.

A worker group stopped at a step boundary (the agent's stop, the end of a drain on a
spot notice, SIGTERM) keeps the round's inner state at that step beside the job's
regional checkpoint: the parameters and the inner optimizer state saved sharded, every
rank its own part (:func:`save_inner_tensors`, into the ``inner-checkpoint/`` directory,
:func:`~regional_agent.handoff.directory.inner_tensors_dir`), then, last, ``inner-checkpoint.pt``
(rank 0, temp + fsync + rename, mode 0600): the step within the round, and each rank's
RNG states and running totals (micro-batches, tokens, loss sum, times). No rank gathers
the model. The data cursor and the learning rate follow from the step: batches are a
function of the data step, the schedule of the round and step, and a step boundary has
no gradient accumulation in flight.

The file names the round it belongs to (:class:`RoundIdentity`: job, round, the hash of
the base θ, a digest of the instruction's training-relevant fields, the group's size and
the regional state the round started from). :func:`resume_verdict` is the pure decision
made when the group is next asked for a round: resume only that very round, else
discard the file and say why. Only rounds trained serially from θ keep one: a delayed
round (``overlap: delayed``) started from parameters a restarted group no longer holds.
Blocking disk I/O; the file functions are rank 0's, the tensor functions collectives.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from geofed.fsutil import AtomicFile
from geofed.params import is_federated
from regional_agent.handoff.directory import inner_tensors_dir
from regional_agent.handoff.messages import RoundInstruction
from regional_agent.worker.inner_loop import RankTotals
from regional_agent.worker.optimizer_checkpoint import FROM_RANK0, load_sharded, save_sharded

__all__ = [
    "FORMAT_VERSION",
    "InnerCheckpoint",
    "InvalidInnerCheckpoint",
    "RankInner",
    "ResumeVerdict",
    "RoundIdentity",
    "discard_inner_checkpoint",
    "instruction_digest",
    "load_inner_tensors",
    "read_inner_checkpoint",
    "resume_verdict",
    "save_inner_tensors",
    "write_inner_checkpoint",
]

#: Format 1 held the whole parameters and optimizer state in the file; such a file is
#: discarded (its round trains from its start).
FORMAT_VERSION = 2
# What a re-sent instruction may change without changing what the round trains: where
# θ is on disk (its hash is compared instead) and whether θ is evaluated first.
_NOT_TRAINING = frozenset({"base_params", "base_hash", "evaluate_base"})


class InvalidInnerCheckpoint(ValueError):
    """An inner checkpoint file that cannot be read; the message says why."""


@dataclass(frozen=True, slots=True)
class RoundIdentity:
    """What a round's inner state belongs to; resumed only into the very same round.

    ``after_round`` and ``start_cursor`` are the regional state the round started from
    (the last completed round, None for none, and its data cursor).
    """

    job: str
    round: int
    base_hash: str
    instruction: str
    """:func:`instruction_digest` of the round's instruction."""
    world_size: int
    after_round: int | None
    start_cursor: int


def instruction_digest(instruction: RoundInstruction) -> str:
    """A digest of everything in ``instruction`` that shapes what the round trains."""
    body = json.loads(instruction.to_json())
    kept = {name: value for name, value in body.items() if name not in _NOT_TRAINING}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class RankInner:
    """One rank's share of a round stopped mid-way: its RNG states and totals so far."""

    cpu_rng: torch.Tensor
    cuda_rng: torch.Tensor | None
    totals: RankTotals


@dataclass(frozen=True, slots=True)
class InnerCheckpoint:
    """A round's inner state at the start of step ``step`` (``step`` steps trained)."""

    identity: RoundIdentity
    step: int
    inner_steps: int
    ranks: tuple[RankInner, ...] = field(repr=False)


@dataclass(frozen=True, slots=True)
class ResumeVerdict:
    """Resume the round at ``step``, or discard the file (``step`` None); and why."""

    step: int | None
    reason: str


def resume_verdict(
    saved: RoundIdentity, step: int, inner_steps: int, current: RoundIdentity
) -> ResumeVerdict:
    """Whether inner state ``saved`` at ``step`` of ``inner_steps`` resumes ``current``."""
    where = f"job {current.job} round {current.round}"
    mismatch: str | None = None
    if (saved.job, saved.round) != (current.job, current.round):
        mismatch = f"it is of job {saved.job} round {saved.round}"
    elif saved.base_hash != current.base_hash:
        mismatch = f"it was trained from θ {saved.base_hash[:12]}, not {current.base_hash[:12]}"
    elif saved.instruction != current.instruction:
        mismatch = "the instruction changed (steps, seed, data, task or training)"
    elif saved.world_size != current.world_size:
        mismatch = f"it was taken by {saved.world_size} ranks, not {current.world_size}"
    elif (saved.after_round, saved.start_cursor) != (current.after_round, current.start_cursor):
        mismatch = (
            f"it follows round {saved.after_round} at data step {saved.start_cursor}, "
            f"the regional state round {current.after_round} at data step {current.start_cursor}"
        )
    elif not 0 < step < inner_steps:
        mismatch = f"its step {step} is not within the round's {inner_steps} steps"
    if mismatch is not None:
        return ResumeVerdict(None, f"{where}: discarding the inner checkpoint: {mismatch}")
    return ResumeVerdict(
        step, f"{where}: resuming at step {step} of {inner_steps} from the inner checkpoint"
    )


def discard_inner_checkpoint(path: Path) -> None:
    """Remove the inner checkpoint at ``path``, its tensors, and any temp file a killed
    writer left (the file first: without it the tensors are never read)."""
    path.unlink(missing_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)
    shutil.rmtree(inner_tensors_dir(path), ignore_errors=True)


def save_inner_tensors(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    path: Path,
    group: dist.ProcessGroup | None = None,
    *,
    replicated: bool = False,
) -> None:
    """Save the federated parameters and the optimizer state, every rank its own shards
    (``replicated``, DDP: rank 0 the whole), into
    :func:`~regional_agent.handoff.directory.inner_tensors_dir` of ``path`` (a collective)."""
    others = replicated and dist.is_initialized() and dist.get_rank() != 0
    state = {} if others else _training_state(model, optimizer)
    save_sharded(state, inner_tensors_dir(path), group, replicated=replicated)


def load_inner_tensors(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    path: Path,
    group: dist.ProcessGroup | None = None,
    *,
    replicated: bool = False,
) -> None:
    """Load what :func:`save_inner_tensors` saved into the model and optimizer (a
    collective; a failure is met on every rank alike; ``replicated``: rank 0 reads the
    whole and broadcasts it, tensor by tensor)."""
    if replicated and dist.is_initialized():
        rank0 = dist.get_rank() == 0
        whole = _training_state(model, optimizer) if rank0 else None
        load_sharded(whole, inner_tensors_dir(path), group, replicated=True)
        given = whole if whole is not None else {"model": {}, "optimizer": {}}
        set_model_state_dict(model, given["model"], options=FROM_RANK0)
        set_optimizer_state_dict(model, optimizer, given["optimizer"], options=FROM_RANK0)
        return
    state = _training_state(model, optimizer)
    load_sharded(state, inner_tensors_dir(path), group)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def _training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    # The federated tensors (each rank's shards under FSDP); θ does not carry the rest.
    model_state = {
        name: value
        for name, value in get_model_state_dict(model).items()
        if isinstance(value, torch.Tensor) and is_federated(value)
    }
    return {
        "model": model_state,
        "optimizer": get_optimizer_state_dict(model, optimizer),
    }


def write_inner_checkpoint(path: Path, checkpoint: InnerCheckpoint) -> None:
    """Atomically and durably replace ``path`` with ``checkpoint``, owner-only (the
    tensors it names are saved first, by :func:`save_inner_tensors`)."""
    body: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "identity": asdict(checkpoint.identity),
        "step": checkpoint.step,
        "inner_steps": checkpoint.inner_steps,
        "ranks": [
            {"cpu_rng": r.cpu_rng, "cuda_rng": r.cuda_rng, "totals": asdict(r.totals)}
            for r in checkpoint.ranks
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with AtomicFile(path, private=True) as f:
        torch.save(body, f)


def read_inner_checkpoint(path: Path) -> InnerCheckpoint | None:
    """The inner checkpoint at ``path``; None if there is none.

    Raises :class:`InvalidInnerCheckpoint` when the file is unreadable or malformed.
    """
    try:
        body = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        return None
    except Exception as exc:
        raise InvalidInnerCheckpoint(f"{path}: unreadable: {exc}") from None
    try:
        return _parse(body)
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidInnerCheckpoint(f"{path}: malformed: {exc}") from None


def _parse(body: object) -> InnerCheckpoint:
    if not isinstance(body, dict) or body.get("format") != FORMAT_VERSION:
        raise ValueError(f"not a format-{FORMAT_VERSION} inner checkpoint")
    identity = RoundIdentity(**body["identity"])
    for name in ("job", "base_hash", "instruction"):
        if not isinstance(getattr(identity, name), str):
            raise TypeError(f"identity.{name} is not a string")
    ranks = tuple(_rank(entry) for entry in body["ranks"])
    if len(ranks) != identity.world_size:
        raise ValueError(f"{len(ranks)} ranks' states for a group of {identity.world_size}")
    step, inner_steps = body["step"], body["inner_steps"]
    if not isinstance(step, int) or not isinstance(inner_steps, int):
        raise TypeError("step and inner_steps must be integers")
    return InnerCheckpoint(identity, step, inner_steps, ranks)


def _rank(entry: Mapping[str, Any]) -> RankInner:
    cpu_rng, cuda_rng = entry["cpu_rng"], entry["cuda_rng"]
    if not isinstance(cpu_rng, torch.Tensor) or not (
        cuda_rng is None or isinstance(cuda_rng, torch.Tensor)
    ):
        raise TypeError("RNG states must be tensors")
    return RankInner(cpu_rng, cuda_rng, RankTotals(**entry["totals"]))
