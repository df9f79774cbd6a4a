"""The regional agent's Prometheus metrics: the one catalogue of names, and their collectors.

Alert rules (``deploy/prometheus``) and the dashboard (``deploy/grafana``) reference the
names in :data:`CATALOGUE`; change a name here and there together. Conventions: prefix
``geofed_agent_``, base units (seconds, bytes), counters end in ``_total``, timestamps
are Unix seconds. Labels take only bounded values: ``region`` is the agent's own name,
``job`` comes from announcements of admitted jobs, ``kind``, ``direction``, ``scheme``,
``outcome`` and ``certificate`` from fixed sets checked here.

Compute utilisation is ``rate(geofed_agent_train_seconds_total) /
rate(geofed_agent_wall_seconds_total)``: both grow with the clock while their state is
on (:meth:`AgentMetrics.training`, :meth:`AgentMetrics.set_participating`), so a scrape
in the middle of a long round sees the time spent so far. The codec's compression ratio
is ``geofed_agent_fp32_equivalent_bytes_total{direction="upload"} /
geofed_agent_delta_bytes_total`` (both counted when the coordinator accepts a delta);
``geofed_agent_upload_bytes_total`` adds what retries re-sent (the WAN's cost).
``geofed_agent_round_phase_seconds{phase}`` shows where each finished round's time went
(:mod:`regional_agent.rounds.timeline`: sync, train, encode, upload, wait).

Inside the region, each trained round sets what its workers measured
(:class:`~regional_agent.handoff.training_stats.TrainingStats`): step time, tokens/s, time
waiting for data and in the gradient all-reduce, learning rate, gradient norm, peak
accelerator memory, and the model FLOPs utilisation (:mod:`regional_agent.handoff.flops`). A
figure that is unknown is not exported (no sample) rather than zero:
:data:`ACCELERATOR_ONLY` names those a CPU region never has, and the MFU needs a known
device or the operator's ``workers.peak_flops``; the all-reduce time exists under DDP.

The registry is always passed in (never the process-global one).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Final

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from geofed import codec_params
from geofed.metric_spec import MetricSpec, counter, gauge, histogram, set_or_remove
from geofed.training_config import Precision
from geofed.types import ArtifactKind, InvalidName, validate_name
from regional_agent.handoff.flops import flops_utilisation, peak_flops
from regional_agent.handoff.training_stats import RankTiming, TrainingStats
from regional_agent.telemetry.metrics import HARDWARE, HardwareMetrics

__all__ = [
    "ACCELERATOR_ONLY",
    "CATALOGUE",
    "CERTIFICATES",
    "DIRECTIONS",
    "DOWNLOAD_KINDS",
    "OUTCOMES",
    "PHASE_BUCKETS_S",
    "ROUND_PHASES",
    "SCHEMES",
    "TRANSFER_BUCKETS_S",
    "AgentMetrics",
    "MetricsError",
]

#: WAN transfers of a delta: from a second up to two hours (the client library's
#: default buckets stop at 10 s).
TRANSFER_BUCKETS_S: Final = (
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0,
)  # fmt: skip

#: Phases of a round: from a tenth of a second (encoding a small delta) to two hours.
PHASE_BUCKETS_S: Final = (
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0,
)  # fmt: skip
#: The phases of :mod:`regional_agent.rounds.timeline`.
ROUND_PHASES: Final = frozenset({"sync", "train", "encode", "upload", "wait"})
DIRECTIONS: Final = frozenset({"upload", "download"})
SCHEMES: Final = frozenset(codec_params.SCHEMES)
OUTCOMES: Final = frozenset({"accepted", "straggler", "refused", "failed"})
DOWNLOAD_KINDS: Final = frozenset({ArtifactKind.GLOBAL_UPDATE, ArtifactKind.GLOBAL_CHECKPOINT})
CERTIFICATES: Final = frozenset({"identity", "tls", "mqtt"})

Clock = Callable[[], float]


class MetricsError(ValueError):
    """A value or label the catalogue does not allow; nothing was recorded."""


WORKER_RESTARTS = MetricSpec(
    "geofed_agent_worker_restarts_total",
    "counter",
    "Worker-group restarts of any kind: in place by the launcher, or relaunches.",
    ("region",),
)
NODES_EXCLUDED = MetricSpec(
    "geofed_agent_nodes_excluded",
    "gauge",
    "Nodes of the worker group left out for straggling (workers.stragglers.exclude).",
    ("region",),
)
ROUNDS_TRAINED = MetricSpec(
    "geofed_agent_rounds_trained_total",
    "counter",
    "Rounds whose inner steps the worker group finished.",
    ("job", "region"),
)
ROUND_OUTCOMES = MetricSpec(
    "geofed_agent_round_outcomes_total",
    "counter",
    "How rounds ended for this region: accepted, straggler, refused or failed.",
    ("job", "region", "outcome"),
)
ROUND = MetricSpec(
    "geofed_agent_round", "gauge", "The round this region trained last.", ("job", "region")
)
TRAIN_LOSS = MetricSpec(
    "geofed_agent_train_loss",
    "gauge",
    "Training loss of this region's latest trained round.",
    ("job", "region"),
)
TRAIN_SECONDS = MetricSpec(
    "geofed_agent_train_seconds_total",
    "counter",
    "Seconds the worker group spent training inner steps.",
    ("region",),
)
WALL_SECONDS = MetricSpec(
    "geofed_agent_wall_seconds_total",
    "counter",
    "Seconds the agent had a running job to take part in (or was training).",
    ("region",),
)
UPLOAD_BYTES = MetricSpec(
    "geofed_agent_upload_bytes_total",
    "counter",
    "Delta bytes sent to the coordinator, re-sent chunks included.",
    ("region",),
)
UPLOAD_RETRIES = MetricSpec(
    "geofed_agent_upload_retries_total",
    "counter",
    "Upload attempts after the first one of each delta.",
    ("region",),
)
UPLOAD_DURATION = MetricSpec(
    "geofed_agent_upload_duration_seconds",
    "histogram",
    "Time to upload one delta, retries included.",
    ("region",),
)
ROUND_PHASE_SECONDS = MetricSpec(
    "geofed_agent_round_phase_seconds",
    "histogram",
    "Seconds of each phase of a finished round: sync, train, encode, upload, wait.",
    ("job", "region", "phase"),
)
DELTA_BYTES = MetricSpec(
    "geofed_agent_delta_bytes_total",
    "counter",
    "Encoded size of the deltas the coordinator accepted, once each.",
    ("region", "scheme"),
)
DOWNLOAD_BYTES = MetricSpec(
    "geofed_agent_download_bytes_total",
    "counter",
    "Bytes of global updates and checkpoints received from the coordinator.",
    ("region", "kind"),
)
FP32_EQUIVALENT_BYTES = MetricSpec(
    "geofed_agent_fp32_equivalent_bytes_total",
    "counter",
    "What accepted deltas (upload) and applied downloads (download) weigh as raw float32.",
    ("region", "direction", "scheme"),
)
RESYNCS = MetricSpec(
    "geofed_agent_resyncs_total",
    "counter",
    "Full resyncs from the latest global checkpoint.",
    ("job", "region"),
)
MQTT_CONNECTED = MetricSpec(
    "geofed_agent_mqtt_connected",
    "gauge",
    "1 while the control-plane connection is up.",
    ("region",),
)
POLICY_DENIALS = MetricSpec(
    "geofed_agent_policy_denials_total",
    "counter",
    "Transfers the region's own policy refused, by artifact kind.",
    ("region", "kind"),
)
CERTIFICATE_EXPIRY = MetricSpec(
    "geofed_agent_certificate_expiry_timestamp_seconds",
    "gauge",
    "notAfter of the agent's certificates (identity, tls, mqtt).",
    ("region", "certificate"),
)

TRAIN_STEP_SECONDS = MetricSpec(
    "geofed_agent_train_step_seconds",
    "gauge",
    "Mean wall time of one optimizer step in this region's latest trained round.",
    ("job", "region"),
)
TRAIN_TOKENS_PER_SECOND = MetricSpec(
    "geofed_agent_train_tokens_per_second",
    "gauge",
    "Tokens the region's worker group trained per second in its latest round.",
    ("job", "region"),
)
MFU = MetricSpec(
    "geofed_agent_mfu_ratio",
    "gauge",
    "Model FLOPs utilisation of the latest round: achieved over peak FLOPs of the devices.",
    ("job", "region"),
)
PEAK_ACCELERATOR_MEMORY = MetricSpec(
    "geofed_agent_peak_accelerator_memory_bytes",
    "gauge",
    "Peak accelerator memory allocated by the largest rank in the latest round.",
    ("job", "region"),
)
DATA_WAIT_SECONDS = MetricSpec(
    "geofed_agent_data_wait_seconds",
    "gauge",
    "Seconds the slowest rank waited for training batches in the latest round.",
    ("job", "region"),
)
ALLREDUCE_SECONDS = MetricSpec(
    "geofed_agent_allreduce_seconds",
    "gauge",
    "Seconds with a data-parallel collective in flight (DDP: the gradient all-reduce; FSDP: the "
    "all-gathers and reduce-scatters) on the rank with the most in the latest round.",
    ("job", "region"),
)
LEARNING_RATE = MetricSpec(
    "geofed_agent_learning_rate",
    "gauge",
    "Learning rate of the last inner step of the latest round.",
    ("job", "region"),
)
GRAD_NORM = MetricSpec(
    "geofed_agent_grad_norm",
    "gauge",
    "Global gradient L2 norm at the last inner step of the latest round, before clipping.",
    ("job", "region"),
)

RANK_BUSY_SECONDS = MetricSpec(
    "geofed_agent_rank_busy_seconds",
    "gauge",
    "Approximate seconds a step each rank did not wait for its peers in the latest round "
    "(DDP and FSDP).",
    ("job", "region", "rank", "node"),
)
RANK_DATA_WAIT_SECONDS = MetricSpec(
    "geofed_agent_rank_data_wait_seconds",
    "gauge",
    "Seconds each rank waited for training batches in the latest trained round.",
    ("job", "region", "rank", "node"),
)
RANK_STRAGGLER = MetricSpec(
    "geofed_agent_rank_straggler",
    "gauge",
    "1 while a rank is persistently slower than its peers (regional_agent/rounds/stragglers.py).",
    ("job", "region", "rank", "node"),
)
#: Per-rank gauges, set by :meth:`AgentMetrics.ranks_measured`.
PER_RANK: Final[tuple[MetricSpec, ...]] = (
    RANK_BUSY_SECONDS,
    RANK_DATA_WAIT_SECONDS,
    RANK_STRAGGLER,
)

#: Per-job training gauges, set by :meth:`AgentMetrics.round_measured`.
TRAINING: Final[tuple[MetricSpec, ...]] = (
    TRAIN_STEP_SECONDS,
    TRAIN_TOKENS_PER_SECOND,
    MFU,
    PEAK_ACCELERATOR_MEMORY,
    DATA_WAIT_SECONDS,
    ALLREDUCE_SECONDS,
    LEARNING_RATE,
    GRAD_NORM,
)

#: Names only an accelerator's worker group exports samples of (declared everywhere).
ACCELERATOR_ONLY: Final = frozenset(
    {PEAK_ACCELERATOR_MEMORY.name, *(spec.name for spec in HARDWARE if "_gpu" in spec.name)}
)

CATALOGUE: Final[tuple[MetricSpec, ...]] = (
    WORKER_RESTARTS,
    NODES_EXCLUDED,
    ROUNDS_TRAINED,
    ROUND_OUTCOMES,
    ROUND,
    TRAIN_LOSS,
    TRAIN_SECONDS,
    WALL_SECONDS,
    UPLOAD_BYTES,
    UPLOAD_RETRIES,
    UPLOAD_DURATION,
    ROUND_PHASE_SECONDS,
    DELTA_BYTES,
    DOWNLOAD_BYTES,
    FP32_EQUIVALENT_BYTES,
    RESYNCS,
    MQTT_CONNECTED,
    POLICY_DENIALS,
    CERTIFICATE_EXPIRY,
    *TRAINING,
    *PER_RANK,
    *HARDWARE,
)


class _Stopwatches(Collector):
    """Train and wall seconds as counters that grow with the clock while switched on.

    Wall time runs while the agent participates *or* trains, so train <= wall always
    holds and utilisation never exceeds 1.
    """

    def __init__(self, region: str, clock: Clock) -> None:
        self._region = region
        self._clock = clock
        self._lock = threading.Lock()
        self._training_since: float | None = None
        self._wall_since: float | None = None
        self._participating = False
        # Closed intervals so far; what a scrape saw last (a counter never goes back).
        self._train_s = 0.0
        self._wall_s = 0.0
        self._seen = (0.0, 0.0)

    def set(self, *, training: bool | None = None, participating: bool | None = None) -> None:
        with self._lock:
            now = self._clock()
            train_s, wall_s = self._totals(now)
            if training is not None and training != (self._training_since is not None):
                self._train_s = train_s
                self._training_since = now if training else None
            if participating is not None:
                self._participating = participating
            wall = self._participating or self._training_since is not None
            if wall != (self._wall_since is not None):
                self._wall_s = wall_s
                self._wall_since = now if wall else None

    @property
    def training(self) -> bool:
        return self._training_since is not None

    def totals(self) -> tuple[float, float]:
        """(train, wall) seconds up to now."""
        with self._lock:
            return self._totals(self._clock())

    def _totals(self, now: float) -> tuple[float, float]:
        train_s = self._train_s + _elapsed(self._training_since, now)
        wall_s = self._wall_s + _elapsed(self._wall_since, now)
        # A clock that steps back must not make a counter decrease.
        self._seen = (max(self._seen[0], train_s), max(self._seen[1], wall_s))
        return self._seen

    def describe(self) -> Iterable[CounterMetricFamily]:
        return self._families(0.0, 0.0, with_samples=False)

    def collect(self) -> Iterable[CounterMetricFamily]:
        return self._families(*self.totals(), with_samples=True)

    def _families(
        self, train_s: float, wall_s: float, *, with_samples: bool
    ) -> list[CounterMetricFamily]:
        families = []
        for spec, value in ((TRAIN_SECONDS, train_s), (WALL_SECONDS, wall_s)):
            family = CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
            if with_samples:
                family.add_metric([self._region], value)
            families.append(family)
        return families


def _elapsed(since: float | None, now: float) -> float:
    return 0.0 if since is None else max(0.0, now - since)


class AgentMetrics:
    """Every collector of the catalogue for the agent of ``region``, registered in ``registry``.

    The methods record one event each and check their arguments first: a bad argument
    raises :class:`MetricsError` and records nothing. ``clock`` is a monotonic clock in
    seconds (injected by tests). ``peak_flops`` is the operator's peak FLOPs/s of one
    of this node's devices (``workers.peak_flops``), for the MFU where the device is not
    in :data:`regional_agent.handoff.flops.PEAK_FLOPS`.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        region: str,
        *,
        clock: Clock = time.monotonic,
        peak_flops: float | None = None,
    ) -> None:
        try:
            self.region = validate_name("region", region)
        except InvalidName as exc:
            raise MetricsError(str(exc)) from None
        self.registry = registry
        self.worker_restarts = counter(WORKER_RESTARTS, registry)
        self.nodes_excluded_gauge = gauge(NODES_EXCLUDED, registry)
        self.rounds_trained = counter(ROUNDS_TRAINED, registry)
        self.round_outcomes = counter(ROUND_OUTCOMES, registry)
        self.round = gauge(ROUND, registry)
        self.train_loss = gauge(TRAIN_LOSS, registry)
        self.upload_bytes = counter(UPLOAD_BYTES, registry)
        self.upload_retries = counter(UPLOAD_RETRIES, registry)
        self.upload_duration = histogram(UPLOAD_DURATION, registry, TRANSFER_BUCKETS_S)
        self.round_phase_seconds = histogram(ROUND_PHASE_SECONDS, registry, PHASE_BUCKETS_S)
        self.delta_bytes = counter(DELTA_BYTES, registry)
        self.download_bytes = counter(DOWNLOAD_BYTES, registry)
        self.fp32_equivalent_bytes = counter(FP32_EQUIVALENT_BYTES, registry)
        self.resyncs = counter(RESYNCS, registry)
        self.mqtt_connected = gauge(MQTT_CONNECTED, registry)
        self.policy_denials = counter(POLICY_DENIALS, registry)
        self.certificate_expiry = gauge(CERTIFICATE_EXPIRY, registry)
        self.train_step_seconds = gauge(TRAIN_STEP_SECONDS, registry)
        self.train_tokens_per_second = gauge(TRAIN_TOKENS_PER_SECOND, registry)
        self.mfu = gauge(MFU, registry)
        self.peak_accelerator_memory = gauge(PEAK_ACCELERATOR_MEMORY, registry)
        self.data_wait_seconds = gauge(DATA_WAIT_SECONDS, registry)
        self.allreduce_seconds = gauge(ALLREDUCE_SECONDS, registry)
        self.learning_rate = gauge(LEARNING_RATE, registry)
        self.grad_norm = gauge(GRAD_NORM, registry)
        self.rank_busy_seconds = gauge(RANK_BUSY_SECONDS, registry)
        self.rank_data_wait_seconds = gauge(RANK_DATA_WAIT_SECONDS, registry)
        self.rank_straggler = gauge(RANK_STRAGGLER, registry)
        self._rank_series: dict[str, set[tuple[str, str]]] = {}
        self.hardware = HardwareMetrics(registry, self.region)
        if peak_flops is not None and not (math.isfinite(peak_flops) and peak_flops > 0):
            raise MetricsError(f"peak_flops must be a finite number > 0, got {peak_flops}")
        self._peak_flops = peak_flops
        self._stopwatches = _Stopwatches(self.region, clock)
        registry.register(self._stopwatches)
        self._restarts_seen = 0
        # Series that exist from the start, so the first increment is a visible increase.
        self.worker_restarts.labels(region=self.region)
        self.upload_bytes.labels(region=self.region)
        self.upload_retries.labels(region=self.region)
        self.mqtt_connected.labels(region=self.region).set(0)
        self.nodes_excluded_gauge.labels(region=self.region).set(0)
        for kind in ArtifactKind:
            self.policy_denials.labels(region=self.region, kind=kind.value)

    # -- time ------------------------------------------------------------------------

    @contextmanager
    def training(self) -> Iterator[None]:
        """Count the enclosed block as training time (not re-entrant)."""
        if self._stopwatches.training:
            raise MetricsError("training time is already being counted")
        self._stopwatches.set(training=True)
        try:
            yield
        finally:
            self._stopwatches.set(training=False)

    def set_participating(self, active: bool) -> None:
        """Whether the agent has a running job to take part in (wall time runs meanwhile)."""
        self._stopwatches.set(participating=active)

    def times(self) -> tuple[float, float]:
        """(train, wall) seconds counted so far."""
        return self._stopwatches.totals()

    # -- rounds ----------------------------------------------------------------------

    def round_trained(self, job: str, round_: int, loss: float | None) -> None:
        """The worker group finished ``round_`` of ``job``; ``loss`` if it reported one."""
        _check_job(job)
        if round_ < 0:
            raise MetricsError(f"round must be >= 0, got {round_}")
        if loss is not None and not math.isfinite(loss):
            raise MetricsError(f"training loss must be finite, got {loss}")
        self.rounds_trained.labels(job=job, region=self.region).inc()
        self.round.labels(job=job, region=self.region).set(round_)
        if loss is not None:
            self.train_loss.labels(job=job, region=self.region).set(loss)

    def round_measured(
        self, job: str, stats: TrainingStats, devices: int, precision: Precision
    ) -> None:
        """What the worker group measured training ``job``'s latest round on ``devices``.

        Figures it could not measure, and the MFU of a device of unknown peak, are
        removed rather than left at an older round's value.
        """
        _check_job(job)
        if devices < 1:
            raise MetricsError(f"devices must be >= 1, got {devices}")
        peak = peak_flops(stats.accelerator, precision, self._peak_flops)
        mfu = (
            None
            if peak is None
            else flops_utilisation(stats.tokens_per_second, stats.flops_per_token, peak, devices)
        )
        values: tuple[tuple[Gauge, float | None], ...] = (
            (self.train_step_seconds, stats.step_seconds),
            (self.train_tokens_per_second, stats.tokens_per_second),
            (self.mfu, mfu),
            (
                self.peak_accelerator_memory,
                None if stats.peak_memory_bytes is None else float(stats.peak_memory_bytes),
            ),
            (self.data_wait_seconds, stats.data_wait_seconds),
            (self.allreduce_seconds, stats.comm_seconds),
            (self.learning_rate, stats.learning_rate),
            (self.grad_norm, stats.grad_norm),
        )
        for collector, value in values:
            set_or_remove(collector, (job, self.region), value)

    def ranks_measured(
        self, job: str, timings: Sequence[RankTiming], stragglers: Collection[int]
    ) -> None:
        """Each rank's own times in ``job``'s latest round, and which ranks straggle; the
        series of ranks no longer in the group are removed."""
        _check_job(job)
        series = {(str(t.rank), str(t.node)) for t in timings}
        for rank, node in self._rank_series.get(job, set()) - series:
            for collector in self._rank_gauges():
                collector.remove(job, self.region, rank, node)
        self._rank_series[job] = series
        for t in timings:
            labels = (job, self.region, str(t.rank), str(t.node))
            set_or_remove(self.rank_busy_seconds, labels, t.busy_seconds)
            self.rank_data_wait_seconds.labels(*labels).set(t.data_wait_seconds)
            self.rank_straggler.labels(*labels).set(1.0 if t.rank in stragglers else 0.0)

    def _rank_gauges(self) -> tuple[Gauge, ...]:
        return (self.rank_busy_seconds, self.rank_data_wait_seconds, self.rank_straggler)

    def round_ended(self, job: str, outcome: str) -> None:
        """A round ended for this region: accepted, straggler, refused or failed."""
        _check_job(job)
        _check_member("outcome", outcome, OUTCOMES)
        self.round_outcomes.labels(job=job, region=self.region, outcome=outcome).inc()

    def round_phases(self, job: str, seconds: Mapping[str, float]) -> None:
        """A finished round's timeline: the seconds of each phase it went through."""
        _check_job(job)
        for phase, value in seconds.items():
            _check_member("phase", phase, ROUND_PHASES)
            if not (math.isfinite(value) and value >= 0):
                raise MetricsError(f"{phase} seconds must be a finite number >= 0, got {value}")
        for phase, value in seconds.items():
            self.round_phase_seconds.labels(job=job, region=self.region, phase=phase).observe(value)

    def resynced(self, job: str) -> None:
        """θ was rebuilt from the latest global checkpoint."""
        _check_job(job)
        self.resyncs.labels(job=job, region=self.region).inc()

    def nodes_excluded(self, count: int) -> None:
        """The worker group runs without ``count`` of its nodes (stragglers left out)."""
        self.nodes_excluded_gauge.labels(region=self.region).set(count)

    def observe_worker_restarts(self, total: int) -> None:
        """The worker group's own running count of restarts; counts what is new.

        A count lower than the last one seen is a new worker group starting from zero.
        """
        if total < 0:
            raise MetricsError(f"restart count must be >= 0, got {total}")
        new = total - self._restarts_seen if total >= self._restarts_seen else total
        self._restarts_seen = total
        if new:
            self.worker_restarts.labels(region=self.region).inc(new)

    def forget_job(self, job: str) -> None:
        """Drop the series of a job that ended, so its last loss and round stop showing."""
        _check_job(job)
        for collector in (self.rounds_trained, self.round, self.train_loss, self.resyncs):
            collector.remove(job, self.region)
        for collector in self._training_gauges():
            collector.remove(job, self.region)
        for rank, node in self._rank_series.pop(job, set()):
            for collector in self._rank_gauges():
                collector.remove(job, self.region, rank, node)
        for outcome in OUTCOMES:
            self.round_outcomes.remove(job, self.region, outcome)
        for phase in ROUND_PHASES:
            self.round_phase_seconds.remove(job, self.region, phase)

    def _training_gauges(self) -> tuple[Gauge, ...]:
        return (
            self.train_step_seconds,
            self.train_tokens_per_second,
            self.mfu,
            self.peak_accelerator_memory,
            self.data_wait_seconds,
            self.allreduce_seconds,
            self.learning_rate,
            self.grad_norm,
        )

    # -- transfers -------------------------------------------------------------------

    def upload_finished(self, sent_bytes: int, attempts: int, seconds: float) -> None:
        """One upload ended (accepted or not) after ``attempts`` tries sending ``sent_bytes``."""
        _check_bytes("sent_bytes", sent_bytes)
        if attempts < 1:
            raise MetricsError(f"an upload takes at least one attempt, got {attempts}")
        if not (math.isfinite(seconds) and seconds >= 0):
            raise MetricsError(f"upload duration must be a finite number >= 0, got {seconds}")
        self.upload_bytes.labels(region=self.region).inc(sent_bytes)
        self.upload_retries.labels(region=self.region).inc(attempts - 1)
        self.upload_duration.labels(region=self.region).observe(seconds)

    def delta_accepted(self, scheme: str, encoded_bytes: int, fp32_bytes: int) -> None:
        """The coordinator accepted a delta of ``encoded_bytes`` encoding ``fp32_bytes``."""
        _check_member("scheme", scheme, SCHEMES)
        _check_bytes("encoded_bytes", encoded_bytes)
        _check_bytes("fp32_bytes", fp32_bytes)
        self.delta_bytes.labels(region=self.region, scheme=scheme).inc(encoded_bytes)
        self.fp32_equivalent_bytes.labels(
            region=self.region, direction="upload", scheme=scheme
        ).inc(fp32_bytes)

    def downloaded(self, kind: ArtifactKind, received_bytes: int) -> None:
        """``received_bytes`` of a global update or checkpoint arrived (resumed parts too)."""
        if not isinstance(kind, ArtifactKind) or kind not in DOWNLOAD_KINDS:
            allowed = ", ".join(sorted(k.value for k in DOWNLOAD_KINDS))
            raise MetricsError(f"download kind must be one of {allowed}, got {kind!r}")
        _check_bytes("received_bytes", received_bytes)
        self.download_bytes.labels(region=self.region, kind=kind.value).inc(received_bytes)

    def download_applied(self, scheme: str, fp32_bytes: int) -> None:
        """A verified download of ``scheme`` was applied; it stands for ``fp32_bytes``."""
        _check_member("scheme", scheme, SCHEMES)
        _check_bytes("fp32_bytes", fp32_bytes)
        self.fp32_equivalent_bytes.labels(
            region=self.region, direction="download", scheme=scheme
        ).inc(fp32_bytes)

    def policy_denied(self, kind: ArtifactKind) -> None:
        """The region's own policy refused a transfer of ``kind``."""
        if not isinstance(kind, ArtifactKind):
            raise MetricsError(f"policy denial kind must be an ArtifactKind, got {kind!r}")
        self.policy_denials.labels(region=self.region, kind=kind.value).inc()

    # -- state -----------------------------------------------------------------------

    def set_mqtt_connected(self, connected: bool) -> None:
        self.mqtt_connected.labels(region=self.region).set(1 if connected else 0)

    def set_certificate_expiry(self, certificate: str, not_after: datetime) -> None:
        """``not_after`` (timezone-aware) of ``certificate``: identity, tls or mqtt."""
        _check_member("certificate", certificate, CERTIFICATES)
        if not_after.tzinfo is None:
            raise MetricsError(f"not_after must be timezone-aware, got {not_after.isoformat()}")
        self.certificate_expiry.labels(region=self.region, certificate=certificate).set(
            not_after.timestamp()
        )


def _check_job(job: str) -> None:
    try:
        validate_name("job", job)
    except InvalidName as exc:
        raise MetricsError(str(exc)) from None


def _check_member(what: str, value: str, allowed: frozenset[str]) -> None:
    if value not in allowed:
        raise MetricsError(f"{what} must be one of {', '.join(sorted(allowed))}, got {value!r}")


def _check_bytes(what: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MetricsError(f"{what} must be an integer >= 0, got {value!r}")
