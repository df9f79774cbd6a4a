"""The straggler rule inside a region (regional_agent/rounds/stragglers.py)."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from regional_agent.handoff.training_stats import RankTiming, TrainingStats
from regional_agent.metrics import AgentMetrics
from regional_agent.rounds.measurements import RoundMeasurements
from regional_agent.rounds.stragglers import StragglerRule, StragglerWatch, judge


def round_of(
    *seconds: float, nodes: tuple[int, ...] | None = None, hosts: tuple[str, ...] | None = None
) -> tuple[RankTiming, ...]:
    nodes = nodes or tuple(range(len(seconds)))
    hosts = hosts or ("",) * len(seconds)
    return tuple(
        RankTiming(rank, node, step, 0.01 * rank, host)
        for rank, (step, node, host) in enumerate(zip(seconds, nodes, hosts, strict=True))
    )


def test_a_rank_slow_in_enough_rounds_of_the_window_is_a_straggler() -> None:
    watch = StragglerWatch(StragglerRule(ratio=1.3, window=5, min_rounds=3))
    hosts = ("a", "b", "gpu-7", "d")
    first = watch.observe(0, round_of(1.0, 1.0, 2.0, 1.0, hosts=hosts))
    assert first.ranks == ()
    assert "1 round(s) measured, 3 needed" in first.reason
    assert watch.observe(1, round_of(1.0, 1.1, 1.9, 1.0, hosts=hosts)).ranks == ()
    verdict = watch.observe(2, round_of(1.0, 0.9, 2.1, 1.0, hosts=hosts))
    assert verdict.ranks == (2,)
    assert verdict.nodes == (2,)
    assert (
        "rank 2 (node 2 on gpu-7) over 1.3x its peers' median busy time in 3 of the last 3 "
        "rounds" in verdict.reason
    )
    assert "latest 2.1 s busy a step" in verdict.reason


def test_a_round_read_back_again_counts_once() -> None:
    watch = StragglerWatch(StragglerRule(ratio=1.3, window=5, min_rounds=3))
    slow = round_of(1.0, 2.0)
    for _ in range(3):
        assert watch.observe(0, slow).ranks == ()
    assert watch.observe(1, slow).ranks == ()
    assert watch.observe(2, slow).ranks == (1,)
    assert watch.observe(1, round_of(1.0, 1.0)).ranks == (1,)  # an older round: no change


def test_half_a_group_slow_or_idle_peers_do_not_hide_a_straggler() -> None:
    rule = StragglerRule(ratio=1.3, window=3, min_rounds=3)
    # Two ranks, one 1.8x the other: each is measured against the other alone.
    assert judge([round_of(1.0, 1.8)] * 3, rule).ranks == (1,)
    # One node of two slow: each of its ranks against peers mostly fast.
    half = round_of(1.0, 1.0, 2.0, 2.0, nodes=(0, 0, 1, 1))
    assert judge([half] * 3, rule).ranks == (2, 3)
    assert judge([half] * 3, rule).nodes == (1,)
    three = round_of(1.0, 1.0, 1.0, 2.0, 2.0, nodes=(0, 0, 0, 1, 1))
    assert judge([three] * 3, rule).ranks == (3, 4)
    # Peers that measured no busy time at all: a busy rank is slow, idle ones are not.
    assert judge([round_of(0.0, 0.0, 0.5)] * 3, rule).ranks == (2,)
    assert judge([round_of(0.0, 0.0, 0.0)] * 3, rule).ranks == ()


def test_one_slow_round_is_not_a_straggler_and_a_recovered_rank_is_let_go() -> None:
    rule = StragglerRule(ratio=1.3, window=4, min_rounds=3)
    steady = round_of(1.0, 1.0, 1.0)
    hiccup = round_of(1.0, 3.0, 1.0)
    assert judge([steady, hiccup, steady, steady], rule).ranks == ()
    slow = round_of(1.0, 1.5, 1.0)
    assert judge([slow, slow, slow, steady], rule).ranks == (1,)
    # The window moves on: two slow rounds of the last four are not enough.
    watch = StragglerWatch(rule)
    for round_, timings in enumerate((slow, slow, slow)):
        watch.observe(round_, timings)
    assert watch.observe(3, steady).ranks == (1,)
    assert watch.observe(4, steady).ranks == ()


def test_the_slope_under_the_ratio_is_not_slow() -> None:
    rule = StragglerRule(ratio=1.3, window=3, min_rounds=3)
    even = round_of(1.0, 1.29, 1.0)
    verdict = judge([even, even, even], rule)
    assert verdict.ranks == ()
    assert "no rank over 1.3x" in verdict.reason


def test_a_single_rank_or_a_relaunch_on_other_nodes_decides_nothing() -> None:
    assert "no peers" in judge([round_of(5.0)] * 5, StragglerRule()).reason
    watch = StragglerWatch(StragglerRule(window=3, min_rounds=2))
    watch.observe(0, round_of(1.0, 2.0))
    assert watch.observe(1, round_of(1.0, 2.0)).ranks == (1,)
    # Relaunched with rank 1 on another node: the window starts again.
    moved = watch.observe(2, round_of(1.0, 2.0, nodes=(0, 3)))
    assert moved.ranks == ()
    assert "1 round(s) measured" in moved.reason


def test_several_slow_ranks_on_one_node_name_that_node() -> None:
    rule = StragglerRule(ratio=1.2, window=3, min_rounds=2)
    timings = round_of(1.0, 1.0, 1.0, 1.0, 1.5, 1.6, nodes=(0, 0, 1, 1, 2, 2))
    verdict = judge([timings, timings], rule)
    assert verdict.ranks == (4, 5)
    assert verdict.nodes == (2,)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"ratio": 1.0}, "ratio must be > 1"),
        ({"window": 3, "min_rounds": 4}, "min_rounds must be between 1 and window"),
        ({"min_rounds": 0}, "min_rounds must be between 1 and window"),
    ],
)
def test_a_rule_that_cannot_hold_is_refused(settings: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StragglerRule(**settings)  # type: ignore[arg-type]


def stats_of(timings: tuple[RankTiming, ...]) -> TrainingStats:
    slowest = max(t.busy_seconds or 0.0 for t in timings)
    return TrainingStats(
        step_seconds=slowest,
        tokens_per_second=100.0,
        data_wait_seconds=0.0,
        learning_rate=1e-3,
        grad_norm=1.0,
        flops_per_token=6e6,
        ranks=timings,
    )


def test_measurements_export_the_verdict_and_log_its_changes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    measurements = RoundMeasurements(
        AgentMetrics(registry, "eu-west"), StragglerRule(ratio=1.3, window=3, min_rounds=2)
    )

    def straggling(rank: int) -> float | None:
        labels = {"job": "j", "region": "eu-west", "rank": str(rank), "node": str(rank)}
        return registry.get_sample_value("geofed_agent_rank_straggler", labels)

    slow, steady = stats_of(round_of(1.0, 2.0)), stats_of(round_of(1.0, 1.0))
    with caplog.at_level(logging.INFO, logger="regional_agent.rounds.measurements"):
        assert measurements.record("j", 0, slow, 2, "fp32") is not None
        assert straggling(1) == 0.0
        measurements.record("j", 1, slow, 2, "fp32")
        assert straggling(1) == 1.0
        measurements.record("j", 2, steady, 2, "fp32")
        measurements.record("j", 3, steady, 2, "fp32")
        assert straggling(1) == 0.0
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert messages[0].startswith("job j: straggling ranks (1,): rank 1 (node 1) over")
    assert messages[1].startswith("job j: no straggling rank any more")
    assert (
        registry.get_sample_value(
            "geofed_agent_train_step_seconds", {"job": "j", "region": "eu-west"}
        )
        == 1.0
    )
    measurements.record("j", 4, slow, 2, "fp32")
    measurements.record("j", 5, slow, 2, "fp32")
    assert straggling(1) == 1.0
    # Workers that report no per-rank times: the region's figures only, no verdict, and
    # no per-rank series left at an older round's.
    assert measurements.record("j", 6, replace(steady, ranks=()), 1, "fp32") is None
    assert straggling(1) is None
    assert straggling(0) is None


def test_busy_times_not_measured_decide_nothing() -> None:
    unmeasured = tuple(RankTiming(rank, 0, None, 0.0) for rank in range(2))
    verdict = judge([unmeasured] * 3, StragglerRule())
    assert verdict.ranks == ()
    assert "not measured in every round of the window" in verdict.reason
