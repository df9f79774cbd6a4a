"""The regional agent's metric catalogue and collectors (regional_agent.metrics)."""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from geofed.types import ArtifactKind
from regional_agent.handoff.training_stats import RankTiming, TrainingStats
from regional_agent.metrics import ACCELERATOR_ONLY, CATALOGUE, AgentMetrics, MetricsError
from regional_agent.telemetry.node import GpuSample, NodeSample

#: A round measured on one H100 (bf16 peak 989e12 FLOPs/s per device).
GPU_ROUND = TrainingStats(
    step_seconds=0.25,
    tokens_per_second=100_000.0,
    data_wait_seconds=0.5,
    learning_rate=3e-4,
    grad_norm=1.5,
    flops_per_token=6 * 125e6,
    comm_seconds=2.0,
    peak_memory_bytes=40 * 2**30,
    accelerator="NVIDIA H100 80GB HBM3",
)
#: The same on the CPU under FSDP: no memory peak, no all-reduce time, no known peak.
CPU_ROUND = TrainingStats(
    step_seconds=0.5,
    tokens_per_second=2_000.0,
    data_wait_seconds=0.1,
    learning_rate=1e-3,
    grad_norm=0.75,
    flops_per_token=6e6,
)

NODE = NodeSample(64 * 2**30, 48 * 2**30, 100 * 2**30, 500 * 2**30)
ONE_GPU = GpuSample(
    0, 0.9, 40 * 2**30, 80 * 2**30, 71.0, 450.0, 3, 0, frozenset({"sw_power_cap"}), {79: 1}
)
TWO_RANKS = (RankTiming(0, 0, 0.25, 0.1), RankTiming(1, 1, 0.5, 0.3))


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def metrics(registry, clock) -> AgentMetrics:
    return AgentMetrics(registry, "eu-west", clock=clock)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"region": "eu-west", **labels})


# -- the catalogue ------------------------------------------------------------------------


def test_catalogue_names_follow_prometheus_conventions():
    names = [spec.name for spec in CATALOGUE]
    assert len(names) == len(set(names))
    for spec in CATALOGUE:
        assert re.fullmatch(r"geofed_agent_[a-z0-9_]+", spec.name), spec.name
        assert spec.name.endswith("_total") == (spec.kind == "counter"), spec.name
        assert "region" in spec.labels, spec.name
        assert len(set(spec.labels)) == len(spec.labels), spec.name
        assert spec.help.endswith("."), spec.name
        if spec.kind == "histogram" or "_seconds" in spec.name:
            assert re.search(r"_(seconds|timestamp_seconds)(_total)?$", spec.name), spec.name


def test_catalogue_has_what_operators_and_the_rules_need():
    names = {spec.name for spec in CATALOGUE}
    assert {
        "geofed_agent_worker_restarts_total",
        "geofed_agent_rounds_trained_total",
        "geofed_agent_upload_bytes_total",
        "geofed_agent_upload_retries_total",
        "geofed_agent_download_bytes_total",
        "geofed_agent_fp32_equivalent_bytes_total",
        "geofed_agent_resyncs_total",
        "geofed_agent_train_loss",
        "geofed_agent_round",
        "geofed_agent_mqtt_connected",
        "geofed_agent_policy_denials_total",
        "geofed_agent_certificate_expiry_timestamp_seconds",
        "geofed_agent_train_seconds_total",
        "geofed_agent_wall_seconds_total",
        "geofed_agent_train_step_seconds",
        "geofed_agent_train_tokens_per_second",
        "geofed_agent_mfu_ratio",
        "geofed_agent_peak_accelerator_memory_bytes",
        "geofed_agent_data_wait_seconds",
        "geofed_agent_allreduce_seconds",
        "geofed_agent_learning_rate",
        "geofed_agent_grad_norm",
    } <= names
    assert names >= ACCELERATOR_ONLY


def _populate(metrics: AgentMetrics) -> None:
    metrics.set_participating(True)
    metrics.round_trained("charlm", 4, 2.5)
    metrics.round_ended("charlm", "accepted")
    metrics.resynced("charlm")
    metrics.observe_worker_restarts(1)
    metrics.upload_finished(sent_bytes=1200, attempts=2, seconds=3.5)
    metrics.delta_accepted("int8", encoded_bytes=1000, fp32_bytes=4000)
    metrics.downloaded(ArtifactKind.GLOBAL_UPDATE, 900)
    metrics.download_applied("int8", 4000)
    metrics.policy_denied(ArtifactKind.MODEL_DELTA)
    metrics.set_mqtt_connected(True)
    metrics.set_certificate_expiry("identity", datetime(2030, 1, 1, tzinfo=UTC))
    metrics.round_measured("charlm", GPU_ROUND, devices=1, precision="bf16")
    metrics.round_phases("charlm", {"sync": 1.5, "wait": 30.0})
    metrics.ranks_measured("charlm", TWO_RANKS, stragglers={1})
    metrics.hardware.sampled("gpu-node-1", NODE, [ONE_GPU])


def test_every_catalogued_metric_is_exposed_as_declared_and_nothing_else(registry, metrics):
    _populate(metrics)
    exposed = {
        family.name: family
        for family in text_string_to_metric_families(generate_latest(registry).decode())
    }
    for spec in CATALOGUE:
        # The text format names a counter family by its stem.
        family = exposed.pop(
            spec.name.removesuffix("_total") if spec.kind == "counter" else spec.name
        )
        assert family.type == spec.kind, spec.name
        assert family.documentation == spec.help, spec.name
        own = {s.name for s in family.samples}
        assert own, f"{spec.name} exposes no sample"
        for s in family.samples:
            assert set(s.labels) - {"le"} == set(spec.labels), (spec.name, s.labels)
    # prometheus_client's companion *_created gauges are all that is left.
    assert all(name.endswith("_created") for name in exposed), sorted(exposed)


def test_collectors_go_to_the_registry_passed_in(registry):
    AgentMetrics(registry, "eu-west")
    AgentMetrics(CollectorRegistry(), "eu-west")  # a second agent elsewhere: no clash
    text = generate_latest(prometheus_client.REGISTRY).decode()
    assert "geofed_agent_" not in text
    with pytest.raises(ValueError, match="Duplicated"):
        AgentMetrics(registry, "eu-west")


def test_a_bad_region_name_is_refused():
    with pytest.raises(MetricsError, match="region"):
        AgentMetrics(CollectorRegistry(), "EU West")


def test_series_the_rules_take_increases_of_exist_from_the_start(registry, metrics):
    """increase() misses a counter's first step if the series appears with it."""
    assert sample(registry, "geofed_agent_worker_restarts_total") == 0
    assert sample(registry, "geofed_agent_upload_retries_total") == 0
    assert sample(registry, "geofed_agent_mqtt_connected") == 0
    for kind in ArtifactKind:
        assert sample(registry, "geofed_agent_policy_denials_total", kind=kind.value) == 0


# -- utilisation: train and wall seconds --------------------------------------------------


def test_wall_time_runs_while_participating_and_train_time_while_training(registry, metrics, clock):
    metrics.set_participating(True)
    clock.now += 10
    with metrics.training():
        clock.now += 60
        # A scrape in the middle of a round sees the time so far.
        assert sample(registry, "geofed_agent_train_seconds_total") == 60
        clock.now += 20
    clock.now += 10
    metrics.set_participating(False)
    clock.now += 500  # idle: no job to take part in
    assert metrics.times() == (80, 100)
    assert sample(registry, "geofed_agent_train_seconds_total") == 80
    assert sample(registry, "geofed_agent_wall_seconds_total") == 100


def test_training_counts_as_wall_time_so_utilisation_never_exceeds_one(metrics, clock):
    with metrics.training():
        clock.now += 30
    clock.now += 30
    assert metrics.times() == (30, 30)


def test_training_time_stops_when_the_block_raises(metrics, clock):
    def crash() -> None:
        with metrics.training():
            clock.now += 5
            raise RuntimeError("worker group failed")

    with pytest.raises(RuntimeError):
        crash()
    clock.now += 100
    assert metrics.times() == (5, 5)


def test_training_is_not_reentrant_and_a_nested_try_changes_nothing(metrics, clock):
    with metrics.training():
        clock.now += 5
        with pytest.raises(MetricsError, match="already"), metrics.training():
            pass
        clock.now += 5
    assert metrics.times() == (10, 10)


def test_a_clock_stepping_back_never_makes_the_counters_decrease(metrics, clock):
    metrics.set_participating(True)
    clock.now += 10
    before = metrics.times()
    clock.now -= 50
    metrics.set_participating(False)
    assert metrics.times() == before == (0, 10)


# -- rounds -------------------------------------------------------------------------------


def test_round_trained_counts_and_sets_round_and_loss(registry, metrics):
    metrics.round_trained("charlm", 3, 2.75)
    metrics.round_trained("charlm", 4, None)
    assert sample(registry, "geofed_agent_rounds_trained_total", job="charlm") == 2
    assert sample(registry, "geofed_agent_round", job="charlm") == 4
    assert sample(registry, "geofed_agent_train_loss", job="charlm") == 2.75


@pytest.mark.parametrize(
    ("job", "round_", "loss", "message"),
    [
        ("charlm", 5, math.nan, "finite"),
        ("charlm", 5, math.inf, "finite"),
        ("charlm", -1, 1.0, "round"),
        ("Char LM", 5, 1.0, "job"),
    ],
)
def test_round_trained_refuses_bad_values_and_records_nothing(
    registry, metrics, job, round_, loss, message
):
    metrics.round_trained("charlm", 4, 2.0)
    with pytest.raises(MetricsError, match=message):
        metrics.round_trained(job, round_, loss)
    assert sample(registry, "geofed_agent_rounds_trained_total", job="charlm") == 1
    assert sample(registry, "geofed_agent_round", job="charlm") == 4
    assert sample(registry, "geofed_agent_train_loss", job="charlm") == 2.0


def test_round_outcomes_are_a_fixed_set(registry, metrics):
    metrics.round_ended("charlm", "straggler")
    assert (
        sample(registry, "geofed_agent_round_outcomes_total", job="charlm", outcome="straggler")
        == 1
    )
    with pytest.raises(MetricsError, match="outcome must be one of accepted, failed"):
        metrics.round_ended("charlm", "late")


def test_worker_restarts_follow_the_groups_running_count(registry, metrics):
    for total in (0, 2, 2, 3):
        metrics.observe_worker_restarts(total)
    assert sample(registry, "geofed_agent_worker_restarts_total") == 3
    metrics.observe_worker_restarts(1)  # a new worker group counts from zero
    assert sample(registry, "geofed_agent_worker_restarts_total") == 4
    with pytest.raises(MetricsError, match=">= 0"):
        metrics.observe_worker_restarts(-1)
    assert sample(registry, "geofed_agent_worker_restarts_total") == 4


def test_forget_job_drops_its_series_only(registry, metrics):
    metrics.round_trained("charlm", 3, 2.0)
    metrics.round_ended("charlm", "accepted")
    metrics.resynced("charlm")
    metrics.round_trained("other", 1, 1.0)
    metrics.forget_job("charlm")
    text = generate_latest(registry).decode()
    assert 'job="charlm"' not in text
    assert sample(registry, "geofed_agent_round", job="other") == 1
    metrics.forget_job("never-seen")  # nothing to drop is fine


# -- training inside the region -----------------------------------------------------------


def test_round_measured_exports_what_the_workers_measured(registry, metrics):
    metrics.round_measured("charlm", GPU_ROUND, devices=1, precision="bf16")

    def gauge(name: str) -> float | None:
        return sample(registry, name, job="charlm")

    assert gauge("geofed_agent_train_step_seconds") == 0.25
    assert gauge("geofed_agent_train_tokens_per_second") == 100_000.0
    assert gauge("geofed_agent_data_wait_seconds") == 0.5
    assert gauge("geofed_agent_allreduce_seconds") == 2.0
    assert gauge("geofed_agent_learning_rate") == 3e-4
    assert gauge("geofed_agent_grad_norm") == 1.5
    assert gauge("geofed_agent_peak_accelerator_memory_bytes") == 40 * 2**30
    # 1e5 tokens/s x 7.5e8 FLOPs per token over one H100's 989e12 bf16 FLOPs/s.
    assert math.isclose(gauge("geofed_agent_mfu_ratio") or 0, 7.5e13 / 989e12)


def test_mfu_counts_every_device_and_follows_the_precision(registry, metrics):
    metrics.round_measured("charlm", GPU_ROUND, devices=4, precision="fp32")
    mfu = sample(registry, "geofed_agent_mfu_ratio", job="charlm")
    assert mfu is not None
    assert math.isclose(mfu, 7.5e13 / (4 * 67e12))


def test_unknown_figures_are_not_exported_and_an_older_rounds_are_dropped(registry, metrics):
    metrics.round_measured("charlm", GPU_ROUND, devices=1, precision="bf16")
    metrics.round_measured("charlm", CPU_ROUND, devices=2, precision="fp32")
    assert sample(registry, "geofed_agent_train_step_seconds", job="charlm") == 0.5
    for name in (
        "geofed_agent_mfu_ratio",
        "geofed_agent_peak_accelerator_memory_bytes",
        "geofed_agent_allreduce_seconds",
    ):
        assert sample(registry, name, job="charlm") is None, name


def test_the_operators_peak_flops_gives_an_mfu_on_any_device(registry, clock):
    metrics = AgentMetrics(registry, "eu-west", clock=clock, peak_flops=1e11)
    metrics.round_measured("charlm", CPU_ROUND, devices=2, precision="fp32")
    mfu = sample(registry, "geofed_agent_mfu_ratio", job="charlm")
    assert mfu is not None
    assert math.isclose(mfu, 2_000.0 * 6e6 / (2 * 1e11))
    with pytest.raises(MetricsError, match="peak_flops"):
        AgentMetrics(CollectorRegistry(), "eu-west", peak_flops=0.0)


def test_forget_job_drops_the_training_gauges(registry, metrics):
    metrics.round_measured("charlm", GPU_ROUND, devices=1, precision="bf16")
    metrics.forget_job("charlm")
    assert 'job="charlm"' not in generate_latest(registry).decode()


# -- transfers ----------------------------------------------------------------------------


def test_upload_counts_bytes_retries_and_duration(registry, metrics):
    metrics.upload_finished(sent_bytes=3000, attempts=3, seconds=42.0)
    metrics.upload_finished(sent_bytes=1000, attempts=1, seconds=8.0)
    assert sample(registry, "geofed_agent_upload_bytes_total") == 4000
    assert sample(registry, "geofed_agent_upload_retries_total") == 2
    assert sample(registry, "geofed_agent_upload_duration_seconds_count") == 2
    assert sample(registry, "geofed_agent_upload_duration_seconds_sum") == 50
    # WAN-sized buckets: a 42 s upload is not lumped into +Inf.
    assert sample(registry, "geofed_agent_upload_duration_seconds_bucket", le="60.0") == 2


@pytest.mark.parametrize(
    ("sent", "attempts", "seconds", "message"),
    [
        (-1, 1, 1.0, "sent_bytes"),
        (True, 1, 1.0, "sent_bytes"),
        (10, 0, 1.0, "at least one attempt"),
        (10, 1, -1.0, "duration"),
        (10, 1, math.nan, "duration"),
    ],
)
def test_upload_refuses_bad_values_and_records_nothing(
    registry, metrics, sent, attempts, seconds, message
):
    with pytest.raises(MetricsError, match=message):
        metrics.upload_finished(sent_bytes=sent, attempts=attempts, seconds=seconds)
    assert sample(registry, "geofed_agent_upload_bytes_total") == 0
    assert sample(registry, "geofed_agent_upload_retries_total") == 0
    assert sample(registry, "geofed_agent_upload_duration_seconds_count") is None


def test_accepted_deltas_give_the_codecs_compression_ratio(registry, metrics):
    metrics.delta_accepted("int8", encoded_bytes=1000, fp32_bytes=3900)
    metrics.delta_accepted("int8", encoded_bytes=1000, fp32_bytes=4100)
    fp32 = sample(
        registry, "geofed_agent_fp32_equivalent_bytes_total", direction="upload", scheme="int8"
    )
    encoded = sample(registry, "geofed_agent_delta_bytes_total", scheme="int8")
    assert fp32 is not None
    assert encoded is not None
    assert fp32 / encoded == 4.0
    with pytest.raises(MetricsError, match="scheme must be one of fp32, int4, int8"):
        metrics.delta_accepted("int2", encoded_bytes=1, fp32_bytes=8)
    assert sample(registry, "geofed_agent_delta_bytes_total", scheme="int8") == 2000


def test_downloads_count_updates_and_checkpoints_only(registry, metrics):
    metrics.downloaded(ArtifactKind.GLOBAL_UPDATE, 500)
    metrics.downloaded(ArtifactKind.GLOBAL_CHECKPOINT, 8000)
    metrics.download_applied("int8", 2000)
    assert sample(registry, "geofed_agent_download_bytes_total", kind="global_update") == 500
    assert sample(registry, "geofed_agent_download_bytes_total", kind="global_checkpoint") == 8000
    assert (
        sample(
            registry,
            "geofed_agent_fp32_equivalent_bytes_total",
            direction="download",
            scheme="int8",
        )
        == 2000
    )
    with pytest.raises(MetricsError, match="download kind"):
        metrics.downloaded(ArtifactKind.RAW_DATA, 1)
    with pytest.raises(MetricsError, match="download kind"):
        metrics.downloaded("global_update", 1)
    assert sample(registry, "geofed_agent_download_bytes_total", kind="raw_data") is None


def test_policy_denials_are_counted_by_artifact_kind(registry, metrics):
    metrics.policy_denied(ArtifactKind.MODEL_DELTA)
    metrics.policy_denied(ArtifactKind.MODEL_DELTA)
    assert sample(registry, "geofed_agent_policy_denials_total", kind="model_delta") == 2
    with pytest.raises(MetricsError, match="ArtifactKind"):
        metrics.policy_denied("model_delta")


# -- state --------------------------------------------------------------------------------


def test_mqtt_connection_state(registry, metrics):
    metrics.set_mqtt_connected(True)
    assert sample(registry, "geofed_agent_mqtt_connected") == 1
    metrics.set_mqtt_connected(False)
    assert sample(registry, "geofed_agent_mqtt_connected") == 0


def test_certificate_expiry_is_unix_seconds_of_not_after(registry, metrics):
    not_after = datetime(2031, 6, 1, 12, 0, tzinfo=UTC)
    metrics.set_certificate_expiry("identity", not_after)
    value = sample(
        registry, "geofed_agent_certificate_expiry_timestamp_seconds", certificate="identity"
    )
    assert value == not_after.timestamp()
    with pytest.raises(MetricsError, match="timezone-aware"):
        metrics.set_certificate_expiry("tls", datetime(2031, 6, 1))
    with pytest.raises(MetricsError, match="certificate must be one of"):
        metrics.set_certificate_expiry("signing", not_after + timedelta(days=1))
    text = generate_latest(registry).decode()
    assert 'certificate="tls"' not in text
    assert 'certificate="signing"' not in text


def test_ranks_measured_exports_each_rank_and_drops_ranks_that_left(registry, metrics):
    metrics.ranks_measured("charlm", TWO_RANKS, stragglers={1})

    def rank(name: str, rank: str, node: str) -> float | None:
        return sample(registry, name, job="charlm", rank=rank, node=node)

    assert rank("geofed_agent_rank_busy_seconds", "0", "0") == 0.25
    assert rank("geofed_agent_rank_busy_seconds", "1", "1") == 0.5
    assert rank("geofed_agent_rank_data_wait_seconds", "1", "1") == 0.3
    assert rank("geofed_agent_rank_straggler", "0", "0") == 0.0
    assert rank("geofed_agent_rank_straggler", "1", "1") == 1.0
    # Relaunched without node 1: its series go, rank 0's stay.
    metrics.ranks_measured("charlm", TWO_RANKS[:1], stragglers=set())
    assert rank("geofed_agent_rank_busy_seconds", "1", "1") is None
    assert rank("geofed_agent_rank_straggler", "1", "1") is None
    assert rank("geofed_agent_rank_busy_seconds", "0", "0") == 0.25
    # Not measured (FSDP): no busy time, the rest stays.
    metrics.ranks_measured("charlm", (RankTiming(0, 0, None, 0.2),), stragglers=set())
    assert rank("geofed_agent_rank_busy_seconds", "0", "0") is None
    assert rank("geofed_agent_rank_data_wait_seconds", "0", "0") == 0.2
    metrics.forget_job("charlm")
    assert 'job="charlm"' not in generate_latest(registry).decode()
