"""A region's inner training state for one job on one rank: built, resumed, made ready.

:meth:`WorkerJobState.build` does what a rank can do alone: import the task, build the model
(on the ``meta`` device where the task allows: :mod:`regional_agent.worker.model_build`), make
its checkpointed modules recompute, and take the data cursor, last round and inner
optimizer state from the job's own regional checkpoint (a job parked while another
trained resumes from it exactly). :meth:`WorkerJobState.ready` then does
the collectives, once per state: wrap the model for the job's parallelism, build the
optimizer and load the checkpoint's optimizer state into it. The split lets the ranks
agree that every one of them got through the first part before any enters a collective
its peers would never join. :func:`read_base` is rank 0's share of a round's start.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from geofed.lr_schedule import apply_lr
from geofed.params import HashingReads, check_federated_state
from geofed.task import Task, load_task
from geofed.theta_chain import ChainReads, read_params
from geofed.theta_file import ThetaReads
from geofed.training_config import TrainingConfig, is_sharded
from regional_agent.handoff.messages import RegionalCheckpoint, RoundInstruction
from regional_agent.worker.activation_checkpointing import (
    checkpoint_activations,
    checkpointed_modules,
)
from regional_agent.worker.base_update import HeldBase
from regional_agent.worker.model_build import build_model
from regional_agent.worker.optimizer_checkpoint import load_optimizer
from regional_agent.worker.parallelism import ParallelModel, wrap

log = logging.getLogger(__name__)


@dataclass
class WorkerJobState:
    """The inner training state of one job, identical on every rank.

    ``resume_optimizer`` is the regional checkpoint's optimizer state until
    :meth:`ready` has loaded it; ``parallel`` and ``optimizer`` exist from then on.
    """

    job: str
    training: TrainingConfig
    task: Task[Any]
    model: nn.Module
    fsdp_units: tuple[nn.Module, ...]
    cursor: int
    last_round: int | None
    resume_optimizer: dict[str, Any] | None
    """A whole optimizer state (a checkpoint of the format before) until :meth:`ready`."""
    #: The sharded optimizer state :meth:`ready` loads (None: none, or loaded).
    resume_optimizer_path: Path | None = None
    #: The round whose optimizer state the job's checkpoint holds (None: none yet).
    saved_optimizer_round: int | None = None
    #: Set while ``model`` is on the meta device: fills what θ does not carry once
    #: :meth:`ready` has allocated the shards (:mod:`regional_agent.worker.model_build`).
    materialize: Callable[[nn.Module], None] | None = None
    parallel: ParallelModel | None = None
    optimizer: torch.optim.Optimizer | None = None
    #: The round whose trained parameters the model holds (None until one is trained
    #: here): a delayed round goes on from them (:mod:`regional_agent.worker.delayed_round`).
    local_round: int | None = None
    #: The θ the model holds after a serial round's hand-over put it back (None: none);
    #: taken by the next round (:mod:`regional_agent.worker.base_update`).
    held_base: HeldBase | None = None

    @classmethod
    def build(
        cls,
        instruction: RoundInstruction,
        device: torch.device,
        checkpoint: RegionalCheckpoint | None,
        optimizer_path: Callable[[str, int], Path] | None = None,
    ) -> WorkerJobState:
        """A fresh state for ``instruction``'s job, resumed from ``checkpoint`` (the job's
        own; another job's is never resumed from) (no collectives)."""
        job, training = instruction.job, instruction.training
        task = load_task(instruction.task, instruction.task_options)
        check_fingerprint(task, instruction.task_fingerprint)
        built = build_model(task, instruction.seed, device)
        level = logging.INFO if built.materialize is not None else logging.WARNING
        log.log(level, "job %s: %s", job, built.reason)
        model = built.model
        if training.activation_checkpointing:
            checkpoint_activations(checkpointed_modules(task, model))
        units = tuple(task.fsdp_units(model)) if is_sharded(training.parallelism) else ()
        if checkpoint is None or checkpoint.job != job:
            log.info("job %s: fresh regional state", job)
            return cls(
                job, training, task, model, units, 0, None, None, None, None, built.materialize
            )
        if checkpoint.parallelism != training.parallelism:
            raise ValueError(
                f"the regional checkpoint of job {job} holds {checkpoint.parallelism} "
                f"optimizer state; the job trains with {training.parallelism}"
            )
        saved = checkpoint.optimizer_round
        log.info(
            "job %s: resumed from the regional checkpoint of round %d (data step %d; %s)",
            job,
            checkpoint.last_round,
            checkpoint.cursor,
            "whole optimizer state"
            if checkpoint.optimizer_state is not None
            else "no optimizer state saved"
            if saved is None
            else f"optimizer state of round {saved}",
        )
        return cls(
            job,
            training,
            task,
            model,
            units,
            checkpoint.cursor,
            checkpoint.last_round,
            checkpoint.optimizer_state,
            None if saved is None or optimizer_path is None else optimizer_path(job, saved),
            saved,
            built.materialize,
        )

    def keep_held_base(self, held: HeldBase) -> None:
        """Record the θ the model holds now."""
        self.held_base = held

    def take_held_base(self) -> HeldBase | None:
        """The θ the model holds, forgotten here: the round that takes it changes it."""
        held, self.held_base = self.held_base, None
        return held

    def serves(self, instruction: RoundInstruction) -> bool:
        """Whether this state trains ``instruction`` (same job, same training section)."""
        return (self.job, self.training) == (instruction.job, instruction.training)

    def ready(
        self,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        timeout: timedelta = timedelta(minutes=10),
    ) -> tuple[ParallelModel, torch.optim.Optimizer]:
        """The wrapped model and its optimizer, made on the first call (collectives; the
        sharded optimizer state is read over ``group``; process groups made here wait
        ``timeout`` for a peer)."""
        if self.parallel is not None and self.optimizer is not None:
            return self.parallel, self.optimizer
        training = self.training
        parallel = wrap(
            self.model,
            training.parallelism,
            training.precision,
            device,
            self.fsdp_units,
            self.materialize,
            training.hsdp_shard_ranks or _node_ranks(),
            timeout,
        )
        self.materialize = None
        optimizer = self._fresh_optimizer(parallel)
        if self.resume_optimizer is not None:
            parallel.load_optimizer_state(optimizer, self.resume_optimizer)
            self.resume_optimizer = None
        elif self.resume_optimizer_path is not None:
            optimizer = self._load_sharded(parallel, optimizer, self.resume_optimizer_path, group)
            self.resume_optimizer_path = None
        self.parallel, self.optimizer = parallel, optimizer
        log.info(
            "job %s: %s, %s compute, on %s",
            self.job,
            training.parallelism,
            training.precision,
            device,
        )
        return parallel, optimizer

    def _fresh_optimizer(self, parallel: ParallelModel) -> torch.optim.Optimizer:
        optimizer = self.task.build_optimizer(parallel.model.parameters())
        # Every rank records the task's base rates now: under FSDP a state loaded from
        # rank 0 fills only the param-group keys each rank already has.
        apply_lr(optimizer, 1.0)
        return optimizer

    def _load_sharded(
        self,
        parallel: ParallelModel,
        optimizer: torch.optim.Optimizer,
        path: Path,
        group: dist.ProcessGroup | None,
    ) -> torch.optim.Optimizer:
        """``optimizer`` with the state saved at ``path``; a fresh one if it cannot be read.

        A failure is met on every rank alike, so every rank starts afresh together, as
        after a crash before the first save.
        """
        try:
            load_optimizer(
                parallel.model,
                optimizer,
                path,
                group,
                replicated=not is_sharded(self.training.parallelism),
            )
        except Exception as exc:
            log.warning(
                "job %s: cannot load the inner optimizer state at %s (%s: %s); starting it afresh",
                self.job,
                path,
                type(exc).__name__,
                exc,
            )
            self.saved_optimizer_round = None
            return self._fresh_optimizer(parallel)
        return optimizer


def _node_ranks() -> int | None:
    """The ranks of this rank's node, as the elastic launcher says (None outside one)."""
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    return int(raw) if raw is not None and raw.isdigit() and int(raw) > 0 else None


@dataclass(frozen=True, slots=True)
class BaseParams:
    """A round's base θ as rank 0 reads it (from its file or its chain): its tensors in
    sorted order, read when asked for and hashed as they are read."""

    state: HashingReads

    @property
    def hash(self) -> str:
        """θ's hash: no read once the state was read whole in its order (loaded into the
        model); before that, θ is read to hash it."""
        return self.state.hexdigest()


def read_base(model: nn.Module, path: str) -> BaseParams:
    """The base θ at ``path`` (a θ file or a chain, :mod:`geofed.theta_chain`), checked to
    fit ``model`` (from its header) (rank 0). Its tensors are read when asked for, one at
    a time: loading θ never keeps all of it resident (a mapped file's pages would stay
    resident while mapped), and hashes it as it loads it."""
    base = read_params(path)  # ThetaFileError is a ValueError
    declared = _declared(base)
    check_federated_state(model, declared)
    shapes = {name: tuple(tensor.shape) for name, tensor in declared.items()}
    return BaseParams(HashingReads(base, shapes))


def _declared(base: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """θ's tensors as its header declares them (shapes only, no value read)."""
    if not isinstance(base, ThetaReads | ChainReads):
        return base  # the format before: mapped, so its shapes cost no read
    return {name: torch.empty(shape, device="meta") for name, shape in base.shapes().items()}


class TaskFilesDiffer(ValueError):
    """The task's files in this region are not those the coordinator fingerprinted: the
    workers decline the round (the agent reports it as the region's refusal)."""


def check_fingerprint(task: Task[Any], announced: str | None) -> None:
    """Raise :class:`TaskFilesDiffer` when ``task`` reads other files than the
    coordinator's (its :meth:`~geofed.task.Task.fingerprint` is not ``announced``)."""
    if announced is None:
        return
    here = task.fingerprint()
    if here != announced:
        raise TaskFilesDiffer(
            f"the task's files here are not the coordinator's (fingerprint {here} here, "
            f"{announced} announced): give every region the same model directory"
        )
