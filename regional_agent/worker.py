"""One rank of a region's worker group: the process, and the round protocol it serves.

Run by a launcher as ``python -m regional_agent.worker --workdir DIR --backend B ...``
under torch's elastic launcher, which sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` and ``TORCHELASTIC_RESTART_COUNT``.

Rank 0 alone reads and writes the hand-off directory: it polls it for the newest pending
instruction and broadcasts it, reads the base θ and the regional checkpoint and broadcasts
them, and writes the results; the other ranks may run on nodes that share no filesystem
with the agent. Rank 0 is always on the head node (the agent's, :func:`is_head_node`):
the ranks renumber themselves head node first (:func:`head_first_ranks`).

Each round: every rank builds or keeps the job's state, rank 0 maps the base θ and
checks it, and the ranks agree that all is well before any collective
(:mod:`regional_agent.job_state`); then the model is wrapped for the job's parallelism
once (:mod:`regional_agent.parallelism`), rank 0's θ is broadcast into it, the ranks
evaluate it when instructed (:mod:`regional_agent.base_evaluation`, reported in the
summary's ``base_eval``), and every rank trains ``inner_steps`` optimizer steps from the
region's data cursor (:mod:`regional_agent.inner_loop`). Rank 0 receives the full fp32
parameters and the whole optimizer state and writes the result, the job's regional
checkpoint and, last, the done marker (see :mod:`regional_agent.handoff`). The inner
optimizer state persists across rounds; the parameters restart from the base each round. A
restarted group resumes from the regional checkpoint and redoes the current round, so a
crash costs at most that round's work and changes nothing in its result: the learning
rate is a function of the round and step, and the data of the cursor. A group stopped
mid-round (the agent's stop, a drain on a spot notice, SIGTERM) keeps the round's inner
state at the step it stopped before, and resumes that very round from it
(:mod:`regional_agent.inner_checkpoint`): only a crash loses steps.

Jobs that share the region share the group, one round at a time. The group holds only
the state of the job it last trained; the others are parked on disk as their own regional
checkpoints (written with every round, so parking costs nothing), and a job's next round
rebuilds its state from its checkpoint: optimizer state, data cursor and last round, so it
trains exactly as if no other job had run in between. The data shard is the instruction's
(``region_index`` of ``num_regions``: the region's place among the job's regions, never
among a round's participants), so leaving a region out of a round changes no other
region's data (:func:`data_shard`).

A delayed round (``overlap: delayed``, the instruction's ``base_pending``) goes on from
the parameters the group holds at the end of the round before and folds θ in when the
agent has it (:mod:`regional_agent.delayed_round`); a group that does not hold them (just
restarted, or another job in between: parked jobs keep no parameters) waits for θ and
trains the round serially. Under ``overlap: streaming`` the delta holds only the round's
fragment (the request's ``names``) and a speculative round folds in only the tensors its
``fold`` names; a serial round loads θ whole, as under ``delayed``.

Every idle poll and every training step starts with a tiny all-reduce (gloo, on the
CPU) of each rank's stop wish (stop file, SIGTERM/SIGINT/SIGHUP, launcher gone), so
all ranks stop at the same step and none is left waiting in a collective.

Exit codes: 0 stopped on request, 1 failed (the traceback is in the rank's log), 2 bad
arguments.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from types import FrameType

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore
from torch.distributed.rendezvous import rendezvous

from geofed.codec import QuantizedTensors
from geofed.params import federated_state, parameters_vector_hash
from geofed.task import DataShard
from geofed.training_config import is_sharded
from regional_agent.base_evaluation import evaluate_base
from regional_agent.delayed_round import DelayedFold, evaluator
from regional_agent.device_delta import DeviceResidual, RoundDeltaQuantizer, payloads_hash
from regional_agent.handoff import (
    BaseReady,
    DeltaRequest,
    HandoffDir,
    RankStatus,
    RegionalCheckpoint,
    RoundInstruction,
    RoundProgress,
    RoundSummary,
)
from regional_agent.inner_checkpoint import (
    InnerCheckpoint,
    InvalidInnerCheckpoint,
    RankInner,
    RoundIdentity,
    discard_inner_checkpoint,
    instruction_digest,
    load_inner_tensors,
    read_inner_checkpoint,
    resume_verdict,
    save_inner_tensors,
    write_inner_checkpoint,
)
from regional_agent.inner_loop import RankTotals, RoundPlan, region_stats, train_round
from regional_agent.job_state import BaseParams, WorkerJobState, read_base
from regional_agent.launch_spec import head_first_ranks, is_head_node
from regional_agent.launcher import LAUNCH_ID_ENV, WorkerSettings
from regional_agent.optimizer_checkpoint import save_due, save_optimizer
from regional_agent.parallelism import ParallelModel
from regional_agent.residual_file import write_residual

log = logging.getLogger("regional_agent.worker")


class StopSignals:
    """Turns termination signals and the loss of the launcher into a stop wish."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._parent = os.getppid()

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        del frame
        self.signal = signum

    def reason(self) -> str | None:
        if self.signal is not None:
            return f"received {signal.Signals(self.signal).name}"
        if os.getppid() != self._parent:
            return "the launcher exited"
        return None


def data_shard(instruction: RoundInstruction, rank: int, world_size: int) -> DataShard:
    """The data ``rank`` of ``world_size`` reads for ``instruction``: fixed by the job's
    assignment (the region's place among the job's regions) and the job's seed."""
    return DataShard(
        region=instruction.region,
        region_index=instruction.region_index,
        num_regions=instruction.num_regions,
        rank=rank,
        world_size=world_size,
        seed=instruction.seed,
        datasets=dict(instruction.datasets),
    )


def round_seed(seed: int, round_: int, rank: int) -> int:
    """The torch seed of ``rank`` in round ``round_``: dropout etc. replay after a restart."""
    digest = hashlib.sha256(f"geofed-round/{seed}/{round_}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


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
        # Rank 0: the residual its last quantized delta left, on its device.
        self._residual: DeviceResidual | None = None
        # Control messages (stop votes, instructions, errors) travel over gloo on the CPU,
        # so checking for a stop every step never synchronises a GPU stream.
        # An explicit timeout: a group made without one waits torch's default 30 minutes.
        self._control = (
            dist.new_group(backend="gloo", timeout=timedelta(seconds=settings.collective_timeout_s))
            if device.type == "cuda"
            else None
        )

    def serve(self) -> None:
        if self._rank == 0:
            self._migrate_legacy_checkpoint()
        while True:
            pending = self._handoff.pending_instruction() if self._rank == 0 else None
            stop, has_work = self._agree(self._wants_stop(), pending is not None)
            if stop:
                log.info("stopping: %s", self._stop_reason() or "asked by another rank")
                if self._state is not None:
                    self._park(self._state, "the group stops")
                self._write_out_residual()
                return
            if not has_work:
                time.sleep(self._settings.poll_interval_s)
                continue
            instruction = self._broadcast_instruction(pending)
            if instruction is not None:
                self._serve(instruction)

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
        checkpoint: RegionalCheckpoint | None = None
        checkpoint_error: str | None = None
        if held is None or not held.serves(instruction):
            if held is not None:
                self._park(held, f"job {job} is next")
            checkpoint, checkpoint_error = self._shared_checkpoint(job)
        # First what each rank does alone, so that a failure is agreed on before any rank
        # enters a collective its peers would never join.
        try:
            state = self._state_for(instruction, checkpoint, checkpoint_error)
            replay = state.last_round is not None and round_ <= state.last_round
            if not replay and self._rank == 0 and not instruction.base_pending:
                base = read_base(state.model, instruction.base_params)
        except Exception as exc:
            log.exception("cannot prepare job %s round %d", job, round_)
            error = f"rank {self._rank}: {type(exc).__name__}: {exc}"
        if self._refused(instruction, self._problems(error)):
            return
        if replay:
            if self._rank == 0:
                self._republish(state, instruction)
            return
        fold: DelayedFold | None = None
        if instruction.base_pending:
            # Every rank holds the same state, so every rank takes the same branch.
            if self._holds_previous_round(state, instruction):
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
                return
            # A restarted group, or another job in between: a serial round once θ is there.
            started = self._await_base(state, instruction)
            if started is None:
                return
            base, instruction = started
        # Then the collectives; every rank runs the same code on the same inputs, so a
        # deterministic failure (a task's optimizer, a checkpoint that does not fit) is
        # met by all of them at the same point.
        error = None
        try:
            parallel, optimizer = state.ready(self._device, self._control, self._timeout)
            parallel.load_full_state(None if base is None else base.state)
        except Exception as exc:
            log.exception("cannot load job %s round %d", job, round_)
            error = f"rank {self._rank}: {type(exc).__name__}: {exc}"
        if self._refused(instruction, self._problems(error)):
            return
        base_hash = "" if base is None else base.hash
        del base  # rank 0's mapped θ: the model holds it now
        base_eval = self._evaluate_base(state, parallel, instruction)
        self._train(state, parallel, optimizer, instruction, base_hash, base_eval)

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

    def _refused(self, instruction: RoundInstruction, problems: list[str]) -> bool:
        if not problems:
            return False
        # Rebuild from the regional checkpoint next time: the state may be half made.
        self._state = None
        if self._rank == 0:
            self._handoff.write_error(instruction.job, instruction.round, "; ".join(problems))
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

    def _shared_checkpoint(self, job: str) -> tuple[RegionalCheckpoint | None, str | None]:
        """The job's regional checkpoint as rank 0 read it, and rank 0's error (a collective).

        Only rank 0 reads the hand-off directory: the other ranks may run on nodes that
        do not share its filesystem. Under FSDP only rank 0's optimizer state is loaded
        (:meth:`ParallelModel.load_optimizer_state`), so the others get it empty.
        """
        box: list[tuple[RegionalCheckpoint | None, str | None] | None] = [None]
        checkpoint: RegionalCheckpoint | None = None
        if self._rank == 0:
            error: str | None = None
            try:
                checkpoint = self._handoff.read_checkpoint(job)
            except Exception as exc:
                log.exception("cannot read the regional checkpoint of job %s", job)
                error = f"{type(exc).__name__}: {exc}"
            sent = checkpoint
            if sent is not None and is_sharded(sent.parallelism) and sent.optimizer_state:
                sent = replace(sent, optimizer_state={})
            box[0] = (sent, error)
        dist.broadcast_object_list(box, src=0, group=self._control)
        assert box[0] is not None
        received, error = box[0]
        return (checkpoint if self._rank == 0 else received), error

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
        (:mod:`regional_agent.inner_checkpoint`).
        """
        shard = data_shard(instruction, self._rank, self._world_size)
        torch.manual_seed(round_seed(instruction.seed, instruction.round, self._rank))
        steps = instruction.inner_steps
        identity = RoundIdentity(
            job=instruction.job,
            round=instruction.round,
            base_hash=base_hash,  # rank 0's; rank 0 alone decides
            instruction=instruction_digest(instruction),
            world_size=self._world_size,
            after_round=state.last_round,
            start_cursor=state.cursor,
        )
        first_step, carried = 0, None
        if fold is None:
            try:
                resumed = self._resume(identity, parallel, optimizer, instruction)
            except _ResumeFailed:
                return
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
                self._keep_inner_state(identity, parallel, optimizer, steps, *stopped[0])
            self._state = None  # part-way through a round; never reused
            if fold is not None and fold.failure is not None and self._rank == 0:
                self._handoff.write_error(instruction.job, instruction.round, fold.failure)
            return
        if fold is not None:
            base_hash, base_eval = fold.base_hash, fold.base_eval
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
        # Collectives under FSDP: every rank takes part.
        request = instruction.delta
        params: Mapping[str, torch.Tensor] | None = None
        delta: QuantizedTensors | None = None
        failure: str | None = None
        if request is None:
            params = parallel.full_state()  # rank 0 receives the whole
        else:
            base_path = (fold.base_path if fold is not None else "") or instruction.base_params
            # The residual's tensors are written with the regional checkpoint: the same
            # cadence, decided before this round's save below.
            checkpoint_round = save_due(
                instruction.round,
                state.saved_optimizer_round,
                self._settings.regional_checkpoint_every,
            ).save
            delta, failure = self._quantize(
                request, instruction, base_path, parallel, checkpoint_round
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
        self._save_optimizer_if_due(state, parallel, optimizer, instruction.round)
        if self._rank == 0:
            summary = RoundSummary(
                job=instruction.job,
                round=instruction.round,
                steps=instruction.inner_steps,
                tokens=region_tokens,
                mean_loss=mean_loss,
                cursor=cursor,
                base_params_hash=base_hash,
                params_hash=payloads_hash(delta)
                if delta is not None
                else parameters_vector_hash(params or {}),
                world_size=self._world_size,
                train_seconds=time.monotonic() - started,
                base_eval=base_eval,
                stats=stats,
                train_started_at=started_at,
                train_finished_at=finished_at,
                base_wait_seconds=None if fold is None else fold.wait_seconds,
                base_folded_at_step=None if fold is None else fold.folded_at_step,
            )
            checkpoint = RegionalCheckpoint(
                job=instruction.job,
                last_round=instruction.round,
                cursor=cursor,
                world_size=self._world_size,
                parallelism=state.training.parallelism,
                optimizer_round=state.saved_optimizer_round,
            )
            self._publish(summary, params if delta is None else None, checkpoint, totals, delta)
        state.cursor, state.last_round = cursor, instruction.round
        state.local_round = instruction.round

    def _save_optimizer_if_due(
        self,
        state: WorkerJobState,
        parallel: ParallelModel,
        optimizer: torch.optim.Optimizer,
        round_: int,
    ) -> None:
        """Save the optimizer state of ``round_`` when rank 0's cadence says so (a
        collective; only rank 0's settings count, so every rank decides alike)."""
        decision = save_due(
            round_, state.saved_optimizer_round, self._settings.regional_checkpoint_every
        )
        (due,) = self._agree(self._rank == 0 and decision.save)
        if due:
            self._save_optimizer(state, parallel, optimizer, round_, decision.reason)

    def _save_optimizer(
        self,
        state: WorkerJobState,
        parallel: ParallelModel,
        optimizer: torch.optim.Optimizer,
        round_: int,
        why: str,
    ) -> bool:
        """Save ``state``'s optimizer state as of the end of ``round_``, every rank its
        part (a collective); False when it failed (on every rank: the checkpoint named so
        far stays)."""
        started = time.monotonic()
        try:
            # Every other round's directory (an unnamed, unfinished one) goes first; the
            # one the record names stays until a newer one is named.
            self._handoff.remove_optimizer_states(state.job, (state.saved_optimizer_round, round_))
            save_optimizer(
                parallel.model,
                optimizer,
                self._handoff.optimizer_path(state.job, round_),
                self._control,
                replicated=not is_sharded(parallel.kind),
            )
        except Exception:
            log.exception(
                "job %s: cannot save the inner optimizer state of round %d", state.job, round_
            )
            return False
        state.saved_optimizer_round = round_
        log.info(
            "job %s: inner optimizer state of round %d saved in %.2f s (%s)",
            state.job,
            round_,
            time.monotonic() - started,
            why,
        )
        return True

    def _write_out_residual(self) -> None:
        """Rank 0: write the residual it holds to its job's held file, unless its tensors
        are in a file already, so that the residual outlives this process."""
        kept = self._residual
        if self._rank != 0 or kept is None or kept.written:
            return
        path = self._handoff.held_residual_path(kept.job)
        try:
            write_residual(path, kept.round, kept.tensors, id_=kept.id)
        except Exception:
            log.exception("job %s: cannot write out the error-feedback residual", kept.job)
            return
        self._residual = replace(kept, written=True)
        log.info("job %s: wrote out the residual of round %d to %s", kept.job, kept.round, path)

    def _park(self, state: WorkerJobState, why: str) -> None:
        """Save ``state``'s optimizer state if its checkpoint holds an older one, and name
        it in the record (a collective), and write out the residual rank 0 holds: a parked
        or stopped job loses nothing."""
        self._write_out_residual()
        parallel, optimizer = state.parallel, state.optimizer
        round_ = state.last_round
        if parallel is None or optimizer is None or round_ is None:
            return
        if state.saved_optimizer_round == round_:
            return
        if not self._save_optimizer(state, parallel, optimizer, round_, why):
            return
        if self._rank == 0:
            try:
                self._handoff.write_checkpoint(
                    RegionalCheckpoint(
                        job=state.job,
                        last_round=round_,
                        cursor=state.cursor,
                        world_size=self._world_size,
                        parallelism=state.training.parallelism,
                        optimizer_round=round_,
                    )
                )
            except OSError:
                log.exception("job %s: cannot write the regional checkpoint", state.job)

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
        box: list[tuple[int, tuple[RankInner, ...]] | None] = [None]
        path = self._handoff.inner_checkpoint_path(identity.job)
        if self._rank == 0:
            checkpoint = self._inner_checkpoint(identity, instruction.inner_steps)
            if checkpoint is not None:
                box[0] = (checkpoint.step, checkpoint.ranks)
        dist.broadcast_object_list(box, src=0, group=self._control)
        if box[0] is None:
            return None
        step, ranks = box[0]
        mine = ranks[self._rank]
        error: str | None = None
        try:
            # Every rank reads its own shards: nothing passes through rank 0.
            load_inner_tensors(
                parallel.model,
                optimizer,
                path,
                self._control,
                replicated=not is_sharded(parallel.kind),
            )
            torch.set_rng_state(mine.cpu_rng)
            if self._device.type == "cuda" and mine.cuda_rng is not None:
                torch.cuda.set_rng_state(mine.cuda_rng, self._device)
        except Exception as exc:
            log.exception("cannot resume job %s round %d", identity.job, identity.round)
            error = f"rank {self._rank}: cannot resume from the inner checkpoint: {exc}"
        problems = self._problems(error)
        if problems:
            if self._rank == 0:
                discard_inner_checkpoint(path)
            self._refused(instruction, problems)
            raise _ResumeFailed
        return step, mine.totals

    def _inner_checkpoint(
        self, identity: RoundIdentity, inner_steps: int
    ) -> InnerCheckpoint | None:
        """The job's inner checkpoint if it resumes this round; else discarded (rank 0)."""
        path = self._handoff.inner_checkpoint_path(identity.job)
        where = f"job {identity.job} round {identity.round}"
        try:
            checkpoint = read_inner_checkpoint(path)
        except (InvalidInnerCheckpoint, OSError) as exc:
            log.warning("%s: discarding the inner checkpoint: %s", where, exc)
            discard_inner_checkpoint(path)
            return None
        if checkpoint is None:
            return None
        verdict = resume_verdict(checkpoint.identity, checkpoint.step, inner_steps, identity)
        if verdict.step is None:
            log.warning("%s", verdict.reason)
            discard_inner_checkpoint(path)
            return None
        log.info("%s", verdict.reason)
        return checkpoint

    def _keep_inner_state(
        self,
        identity: RoundIdentity,
        parallel: ParallelModel,
        optimizer: torch.optim.Optimizer,
        inner_steps: int,
        step: int,
        so_far: RankTotals,
    ) -> None:
        """Keep the state of a round stopped before ``step`` for the restart (collectives:
        every rank saves its shards, then rank 0 writes the file that names them)."""
        mine = RankInner(
            cpu_rng=torch.get_rng_state(),
            cuda_rng=torch.cuda.get_rng_state(self._device)
            if self._device.type == "cuda"
            else None,
            totals=so_far,
        )
        ranks: list[RankInner | None] = [None] * self._world_size
        dist.all_gather_object(ranks, mine, group=self._control)
        path = self._handoff.inner_checkpoint_path(identity.job)
        if self._rank == 0:
            discard_inner_checkpoint(path)  # a stale one of another round, a killed write's
        self._agree(False)  # nobody writes before the stale files are gone
        try:
            save_inner_tensors(
                parallel.model,
                optimizer,
                path,
                self._control,
                replicated=not is_sharded(parallel.kind),
            )
            if self._rank == 0:
                write_inner_checkpoint(
                    path,
                    InnerCheckpoint(
                        identity=identity,
                        step=step,
                        inner_steps=inner_steps,
                        ranks=tuple(r for r in ranks if r is not None),
                    ),
                )
        except Exception:
            # The round is then trained from its start next time, as without one.
            log.exception(
                "job %s round %d: cannot keep the inner state", identity.job, identity.round
            )
            return
        if self._rank == 0:
            log.info(
                "job %s round %d: stopped before step %d of %d; kept the inner state in %s",
                identity.job,
                identity.round,
                step,
                inner_steps,
                path,
            )

    def _quantize(
        self,
        request: DeltaRequest,
        instruction: RoundInstruction,
        base_path: str,
        parallel: ParallelModel,
        write_tensors: bool,
    ) -> tuple[QuantizedTensors | None, str | None]:
        """The round's quantized delta, quantized by rank 0 tensor by tensor as each comes:
        from the replica's own tensors under DDP, all-gathered one at a time from the
        shards under FSDP/HSDP (collectives: every rank gathers every tensor, whatever rank
        0 met, so none is left waiting). Rank 0's delta, or why it has none.
        ``write_tensors``: the residual's tensors go to the round's residual file (a round
        that saves the regional checkpoint); otherwise only rank 0 holds them."""
        started = time.monotonic()
        shapes = {name: t.shape for name, t in federated_state(parallel.model).items()}
        names = tuple(shapes) if request.names is None else request.names
        quantizer: RoundDeltaQuantizer | None = None
        failure: str | None = None
        delta: QuantizedTensors | None = None
        where = f"job {instruction.job} round {instruction.round}"
        if self._rank == 0:
            try:
                quantizer = RoundDeltaQuantizer(
                    request,
                    job=instruction.job,
                    round_=instruction.round,
                    region=instruction.region,
                    base_path=base_path,
                    shapes=shapes,
                    device=self._device,
                    kept=self._residual,
                    held_path=self._handoff.held_residual_path(instruction.job),
                )
            except Exception as exc:
                log.exception("%s: cannot quantize the delta", where)
                failure = f"cannot hand over the delta: {type(exc).__name__}: {exc}"
        for name, whole in parallel.gathered([n for n in names if n in shapes]):
            if quantizer is not None and failure is None:
                try:
                    quantizer.add(name, whole)
                except Exception as exc:
                    log.exception("%s: cannot quantize the delta", where)
                    failure = f"cannot hand over the delta: {type(exc).__name__}: {exc}"
            del whole
        if quantizer is not None and failure is None:
            try:
                delta, self._residual = quantizer.finish(
                    self._handoff.residual_path(instruction.job, instruction.round),
                    write_tensors=write_tensors,
                )
            except Exception as exc:
                log.exception("%s: cannot quantize the delta", where)
                failure = f"cannot hand over the delta: {type(exc).__name__}: {exc}"
        if delta is not None:
            log.info(
                "%s: delta quantized on %s, tensor by tensor (%s, %.1f MB) in %.3f s",
                where,
                self._device,
                request.codec.scheme,
                sum(p.numel() for p in delta.payloads) / 1e6,
                time.monotonic() - started,
            )
        return delta, failure

    def _publish(
        self,
        summary: RoundSummary,
        params: Mapping[str, torch.Tensor] | None,
        checkpoint: RegionalCheckpoint,
        totals: RankTotals,
        delta: QuantizedTensors | None = None,
    ) -> None:
        # Order matters: result (its residual file before it), then checkpoint, then the
        # marker that publishes both.
        self._handoff.write_result(summary, params, delta)
        self._handoff.write_checkpoint(checkpoint)
        self._handoff.write_done(summary)
        # The round's result is out: a stop before this round's end is no longer resumed.
        discard_inner_checkpoint(self._handoff.inner_checkpoint_path(summary.job))
        log.info(
            "job %s round %d: %d steps, %d tokens, mean loss %.4f, lr %.3g, grad norm %.3g, "
            "params %s",
            summary.job,
            summary.round,
            summary.steps,
            summary.tokens,
            summary.mean_loss,
            totals.last_lr,
            totals.last_grad_norm,
            summary.params_hash,
        )


def _join(backend: str, head: bool, timeout: timedelta, device: torch.device) -> tuple[int, int]:
    """Join the process group with the head node's ranks first; return (rank, world size).

    Every rank publishes whether it is on the head node in the launcher's store
    (``MASTER_ADDR``/``MASTER_PORT``, the ``env://`` rendezvous), then all take their
    renumbered rank in a process group over that same store.
    """
    # A store of this attempt's own (the launcher disables sharing the rendezvous
    # store), so no key of an earlier attempt is read.
    store, launcher_rank, world_size = next(rendezvous("env://", timeout=timeout))
    store.set(f"geofed/head/{launcher_rank}", "1" if head else "0")
    keys = [f"geofed/head/{r}" for r in range(world_size)]
    store.wait(keys, timeout)
    heads = [store.get(key) == b"1" for key in keys]
    rank = head_first_ranks(heads)[launcher_rank]
    dist.init_process_group(
        backend,
        store=PrefixStore("geofed/pg", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    return rank, world_size


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise SystemExit(f"worker: {name} is not set; run under torch.distributed.run")
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"worker: {name}={raw!r} is not an integer") from None


def _redirect_output(path: os.PathLike[str] | str) -> None:
    """Send this process's stdout and stderr (C++ messages included) to its rank log."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _device(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _warm_up() -> None:
    """Pay one-time lazy imports now, at start-up, rather than in the first round.

    Building the first optimizer imports torch._dynamo, which takes seconds.
    """
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])


def _report_ready(handoff: HandoffDir, status: RankStatus) -> None:
    """Every rank records its own status; rank 0 also writes every rank's into the
    hand-off directory, where the agent counts them, stamped with its launch (a collective)."""
    handoff.write_rank_status(status)
    statuses: list[RankStatus | None] = [None] * status.world_size
    dist.all_gather_object(statuses, status)
    if status.rank != 0:
        return
    for other in statuses:
        if other is not None and other.rank != 0:
            handoff.write_rank_status(replace(other, launch_id=status.launch_id))


def main(argv: Sequence[str] | None = None) -> int:
    """Run one rank until a stop is requested; return the process exit code."""
    settings = WorkerSettings.from_argv(argv)
    _env_int("RANK")  # fail early outside the elastic launcher
    local_rank = _env_int("LOCAL_RANK")
    restart_count = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    launch_id = os.environ.get(LAUNCH_ID_ENV, "")
    torch.set_num_threads(settings.num_threads)
    device = _device(settings.backend, local_rank)
    timeout = timedelta(seconds=settings.collective_timeout_s)
    # The rank is known only once joined; until then output goes to the launcher's log.
    rank, world_size = _join(settings.backend, is_head_node(os.environ), timeout, device)
    # On the head node this is the hand-off directory; on the others a node-local
    # directory of the same path, for this rank's log and status only.
    handoff = HandoffDir(settings.workdir)
    handoff.log_dir.mkdir(parents=True, exist_ok=True)
    _redirect_output(handoff.rank_log_path(rank))
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    log.info(
        "worker pid %d rank %d/%d launch %s restart %d",
        os.getpid(),
        rank,
        world_size,
        launch_id,
        restart_count,
    )
    stop = StopSignals()
    stop.install()
    status = RankStatus(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        pid=os.getpid(),
        launch_id=launch_id,
        restart_count=restart_count,
        backend=settings.backend,
        device=str(device),
        state="starting",
    )
    handoff.write_rank_status(status)
    _warm_up()
    _report_ready(handoff, replace(status, state="ready"))
    try:
        RoundRunner(handoff, settings, device, stop.reason).serve()
    except Exception:
        log.exception("worker failed")
        return 1
    # Every rank reaches the teardown before any leaves: FSDP's groups abort the
    # process when torn down under a peer that is still using them.
    dist.barrier()
    dist.destroy_process_group()
    log.info("worker stopped cleanly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
