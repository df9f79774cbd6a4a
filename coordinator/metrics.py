"""The coordinator's Prometheus metrics: the one catalogue of names, and their collectors.

Alert rules and dashboards reference the names in :data:`CATALOGUE`; change a name here
and there together. Conventions: prefix ``geofed_``, base units (seconds, bytes),
counters end in ``_total``, timestamps are Unix seconds. Labels take only bounded values:
``job`` and ``region`` come from admitted jobs and loaded policies (never from a URL a
client made up), ``code``, ``kind``, ``verdict``, ``direction`` and ``certificate`` from
fixed sets. Checkpoint age is ``time() - geofed_last_checkpoint_timestamp_seconds``.

The registry is always passed in (never the process-global one), so every test and
every coordinator in one process has its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from prometheus_client import CollectorRegistry, Histogram

from coordinator.errors import CODES
from geofed.metric_spec import MetricSpec, counter, gauge, histogram
from geofed.types import ArtifactKind

__all__ = [
    "CATALOGUE",
    "DURATION_BUCKETS_S",
    "STANDBY_CATALOGUE",
    "CoordinatorMetrics",
    "StandbyMetrics",
]

#: Round and aggregation durations: from a second up to eight hours (WAN rounds are long;
#: the client library's default buckets stop at 10 s).
DURATION_BUCKETS_S: Final = (
    1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0,
    14400.0, 28800.0,
)  # fmt: skip

ROUNDS_COMPLETED = MetricSpec(
    "geofed_rounds_completed_total", "counter", "Rounds whose update was published.", ("job",)
)
ROUNDS_FAILED = MetricSpec(
    "geofed_rounds_failed_total", "counter", "Rounds that ended below quorum.", ("job",)
)
ROUND_DURATION = MetricSpec(
    "geofed_round_duration_seconds",
    "histogram",
    "Time from a round's announcement to its publication.",
    ("job",),
)
CURRENT_ROUND = MetricSpec(
    "geofed_current_round", "gauge", "Round a job is collecting (its base version).", ("job",)
)
DELTAS_ACCEPTED = MetricSpec(
    "geofed_deltas_accepted_total", "counter", "Region deltas accepted.", ("job", "region")
)
DELTAS_REJECTED = MetricSpec(
    "geofed_deltas_rejected_total",
    "counter",
    "Delta uploads refused, by error code of the data-plane protocol.",
    ("code",),
)
STRAGGLERS = MetricSpec(
    "geofed_stragglers_total",
    "counter",
    "Participants that missed a round's close.",
    ("job", "region"),
)
LATE_MERGED = MetricSpec(
    "geofed_late_deltas_merged_total",
    "counter",
    "Late deltas merged into a later round (aggregation.late: merge), by their region.",
    ("job", "region"),
)
RECEIVED_BYTES = MetricSpec(
    "geofed_received_bytes_total", "counter", "Artifact bytes received, by kind.", ("kind",)
)
SENT_BYTES = MetricSpec(
    "geofed_sent_bytes_total", "counter", "Artifact bytes served, by kind.", ("kind",)
)
FP32_EQUIVALENT_BYTES = MetricSpec(
    "geofed_fp32_equivalent_bytes_total",
    "counter",
    "What the accepted deltas and published updates would weigh as raw float32.",
    ("direction",),
)
POLICY_DECISIONS = MetricSpec(
    "geofed_policy_decisions_total",
    "counter",
    "Residency decisions, by verdict (allow, deny) and kind (admission or artifact kind).",
    ("verdict", "kind"),
)
AGGREGATION_DURATION = MetricSpec(
    "geofed_aggregation_duration_seconds",
    "histogram",
    "Aggregation, outer step, encoding and persistence of one round.",
    ("job",),
)
REGIONS_UP = MetricSpec("geofed_regions_up", "gauge", "Regions whose agent reports online.")
REGION_UP = MetricSpec(
    "geofed_region_up", "gauge", "1 while the region's agent reports online.", ("region",)
)
REGION_QUARANTINED = MetricSpec(
    "geofed_region_quarantined",
    "gauge",
    "1 while the region sits out the job's rounds in quarantine (repeated misses).",
    ("job", "region"),
)
GLOBAL_VALIDATION_LOSS = MetricSpec(
    "geofed_global_validation_loss",
    "gauge",
    "Validation loss of the latest global parameters.",
    ("job",),
)
GLOBAL_EVALUATION_METRIC = MetricSpec(
    "geofed_global_evaluation_metric",
    "gauge",
    "Every metric the task's evaluation gave the latest evaluated global parameters "
    "(val_loss, accuracy, perplexity, ...), by name.",
    ("job", "metric"),
)
EVALUATIONS = MetricSpec(
    "geofed_evaluations_total",
    "counter",
    "Evaluations of global parameters recorded, by where they ran (region, coordinator).",
    ("job", "where"),
)
REGION_TRAIN_LOSS = MetricSpec(
    "geofed_region_train_loss",
    "gauge",
    "Training loss a region reported with its latest delta.",
    ("job", "region"),
)
LAST_CHECKPOINT = MetricSpec(
    "geofed_last_checkpoint_timestamp_seconds",
    "gauge",
    "When the job's latest global checkpoint part was stored.",
    ("job",),
)
SNAPSHOT_INTERVAL = MetricSpec(
    "geofed_job_snapshot_interval_rounds",
    "gauge",
    "Rounds between the job's global snapshots, as chosen now (fixed, or Young/Daly).",
    ("job",),
)
CERTIFICATE_EXPIRY = MetricSpec(
    "geofed_certificate_expiry_timestamp_seconds",
    "gauge",
    "notAfter of the coordinator's certificates (identity, tls).",
    ("certificate",),
)
JOBS = MetricSpec("geofed_jobs", "gauge", "Jobs known to the coordinator, by state.", ("state",))
JOBS_QUEUED = MetricSpec(
    "geofed_jobs_queued",
    "gauge",
    "Jobs waiting for capacity, by priority class.",
    ("priority",),
)
PREEMPTIONS = MetricSpec(
    "geofed_preemptions_total",
    "counter",
    "Jobs asked to give their regions back at their next round boundary, by their class.",
    ("priority",),
)
QUEUE_OLDEST_WAIT = MetricSpec(
    "geofed_queue_oldest_wait_seconds",
    "gauge",
    "How long the longest-waiting queued job of each priority class has waited (0: none).",
    ("priority",),
)
REGION_CAPACITY_IN_USE = MetricSpec(
    "geofed_region_capacity_in_use",
    "gauge",
    "GPUs and CPU worker slots the capacity-scheduled jobs hold in each region.",
    ("region", "resource"),
)
TEAM_GPUS_IN_USE = MetricSpec(
    "geofed_team_gpus_in_use", "gauge", "GPUs each team's running and paused jobs hold.", ("team",)
)
TEAM_GPU_SECONDS = MetricSpec(
    "geofed_team_gpu_seconds",
    "gauge",
    "GPU-seconds each team used within its quota window (teams with a GPU-hour quota).",
    ("team",),
)
TEAM_QUOTA_WAITING = MetricSpec(
    "geofed_team_quota_waiting_jobs",
    "gauge",
    "Jobs of each team waiting because the team is at its quota.",
    ("team",),
)
JOB_COST = MetricSpec(
    "geofed_job_cost",
    "gauge",
    "What a job cost since it started, by kind (gpu, upload, download, storage), in the "
    "price table's currency (coordinator.costs).",
    ("job", "team", "kind"),
)
JOB_BUDGET = MetricSpec(
    "geofed_job_budget",
    "gauge",
    "The budget a running job's spec states (budget:), in the price table's currency.",
    ("job", "team"),
)
JOB_PROJECTED_COST = MetricSpec(
    "geofed_job_projected_cost",
    "gauge",
    "What all of a running job's rounds would cost at its cost per round so far (absent "
    "before a round is published or while part of its use is unpriced).",
    ("job", "team"),
)
TEAM_COST = MetricSpec(
    "geofed_team_cost",
    "gauge",
    "What a team's jobs cost over its budget's window (30 days without a budget).",
    ("team",),
)
TEAM_BUDGET = MetricSpec(
    "geofed_team_budget", "gauge", "A team's budget over its window (scheduling file).", ("team",)
)
TEAM_BUDGET_BURN_RATE = MetricSpec(
    "geofed_team_budget_burn_rate",
    "gauge",
    "A team's spend over the last 6 hours as a share of what its budget allows in that time "
    "(1: on course to spend exactly the budget over its window).",
    ("team",),
)
MQTT_CONNECTED = MetricSpec(
    "geofed_mqtt_connected", "gauge", "1 while the control-plane connection is up."
)
LEADER = MetricSpec(
    "geofed_coordinator_leader",
    "gauge",
    "1 while this coordinator leads (serves the full API), 0 while it stands by.",
)
#: A standby's own: labelled with the lease holder it last saw ('' until known). One series
#: at a time; its value changes only when the leader does.
STANDBY_INFO = MetricSpec(
    "geofed_coordinator_standby_info",
    "gauge",
    "1 on a standby coordinator; leader: the leader lease holder it last saw.",
    ("leader",),
)

CATALOGUE: Final[tuple[MetricSpec, ...]] = (
    ROUNDS_COMPLETED,
    ROUNDS_FAILED,
    ROUND_DURATION,
    CURRENT_ROUND,
    DELTAS_ACCEPTED,
    DELTAS_REJECTED,
    STRAGGLERS,
    LATE_MERGED,
    RECEIVED_BYTES,
    SENT_BYTES,
    FP32_EQUIVALENT_BYTES,
    POLICY_DECISIONS,
    AGGREGATION_DURATION,
    REGIONS_UP,
    REGION_UP,
    REGION_QUARANTINED,
    GLOBAL_VALIDATION_LOSS,
    GLOBAL_EVALUATION_METRIC,
    EVALUATIONS,
    REGION_TRAIN_LOSS,
    LAST_CHECKPOINT,
    SNAPSHOT_INTERVAL,
    CERTIFICATE_EXPIRY,
    JOBS,
    JOBS_QUEUED,
    PREEMPTIONS,
    QUEUE_OLDEST_WAIT,
    REGION_CAPACITY_IN_USE,
    TEAM_GPUS_IN_USE,
    TEAM_GPU_SECONDS,
    TEAM_QUOTA_WAITING,
    JOB_COST,
    JOB_BUDGET,
    JOB_PROJECTED_COST,
    TEAM_COST,
    TEAM_BUDGET,
    TEAM_BUDGET_BURN_RATE,
    MQTT_CONNECTED,
    LEADER,
)
#: What a standby coordinator exports (:class:`StandbyMetrics`).
STANDBY_CATALOGUE: Final[tuple[MetricSpec, ...]] = (LEADER, STANDBY_INFO)


def _duration(spec: MetricSpec, registry: CollectorRegistry) -> Histogram:
    return histogram(spec, registry, DURATION_BUCKETS_S)


class CoordinatorMetrics:
    """Every collector of the catalogue, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.rounds_completed = counter(ROUNDS_COMPLETED, registry)
        self.rounds_failed = counter(ROUNDS_FAILED, registry)
        self.round_duration = _duration(ROUND_DURATION, registry)
        self.current_round = gauge(CURRENT_ROUND, registry)
        self.deltas_accepted = counter(DELTAS_ACCEPTED, registry)
        self.deltas_rejected = counter(DELTAS_REJECTED, registry)
        self.stragglers = counter(STRAGGLERS, registry)
        self.late_merged = counter(LATE_MERGED, registry)
        self.received_bytes = counter(RECEIVED_BYTES, registry)
        self.sent_bytes = counter(SENT_BYTES, registry)
        self.fp32_equivalent_bytes = counter(FP32_EQUIVALENT_BYTES, registry)
        self.policy_decisions = counter(POLICY_DECISIONS, registry)
        self.aggregation_duration = _duration(AGGREGATION_DURATION, registry)
        self.regions_up = gauge(REGIONS_UP, registry)
        self.region_up = gauge(REGION_UP, registry)
        self.region_quarantined = gauge(REGION_QUARANTINED, registry)
        self.global_validation_loss = gauge(GLOBAL_VALIDATION_LOSS, registry)
        self.global_evaluation_metric = gauge(GLOBAL_EVALUATION_METRIC, registry)
        self.evaluations = counter(EVALUATIONS, registry)
        self.region_train_loss = gauge(REGION_TRAIN_LOSS, registry)
        self.last_checkpoint = gauge(LAST_CHECKPOINT, registry)
        self.snapshot_interval = gauge(SNAPSHOT_INTERVAL, registry)
        self.certificate_expiry = gauge(CERTIFICATE_EXPIRY, registry)
        self.jobs = gauge(JOBS, registry)
        self.jobs_queued = gauge(JOBS_QUEUED, registry)
        self.preemptions = counter(PREEMPTIONS, registry)
        self.queue_oldest_wait = gauge(QUEUE_OLDEST_WAIT, registry)
        self.region_capacity_in_use = gauge(REGION_CAPACITY_IN_USE, registry)
        self.team_gpus_in_use = gauge(TEAM_GPUS_IN_USE, registry)
        self.team_gpu_seconds = gauge(TEAM_GPU_SECONDS, registry)
        self.team_quota_waiting = gauge(TEAM_QUOTA_WAITING, registry)
        self.job_cost = gauge(JOB_COST, registry)
        self.job_budget = gauge(JOB_BUDGET, registry)
        self.job_projected_cost = gauge(JOB_PROJECTED_COST, registry)
        self.team_cost = gauge(TEAM_COST, registry)
        self.team_budget = gauge(TEAM_BUDGET, registry)
        self.team_budget_burn_rate = gauge(TEAM_BUDGET_BURN_RATE, registry)
        self.mqtt_connected = gauge(MQTT_CONNECTED, registry)
        self.leader = gauge(LEADER, registry)
        # The full app runs only on the leader (or the only coordinator): it leads.
        self.leader.set(1)
        # Series that exist from the start: increase() over a counter born at its first
        # increment is 0, so the alerts on these would miss the first event.
        for code in CODES:
            self.deltas_rejected.labels(code=code)
        for verdict in ("allow", "deny"):
            for kind in (*(k.value for k in ArtifactKind), "admission"):
                self.policy_decisions.labels(verdict=verdict, kind=kind)

    def job_started(self, job: str, regions: Iterable[str]) -> None:
        """Create a job's round counters at zero (see ``__init__``)."""
        self.rounds_completed.labels(job=job)
        self.rounds_failed.labels(job=job)
        for where in ("region", "coordinator"):
            self.evaluations.labels(job=job, where=where)
        for region in regions:
            self.stragglers.labels(job=job, region=region)

    def policy_decision(self, allowed: bool, kind: str) -> None:
        self.policy_decisions.labels(verdict="allow" if allowed else "deny", kind=kind).inc()


class StandbyMetrics:
    """A standby coordinator's collectors (:data:`STANDBY_CATALOGUE`), in ``registry``.

    It exports that it does not lead, so that Prometheus scraping every coordinator's own
    address sees a healthy standby as up, and alerts when no coordinator leads.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.leader = gauge(LEADER, registry)
        self.leader.set(0)
        self.standby_info = gauge(STANDBY_INFO, registry)
        self.saw("")

    def saw(self, leader: str) -> None:
        """The lease holder seen now ('' unknown) replaces the one seen before."""
        self.standby_info.clear()
        self.standby_info.labels(leader=leader).set(1)
