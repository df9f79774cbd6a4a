"""Leaving a straggling node out of the worker group, and bringing it back (pure).

The straggler rule (:mod:`regional_agent.rounds.stragglers`) names the nodes whose ranks
are persistently slower than their peers. With ``workers.stragglers.exclude`` (off by
default; the ``slurm`` launcher, which starts every node itself) the agent relaunches the
group at the round boundary without them, ``srun --exclude`` and fewer ``--nodes``, as
long as ``min_nodes`` nodes remain, and brings a node back after
``readmit_after_rounds`` rounds left out: a node still slow is found again (after the
rule's ``min_rounds``) and left out again. Rank 0's node is never left out: it is the one
that talks to the agent. The rounds counted are the region's, whatever job they belong
to; the ranks' data shards follow the group's size, as after any relaunch.

:class:`NodeExclusions` decides; each change carries its reason; :func:`apply_exclusions`
carries it out on a running group (a relaunch at the round boundary).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field, StrictBool, StrictInt

from geofed.config_sections import ConfigSection
from regional_agent.launch.slurm import SlurmLauncher
from regional_agent.launch.worker_group import WorkerGroup
from regional_agent.rounds.stragglers import StragglerVerdict

__all__ = ["ExclusionChange", "NodeExclusions", "StragglerExclusionConfig", "apply_exclusions"]


class StragglerExclusionConfig(ConfigSection):
    """The agent's ``workers.stragglers`` section."""

    exclude: StrictBool = Field(
        default=False,
        description="relaunch the group without a node whose ranks straggle (slurm launcher)",
    )
    min_nodes: StrictInt = Field(
        default=1, ge=1, description="never fewer nodes than this; at most workers.nnodes"
    )
    readmit_after_rounds: StrictInt = Field(
        default=10,
        ge=1,
        le=1 << 20,
        description="rounds a node is left out before it is tried again",
    )


@dataclass(frozen=True, slots=True)
class ExclusionChange:
    """The nodes (their Slurm node names) to leave out from now on, and why."""

    excluded: frozenset[str]
    reason: str


class NodeExclusions:
    """The region's excluded nodes, decided round by round (see the module docstring)."""

    def __init__(self, config: StragglerExclusionConfig, nnodes: int) -> None:
        self._config = config
        self._nnodes = nnodes
        self._rounds = 0
        #: node name -> the region round it was left out at.
        self._excluded: dict[str, int] = {}

    @property
    def excluded(self) -> frozenset[str]:
        return frozenset(self._excluded)

    def after_round(self, verdict: StragglerVerdict | None) -> ExclusionChange | None:
        """A round ended with ``verdict`` (None: none made): the change to make at this
        boundary (None: none; a straggling node kept for ``min_nodes`` is no change)."""
        self._rounds += 1
        if not self._config.exclude:
            return None
        now, reasons = self._rounds, []
        back = sorted(
            name
            for name, at in self._excluded.items()
            if now - at >= self._config.readmit_after_rounds
        )
        for name in back:
            del self._excluded[name]
            reasons.append(
                f"node {name} back after {self._config.readmit_after_rounds} round(s) left out"
            )
        left_out = []
        for node, name in [] if verdict is None else verdict.node_hosts:
            if node == 0 or name in self._excluded or name in back:
                continue  # rank 0's node talks to the agent; the others are judged anew
            if self._nnodes - len(self._excluded) - 1 < self._config.min_nodes:
                continue
            self._excluded[name] = now
            left_out.append(name)
        if left_out and verdict is not None:
            reasons.append(f"node(s) {', '.join(left_out)} left out: {verdict.reason}")
        if not back and not left_out:
            return None
        return ExclusionChange(self.excluded, "; ".join(reasons))


async def apply_exclusions(
    group: WorkerGroup, exclusions: NodeExclusions, verdict: StragglerVerdict | None
) -> ExclusionChange | None:
    """After a round that ended with ``verdict``: relaunch ``group`` (a ``slurm`` one)
    without the nodes :meth:`NodeExclusions.after_round` leaves out; the change made."""
    change = exclusions.after_round(verdict)
    launcher = group.launcher
    if change is None or not isinstance(launcher, SlurmLauncher):
        return None
    launcher.exclude(change.excluded)
    await group.relaunch(change.reason)
    return change
