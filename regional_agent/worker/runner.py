"""The round protocol one rank serves, the same code on every rank of the group.

Rank 0 alone reads and writes the hand-off directory: it polls it for the newest pending
instruction and broadcasts it, reads the base θ and the regional checkpoint and broadcasts
them, and writes the results; the other ranks may run on nodes that share no filesystem
with the agent. Rank 0 is always on the head node (the agent's,
:func:`~regional_agent.handoff.settings.is_head_node`):
the ranks renumber themselves head node first
(:func:`~regional_agent.handoff.settings.head_first_ranks`).

Each round: every rank builds or keeps the job's state, rank 0 maps the base θ and
checks it, and the ranks agree that all is well before any collective
(:mod:`regional_agent.worker.job_state`); then the model is wrapped for the job's parallelism
once (:mod:`regional_agent.worker.parallelism`), rank 0's θ is broadcast into it (or, when
the group holds θ of the round before, made on the ranks from it and that round's update:
:mod:`regional_agent.worker.base_update`), the ranks evaluate it when instructed
(:mod:`regional_agent.worker.base_evaluation`, reported in the summary's ``base_eval``),
and every rank trains ``inner_steps`` optimizer steps from the region's data cursor
(:mod:`regional_agent.worker.inner_loop`). Rank 0 quantizes the round's delta as the
trained tensors reach it one at a time (:mod:`regional_agent.worker.device_delta`) and
writes the result, the job's regional checkpoint record and, last, the done marker (see
:mod:`regional_agent.handoff`, :mod:`regional_agent.worker.round_records`). The inner
optimizer state persists across rounds; the parameters restart from the base each round. A
restarted group resumes from the regional checkpoint and redoes the current round, so a
crash costs at most that round's work and changes nothing in its result: the learning
rate is a function of the round and step, and the data of the cursor. A group stopped
mid-round (the agent's stop, a drain on a spot notice, SIGTERM) keeps the round's inner
state at the step it stopped before, and resumes that very round from it
(:mod:`regional_agent.worker.inner_checkpoint`): only a crash loses steps.

Jobs that share the region share the group, one round at a time. The group holds only
the state of the job it last trained; the others are parked on disk as their own regional
checkpoints (written with every round, so parking costs nothing), and a job's next round
rebuilds its state from its checkpoint: optimizer state, data cursor and last round, so it
trains exactly as if no other job had run in between. The data shard is the instruction's
(``region_index`` of ``num_regions``: the region's place among the job's regions, never
among a round's participants), so leaving a region out of a round changes no other
region's data (:func:`~regional_agent.worker.inner_loop.data_shard`).

A delayed round (``overlap: delayed``, the instruction's ``base_pending``) goes on from
the parameters the group holds at the end of the round before and folds θ in when the
agent has it (:mod:`regional_agent.worker.delayed_round`); a group that does not hold them (just
restarted, or another job in between: parked jobs keep no parameters) waits for θ and
trains the round serially. Under ``overlap: streaming`` the delta holds only the round's
fragment (the request's ``names``) and a speculative round folds in only the tensors its
``fold`` names; a serial round loads θ whole, as under ``delayed``.

Every training step, and an idle group at most every 0.5 s (``idle_agreement``), starts
with a tiny all-reduce (gloo, on the CPU) of each rank's stop wish (stop file, signals,
launcher gone), so all ranks stop at the same step and none is left in a collective.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from geofed.heap import trim_heap
from geofed.params import parameters_vector_hash
from geofed.theta_chain import StoredUpdate
from regional_agent.handoff.delta_stream import WrittenDelta
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.messages import (
    BaseReady,
    RegionalCheckpoint,
    RoundInstruction,
    RoundProgress,
)
from regional_agent.handoff.settings import WorkerSettings
from regional_agent.worker.base_evaluation import evaluate_base
from regional_agent.worker.base_update import apply_updates, held_base, planned_updates
from regional_agent.worker.delayed_round import DelayedFold, evaluator
from regional_agent.worker.device_delta import hand_over_delta
from regional_agent.worker.idle_agreement import IdleAgreement
from regional_agent.worker.inner_checkpoint import (
    RoundIdentity,
    discard_inner_checkpoint,
    instruction_digest,
)
from regional_agent.worker.inner_loop import (
    RankTotals,
    RoundPlan,
    data_shard,
    region_stats,
    round_seed,
    train_round,
)
from regional_agent.worker.inner_state import keep_inner_state, load_for_resume
from regional_agent.worker.job_state import BaseParams, TaskFilesDiffer, WorkerJobState, read_base
from regional_agent.worker.optimizer_checkpoint import SaveDecision, save_due
from regional_agent.worker.parallelism import ParallelModel
from regional_agent.worker.persistence import (
    park_job,
    save_job_optimizer,
    shared_checkpoint,
    write_out_residual,
)
from regional_agent.worker.place import RankPlace
from regional_agent.worker.residual_shards import DeviceResidual
from regional_agent.worker.round_records import (
    RegionTotals,
    TrainedRound,
    publish_round,
    round_records,
)

log = logging.getLogger(__name__)


class _ResumeFailed(Exception):
    """A round's inner checkpoint could not be loaded (the round is refused)."""


class RoundRunner:
    """Serves instructions from the hand-off directory until a stop is agreed."""

    def __init__(
        self,
        handoff: HandoffDir,
        settings: WorkerSettings,
        device: torch.device,
        stop_reason: Callable[[], str | None],
    ) -> None:
        self._handoff = handoff
        self._settings = settings
        self._device = device
        self._stop_reason = stop_reason
        self._timeout = timedelta(seconds=settings.collective_timeout_s)
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()
        self._state: WorkerJobState | None = None
        self._residual: DeviceResidual | None = None  # this rank's slices of the last one
        # Control messages (stop votes, instructions, errors) travel over gloo on the CPU,
        # so checking for a stop every step never synchronises a GPU stream.
        # An explicit timeout: a group made without one waits torch's default 30 minutes.
        self._control = (
            dist.new_group(backend="gloo", timeout=timedelta(seconds=settings.collective_timeout_s))
            if device.type == "cuda"
            else None
        )
        self._place = RankPlace(handoff, self._rank, self._world_size, self._control, device)

    def serve(self) -> None:
        if self._rank == 0:
            self._migrate_legacy_checkpoint()
        idle = IdleAgreement(self._rank)
        while True:
            pending = self._handoff.pending_instruction() if self._rank == 0 else None
            wants_stop = self._wants_stop()
            if idle.wait_alone(pending is not None, wants_stop):
                time.sleep(self._settings.poll_interval_s)
                continue
            stop, has_work = self._agree(wants_stop, pending is not None)
            idle.agreed()
            if stop:
                log.info("stopping: %s", self._stop_reason() or "asked by another rank")
                if self._state is not None:
                    self._park(self._state, "the group stops")
                self._residual = write_out_residual(self._place, self._residual)
                return
            if not has_work:
                time.sleep(self._settings.poll_interval_s)
                continue
            instruction = self._broadcast_instruction(pending)
            if instruction is not None:
                self._serve(instruction)
                trim_heap()  # the round's transient buffers, before the next one grows

    def _migrate_legacy_checkpoint(self) -> None:
        """Move a checkpoint of the old one-per-region place to its job's (rank 0, before
        any rank reads one: the other ranks are held in the first collective)."""
        try:
            job = self._handoff.migrate_legacy_checkpoint()
        except (OSError, ValueError):
            log.exception("ignoring the legacy regional checkpoint")
            return
        if job is not None:
            log.info("moved the legacy regional checkpoint to job %s's place", job)

    # -- collectives ---------------------------------------------------------------------

    def _wants_stop(self) -> bool:
        if self._stop_reason() is not None:
            return True
        return self._rank == 0 and self._handoff.stop_requested()

    def _agree(self, *flags: bool) -> tuple[bool, ...]:
        """Return, for each flag, whether any rank raised it."""
        tensor = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._control)
        return tuple(bool(v) for v in tensor.tolist())

    def _broadcast_instruction(self, pending: tuple[str, int] | None) -> RoundInstruction | None:
        box: list[RoundInstruction | None] = [None]
        if pending is not None:
            job, round_ = pending
            try:
                box[0] = self._handoff.read_instruction(job, round_)
            except Exception as exc:
                log.exception("unreadable instruction for job %s round %d", job, round_)
                self._handoff.write_error(job, round_, f"unreadable instruction: {exc}")
        dist.broadcast_object_list(box, src=0, group=self._control)
        return box[0]

    def _problems(self, error: str | None) -> list[str]:
        """Every rank's error of the step just done (a collective)."""
        errors: list[str | None] = [None] * self._world_size
        dist.all_gather_object(errors, error, group=self._control)
        return [e for e in errors if e is not None]

    # -- one round -----------------------------------------------------------------------

    def _serve(self, instruction: RoundInstruction) -> None:
        job, round_ = instruction.job, instruction.round
        error: str | None = None
        declined = False
        replay = False
        base: BaseParams | None = None
        # Rank 0 alone reads the hand-off directory; the verdict is shared so that every
        # rank drops its state together. Asked only when the state would replay the round.
        (dropped,) = self._agree(self._rank == 0 and self._regional_state_dropped(instruction))
        if dropped:
            log.warning(
                "job %s round %d: the regional checkpoint was discarded; starting afresh",
                job,
                round_,
            )
            self._state = None
        # Every rank holds the same state, so all take part in the checkpoint's broadcast
        # or none does.
        held = self._state
        # The θ the model holds is one round's only: whatever this round does, it does not
        # hold it after (a serial round's hand-over records the next one).
        held_theta = held.take_held_base() if held is not None else None
        updates: tuple[StoredUpdate, ...] | None = None
        checkpoint: RegionalCheckpoint | None = None
        checkpoint_error: str | None = None
        if held is None or not held.serves(instruction):
            if held is not None:
                self._park(held, f"job {job} is next")
            checkpoint, checkpoint_error = shared_checkpoint(self._place, job)
        # First what each rank does alone, so that a failure is agreed on before any rank
        # enters a collective its peers would never join.
        try:
            state = self._state_for(instruction, checkpoint, checkpoint_error)
            replay = state.last_round is not None and round_ <= state.last_round
            if not replay and self._rank == 0 and not instruction.base_pending:
                if state is held:
                    updates = planned_updates(held_theta, instruction)
                if updates is None:
                    base = read_base(state.model, instruction.base_params)
        except Exception as exc:
            log.exception("cannot prepare job %s round %d", job, round_)
            error = f"rank {self._rank}: {type(exc).__name__}: {exc}"
            # Rank 0 writes the marker: its own check decides whether the group declines.
            declined = isinstance(exc, TaskFilesDiffer)
        if self._refused(instruction, self._problems(error), declined=declined):
            return
        if replay:
            if self._rank == 0:
                self._republish(state, instruction)
            return
        if instruction.base_pending:
            # Every rank holds the same state, so every rank takes the same branch.
            if self._holds_previous_round(state, instruction):
                self._train_ahead(state, instruction)
                return
            # A restarted group, or another job in between: a serial round once θ is there.
            started = self._await_base(state, instruction)
            if started is None:
                return
            base, instruction = started
        # Then the collectives; every rank runs the same code on the same inputs, so a
        # deterministic failure (a task's optimizer, a checkpoint that does not fit) is
        # met by all of them at the same point.
        error, base_hash = None, ""
        try:
            parallel, optimizer = state.ready(self._device, self._control, self._timeout)
            (updating,) = self._agree(updates is not None)
            if updating and apply_updates(parallel, updates, self._control):
                base_hash = instruction.base_hash or ""  # made exactly: no read, no hash
            else:
                if updating and self._rank == 0:
                    base = read_base(state.model, instruction.base_params)
                parallel.load_full_state(None if base is None else base.state)
                base_hash = "" if base is None else base.hash  # hashed as it loaded: no read
        except Exception as exc:
            log.exception("cannot load job %s round %d", job, round_)
            error = f"rank {self._rank}: {type(exc).__name__}: {exc}"
        if self._refused(instruction, self._problems(error)):
            return
        del base  # rank 0's mapped θ: the model holds it now
        base_eval = self._evaluate_base(state, parallel, instruction)
        self._train(state, parallel, optimizer, instruction, base_hash, base_eval)

    def _train_ahead(self, state: WorkerJobState, instruction: RoundInstruction) -> None:
        """A delayed round trained ahead of θ from the round before's parameters, which
        every rank holds made already (no collective before the fold's)."""
        job, round_ = instruction.job, instruction.round
        error: str | None = None
        fold: DelayedFold | None = None
        # Made already: no collective.
        parallel, optimizer = state.ready(self._device, self._control, self._timeout)
        try:
            fold = DelayedFold(
                self._handoff,
                instruction,
                parallel,
                self._agree,
                evaluator(
                    state.task,
                    parallel,
                    state.training,
                    self._device,
                    data_shard(instruction, self._rank, self._world_size),
                    "θ",
                ),
                self._control,
            )
        except Exception as exc:  # the snapshot did not fit, say
            log.exception("cannot start job %s round %d ahead of θ", job, round_)
            error = f"rank {self._rank}: {type(exc).__name__}: {exc}"
        if self._refused(instruction, self._problems(error)) or fold is None:
            return
        if instruction.start == "eager" and not fold.begin(
            self._wants_stop, self._settings.poll_interval_s
        ):
            self._state = None  # as a dropped delayed round: resume from the checkpoint
            if fold.failure is not None and self._rank == 0:
                self._handoff.write_error(job, round_, fold.failure)
            return
        self._train(state, parallel, optimizer, instruction, "", None, fold)

    def _holds_previous_round(self, state: WorkerJobState, instruction: RoundInstruction) -> bool:
        """Whether this state's model holds the parameters it trained in the round before."""
        return state.parallel is not None and state.local_round == instruction.round - 1

    def _await_base(
        self, state: WorkerJobState, instruction: RoundInstruction
    ) -> tuple[BaseParams | None, RoundInstruction] | None:
        """Wait for θ of a delayed round the group cannot continue (a collective loop).

        Returns rank 0's θ (None on the other ranks) and the instruction to train
        serially from it; None when a stop or the agent's cancel came first, or θ could
        not be read (then the round's error marker says why).
        """
        job, round_ = instruction.job, instruction.round
        while True:
            ready: BaseReady | None = None
            cancelled = superseded = False
            if self._rank == 0:
                superseded = self._superseded(instruction)
                cancelled = self._handoff.cancel_requested(job, round_)
                try:
                    ready = None if cancelled else self._handoff.read_base_ready(job, round_)
                except Exception as exc:
                    self._handoff.write_error(job, round_, f"unreadable base-ready marker: {exc}")
                    cancelled = True
            stop, has, cancel, replaced = self._agree(
                self._wants_stop(), ready is not None, cancelled, superseded
            )
            if replaced:
                log.info("job %s round %d: the delayed round was replaced", job, round_)
                return None  # the serve loop takes the new instruction
            if cancel:
                if self._rank == 0 and self._handoff.read_error(job, round_) is None:
                    self._handoff.write_error(job, round_, "the delayed round was cancelled")
                return None
            if stop:
                return None
            if has:
                break
            time.sleep(self._settings.poll_interval_s)
        box: list[BaseReady | None] = [ready]
        dist.broadcast_object_list(box, src=0, group=self._control)
        marker = box[0]
        assert marker is not None
        error: str | None = None
        base: BaseParams | None = None
        if self._rank == 0:
            try:
                base = read_base(state.model, marker.base_params)
            except Exception as exc:
                error = f"rank 0: cannot read θ_{round_}: {type(exc).__name__}: {exc}"
            else:
                if base.hash != marker.base_hash:
                    error = f"θ at {marker.base_params} hashes {base.hash}, not {marker.base_hash}"
        if self._refused(instruction, self._problems(error)):
            return None
        log.info("job %s round %d: θ came; training from it", job, round_)
        return base, replace(
            instruction, base_params=marker.base_params, evaluate_base=marker.evaluate_base
        )

    def _superseded(self, instruction: RoundInstruction) -> bool:
        """Whether the agent rewrote (or dropped) this delayed round's instruction."""
        try:
            current = self._handoff.read_instruction(instruction.job, instruction.round)
        except (OSError, ValueError):
            return True
        return current != instruction

    def _evaluate_base(
        self, state: WorkerJobState, parallel: ParallelModel, instruction: RoundInstruction
    ) -> dict[str, float] | None:
        """θ_r's held-out metrics, when instructed; every rank takes part, rank 0's count."""
        if not instruction.evaluate_base:
            return None
        started = time.monotonic()
        try:
            shard = data_shard(instruction, self._rank, self._world_size)
            metrics = evaluate_base(state.task, parallel, state.training, self._device, shard)
        except Exception:
            # The round still trains; only the evaluation of θ_r is lost.
            log.exception("job %s: evaluating θ_%d failed", instruction.job, instruction.round)
            return None
        log.info(
            "job %s: θ_%d evaluated in %.2f s: %s",
            instruction.job,
            instruction.round,
            time.monotonic() - started,
            metrics,
        )
        return metrics

    def _refused(
        self, instruction: RoundInstruction, problems: list[str], *, declined: bool = False
    ) -> bool:
        """Whether any rank has ``problems``; rank 0's marker says which (``declined``: the
        group declines the round, the task's files differing here)."""
        if not problems:
            return False
        # Rebuild from the regional checkpoint next time: the state may be half made.
        self._state = None
        if self._rank == 0:
            self._handoff.write_error(
                instruction.job, instruction.round, "; ".join(problems), refused=declined
            )
        return True

    def _regional_state_dropped(self, instruction: RoundInstruction) -> bool:
        """Whether the agent discarded the job's regional state this rank still holds.

        The job's checkpoint is written with every round this state completed, so a
        state past the instructed round with no checkpoint of its job on disk was
        discarded (the agent follows a coordinator restored from an older backup, or the
        job ended and a job of the same name came): the round is trained afresh rather
        than refused as a replay. A state of another job is parked, not dropped.
        """
        state = self._state
        if state is None or state.job != instruction.job or state.last_round is None:
            return False
        if instruction.round > state.last_round:
            return False
        return not self._handoff.has_checkpoint(instruction.job)

    def _state_for(
        self,
        instruction: RoundInstruction,
        checkpoint: RegionalCheckpoint | None,
        checkpoint_error: str | None = None,
    ) -> WorkerJobState:
        """The job's state, kept from the last round or built from the job's own regional
        checkpoint (without collectives).

        Only one job's state is held: the one it replaces is already on disk as its
        checkpoint of its last completed round (a state that is not, a round cut short,
        was dropped when it was), so it is parked by letting it go.
        """
        held = self._state
        if held is not None and held.serves(instruction):
            return held
        if checkpoint_error is not None:
            raise ValueError(f"unreadable regional checkpoint: {checkpoint_error}")
        if held is not None:
            log.info(
                "job %s: parked at its regional checkpoint of round %s; serving job %s",
                held.job,
                held.last_round,
                instruction.job,
            )
        self._state = held = None  # freed before the next job's model is built
        if self._device.type == "cuda":
            # Give the parked job's parameters and optimizer state back now, cycles
            # included, rather than when the allocator happens to need them.
            gc.collect()
            torch.cuda.empty_cache()
        self._state = WorkerJobState.build(
            instruction, self._device, checkpoint, self._handoff.optimizer_path
        )
        return self._state

    def _republish(self, state: WorkerJobState, instruction: RoundInstruction) -> None:
        """Answer an instruction the regional state is already past."""
        job, round_ = instruction.job, instruction.round
        if state.last_round == round_ and self._handoff.has_result_file(job, round_):
            # Finished just before a crash that came before its done marker.
            self._handoff.write_done(self._handoff.read_result_file(job, round_).summary)
            log.info("job %s round %d: published the result found on disk", job, round_)
            return
        self._handoff.write_error(
            job,
            round_,
            f"round {round_} is not after the last completed round {state.last_round} "
            f"of job {job} and its result is gone",
        )

    def _train(
        self,
        state: WorkerJobState,
        parallel: ParallelModel,
        optimizer: torch.optim.Optimizer,
        instruction: RoundInstruction,
        base_hash: str,
        base_eval: dict[str, float] | None = None,
        fold: DelayedFold | None = None,
    ) -> None:
        """Train the round; a delayed round (``fold``) folds θ in on the way.

        A serial round resumes from its inner checkpoint when one of this very round is
        there, and keeps one when the group stops it mid-way
        (:mod:`regional_agent.worker.inner_checkpoint`).
        """
        identity = RoundIdentity(
            job=instruction.job,
            round=instruction.round,
            base_hash=base_hash,  # rank 0's; rank 0 alone decides
            instruction=instruction_digest(instruction),
            world_size=self._world_size,
            after_round=state.last_round,
            start_cursor=state.cursor,
        )
        trained = self._inner_loop(state, parallel, optimizer, instruction, identity, fold)
        if trained is None:
            return
        if fold is not None:
            base_hash, base_eval = fold.base_hash, fold.base_eval
        self._finish_round(
            state, parallel, optimizer, instruction, trained, base_hash, base_eval, fold
        )

    def _inner_loop(
        self,
        state: WorkerJobState,
        parallel: ParallelModel,
        optimizer: torch.optim.Optimizer,
        instruction: RoundInstruction,
        identity: RoundIdentity,
        fold: DelayedFold | None,
    ) -> TrainedRound | None:
        """The round's H steps, resumed where an inner checkpoint of it says; None when the
        round did not finish (refused, stopped, or its delayed fold failed: said where it
        must be)."""
        shard = data_shard(instruction, self._rank, self._world_size)
        torch.manual_seed(round_seed(instruction.seed, instruction.round, self._rank))
        steps = instruction.inner_steps
        first_step, carried = 0, None
        if fold is None:
            try:
                resumed = self._resume(identity, parallel, optimizer, instruction)
            except _ResumeFailed:
                return None
            if resumed is not None:
                first_step, carried = resumed
        batches = state.task.batches(
            shard, start_step=state.cursor + first_step * state.training.grad_accumulation
        )
        plan = RoundPlan(
            round=instruction.round,
            inner_steps=steps,
            # Only a constant schedule comes without the job's total, and ignores it.
            total_steps=instruction.total_steps or (instruction.round + 1) * steps,
            training=state.training,
            first_step=first_step,
        )
        stopped: list[tuple[int, RankTotals]] = []

        def on_stop(step: int, so_far: RankTotals) -> None:
            if fold is None:  # a delayed round's start is not θ: nothing to resume into
                stopped.append((step, so_far))

        started = time.monotonic()
        started_at = time.time()  # the wall clock: other processes' timelines compare to it
        progress_at = 0.0

        def should_stop(step: int) -> bool:
            nonlocal progress_at
            if (
                self._rank == 0
                and time.monotonic() - progress_at >= self._settings.progress_interval_s
            ):
                progress_at = time.monotonic()
                self._handoff.write_progress(
                    RoundProgress(instruction.job, instruction.round, step, instruction.inner_steps)
                )
            if fold is not None:
                return fold.between_steps(step, self._wants_stop())
            return self._agree(self._wants_stop())[0]

        totals = train_round(
            parallel,
            optimizer,
            state.task,
            batches,
            plan,
            should_stop,
            self._device,
            carried=carried,
            on_stop=on_stop,
        )
        finished_at = time.time()
        if (
            totals is not None
            and fold is not None
            and not fold.finish(steps, self._wants_stop, self._settings.poll_interval_s)
        ):
            totals = None
        if totals is None:
            log.info("job %s round %d: aborted", instruction.job, instruction.round)
            if stopped and stopped[0][0] > 0:
                keep_inner_state(
                    self._place, self._agree, identity, parallel, optimizer, steps, *stopped[0]
                )
            self._state = None  # part-way through a round; never reused
            if fold is not None and fold.failure is not None and self._rank == 0:
                self._handoff.write_error(instruction.job, instruction.round, fold.failure)
            return None
        return TrainedRound(totals, started, started_at, finished_at)

    def _finish_round(
        self,
        state: WorkerJobState,
        parallel: ParallelModel,
        optimizer: torch.optim.Optimizer,
        instruction: RoundInstruction,
        trained: TrainedRound,
        base_hash: str,
        base_eval: dict[str, float] | None,
        fold: DelayedFold | None,
    ) -> None:
        """The region's totals, the round's result (θ or its quantized delta), the regional
        checkpoint, and the done marker; a diverged or failed hand-over writes the round's
        error marker instead and drops the state."""
        totals = trained.totals
        region = torch.tensor([float(totals.tokens), totals.loss_sum], dtype=torch.float64)
        dist.all_reduce(region, group=self._control)
        region_tokens, region_loss = int(region[0].item()), float(region[1].item())
        mean_loss = region_loss / (totals.micro_batches * self._world_size)
        if not math.isfinite(mean_loss):
            # Keep the regional state of the previous round rather than a diverged one.
            self._state = None
            if self._rank == 0:
                self._handoff.write_error(
                    instruction.job, instruction.round, f"training diverged: mean loss {mean_loss}"
                )
            return
        stats = region_stats(
            totals,
            region_tokens,
            instruction.inner_steps,
            state.task.flops_per_token(state.model),
            self._device,
            self._control,
        )
        cursor = state.cursor + totals.micro_batches
        due = self._checkpoint_due(state, instruction)
        params, delta, failure, restored = self._hand_over(
            state, parallel, instruction, fold, due.residual
        )
        (failed,) = self._agree(failure is not None)
        if failed:
            self._state = None  # as a diverged round: resume from the last checkpoint
            if self._rank == 0:
                self._handoff.write_error(
                    instruction.job, instruction.round, failure or "rank 0 failed"
                )
            return
        # The optimizer state is saved sharded, every few rounds; the record rank 0
        # writes names the one saved last.
        if due.save:
            save_job_optimizer(
                self._place, state, parallel, optimizer, instruction.round, due.reason
            )
        if self._rank == 0:
            summary, checkpoint = round_records(
                instruction,
                state,
                trained,
                RegionTotals(region_tokens, mean_loss, cursor, stats),
                base_hash=base_hash,
                params_hash=delta.payloads_hash
                if delta is not None
                else parameters_vector_hash(params or {}),
                world_size=self._world_size,
                base_eval=base_eval,
                fold=fold,
            )
            publish_round(
                self._handoff, summary, params if delta is None else None, checkpoint, totals, delta
            )
        state.cursor, state.last_round = cursor, instruction.round
        state.local_round = instruction.round
        if restored:  # the model holds θ_round again, not what the round trained
            state.local_round = None
            state.keep_held_base(held_base(instruction, base_hash, self._rank))

    def _hand_over(
        self,
        state: WorkerJobState,
        parallel: ParallelModel,
        instruction: RoundInstruction,
        fold: DelayedFold | None,
        write_residual: bool,
    ) -> tuple[Mapping[str, torch.Tensor] | None, WrittenDelta | None, str | None, bool]:
        """What the round hands the agent: θ whole on rank 0, or the quantized delta an
        instruction's ``delta`` asks for; rank 0's failure, if any (a collective under
        FSDP: every rank takes part); and whether the model holds θ_round again (a serial
        round's delta puts it back, :mod:`regional_agent.worker.base_update`). The
        residual's tensors are written when ``write_residual`` (a checkpoint the
        coordinator asked for)."""
        request = instruction.delta
        if request is None:
            return parallel.full_state(), None, None, False  # rank 0 receives the whole
        base_path = (fold.base_path if fold is not None else "") or instruction.base_params
        serial = fold is None and instruction.overlap == "none"
        delta, failure, self._residual, restored = hand_over_delta(
            self._place,
            request,
            instruction,
            base_path,
            parallel,
            write_residual,
            self._residual,
            restore=serial,
        )
        return None, delta, failure, restored

    def _checkpoint_due(self, state: WorkerJobState, instruction: RoundInstruction) -> SaveDecision:
        """Whether this round saves the regional checkpoint (optimizer state, and the
        residual if asked): rank 0's cadence and the agent's ask decide for every rank."""
        rank0 = self._rank == 0
        asked = self._handoff.checkpoint_asked(instruction.job) if rank0 else None
        every = self._settings.regional_checkpoint_every
        decision = save_due(instruction.round, state.saved_optimizer_round, every, asked)
        due, residual = self._agree(rank0 and decision.save, rank0 and decision.residual)
        return SaveDecision(due, decision.reason, residual)

    def _park(self, state: WorkerJobState, why: str) -> None:
        """Park ``state`` (:func:`~regional_agent.worker.persistence.park_job`, a collective)
        after writing out the residual rank 0 holds."""
        self._residual = write_out_residual(self._place, self._residual)
        park_job(self._place, state, why)

    def _resume(
        self,
        identity: RoundIdentity,
        parallel: ParallelModel,
        optimizer: torch.optim.Optimizer,
        instruction: RoundInstruction,
    ) -> tuple[int, RankTotals] | None:
        """Load the round's inner checkpoint when it is of this very round (collectives).

        Returns the step to start at and this rank's totals before it; None to train the
        round from its start (no checkpoint, or one rank 0 discarded, saying why). Raises
        :class:`_ResumeFailed` when loading it failed: the round's error marker says why,
        and the file is gone, so the round is trained from its start when asked again.
        """
        found = load_for_resume(self._place, identity, parallel, optimizer, instruction.inner_steps)
        if found is None:
            return None
        problems = self._problems(found if isinstance(found, str) else None)
        if problems:
            if self._rank == 0:
                discard_inner_checkpoint(self._handoff.inner_checkpoint_path(identity.job))
            self._refused(instruction, problems)
            raise _ResumeFailed
        assert not isinstance(found, str)  # a failure on any rank is a problem of all
        return found
