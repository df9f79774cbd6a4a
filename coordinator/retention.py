"""How much of a job's checkpoint chain to keep: the job spec's ``retention`` section.

.. code-block:: yaml

    retention:
      keep_snapshots: 3     # the newest 3 snapshots, with every update after the oldest
      keep_every: 10        # and, besides, every 10th snapshot alone (an archive point)

Without the section every snapshot and update is kept (the chain grows by one update a
round and one snapshot every ``snapshot_every`` rounds). With it, the coordinator prunes
the chain after each snapshot it publishes: the newest ``keep_snapshots`` snapshots and
every update after the oldest of them stay, so any version from that snapshot on can be
rebuilt exactly; an archived snapshot (``keep_every``) stays alone, without the updates
that followed it, so it restores its own version only.

:func:`plan_retention` is the pure decision; :meth:`coordinator.checkpoints.CheckpointStore.remove`
carries it out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import Field, StrictInt

from coordinator.checkpoints import CheckpointEntry, EntryKind
from geofed.config_sections import ConfigSection

__all__ = ["RetentionConfig", "RetentionPlan", "plan_retention"]


class RetentionConfig(ConfigSection):
    """What a job's checkpoint chain keeps (see the module docstring)."""

    keep_snapshots: StrictInt = Field(
        ge=1,
        description="the newest snapshots kept with every update after the oldest of them",
    )
    keep_every: StrictInt | None = Field(
        default=None,
        ge=2,
        description="also keep every n-th snapshot (by its number, round / snapshot_every), "
        "without its updates; default: none",
    )


@dataclass(frozen=True, slots=True)
class RetentionPlan:
    """The entries to drop from a chain, and why (for the audit entry)."""

    remove: tuple[CheckpointEntry, ...]
    reason: str


def plan_retention(
    entries: Sequence[CheckpointEntry], config: RetentionConfig, snapshot_every: int
) -> RetentionPlan:
    """Which of a job's chain ``entries`` (in chain order) ``config`` drops."""
    snapshots = [e for e in entries if e.kind is EntryKind.SNAPSHOT]
    if len(snapshots) <= config.keep_snapshots:
        return RetentionPlan(
            (), f"{len(snapshots)} snapshot(s), at most {config.keep_snapshots} kept: none dropped"
        )
    cutoff = snapshots[-config.keep_snapshots].round

    def archived(entry: CheckpointEntry) -> bool:
        every = config.keep_every
        return (
            every is not None
            and entry.kind is EntryKind.SNAPSHOT
            and (entry.round // snapshot_every) % every == 0
        )

    remove = tuple(e for e in entries if e.round < cutoff and not archived(e))
    kept_archive = sorted(e.round for e in entries if e.round < cutoff and archived(e))
    reason = (
        f"keeping the newest {config.keep_snapshots} snapshot(s), from round {cutoff} on"
        + (f", and the archived snapshot(s) of round(s) {kept_archive}" if kept_archive else "")
        + f": {len(remove)} older entr{'y' if len(remove) == 1 else 'ies'} dropped"
    )
    return RetentionPlan(remove, reason)
