"""The worker side of a delayed round (``overlap: delayed``) on one rank.

The workers start round r+1 from the parameters y they hold at the end of round r and
keep a snapshot S = y on the device (one copy of the rank's share of the model). Before
every step rank 0 looks for the round's base-ready marker and for a cancel request; one
tiny all-reduce (with the stop wish) carries both to every rank, so all fold θ_{r+1} in at
the same step: y <- θ_{r+1} + (y - S) (:mod:`regional_agent.handoff.overlap`), each rank on its
own shard under FSDP. θ is broadcast from rank 0 into the model as in a serial round, and
evaluated there when the marker asks for it (between the two halves of the correction,
while the model holds θ exactly). If θ has not come when the last step is done, the ranks
wait for it (still honouring a stop), then fold it in.

Under ``overlap_start: eager`` (the instruction's ``start``) the round starts instead from
the estimate S the agent hands over (:mod:`regional_agent.rounds.eager_start`): before the first
step the ranks wait for the round's start marker (still honouring a stop and a cancel),
load S as they load θ (rank 0 reads it, each rank takes its shard under FSDP) and keep it
as the snapshot; a marker without S (the agent had no estimate) keeps the local start.

Under ``overlap: streaming`` the instruction's ``fold`` names the tensors θ changed in
(the previous round's fragment): S holds only those (1/F of the model), only those are
loaded from θ and corrected, and every other tensor keeps its local progress untouched.
Evaluating θ there takes the whole θ for the evaluation, and puts the other tensors back
afterwards (a copy of them held only meanwhile).

A cancel (the agent will not use the round) or a θ that cannot be read ends the round
without a result; the caller drops the rank's state, so the next round resumes from the
regional checkpoint of round r, as a restarted group does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from geofed.params import federated_state
from geofed.task import DataShard
from geofed.training_config import TrainingConfig
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.messages import BaseReady, RoundInstruction, StartReady
from regional_agent.handoff.overlap import add_progress, progress_in_place, select, take_snapshot
from regional_agent.worker.base_evaluation import evaluate_base
from regional_agent.worker.job_state import read_base
from regional_agent.worker.parallelism import ParallelModel

log = logging.getLogger(__name__)

_Marker = TypeVar("_Marker", BaseReady, StartReady)

#: (stop, base ready, cancelled) -> whether any rank raised each.
Agree = Callable[..., tuple[bool, ...]]


def local_tensors(parallel: ParallelModel) -> dict[str, torch.Tensor]:
    """This rank's federated tensors, as views of the model's own memory (shards under
    FSDP), so in-place updates change the model."""
    return {
        name: tensor.to_local() if isinstance(tensor, DTensor) else tensor
        for name, tensor in federated_state(parallel.model).items()
    }


class DelayedFold:
    """Folds θ into a delayed round that started from the local parameters."""

    def __init__(
        self,
        handoff: HandoffDir,
        instruction: RoundInstruction,
        parallel: ParallelModel,
        agree: Agree,
        evaluate: Callable[[], dict[str, float] | None],
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """``agree`` is the caller's control all-reduce over ``group`` (gloo, on the CPU)."""
        self._handoff = handoff
        self._instruction = instruction
        self._parallel = parallel
        self._agree = agree
        self._evaluate = evaluate
        self._group = group
        self._rank = dist.get_rank()
        #: The tensors folded in (``streaming``: θ changed only these); None: all.
        self._names = instruction.fold
        self._snapshot: dict[str, torch.Tensor] = take_snapshot(
            local_tensors(parallel), self._names
        )
        #: Set once θ is folded in: its hash (rank 0; "" elsewhere), its metrics, the step.
        self.base_hash = ""
        self.base_path = ""  # the file θ_round was folded in from
        self.base_eval: dict[str, float] | None = None
        self.folded_at_step: int | None = None
        self.wait_seconds = 0.0
        #: Eager start: how long the ranks waited for S, and whether they took it.
        self.start_wait_seconds = 0.0
        self.started_from_estimate = False
        #: Why the round ended without a result when it was not a stop (rank 0 reports it).
        self.failure: str | None = None

    @property
    def folded(self) -> bool:
        return self.folded_at_step is not None

    def between_steps(self, step: int, wants_stop: bool) -> bool:
        """Before step ``step``: fold θ in if it came; True when the round must end."""
        if self.folded:
            return self._agree(wants_stop)[0]
        outcome = self._check(wants_stop)
        if outcome is None:
            return True
        if isinstance(outcome, BaseReady):
            self._fold(outcome, step)
        return self.failure is not None

    def finish(self, steps: int, wants_stop: Callable[[], bool], poll_s: float) -> bool:
        """After the last step: wait for θ if it has not come and fold it in; True when it
        is folded (False: stopped, cancelled or failed)."""
        if self.folded:
            return True
        started = time.monotonic()
        while True:
            outcome = self._check(wants_stop())
            if outcome is None:
                return False
            if isinstance(outcome, BaseReady):
                self.wait_seconds = time.monotonic() - started
                self._fold(outcome, steps)
                return self.failure is None
            time.sleep(poll_s)

    def begin(self, wants_stop: Callable[[], bool], poll_s: float) -> bool:
        """Eager start, before the first step: wait for S, load it and take it as the
        snapshot. False when stopped, cancelled or failed (then ``failure`` says why)."""
        job, round_ = self._instruction.job, self._instruction.round
        started = time.monotonic()
        while True:
            marker = self._poll(self._handoff.read_start_ready, "start marker", wants_stop())
            if marker is None:
                return False
            if marker is not False:
                break
            time.sleep(poll_s)
        self.start_wait_seconds = time.monotonic() - started
        if not marker.start_params:
            log.info(
                "job %s round %d: no eager estimate (%s); starting from the local parameters "
                "(%.3f s waited)",
                job,
                round_,
                marker.reason or "none made",
                self.start_wait_seconds,
            )
            return True
        start: Mapping[str, torch.Tensor] | None = None
        error: str | None = None
        if self._rank == 0:
            try:
                read = read_base(self._parallel.model, marker.start_params)
            except Exception as exc:
                log.exception("job %s round %d: cannot read S", job, round_)
                error = f"cannot read the eager start: {type(exc).__name__}: {exc}"
            else:
                if read.hash == marker.start_hash:
                    start = read.state
                else:
                    error = (
                        f"S at {marker.start_params} hashes {read.hash}, not {marker.start_hash}"
                    )
        (failed,) = self._agree(error is not None)
        if failed:
            self.failure = error or "rank 0 could not read the eager start"
            return False
        self._parallel.load_full_state(start)
        del start
        with torch.no_grad():
            tensors = local_tensors(self._parallel)
            for name, saved in self._snapshot.items():
                saved.copy_(tensors[name].detach())
        self.started_from_estimate = True
        log.info(
            "job %s round %d: starting from the eager estimate S %s (%.3f s waited for it)",
            job,
            round_,
            marker.start_hash,
            self.start_wait_seconds,
        )
        return True

    # -- internals -----------------------------------------------------------------------

    def _check(self, wants_stop: bool) -> BaseReady | Literal[False] | None:
        """None: stop or cancel agreed; False: θ not there yet; else the marker (all ranks)."""
        return self._poll(self._handoff.read_base_ready, "base-ready marker", wants_stop)

    def _poll(
        self, read: Callable[[str, int], _Marker | None], what: str, wants_stop: bool
    ) -> _Marker | Literal[False] | None:
        """One look for the agent's ``what`` (a collective): None when a stop or a cancel is
        agreed, False while the marker is not there, else rank 0's marker on every rank."""
        job, round_ = self._instruction.job, self._instruction.round
        ready: _Marker | None = None
        cancelled = False
        if self._rank == 0:
            cancelled = self._handoff.cancel_requested(job, round_)
            if not cancelled:
                try:
                    ready = read(job, round_)
                except Exception as exc:  # a damaged marker fails the round, on every rank
                    log.exception("job %s round %d: unreadable %s", job, round_, what)
                    self.failure = f"unreadable {what}: {exc}"
                    cancelled = True
        stop, has, cancel = self._agree(wants_stop, ready is not None, cancelled)
        if cancel:
            if self.failure is None:
                self.failure = "the delayed round was cancelled by the agent"
            return None
        if stop:
            return None
        if not has:
            return False
        box: list[_Marker | None] = [ready]
        dist.broadcast_object_list(box, src=0, group=self._group)
        assert box[0] is not None
        return box[0]

    def _fold(self, ready: BaseReady, step: int) -> None:
        """y <- θ + (y - S), evaluating θ on the way when asked."""
        job, round_ = self._instruction.job, self._instruction.round
        base: Mapping[str, torch.Tensor] | None = None
        error: str | None = None
        if self._rank == 0:
            try:
                read = read_base(self._parallel.model, ready.base_params)
            except Exception as exc:
                log.exception("job %s round %d: cannot read θ", job, round_)
                error = f"cannot read θ_{round_}: {type(exc).__name__}: {exc}"
            else:
                if read.hash == ready.base_hash:
                    base, self.base_hash = read.state, read.hash
                    self.base_path = ready.base_params
                else:
                    error = f"θ at {ready.base_params} hashes {read.hash}, not {ready.base_hash}"
        (failed,) = self._agree(error is not None)
        if failed:
            self.failure = error or "rank 0 could not read θ"
            return
        started = time.monotonic()
        names = self._names
        progress = progress_in_place(self._snapshot, select(local_tensors(self._parallel), names))
        if names is None:
            self._parallel.load_full_state(base)
            if ready.evaluate_base:
                self.base_eval = self._evaluate()
        elif ready.evaluate_base:
            self._evaluate_whole(base, names)
        else:
            # θ changed only in these; the others keep y (strict=False leaves them be).
            self._parallel.load_full_state(None if base is None else select(base, names))
        del base
        add_progress(select(local_tensors(self._parallel), names), progress)
        self._snapshot = {}
        self.folded_at_step = step
        log.info(
            "job %s round %d: θ folded in before step %d of %d (%.3f s)",
            job,
            round_,
            step,
            self._instruction.inner_steps,
            time.monotonic() - started,
        )

    def _evaluate_whole(
        self, base: Mapping[str, torch.Tensor] | None, names: tuple[str, ...]
    ) -> None:
        """Load the whole θ, evaluate it, and put back the tensors outside ``names``."""
        kept = {
            name: tensor.detach().clone()
            for name, tensor in local_tensors(self._parallel).items()
            if name not in names
        }
        self._parallel.load_full_state(base)
        self.base_eval = self._evaluate()
        with torch.no_grad():
            tensors = local_tensors(self._parallel)
            for name, saved in kept.items():
                tensors[name].copy_(saved)


def evaluator(
    task: Any,
    parallel: ParallelModel,
    training: TrainingConfig,
    device: torch.device,
    shard: DataShard,
    what: str,
) -> Callable[[], dict[str, float] | None]:
    """Evaluate the parameters the model holds on ``shard``'s held-out data; None
    (logged) when the task fails."""

    def run() -> dict[str, float] | None:
        try:
            return evaluate_base(task, parallel, training, device, shard)
        except Exception:
            log.exception("evaluating %s failed", what)
            return None

    return run
