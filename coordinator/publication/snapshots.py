"""One job's snapshot policy at work: what it measures, the newest snapshot, the plan.

:mod:`coordinator.publication.snapshot_policy` decides; this feeds it. It learns the round duration
and the snapshot cost from each published round, the failures of the job's regions
from the control plane (a region of the job going offline while the job runs) and from
the rounds (a participant that missed a published round's deadline without having gone
offline), and the newest snapshot by listing the job's checkpoint chain when the engine
recovers. The measurements are saved in the state directory after each round, with the
last hour's failures and the regions drained (so a restart neither forgets a failure
nor drains again a region an operator started again). The job's hardware risk
(:mod:`coordinator.scheduling.hardware_risk`) comes from its serving regions' last
reported hardware and the failures counted here; new uncorrectable ECC errors are those
the agent's hardware history counts, or for an agent that keeps none, those since the
first status this coordinator process took of the region's host
(``ControlPlane.ecc_first_seen``). The plan is made again with the trend
of the job's validation losses each time it is (each publication, each failure).
A risk snapshot asks the regions at that risk for a regional checkpoint from the next
round on (a ``checkpoint`` command after the publication); after each published round,
a region whose hardware alone is at ``hardware_risk.drain_at`` is sent a ``drain``
command (again after the next round if the broker did not take it).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from typing import Any

from coordinator.jobs.context import JobContext
from coordinator.publication.loss_trend import loss_trend
from coordinator.publication.snapshot_policy import (
    SnapshotDecision,
    SnapshotPlan,
    SnapshotSettings,
    SnapshotStats,
    decide_snapshot,
    load_stats,
    next_snapshot_round,
    plan_interval,
    rearmed,
    risk_snapshot,
    save_stats,
    snapshot_status,
)
from coordinator.rounds.state import RoundState
from coordinator.scheduling.hardware_risk import (
    FAILURE_WINDOW_S,
    SNAPSHOT_RISK,
    Risk,
    drain_due,
    job_risk,
    region_risk,
)
from coordinator.services import Services
from coordinator.storage.checkpoints import EntryKind

__all__ = ["JobSnapshots"]

log = logging.getLogger(__name__)


class JobSnapshots:
    """The snapshot policy of one job (see the module docstring).

    ``serving(region)`` says whether the region serves the running job now: its
    failures count only then. ``losses``: the job's validation loss by evaluated version,
    kept up to date by its owner (its trend stretches an auto interval).
    """

    def __init__(
        self,
        services: Services,
        ctx: JobContext,
        serving: Callable[[str], bool],
        losses: Mapping[int, float],
    ) -> None:
        self._s = services
        self._ctx = ctx
        self._serving = serving
        self._losses = losses
        self.settings = SnapshotSettings.of(ctx.spec)
        self.stats = SnapshotStats()
        #: The version of the newest snapshot in the job's chain (None: not read yet).
        self.last_round: int | None = None
        self._path = services.config.state_dir / "snapshot_policy" / f"{ctx.job}.json"
        self._up = {region: self._is_up(region) for region in ctx.spec.regions}
        self._offline_at: dict[str, float] = {}
        #: The round duration the plan was last made with.
        self._round_s: float | None = None
        #: The score a risk snapshot was last stored at (None: none since it fell back).
        self._risk_acted_at: float | None = None
        #: The round whose announcement asks these regions for a regional checkpoint.
        self._checkpoint_ask: tuple[int, tuple[str, ...]] = (-1, ())
        self.plan: SnapshotPlan = self._replan(None)
        services.control.on_region_change(self._region_changed)

    @property
    def every_rounds(self) -> int:
        return self.plan.every_rounds

    def next_round(self, version: int) -> int:
        """The version the next snapshot is planned for, at θ_version."""
        return next_snapshot_round(version, self.last_round, self.plan)

    def status(self, version: int) -> dict[str, Any]:
        """The ``snapshot`` object of the job's status at θ_version."""
        return snapshot_status(self.plan, version, self.last_round, self.risk())

    def risk(self) -> Risk:
        """The job's hardware risk now, from its regions' statuses and failures."""
        return job_risk(self.region_risks())

    def region_risks(self, *, hardware_only: bool = False) -> dict[str, Risk]:
        """The hardware risk of each region serving the job now (``hardware_only``: from
        its hardware alone, its failures left out)."""
        now = self._s.clock()
        risks = {}
        control = self._s.control
        for region in sorted(set(control.regions) | set(self._ctx.spec.regions)):
            if not self._serving(region):
                continue  # a region that left (or has not joined) adds no risk
            view = control.regions.get(region)
            # The last hardware reported: a Last Will (offline) carries none.
            hardware = control.last_hardware.get(region)
            capacity = None if view is None else view.status.capacity
            first = (
                None if hardware is None else control.ecc_first_seen.get((region, hardware.host))
            )
            risks[region] = region_risk(
                hardware,
                first,
                [] if hardware_only else self.stats.failed_at.get(region, []),
                now,
                gpus_offered=0 if capacity is None else capacity.gpus,
            )
        return risks

    async def recover(self) -> None:
        """Read the saved measurements and find the newest snapshot in the chain."""
        files = self._s.executors.files
        self.stats = await files(load_stats, self._path)
        entries = await files(self._ctx.publishing.location.store.entries, self._ctx.job)
        snapshots = [entry.round for entry in entries if entry.kind is EntryKind.SNAPSHOT]
        self.last_round = max(snapshots, default=None)
        self._replan(self.stats.round_s)

    def decide(self, rs: RoundState) -> SnapshotDecision:
        """Whether the θ that publishing ``rs`` makes gets a snapshot, and why."""
        round_s = self.stats.round_s
        if round_s is None:
            round_s = _duration(rs, self._s.clock())
        plan = self._replan(round_s)
        risks = self.region_risks()
        risk = job_risk(risks)
        self._risk_acted_at = rearmed(risk, self._risk_acted_at)
        urgent = risk_snapshot(risk, self._risk_acted_at)
        if urgent is not None:
            asked = tuple(
                region for region in sorted(risks) if risks[region].score >= SNAPSHOT_RISK
            )
            self._checkpoint_ask = (rs.config.round + 1, asked)
            log.warning(
                "job %s: snapshot now, and a regional checkpoint of %s with round %d: %s",
                self._ctx.job,
                ", ".join(asked),
                rs.config.round + 1,
                urgent.reason,
            )
            return urgent
        return decide_snapshot(rs.config.round + 1, self.last_round, plan)

    def stored(self, version: int, snapshot_s: float) -> None:
        """θ_version's snapshot is in the chain; it took ``snapshot_s`` wall seconds."""
        self.stats.snapshot_took(snapshot_s)
        self.last_round = version if self.last_round is None else max(self.last_round, version)
        # Stored, not just decided: a publication tried again snapshots for the risk again.
        risk = self.risk()
        if risk.score >= SNAPSHOT_RISK:
            self._risk_acted_at = risk.score
        # The status may be read before the round's publication ends: it shows the plan
        # this cost makes at once, never the new snapshot with the plan that had no cost.
        self._replan(self._round_s)

    async def published(self, rs: RoundState) -> None:
        """Count the published round ``rs`` and save the measurements."""
        self.stats.round_took(_duration(rs, self._s.clock()), rs.config.participants)
        for region in rs.stragglers:
            if self._offline_at.get(region, float("-inf")) < rs.config.opened_at:
                self._failed(region, f"missed the deadline of round {rs.config.round}")
        self._replan(self.stats.round_s)
        await self._ask_checkpoints(rs.config.round + 1)
        await self._drain_risky()
        kept = copy.deepcopy(self.stats)  # the region listener may count a failure meanwhile
        try:
            await self._s.executors.files(save_stats, self._path, kept)
        except OSError as exc:  # measured again after a restart
            log.warning("job %s: cannot save its snapshot measurements: %s", self._ctx.job, exc)

    async def _ask_checkpoints(self, version: int) -> None:
        """Ask the regions of the risk snapshot of θ_version for a regional checkpoint
        from round ``version`` on (a command to each: agents that predate it ignore it)."""
        asked_round, regions = self._checkpoint_ask
        if asked_round != version:
            return
        self._checkpoint_ask = (-1, ())
        reason = f"hardware risk: θ_{version} was snapshotted for it"
        for region in regions:
            await self._s.control.command(
                region, "checkpoint", self._ctx.job, reason, round=version
            )

    async def _drain_risky(self) -> None:
        """Drain each region whose hardware alone reached ``hardware_risk.drain_at``,
        once a rise (:func:`~coordinator.scheduling.hardware_risk.drain_due`)."""
        drain_at = self._s.config.hardware_risk.drain_at
        for region, risk in self.region_risks(hardware_only=True).items():
            reason, drained = drain_due(risk, drain_at, region in self.stats.drained)
            if not drained:
                self.stats.drained.discard(region)
            if reason is None:
                continue
            log.warning("job %s: draining region %s: %s", self._ctx.job, region, reason)
            if await self._s.control.command(region, "drain", self._ctx.job, reason):
                self.stats.drained.add(region)  # else tried again after the next round
                await self._s.control.event(
                    "region.drain", job=self._ctx.job, region=region, detail=reason
                )

    def _replan(self, round_s: float | None) -> SnapshotPlan:
        self._round_s = round_s
        trend = loss_trend(self._losses)
        self.plan = plan_interval(self.settings, self.stats, self._ctx.spec.regions, round_s, trend)
        self._s.metrics.snapshot_interval.labels(job=self._ctx.job).set(self.plan.every_rounds)
        return self.plan

    def _is_up(self, region: str) -> bool:
        view = self._s.control.regions.get(region)
        return view is not None and view.up

    def _region_changed(self, region: str) -> None:
        if region not in self._up:
            return
        was, up = self._up[region], self._is_up(region)
        self._up[region] = up
        if was and not up and self._serving(region):
            self._offline_at[region] = self._s.clock()
            self._failed(region, "went offline")
            self._replan(self.stats.round_s)

    def _failed(self, region: str, what: str) -> None:
        self.stats.region_failed(region, what)
        now = self._s.clock()
        failed_at = self.stats.failed_at
        recent = [at for at in failed_at.get(region, []) if at >= now - FAILURE_WINDOW_S]
        failed_at[region] = [*recent, now]
        log.info(
            "job %s: region %s %s (a failure, for the snapshot interval)",
            self._ctx.job,
            region,
            what,
        )


def _duration(rs: RoundState, now: float) -> float:
    ended = rs.ended_at if rs.ended_at is not None else now
    return max(0.0, ended - rs.config.opened_at)
