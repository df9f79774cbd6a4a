"""How much of a job's checkpoint chain to keep: the job spec's ``retention`` section.

.. code-block:: yaml

    retention:
      keep_snapshots: 3     # the newest 3 snapshots, with every update after the oldest
      keep_every: 10        # and, besides, every 10th snapshot alone (an archive point)

Without the section every snapshot and update is kept (the chain grows by one update a
round and one snapshot every ``snapshot_every`` rounds, or at the rounds the job's
adaptive interval chose: snapshot rounds need not be regular). With it, the coordinator prunes
the chain after each snapshot it publishes: the newest ``keep_snapshots`` snapshots and
every update after the oldest of them stay, so any version from that snapshot on can be
rebuilt exactly; an archived snapshot (``keep_every``) stays alone, without the updates
that followed it, so it restores its own version only. The archive points are the first
snapshot of each span of ``keep_every`` x ``snapshot_every`` rounds (with
``snapshot_every: auto``, x ``snapshot_min_rounds``): with snapshots every K rounds that
is every ``keep_every``-th snapshot, and whatever the rounds of the snapshots, the choice
of an archived snapshot never changes as later ones are taken and older ones pruned.

:func:`plan_retention` is the pure decision;
:meth:`coordinator.storage.checkpoints.CheckpointStore.remove`
carries it out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import Field, StrictInt

from coordinator.storage.checkpoints import CheckpointEntry, EntryKind
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
        description="also keep, without its updates, the first snapshot of every n x "
        "snapshot_every rounds (every n-th snapshot when they are regular; with "
        "snapshot_every: auto, n x snapshot_min_rounds); default: none",
    )


@dataclass(frozen=True, slots=True)
class RetentionPlan:
    """The entries to drop from a chain, and why (for the audit entry)."""

    remove: tuple[CheckpointEntry, ...]
    reason: str


def plan_retention(
    entries: Sequence[CheckpointEntry], config: RetentionConfig, snapshot_every: int
) -> RetentionPlan:
    """Which of a job's chain ``entries`` (in chain order) ``config`` drops;
    ``snapshot_every``: the spacing the archive spans count in (see the module docstring)."""
    if snapshot_every < 1:
        raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}")
    snapshots = [e for e in entries if e.kind is EntryKind.SNAPSHOT]
    if len(snapshots) <= config.keep_snapshots:
        return RetentionPlan(
            (), f"{len(snapshots)} snapshot(s), at most {config.keep_snapshots} kept: none dropped"
        )
    cutoff = snapshots[-config.keep_snapshots].round
    archive: set[int] = set()
    if config.keep_every is not None:
        span = config.keep_every * snapshot_every
        spans: set[int] = set()
        for snapshot in sorted(snapshots, key=lambda e: e.round):
            # The first snapshot of its span, as listed: an archived one is never pruned,
            # so no earlier one of its span can reappear and change the choice.
            if snapshot.round // span not in spans:
                spans.add(snapshot.round // span)
                archive.add(snapshot.round)

    def archived(entry: CheckpointEntry) -> bool:
        return entry.kind is EntryKind.SNAPSHOT and entry.round in archive

    remove = tuple(e for e in entries if e.round < cutoff and not archived(e))
    kept_archive = sorted(e.round for e in entries if e.round < cutoff and archived(e))
    reason = (
        f"keeping the newest {config.keep_snapshots} snapshot(s), from round {cutoff} on"
        + (f", and the archived snapshot(s) of round(s) {kept_archive}" if kept_archive else "")
        + f": {len(remove)} older entr{'y' if len(remove) == 1 else 'ies'} dropped"
    )
    return RetentionPlan(remove, reason)
