"""One round, start to finish (protocol steps 2-6): sync, train, encode, check, upload.

:meth:`RoundPipeline.run` takes a round announcement and returns how the round ended
for this region (:class:`RoundEnd`): ``accepted``, ``straggler`` (the round closed
first), ``refused`` (by the coordinator, or by the region's own policy: see
:mod:`regional_agent.rounds.residency`, asked before training and before any upload) or ``failed``
(θ_r could not be reconstructed, or the workers refused the instruction). Failures that
a later try may overcome (the coordinator unreachable, a wait ran out) raise
:class:`RetryLater`; a worker group that crashed past its relaunch cap raises
``WorkerGroupFailed``, which ends the agent.

Each step leaves durable state behind before the next starts (θ_r, the worker group's
done marker, the spooled delta), so running the same announcement again after a crash
or a cancellation repeats no finished work: a spooled delta is re-sent as it is, a
trained round is read back from the worker group's hand-off directory. Blocking work
(hashing, codec, signing, file I/O) runs in worker threads.

A coordinator restored from an older backup announces a round the region is already
past: the pipeline confirms it with the coordinator, discards the job's regional state
(θ, residual, progress, spooled deltas, the worker group's regional checkpoint) and
takes part in the announced round from a full resync.

Metrics (:class:`~regional_agent.metrics.AgentMetrics`): the time the worker group
trains, each round trained (once per round, however often it is read back) with what
the workers measured training it (step time, throughput, MFU...), and the
size of every delta the coordinator accepts; the residency gate counts the region's own
policy refusals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, TypeVar

from geofed.codec import CodecError, EncodedStream, ErrorFeedback
from geofed.control import RoundAnnouncement
from geofed.data.fingerprint import dataset_fingerprint
from geofed.data.location import DataError, DatasetLocation
from geofed.evaluation_config import region_evaluates
from geofed.heap import trim_heap
from geofed.lineage import Software, local_software
from geofed.manifest import Manifest
from geofed.timeouts import Timeout
from policies import PolicySet
from regional_agent.credentials import Credentials
from regional_agent.drain import RoundPosition
from regional_agent.handoff.delta_stream import DeltaStream
from regional_agent.handoff.delta_terms import UnusableDelta, rounding_generator
from regional_agent.handoff.messages import DeltaRequest, RoundInstruction, RoundResult
from regional_agent.handoff.overlap import SPECULATIVE, theta_fragments
from regional_agent.launch.worker_group import RoundFailed, RoundRefused, WorkerGroup
from regional_agent.metrics import AgentMetrics
from regional_agent.rounds.datasets import RoundDatasets, round_datasets
from regional_agent.rounds.delta import (
    DeltaOrigin,
    check_worker_delta,
    delta_manifest,
    encode_delta,
    sign_delta,
)
from regional_agent.rounds.measurements import RoundMeasurements
from regional_agent.rounds.overlap_pipeline import DelayedRounds
from regional_agent.rounds.residency import ExportGate
from regional_agent.rounds.schedule import Progress, judge_lost_delta, judge_rollback
from regional_agent.rounds.timeline import Phase, Timeline
from regional_agent.state import (
    AgentState,
    DeltaMeta,
    JobDirectory,
    ProgressDamaged,
    SpooledDelta,
    StateError,
)
from regional_agent.status import StatusReporter
from regional_agent.transfer.coordinator_client import CoordinatorError, HttpError, TransportError
from regional_agent.transfer.sync import ResyncFailed, Synced, Synchronizer
from regional_agent.transfer.uploader import BaseMismatch, RoundClosed, Uploader, UploadRefused

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]
Outcome = Literal["accepted", "straggler", "refused", "failed"]
#: How often a rollback checks whether the worker group finished the round it trains.
_IDLE_POLL_S = 0.2


T = TypeVar("T")
Shape = tuple[int, ...]


def _fingerprints(locations: Mapping[str, DatasetLocation]) -> dict[str, str] | None:
    """Each located dataset's fingerprint (what the region says of it off the region)."""
    if not locations:
        return None
    try:
        return {name: dataset_fingerprint(loc) for name, loc in sorted(locations.items())}
    except DataError as exc:
        log.warning("no dataset fingerprint: %s", exc)
        return None


def _software(task_spec: str) -> Software | None:
    """What trains this region's deltas, for their lineage; None if it cannot be told."""
    try:
        return local_software(task_spec)
    except Exception as exc:  # lineage is best effort: the delta is still good
        log.warning("no software fingerprint for task %s: %s", task_spec, exc)
        return None


async def _blocking(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn`` in a thread; if cancelled meanwhile, let the thread finish first.

    A cancelled round is run again right away, so its file work must not overlap the
    next attempt's (a spool being written while it is read back).
    """
    future = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        if not future.cancelled():
            future.exception()  # retrieved: the cancellation is what the caller sees
        raise


def round_timings(train_s: float, encode_s: float) -> dict[str, float]:
    """What a delta's commit tells the coordinator of its round: seconds trained, encoded.

    With the uploader's ``upload_s`` they make the coordinator's view of each region's
    round (the status page's timeline); the agent's own timeline has every phase.
    """
    return {"train_s": round(max(0.0, train_s), 3), "encode_s": round(max(0.0, encode_s), 3)}


class RetryLater(Exception):
    """The round may still succeed; try it again after a pause (the message says why)."""


@dataclass(frozen=True, slots=True)
class RoundFragments:
    """The tensors a round deals in (``overlap: streaming``; all None otherwise): its
    delta's (``names``), the next round's (``next_names``), and those θ changed in since
    the round before (``fold``, None for round 0)."""

    names: tuple[str, ...] | None = None
    next_names: tuple[str, ...] | None = None
    fold: tuple[str, ...] | None = None

    @classmethod
    def of(cls, announcement: RoundAnnouncement, theta: Mapping[str, Shape]) -> RoundFragments:
        """The fragments of θ (its shapes, in θ's order); raises
        :class:`~geofed.fragments.FragmentError` when θ cannot be split."""
        plan = theta_fragments(announcement.overlap, announcement.fragments, theta)
        if plan is None:
            return cls()
        round_ = announcement.round
        return cls(
            names=plan.names(round_),
            next_names=plan.names(round_ + 1),
            fold=plan.names(round_ - 1) if round_ > 0 else None,
        )


@dataclass(frozen=True, slots=True)
class RoundEnd:
    """How a round ended for this region."""

    outcome: Outcome
    detail: str
    params_hash: str | None = None
    train_loss: float | None = None
    #: The region itself refused the round (its own policy, a dataset it does not train
    #: on, or task files that are not the coordinator's), not the coordinator: its status
    #: says so, and the coordinator audits it.
    by_region: bool = False


@dataclass(frozen=True)
class PipelineRegion:
    """What the pipeline needs to know about its region."""

    credentials: Credentials
    policies: PolicySet
    datasets: Sequence[str]
    #: Where the region keeps the datasets its agent config gives files for.
    locations: Mapping[str, DatasetLocation] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.credentials.identity.name

    @property
    def jurisdiction(self) -> str:
        found = self.policies.jurisdiction_of(self.name)
        if found is None:
            raise ValueError(f"no policy is loaded for region {self.name}")
        return found


class RoundPipeline:
    """Runs rounds for one region (see the module docstring)."""

    def __init__(
        self,
        region: PipelineRegion,
        state: AgentState,
        workers: WorkerGroup,
        synchronizer: Synchronizer,
        uploader: Uploader,
        status: StatusReporter,
        *,
        metrics: AgentMetrics,
        measurements: RoundMeasurements | None = None,
        train_timeout_s: float,
        clock: Clock,
        timeline: Timeline | None = None,
    ) -> None:
        self._region = region
        self._timeline = timeline
        self._state = state
        self._workers = workers
        self._sync = synchronizer
        self._uploader = uploader
        self._status = status
        self._metrics = metrics
        self._measurements = measurements or RoundMeasurements(metrics)
        self._train_timeout_s = train_timeout_s
        self._clock = clock
        self._monotonic = time.monotonic
        # (job, round) -> its training and encoding seconds, sent with its delta's commit
        self._timings: dict[tuple[str, int], dict[str, float]] = {}
        # job -> the last round counted as trained (a round read back is not counted again)
        self._trained: dict[str, int] = {}
        self._residency = ExportGate(region.policies, region.name, region.datasets, metrics)
        self._delayed = DelayedRounds(workers, region.name, train_timeout_s)
        # The pace a drain on SIGTERM estimates the rest of a round from (regional_agent.drain):
        # job -> seconds per inner step and seconds from trained to delivered, last measured.
        self._step_s: dict[str, float] = {}
        self._tail_s: dict[str, float] = {}
        # (job, round) -> when its training ended (monotonic), while it is being delivered.
        self._trained_at: dict[tuple[str, int], float] = {}

    def use_region(self, region: PipelineRegion) -> None:
        """Check residency with ``region``'s reloaded policies from the next question on."""
        self._region = region
        self._residency = ExportGate(region.policies, region.name, region.datasets, self._metrics)

    async def run(self, announcement: RoundAnnouncement, *, resync: bool = False) -> RoundEnd:
        """Take part in the announced round; ``resync`` discards the θ held first."""
        job = self._state.job(announcement.job)
        try:
            if resync:
                await _blocking(job.forget_params)
            try:
                await _blocking(job.recover)
            except ProgressDamaged as exc:
                await self._repair_progress(job, announcement, str(exc))
                await _blocking(job.recover)
            await self._settle_speculation(job, announcement, resync)
            await self._follow_rollback(job, announcement)
            uploaded = await _blocking(job.uploaded_round)
            if uploaded is not None and uploaded >= announcement.round:
                return RoundEnd("accepted", f"the delta of round {announcement.round} was accepted")
            await self._settle_stale_spools(job, announcement.round)
            spooled = await self._checked_spool(job, announcement.round)
            if spooled is None:
                produced = await self._produce(job, announcement)
                if isinstance(produced, RoundEnd):
                    return produced
                spooled = produced
            else:
                log.info("round %d: resuming the spooled delta", announcement.round)
            self._trained_at.setdefault((announcement.job, announcement.round), self._monotonic())
            return await self._deliver(job, announcement, spooled)
        except (TransportError, Timeout) as exc:
            raise RetryLater(str(exc)) from exc
        except OSError as exc:
            # The region's own disk: full, or a file removed under the agent. The daemon
            # stays up; what the round left half-written is freed, and it is tried again
            # after a back-off (a full disk may be emptied meanwhile).
            await self._free_round(job, announcement.round, exc)
            raise RetryLater(f"local storage: {exc}") from exc
        except (CoordinatorError, UnusableDelta, CodecError, StateError) as exc:
            # The coordinator is not who it should be (or answers nonsense), the trained
            # parameters cannot form a delta (shapes, NaN), or the regional state is
            # damaged: this round is lost for this region.
            return RoundEnd("failed", f"{type(exc).__name__}: {exc}")
        finally:
            self._trained_at.pop((announcement.job, announcement.round), None)

    async def position(self, announcement: RoundAnnouncement) -> RoundPosition:
        """Where the announced round (the one running) is, and the job's measured pace."""
        job, round_ = announcement.job, announcement.round
        if (job, round_) in self._trained_at:
            steps_done = announcement.inner_steps
        else:
            progress = await asyncio.to_thread(self._workers.handoff.read_progress, job, round_)
            steps_done = 0 if progress is None else progress.steps_done
        return RoundPosition(
            job=job,
            round=round_,
            steps_done=steps_done,
            inner_steps=announcement.inner_steps,
            step_s=self._step_s.get(job),
            tail_s=self._tail_s.get(job),
        )

    # -- steps ------------------------------------------------------------------------

    async def _produce(
        self, job: JobDirectory, announcement: RoundAnnouncement
    ) -> SpooledDelta | RoundEnd:
        refused = self._residency.refusal(announcement.job, announcement.round, "training")
        if refused is not None:
            # Training a round whose delta could never leave would only waste the round.
            return RoundEnd("refused", refused, by_region=True)
        data = round_datasets(
            announcement, self._region.name, self._region.datasets, self._region.locations
        )
        if data.refusal is not None:
            return RoundEnd("refused", data.refusal, by_region=True)
        synced = await self._reach_theta(job, announcement)
        if isinstance(synced, RoundEnd):
            return synced
        trained = await self._train(job, announcement, synced, data)
        if isinstance(trained, RoundEnd):
            return trained
        result, fragments = trained
        return await self._encode(job, announcement, synced, data, result, fragments)

    async def _reach_theta(
        self, job: JobDirectory, announcement: RoundAnnouncement
    ) -> Synced | RoundEnd:
        """θ_r of the round, held, updated or resynced, and saved (protocol step 2)."""
        where = {"job": announcement.job, "round": announcement.round}
        # The hash and loss of an earlier round do not describe this one.
        self._status.update(
            "syncing",
            **where,
            params_hash=None,
            train_loss=None,
            detail="reaching the round's parameters",
        )
        held = await _blocking(job.load_params)
        await _blocking(job.prepare_params)
        try:
            with self._phase(announcement, "sync"):
                synced = await self._sync.sync(announcement, held, job)
        except ResyncFailed as exc:
            return RoundEnd("failed", str(exc))
        except HttpError as exc:
            if exc.status >= 500 or exc.code == "not_found":
                raise RetryLater(str(exc)) from exc
            return RoundEnd("failed", str(exc))
        if synced.method != "held":
            await _blocking(job.record_params, synced.version)
        if synced.refused:
            log.warning(
                "job %s round %d: resynced after refusing the update: %s",
                announcement.job,
                announcement.round,
                synced.refused,
            )
        return synced

    async def _train(
        self,
        job: JobDirectory,
        announcement: RoundAnnouncement,
        synced: Synced,
        data: RoundDatasets,
    ) -> tuple[RoundResult, RoundFragments] | RoundEnd:
        """The workers' result of the round trained from ``synced`` (protocol step 3), its
        measurements counted, and the next delayed round started ahead when it may be."""
        where = {"job": announcement.job, "round": announcement.round}
        base_hash = synced.version.hash
        self._status.update(
            "training", **where, params_hash=base_hash, detail=f"{announcement.inner_steps} steps"
        )
        try:
            fragments = RoundFragments.of(announcement, await _blocking(synced.shapes))
        except ValueError as exc:  # FragmentError: the model cannot be split as announced
            return RoundEnd("failed", str(exc), params_hash=base_hash)
        instruction = self._instruction(announcement, job, synced, data, fragments.names)
        try:
            with self._metrics.training(), self._phase(announcement, "train"):
                result = await self._delayed_result(
                    announcement, instruction, base_hash, fragments.fold
                ) or await self._workers.run_round(instruction, self._train_timeout_s)
        except RoundRefused as exc:  # the task's files here are not the coordinator's
            return RoundEnd("refused", str(exc), params_hash=base_hash, by_region=True)
        except RoundFailed as exc:
            return RoundEnd("failed", str(exc), params_hash=base_hash)
        summary = result.summary
        if self._timeline is not None:
            self._timeline.worker_trained(
                announcement.job,
                announcement.round,
                summary.train_started_at,
                summary.train_finished_at,
            )
        if summary.base_params_hash != base_hash:  # θ's file is not what was recorded:
            await _blocking(job.forget_params)  # the next sync resyncs rather than retrying it
            why = f"the workers trained from θ {summary.base_params_hash}, not {base_hash}"
            return RoundEnd("failed", why, params_hash=base_hash)
        await self._delayed.speculate(
            announcement,
            instruction,
            job.held_path(announcement.round + 1),
            result=result,
            job=job,
            names=fragments.next_names,
        )
        self._count_trained(announcement.job, announcement.round, summary.mean_loss)
        if summary.stats is not None:
            self._step_s[announcement.job] = summary.stats.step_seconds
            stats, precision = summary.stats, announcement.training.precision
            self._measurements.record(
                announcement.job, announcement.round, stats, summary.world_size, precision
            )
        return result, fragments

    async def _encode(
        self,
        job: JobDirectory,
        announcement: RoundAnnouncement,
        synced: Synced,
        data: RoundDatasets,
        result: RoundResult,
        fragments: RoundFragments,
    ) -> SpooledDelta:
        """The round's delta framed (or encoded), its manifest signed, and all of it spooled
        for the upload (protocol step 4)."""
        summary = result.summary
        base_hash = synced.version.hash
        self._status.update(
            "uploading",
            job=announcement.job,
            round=announcement.round,
            train_loss=summary.mean_loss,
            detail="encoding the delta",
        )
        origin = DeltaOrigin(
            job=announcement.job,
            round=announcement.round,
            base_round=announcement.base_round,
            base_hash=base_hash,
            tokens=summary.tokens,
            producer=self._region.credentials.identity,
            jurisdiction=self._region.jurisdiction,
            datasets=data.names,
            training=announcement.training,
            base_eval=summary.base_eval,
            software=await _blocking(_software, announcement.task),
            data_fingerprints=await _blocking(_fingerprints, data.locations),
        )
        meta = DeltaMeta(train_loss=summary.mean_loss, tokens=summary.tokens, params_hash=base_hash)

        def encode_sign_spool() -> SpooledDelta:
            stream: EncodedStream | DeltaStream
            residual: ErrorFeedback | Path
            if result.delta is not None and result.residual is not None:
                # Quantized and sealed by rank 0, with its error feedback: the agent signs
                # its stream file and spools it under a second name.
                stream = check_worker_delta(
                    synced.shapes(), result.delta, announcement.codec, fragments.names
                )
                residual = result.residual
            elif fragments.names is not None:
                # Every streaming instruction asks for the fragment's delta; parameters
                # would be encoded whole, which the coordinator refuses.
                raise UnusableDelta(
                    "the workers handed over parameters, not the delta of the round's fragment"
                )
            else:  # a result holding the trained parameters
                generator = None
                if announcement.codec.stochastic_rounding:
                    generator = rounding_generator(job.job, announcement.round, self._region.name)
                encoded = encode_delta(
                    synced.tensors(),
                    result.params,
                    job.load_feedback(),
                    announcement.codec,
                    generator=generator,
                )
                stream, residual = encoded.stream, encoded.feedback
            manifest = delta_manifest(origin, stream, now=self._clock())
            signed = sign_delta(manifest, self._region.credentials)
            frames = stream.path if isinstance(stream, DeltaStream) else list(stream.frames())
            spooled = job.write_spool(announcement.round, signed.to_bytes(), frames, residual, meta)
            trim_heap()  # what hashing and signing the stream freed
            return spooled

        encode_started = self._monotonic()
        with self._phase(announcement, "encode"):
            delta = await _blocking(encode_sign_spool)
        for key in [k for k in self._timings if k[0] == announcement.job]:
            del self._timings[key]  # an earlier round's delta that never left
        self._timings[(announcement.job, announcement.round)] = round_timings(
            summary.train_seconds, self._monotonic() - encode_started
        )
        await _blocking(self._workers.handoff.prune_rounds, announcement.job, announcement.round)
        return delta

    def _instruction(
        self,
        announcement: RoundAnnouncement,
        job: JobDirectory,
        synced: Synced,
        data: RoundDatasets,
        names: tuple[str, ...] | None = None,
    ) -> RoundInstruction:
        """The serial instruction of the announced round; ``data``: its datasets and where
        they are; ``names``: the tensors its delta holds (the round's fragment under
        streaming; None: all)."""
        region_index, num_regions = announcement.data_shard(self._region.name)
        return RoundInstruction(
            job=announcement.job,
            round=announcement.round,
            base_params=str(job.held_path(synced.version.round)),
            base_hash=synced.version.hash,
            inner_steps=announcement.inner_steps,
            task=announcement.task,
            task_options=dict(announcement.task_options),
            seed=announcement.seed,
            region=self._region.name,
            region_index=region_index,
            num_regions=num_regions,
            training=announcement.training,
            total_steps=announcement.total_steps,
            overlap=announcement.overlap,
            evaluate_base=region_evaluates(
                announcement.evaluation,
                self._region.name,
                announcement.round,
                announcement.participants,
            ).evaluate,
            delta=DeltaRequest(announcement.codec, str(job.feedback_path), names=names),
            datasets=dict(data.locations),
            datasets_without_files=data.without_files,
            task_fingerprint=announcement.task_fingerprint,
        )

    async def _deliver(
        self, job: JobDirectory, announcement: RoundAnnouncement, delta: SpooledDelta
    ) -> RoundEnd:
        meta = delta.meta

        def end(outcome: Outcome, detail: str) -> RoundEnd:
            return RoundEnd(outcome, detail, meta.params_hash, meta.train_loss)

        # Asked again before anything leaves: a spooled delta may meet a changed policy.
        refused = self._residency.refusal(announcement.job, announcement.round, "upload")
        if refused is not None:
            await _blocking(job.discard_spool, announcement.round)
            return RoundEnd("refused", refused, meta.params_hash, meta.train_loss, by_region=True)
        self._status.update(
            "uploading",
            job=announcement.job,
            round=announcement.round,
            params_hash=meta.params_hash,
            train_loss=meta.train_loss,
            detail="uploading the delta",
        )
        try:
            with self._phase(announcement, "upload"):
                timings = self._timings.pop((announcement.job, announcement.round), {})
                report = await self._uploader.upload(
                    announcement.job, delta, {"train_loss": meta.train_loss, **timings}
                )
        except RoundClosed as exc:
            # Kept: a round closed by a pause, or below quorum, may be re-opened as is;
            # a later round drops the spool once the coordinator confirms it is closed.
            return end("straggler", f"straggler: {exc}")
        except BaseMismatch as exc:
            # The coordinator's θ_r is not ours: hold nothing, so the next sync resyncs.
            await _blocking(job.discard_spool, announcement.round)
            await _blocking(job.forget_params)
            return end("refused", str(exc))
        except UploadRefused as exc:
            await _blocking(job.discard_spool, announcement.round)
            return end("refused", str(exc))
        self._count_accepted(delta.manifest.manifest)
        if self._timeline is not None:
            self._timeline.accepted(announcement.job, announcement.round)
        await _blocking(job.promote, announcement.round)
        trained_at = self._trained_at.get((announcement.job, announcement.round))
        if trained_at is not None:
            self._tail_s[announcement.job] = self._monotonic() - trained_at
        sent = f"{report.chunks_sent} chunks, {report.bytes_sent} bytes sent"
        return end(
            "accepted", f"delta accepted ({sent}{', resumed' if report.attempts > 1 else ''})"
        )

    async def _free_round(self, job: JobDirectory, round_: int, error: OSError) -> None:
        """Drop the round's spooled delta after ``error`` unless it is whole and checks
        out: it is made again on the next try (a full disk gets its room back now)."""
        log.warning("job %s round %d: local storage failed: %s", job.job, round_, error)
        with contextlib.suppress(OSError, StateError):
            if await self._checked_spool(job, round_) is not None:
                return
        with contextlib.suppress(OSError):
            await _blocking(job.discard_spool, round_)

    async def _checked_spool(self, job: JobDirectory, round_: int) -> SpooledDelta | None:
        """The delta spooled for ``round_``, checked frame by frame against its signed
        manifest before it is offered again; a damaged one is dropped (the round's delta
        is then made again) rather than sent for the coordinator to refuse."""
        try:
            spooled = await _blocking(job.read_spool, round_)
            if spooled is not None:
                await _blocking(spooled.verify)
        except StateError as exc:
            log.warning(
                "job %s round %d: the spooled delta is damaged (%s); dropped, the round's "
                "delta is made again",
                job.job,
                round_,
                exc,
            )
            await _blocking(job.discard_spool, round_)
            return None
        return spooled

    async def _repair_progress(
        self, job: JobDirectory, announcement: RoundAnnouncement, damage: str
    ) -> None:
        """Rebuild a damaged progress record (``damage`` says how) from what the
        coordinator holds: the announced round delivered when it holds this region's delta
        of it, else nothing recorded (a delta spooled for the round is then offered again,
        or the round trained)."""
        try:
            delivered = await self._sync.delivered(announcement.job, announcement.round)
        except HttpError as exc:
            if exc.status >= 500:
                raise RetryLater(str(exc)) from exc
            raise StateError(f"{damage}; the coordinator cannot say what it holds: {exc}") from exc
        await _blocking(job.forget_progress)
        held = delivered is not None and self._region.name in delivered
        if held:
            await _blocking(job.promote, announcement.round)
        log.warning(
            "job %s: %s; rebuilt from the coordinator, which %s this region's delta of round %d",
            job.job,
            damage,
            "holds" if held else "does not hold",
            announcement.round,
        )

    async def _follow_rollback(self, job: JobDirectory, announcement: RoundAnnouncement) -> None:
        """Discard the job's regional state if its coordinator was restored from a backup.

        Only when the announcement contradicts the recorded progress is the coordinator
        asked which θ it holds; :func:`~regional_agent.rounds.schedule.judge_rollback` decides.
        When it opens a round the region delivered, the coordinator is asked whether it
        still holds that delta; :func:`~regional_agent.rounds.schedule.judge_lost_delta` decides.
        After the discard the round runs as for a region that joins afresh: a full resync
        from the coordinator's latest checkpoint, a new error-feedback residual, and a
        worker group that starts its inner state anew.
        """
        progress = Progress(*await _blocking(job.progress))
        region = self._region.name
        contradicted = progress.contradicted_by(announcement)
        if not contradicted and not progress.delivered(announcement, region):
            return
        try:
            coordinator = await self._sync.coordinator_version(announcement.job)
            delivered = (
                None
                if contradicted
                else await self._sync.delivered(announcement.job, announcement.round)
            )
        except HttpError as exc:
            if exc.status >= 500:
                raise RetryLater(str(exc)) from exc
            log.warning("job %s: cannot ask the coordinator which θ it holds: %s", job.job, exc)
            return
        if not contradicted:
            # Opened again after this region delivered it: as usual, unless the delta is lost.
            rollback = judge_lost_delta(announcement, progress, region, coordinator, delivered)
            if rollback is None:
                return
        else:
            rollback = judge_rollback(announcement, progress, coordinator)
            if rollback is None:
                log.info(
                    "job %s round %d: a stale announcement (the coordinator holds %s); "
                    "keeping the local state",
                    job.job,
                    announcement.round,
                    f"θ_{coordinator.round}" if coordinator is not None else "no θ",
                )
                return
        log.warning(
            "job %s: coordinator rolled back from round %d to %d; "
            "discarding local job state and resyncing",
            job.job,
            rollback.from_round,
            rollback.to_round,
        )
        await self._delayed.cancel_pending("the coordinator rolled back")
        await self._workers_idle()
        await _blocking(job.discard)
        await _blocking(self._workers.handoff.forget_job, job.job)
        self._trained.pop(job.job, None)  # the rounds after the restored one run again

    # -- overlap: delayed (regional_agent.rounds.overlap_pipeline) -------------------------------

    async def announced(self, announcement: RoundAnnouncement) -> None:
        """An announcement arrived: drop the speculative round it ends, if any."""
        try:
            await self._delayed.announced(announcement)
        except (OSError, ValueError) as exc:
            log.warning("job %s: cannot check its speculative round: %s", announcement.job, exc)

    async def _settle_speculation(
        self, job: JobDirectory, announcement: RoundAnnouncement, resync: bool
    ) -> None:
        spooled = announcement.round in await _blocking(job.spooled_rounds)
        await self._delayed.settle(announcement, resync=resync, spooled=spooled)

    async def _delayed_result(
        self,
        announcement: RoundAnnouncement,
        instruction: RoundInstruction,
        base_hash: str,
        fold: tuple[str, ...] | None = None,
    ) -> RoundResult | None:
        """The result of the round trained ahead of θ, when one stands for this round."""
        if announcement.overlap not in SPECULATIVE:
            return None
        return await self._delayed.train(instruction, base_hash, fold)

    async def _workers_idle(self) -> None:
        """Wait until the worker group has no instruction in hand (bounded by the train
        timeout): a round it still trains would write its regional checkpoint after the
        discard, and the group would then refuse the restored round as a replay."""
        handoff = self._workers.handoff
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._train_timeout_s
        while (pending := await _blocking(handoff.pending_instruction)) is not None:
            if loop.time() > deadline:
                job, round_ = pending
                raise RetryLater(f"the worker group still trains round {round_} of {job}")
            await asyncio.sleep(_IDLE_POLL_S)

    async def _settle_stale_spools(self, job: JobDirectory, current_round: int) -> None:
        """Deltas of earlier rounds left by a crash: learn whether they were accepted.

        A delta the region's own policy now refuses is dropped unsent.
        """
        for round_ in await _blocking(job.spooled_rounds):
            if round_ >= current_round:
                continue
            delta = await _blocking(job.read_spool, round_)
            if delta is None or self._residency.refusal(job.job, round_, "upload") is not None:
                await _blocking(job.discard_spool, round_)
                continue
            try:
                await self._uploader.upload(job.job, delta, {"train_loss": delta.meta.train_loss})
            except CoordinatorError as exc:
                log.warning("round %d: could not settle the spooled delta: %s", round_, exc)
                continue
            except (RoundClosed, BaseMismatch, UploadRefused) as exc:
                log.info("round %d: the spooled delta was not taken (%s); dropping it", round_, exc)
                await _blocking(job.discard_spool, round_)
                continue
            self._count_accepted(delta.manifest.manifest)
            await _blocking(job.promote, round_)

    # -- metrics ----------------------------------------------------------------------

    def _phase(
        self, announcement: RoundAnnouncement, phase: Phase
    ) -> contextlib.AbstractContextManager[None]:
        """Time ``phase`` of the announced round on the round timeline, if one is kept."""
        if self._timeline is None:
            return contextlib.nullcontext()
        return self._timeline.phase(announcement.job, announcement.round, phase)

    def _count_trained(self, job: str, round_: int, loss: float) -> None:
        if self._trained.get(job, -1) >= round_:
            return
        self._trained[job] = round_
        if not math.isfinite(loss):
            log.warning("job %s round %d: training loss %s is not exported", job, round_, loss)
        self._metrics.round_trained(job, round_, loss if math.isfinite(loss) else None)

    def _count_accepted(self, manifest: Manifest) -> None:
        fp32_bytes = 4 * sum(math.prod(spec.shape) for spec in manifest.tensors)
        self._metrics.delta_accepted(manifest.codec.scheme, manifest.total_size, fp32_bytes)
