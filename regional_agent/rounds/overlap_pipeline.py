"""The agent's side of delayed rounds (``overlap: delayed``, :mod:`regional_agent.handoff.overlap`).

:meth:`DelayedRounds.speculate`: the moment round r's result is read, before its delta is
encoded, the agent writes round r+1's instruction with ``base_pending``: the workers go
on from their own parameters and will find θ_{r+1} at the file the instruction names
(where the agent stores θ_{r+1} once synced).

:meth:`DelayedRounds.train`: when round r+1 is announced and θ_{r+1} synced, the
speculative round is used if it trains exactly what the announcement asks (same
participants, settings, θ file; no resync): the agent writes the base-ready marker (θ's
path, hash, and whether to evaluate it) and waits for the round's done marker. The delta
is then formed against θ_{r+1} as in a serial round; the coordinator sees no difference.

Under ``overlap_start: eager`` :meth:`DelayedRounds.speculate` then computes S, the
estimate the workers start round r+1 from, in a thread, and hands it over
(:mod:`regional_agent.rounds.eager_start`); the workers wait for it before their first step.

Under ``overlap: streaming`` the same, fragment by fragment: round r+1's instruction
names its own fragment in its delta request and folds in only round r's (``fold``), the
tensors θ_{r+1} changed in; :meth:`DelayedRounds.train` uses it only if both are the
ones the announced round's θ gives.

Otherwise the speculative round is cancelled (a cancel file the workers check between
steps; they answer with the round's error marker and drop its steps) and the announced
round is trained serially from θ, with the optimizer state and data cursor of the
regional checkpoint. :meth:`DelayedRounds.announced` asks for the cancel as soon as an
announcement ends the speculative round (a pause, the job's end, a round skipped, a region
left out); :meth:`DelayedRounds.settle`, before any round runs, makes sure no
speculative round is left that the round about to run cannot use.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from geofed.control import RoundAnnouncement
from geofed.timeouts import wait_for
from regional_agent.handoff.messages import BaseReady, RoundInstruction, RoundResult
from regional_agent.handoff.overlap import (
    keeps_speculation,
    next_instruction,
    speculate_next,
    speculation_unusable,
)
from regional_agent.launch.worker_group import WorkerGroup
from regional_agent.rounds.eager_start import hand_start
from regional_agent.state import JobDirectory

log = logging.getLogger(__name__)

#: How often a cancel checks whether the workers dropped the speculative round.
_POLL_S = 0.05


class DelayedRounds:
    """Speculative rounds of one worker group (see the module docstring)."""

    def __init__(self, workers: WorkerGroup, region: str, timeout_s: float) -> None:
        self._workers = workers
        self._region = region
        self._timeout_s = timeout_s

    async def speculate(
        self,
        announcement: RoundAnnouncement,
        trained: RoundInstruction,
        promised: Path,
        *,
        result: RoundResult | None = None,
        job: JobDirectory | None = None,
        names: tuple[str, ...] | None = None,
    ) -> None:
        """Start round ``trained.round + 1`` now, if the job overlaps and has one more;
        from the eager estimate when the job asks for it (and ``result`` and ``job`` say
        what it is made from). ``names``: the next round's fragment (``streaming``)."""
        if not speculate_next(announcement.overlap, trained.round, announcement.total_rounds):
            return
        outer = announcement.outer_optimizer
        eager_job = announcement.overlap == "delayed" and announcement.overlap_start == "eager"
        if not eager_job or outer is None or job is None:
            result = None
        eager = result is not None
        handoff = self._workers.handoff
        next_round = trained.round + 1
        path = handoff.instruction_path(trained.job, next_round)
        if await asyncio.to_thread(path.exists):
            # Written before a restart of the agent, or already answered; an eager round
            # whose S never came still needs it.
            waiting = await asyncio.to_thread(self._awaits_start, trained.job, next_round)
            if not (eager and waiting):
                return
        else:
            spec = next_instruction(
                trained, str(promised), "eager" if eager else "local", names=names
            )
            await asyncio.to_thread(handoff.write_instruction, spec)
            log.info("job %s: round %d started ahead of θ_%d", spec.job, spec.round, spec.round)
        if result is not None and outer is not None and job is not None:
            await asyncio.to_thread(
                hand_start,
                job,
                handoff,
                outer,
                trained.round,
                trained.base_params,
                result.summary.base_params_hash,
                result.params,
                len(announcement.participants),
                result.delta,
            )

    async def train(
        self, wanted: RoundInstruction, base_hash: str, fold: tuple[str, ...] | None = None
    ) -> RoundResult | None:
        """The result of the speculative round that stands for ``wanted``, or None: train
        ``wanted`` serially (any other speculative round is cancelled first). ``fold``:
        the tensors θ changed in since the round before (``streaming``; None: all)."""
        handoff = self._workers.handoff
        job, round_ = wanted.job, wanted.round
        spec = await self._speculative(job, round_)
        if spec is None:
            await self.cancel_pending("a serial round is about to start")
            # A cancel an announcement asked for, answered by now: no longer needed.
            await asyncio.to_thread(handoff.clear_cancel, job, round_)
            return None
        done = await asyncio.to_thread(handoff.read_completed, job, round_)
        if done is not None:
            return done
        reason = speculation_unusable(spec, wanted, resync=False, fold=fold)
        if reason is not None:
            await self._cancel(job, round_, reason)
            return None
        ready = BaseReady(job, round_, wanted.base_params, base_hash, wanted.evaluate_base)
        await asyncio.to_thread(handoff.write_base_ready, ready)
        result = await self._workers.collect_round(job, round_, self._timeout_s)
        summary = result.summary
        if summary.base_folded_at_step is None:
            log.info("job %s round %d: the workers trained it from θ (restarted)", job, round_)
            return result
        log.info(
            "job %s round %d: trained ahead of θ (started at %s, θ folded in before step %s "
            "of %d, %.3f s waited for it)",
            job,
            round_,
            summary.train_started_at,
            summary.base_folded_at_step,
            summary.steps,
            summary.base_wait_seconds or 0.0,
        )
        return result

    async def settle(self, announcement: RoundAnnouncement, *, resync: bool, spooled: bool) -> None:
        """Before the announced round runs: cancel a speculative round it cannot use.

        Kept: the announced round's own (decided by :meth:`train`), and the next one's
        while the announced round's delta is still to be delivered (``spooled``).
        """
        pending = await self._pending_speculation()
        if pending is None:
            return
        job, round_ = pending
        if job == announcement.job and not resync:
            if round_ == announcement.round:
                return
            if round_ == announcement.round + 1 and spooled:
                return
        reason = "resync" if resync else f"round {announcement.round} of {announcement.job} runs"
        await self._cancel(job, round_, reason)

    async def cancel_pending(self, reason: str) -> None:
        """Cancel whatever speculative round the workers hold, and wait for them to drop it."""
        pending = await self._pending_speculation()
        if pending is not None:
            await self._cancel(*pending, reason)

    async def announced(self, announcement: RoundAnnouncement) -> None:
        """Ask for the cancel of the job's speculative round if the announcement ends it
        (without waiting: the next round to run waits, in :meth:`settle`)."""
        pending = await self._pending_speculation()
        if pending is None or pending[0] != announcement.job:
            return
        reason = keeps_speculation(
            pending[1],
            announcement.round,
            announcement.state,
            self._region in announcement.participants,
        )
        if reason is not None:
            log.info("job %s: dropping the speculative round %d: %s", *pending, reason)
            await asyncio.to_thread(self._workers.handoff.request_cancel, *pending)

    # -- internals -----------------------------------------------------------------------

    def _awaits_start(self, job: str, round_: int) -> bool:
        """Whether round ``round_``'s eager instruction is still waiting for its S."""
        handoff = self._workers.handoff
        try:
            spec = handoff.read_instruction(job, round_)
        except (FileNotFoundError, ValueError):
            return False
        return (
            spec.start == "eager"
            and handoff.read_start_ready(job, round_) is None
            and handoff.read_done(job, round_) is None
            and handoff.read_error(job, round_) is None
        )

    async def _speculative(self, job: str, round_: int) -> RoundInstruction | None:
        """Round ``round_``'s instruction if it is a speculative one still in play."""
        handoff = self._workers.handoff

        def read() -> RoundInstruction | None:
            try:
                spec = handoff.read_instruction(job, round_)
            except FileNotFoundError:
                return None
            if not spec.base_pending:
                return None
            if handoff.read_error(job, round_) is not None or handoff.cancel_requested(job, round_):
                return None  # failed or cancelled: the round is trained serially
            return spec

        return await asyncio.to_thread(read)

    async def _pending_speculation(self) -> tuple[str, int] | None:
        handoff = self._workers.handoff

        def find() -> tuple[str, int] | None:
            pending = handoff.pending_instruction()
            if pending is None:
                return None
            try:
                spec = handoff.read_instruction(*pending)
            except (FileNotFoundError, ValueError):
                return None
            return pending if spec.base_pending else None

        return await asyncio.to_thread(find)

    async def _cancel(self, job: str, round_: int, reason: str) -> None:
        """Cancel round ``round_``'s speculation and wait until the workers answered it."""
        handoff = self._workers.handoff
        log.info("job %s: dropping the speculative round %d: %s", job, round_, reason)
        await asyncio.to_thread(handoff.request_cancel, job, round_)

        def answered() -> bool:
            return (
                handoff.read_done(job, round_) is not None
                or handoff.read_error(job, round_) is not None
            )

        async def until_answered() -> None:
            # Files, not an event: the answer comes from another process.
            answer = False
            while not answer:
                await asyncio.sleep(_POLL_S)
                answer = await asyncio.to_thread(answered)

        await wait_for(until_answered(), self._timeout_s, f"the cancel of round {round_} of {job}")
        await asyncio.to_thread(handoff.clear_cancel, job, round_)
