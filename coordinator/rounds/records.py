"""What the coordinator persists about jobs and rounds, and how it announces them.

A job is ``queued`` (waiting for capacity), ``running``, ``paused``, ``cancelled``,
``completed`` or ``failed``. Each round of a job has one record in the state store
(``rounds`` table, key (job, round)): the round state machine's state, the attempt
number (a round that failed below quorum, or was abandoned by a pause, is re-opened as a
new attempt with the deltas already accepted), consecutive failures, failed publication
attempts, why its deadline is what it is, and the quarantine standing of the job's
regions when the record was written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal

from coordinator.aggregation.outer_optimizer import OuterOptimizerConfig
from coordinator.jobs.spec import JobSpec
from coordinator.rounds.quarantine import Quarantine, QuarantineConfig
from coordinator.rounds.state import RoundState
from coordinator.scheduling.elastic import Membership
from geofed.api_paths import ApiPaths
from geofed.control import RoundAnnouncement
from geofed.control.messages import AnnouncedPhase
from geofed.evaluation_config import EvaluationConfig
from geofed.training_config import TrainingConfig

__all__ = ["JobState", "RoundRecord", "announcement", "job_announcement"]


class JobState(StrEnum):
    QUEUED = "queued"  # admitted by residency, waiting for capacity (coordinator.jobs.capacity)
    RUNNING = "running"
    PAUSED = "paused"
    CANCELLED = "cancelled"
    COMPLETED = "completed"
    FAILED = "failed"

    @property
    def final(self) -> bool:
        return self in (JobState.CANCELLED, JobState.COMPLETED, JobState.FAILED)


@dataclass
class RoundRecord:
    """One round's persisted record (see the module docstring)."""

    state: RoundState
    attempt: int
    failures: int
    deadline_reason: str
    quarantine: Quarantine
    publication_failures: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state.to_dict(),
            "attempt": self.attempt,
            "failures": self.failures,
            "deadline_reason": self.deadline_reason,
            "quarantine": self.quarantine.to_dict(),
            "publication_failures": self.publication_failures,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], config: QuarantineConfig) -> RoundRecord:
        """Rebuild a record; raises ``RoundStateError``/``QuarantineError``/``ValueError``."""
        attempt, failures = data.get("attempt"), data.get("failures")
        publication_failures = data.get("publication_failures", 0)  # absent in older records
        if not isinstance(attempt, int) or not isinstance(failures, int):
            raise ValueError(  # noqa: TRY004 - a damaged record, reported like the others
                f"round record has no attempt/failures counts: {dict(data)!r:.200}"
            )
        if not isinstance(publication_failures, int):
            raise ValueError(  # noqa: TRY004 - a damaged record, reported like the others
                f"round record has a bad publication_failures count: {publication_failures!r}"
            )
        return cls(
            state=RoundState.from_dict(data.get("state")),
            attempt=attempt,
            failures=failures,
            deadline_reason=str(data.get("deadline_reason", "")),
            quarantine=Quarantine.from_dict(config, data.get("quarantine", {"regions": {}})),
            publication_failures=publication_failures,
        )


def announcement(
    *,
    job: str,
    version: int,
    params_hash: str,
    update_digest: str | None,
    round_state: RoundState | None,
    state: AnnouncedPhase,
    regions: tuple[str, ...],
    quorum: int,
    inner_steps: int,
    codec: Any,
    task: str,
    task_options: Mapping[str, Any],
    seed: int,
    training: TrainingConfig,
    total_rounds: int,
    default_deadline_s: float,
    now: float,
    evaluation: EvaluationConfig | None = None,
    overlap: Literal["none", "delayed", "streaming"] = "none",
    overlap_start: Literal["local", "eager"] = "local",
    fragments: int | None = None,
    outer_optimizer: OuterOptimizerConfig | None = None,
    assignment: Mapping[str, int] | None = None,
    shards: int | None = None,
    datasets: Mapping[str, Sequence[str]] | None = None,
    task_fingerprint: str | None = None,
    trace: str | None = None,
    max_staleness: int = 0,
) -> RoundAnnouncement:
    """The announcement of round ``version`` in ``state``.

    Without an open round (a paused job between rounds, a finished or cancelled job)
    the job's regions stand in as participants and ``now`` as the deadline.
    """
    if round_state is not None and round_state.config.round == version:
        participants = round_state.config.participants
        min_regions = round_state.config.min_regions
        deadline_at = round_state.deadline_at
        deadline_s = round_state.deadline_at - round_state.config.opened_at
    else:
        participants = regions
        min_regions = min(quorum, len(regions))
        deadline_at = now
        deadline_s = default_deadline_s
    has_update = version > 0 and update_digest is not None
    return RoundAnnouncement(
        job=job,
        round=version,
        base_round=version,
        base_hash=params_hash,
        update_url=ApiPaths.update(job, version - 1) if has_update else None,
        update_digest=update_digest if has_update else None,
        participants=participants,
        min_regions=min_regions,
        deadline=datetime.fromtimestamp(deadline_at, UTC),
        deadline_s=max(deadline_s, 1e-3),
        inner_steps=inner_steps,
        codec=codec,
        task=task,
        task_options=dict(task_options),
        seed=seed,
        state=state,
        training=training,
        total_rounds=total_rounds,
        evaluation=evaluation if evaluation is not None else EvaluationConfig(),
        overlap=overlap,
        overlap_start=overlap_start,
        fragments=fragments if overlap == "streaming" else None,
        # Only a region that starts from the eager estimate replays the outer optimizer.
        outer_optimizer=outer_optimizer if overlap_start == "eager" else None,
        regions=regions,
        assignment=dict(assignment or {}),
        shards=shards if assignment else None,
        datasets={region: tuple(names) for region, names in (datasets or {}).items()},
        task_fingerprint=task_fingerprint,
        trace=trace,
        max_staleness=max_staleness,
    )


def job_announcement(
    spec: JobSpec,
    applied: Membership,
    job: str,
    version: int,
    *,
    params_hash: str,
    update_digest: str | None,
    round_state: RoundState | None,
    state: AnnouncedPhase,
    now: float,
    task_fingerprint: str | None,
    trace: str | None,
) -> RoundAnnouncement:
    """:func:`announcement` of a job as ``spec`` describes it, on the regions ``applied``."""
    merging = spec.aggregation.late == "merge"
    return announcement(
        job=job,
        version=version,
        params_hash=params_hash,
        update_digest=update_digest,
        round_state=round_state,
        state=state,
        regions=spec.region_names,
        quorum=spec.quorum,
        inner_steps=spec.inner_steps,
        codec=spec.codec,
        task=spec.task.spec,
        task_options=spec.task.options,
        seed=spec.seed,
        training=spec.training,
        total_rounds=spec.rounds,
        default_deadline_s=spec.deadline.initial_s,
        now=now,
        evaluation=spec.evaluation,
        overlap=spec.overlap,
        overlap_start=spec.overlap_start,
        fragments=spec.fragments,
        outer_optimizer=spec.outer_optimizer,
        assignment=applied.assignment,
        shards=applied.slots,
        datasets={r: applied.datasets[r] for r in applied.assignment},
        task_fingerprint=task_fingerprint,
        trace=trace,
        max_staleness=spec.aggregation.max_staleness if merging else 0,
    )
