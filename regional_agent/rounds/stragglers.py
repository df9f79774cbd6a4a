"""Which ranks of a region's worker group are persistently slower than their peers.

The region steps at its slowest rank's pace, so one slow GPU, node or data loader slows
all of it. The ranks step together, so their step times are equal; what tells the slow
one is that it waits less for the others: the worker group reports each rank's busy
time a step, its step time less the time it had a data-parallel collective in flight
(:class:`~regional_agent.handoff.training_stats.RankTiming`; measured under DDP, FSDP
and HSDP).
The rule, over a window of the latest rounds trained with the same ranks, each round
counted once:

- a rank is *slow in a round* when its busy time is over ``ratio`` times the median busy
  time of its peers in that round (the others: a slow rank, or a slow half of the group,
  does not raise the bar it is measured against);
- a rank is a *straggler* when it was slow in at least ``min_rounds`` of the window's
  rounds: one hiccup (a checkpoint, a page fault storm) is not a straggler.

A region of one rank has no peers to compare with; a round whose busy times were not
measured (a collective whose end could not be marked) and a window with fewer than
``min_rounds`` rounds decide nothing. Pure: the verdict carries its reason.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from regional_agent.handoff.training_stats import RankTiming

__all__ = ["StragglerRule", "StragglerVerdict", "StragglerWatch"]

#: A rank this much slower than the round's median is slow in that round.
DEFAULT_RATIO: Final = 1.3
DEFAULT_WINDOW: Final = 5
DEFAULT_MIN_ROUNDS: Final = 3


@dataclass(frozen=True, slots=True)
class StragglerRule:
    """The rule's settings (see the module's docstring)."""

    ratio: float = DEFAULT_RATIO
    window: int = DEFAULT_WINDOW
    min_rounds: int = DEFAULT_MIN_ROUNDS

    def __post_init__(self) -> None:
        if not self.ratio > 1.0:
            raise ValueError(f"ratio must be > 1, got {self.ratio}")
        if not 1 <= self.min_rounds <= self.window:
            raise ValueError(
                f"min_rounds must be between 1 and window ({self.window}), got {self.min_rounds}"
            )


@dataclass(frozen=True, slots=True)
class StragglerVerdict:
    """The ranks found straggling (and their nodes), and why."""

    ranks: tuple[int, ...]
    nodes: tuple[int, ...]
    reason: str
    #: Each straggling node with its name (its Slurm node name, else its host name).
    node_hosts: tuple[tuple[int, str], ...] = ()


class StragglerWatch:
    """One job's window of per-rank timings in a region, and the verdict after each round."""

    def __init__(self, rule: StragglerRule | None = None) -> None:
        self.rule = rule or StragglerRule()
        self._rounds: deque[tuple[RankTiming, ...]] = deque(maxlen=self.rule.window)
        self._last: tuple[int, StragglerVerdict] | None = None

    def observe(self, round_: int, timings: Sequence[RankTiming]) -> StragglerVerdict:
        """Add round ``round_``'s timings (one per rank, in rank order) and judge the
        window; a round already seen (a result read back again) changes nothing."""
        if self._last is not None and round_ <= self._last[0]:
            return self._last[1]
        layout = [(t.rank, t.node, t.host) for t in timings]
        if self._rounds and [(t.rank, t.node, t.host) for t in self._rounds[-1]] != layout:
            # Other ranks (a relaunch on other nodes, another size): compare like with like.
            self._rounds.clear()
        self._rounds.append(tuple(timings))
        verdict = judge(list(self._rounds), self.rule)
        self._last = (round_, verdict)
        return verdict


def judge(rounds: Sequence[Sequence[RankTiming]], rule: StragglerRule) -> StragglerVerdict:
    """The verdict over ``rounds`` (oldest first, the same ranks in each)."""
    if not rounds or len(rounds[-1]) < 2:
        return StragglerVerdict((), (), "a single rank has no peers to compare with")
    if any(t.busy_seconds is None for timings in rounds for t in timings):
        return StragglerVerdict(
            (), (), "the ranks' busy time is not measured in every round of the window"
        )
    if len(rounds) < rule.min_rounds:
        return StragglerVerdict(
            (), (), f"{len(rounds)} round(s) measured, {rule.min_rounds} needed to judge"
        )
    slow_rounds: dict[int, int] = {}
    ratios: dict[int, list[float]] = {}
    for timings in rounds:
        busy = {t.rank: t.busy_seconds or 0.0 for t in timings}
        for t in timings:
            peers = statistics.median(b for rank, b in busy.items() if rank != t.rank)
            ratio = _ratio(busy[t.rank], peers)
            ratios.setdefault(t.rank, []).append(ratio)
            if ratio > rule.ratio:
                slow_rounds[t.rank] = slow_rounds.get(t.rank, 0) + 1
    latest = {t.rank: t for t in rounds[-1]}
    stragglers = sorted(r for r, n in slow_rounds.items() if n >= rule.min_rounds)
    if not stragglers:
        return StragglerVerdict(
            (),
            (),
            f"no rank over {rule.ratio:g}x its peers' median busy time in "
            f"{rule.min_rounds} of the last {len(rounds)} rounds",
        )
    parts = []
    for rank in stragglers:
        t = latest[rank]
        parts.append(
            f"rank {rank} (node {t.node}{_on(t.host)}) over {rule.ratio:g}x its peers' median "
            f"busy time in "
            f"{slow_rounds[rank]} of the last {len(rounds)} rounds (median "
            f"{statistics.median(ratios[rank]):.2f}x; latest {t.busy_seconds or 0.0:.3g} s busy "
            f"a step, {t.data_wait_seconds:.3g} s waiting for data in the round)"
        )
    node_hosts = tuple(sorted({(latest[rank].node, latest[rank].host) for rank in stragglers}))
    nodes = tuple(sorted({node for node, _ in node_hosts}))
    return StragglerVerdict(tuple(stragglers), nodes, "; ".join(parts), node_hosts)


def _ratio(busy: float, peers: float) -> float:
    """``busy`` over its peers' median; busy where the peers were not (0 s) is slow."""
    if peers > 0:
        return busy / peers
    return float("inf") if busy > 0 else 1.0


def _on(host: str) -> str:
    return f" on {host}" if host else ""
