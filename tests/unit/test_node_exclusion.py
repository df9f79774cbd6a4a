"""Leaving a straggling node out of the worker group and bringing it back (pure)."""

from __future__ import annotations

from regional_agent.handoff.training_stats import RankTiming
from regional_agent.launch.exclusion import NodeExclusions, StragglerExclusionConfig
from regional_agent.rounds.stragglers import StragglerRule, StragglerVerdict, StragglerWatch

ON = StragglerExclusionConfig(exclude=True, min_nodes=1, readmit_after_rounds=3)


def straggling(*nodes: tuple[int, str]) -> StragglerVerdict:
    ranks = tuple(node for node, _ in nodes)
    return StragglerVerdict(ranks, ranks, "rank 1 over 1.3x its peers", tuple(nodes))


CALM = StragglerVerdict((), (), "no rank over 1.3x")


def test_a_straggling_node_is_left_out_then_tried_again_after_its_rounds() -> None:
    exclusions = NodeExclusions(ON, nnodes=3)
    assert exclusions.after_round(CALM) is None
    change = exclusions.after_round(straggling((2, "node-c")))
    assert change is not None
    assert change.excluded == {"node-c"}
    assert change.reason == "node(s) node-c left out: rank 1 over 1.3x its peers"
    # Its verdicts are stale once it is out: the same verdict changes nothing.
    assert exclusions.after_round(straggling((2, "node-c"))) is None
    assert exclusions.after_round(None) is None
    back = exclusions.after_round(CALM)
    assert back is not None
    assert (back.excluded, back.reason) == (
        frozenset(),
        "node node-c back after 3 round(s) left out",
    )
    again = exclusions.after_round(straggling((2, "node-c")))
    assert again is not None
    assert again.excluded == {"node-c"}


def test_rank_zeros_node_and_the_minimum_stay() -> None:
    config = StragglerExclusionConfig(exclude=True, min_nodes=2)
    exclusions = NodeExclusions(config, nnodes=3)
    assert exclusions.after_round(straggling((0, "head"))) is None, "rank 0 talks to the agent"
    change = exclusions.after_round(straggling((1, "node-b"), (2, "node-c")))
    assert change is not None
    assert change.excluded == {"node-b"}, "two nodes stay: rank 0's and one more"
    assert exclusions.excluded == {"node-b"}
    alone = NodeExclusions(ON, nnodes=3).after_round(straggling((1, "b"), (2, "c")))
    assert alone is not None
    assert alone.excluded == {"b", "c"}, "min_nodes 1: rank 0's node alone may go on"
    two = NodeExclusions(StragglerExclusionConfig(exclude=True, min_nodes=2), nnodes=2)
    assert two.after_round(straggling((1, "node-b"))) is None


def test_nothing_is_left_out_unless_the_operator_asks() -> None:
    exclusions = NodeExclusions(StragglerExclusionConfig(), nnodes=2)
    assert exclusions.after_round(straggling((1, "node-b"))) is None
    assert exclusions.excluded == frozenset()


def test_a_verdict_names_each_straggling_node_with_its_host() -> None:
    watch = StragglerWatch(StragglerRule(ratio=1.3, window=2, min_rounds=2))
    timings = [
        RankTiming(rank=0, node=0, busy_seconds=0.1, data_wait_seconds=0.0, host="node-a"),
        RankTiming(rank=1, node=1, busy_seconds=0.5, data_wait_seconds=0.0, host="node-b"),
    ]
    watch.observe(0, timings)
    verdict = watch.observe(1, timings)
    assert verdict.node_hosts == ((1, "node-b"),)


def test_the_window_starts_again_when_a_node_is_another_host() -> None:
    """A node back and another left out keep the group's size: the rounds of the other
    host are not held against the new one."""
    watch = StragglerWatch(StragglerRule(ratio=1.3, window=2, min_rounds=2))

    def timings(host: str) -> list[RankTiming]:
        return [
            RankTiming(rank=0, node=0, busy_seconds=0.1, data_wait_seconds=0.0, host="head"),
            RankTiming(rank=1, node=1, busy_seconds=0.5, data_wait_seconds=0.0, host=host),
        ]

    watch.observe(0, timings("node-b"))
    assert watch.observe(1, timings("node-c")).ranks == (), "one round of node-c only"
    assert watch.observe(2, timings("node-c")).node_hosts == ((1, "node-c"),)
