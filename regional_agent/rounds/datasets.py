"""Which of the region's datasets a job's round reads, and whether the region holds them.

Pure: the job's announcement names the datasets each of its regions trains on; the agent
config says which datasets this region trains on and where their files are. A job that
names a dataset the region does not train on is refused here, before anything trains,
with the names on both sides.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from geofed.control import RoundAnnouncement
from geofed.data.location import DatasetLocation

__all__ = ["RoundDatasets", "round_datasets"]


@dataclass(frozen=True, slots=True)
class RoundDatasets:
    """The datasets the round trains on (``names``: its deltas' provenance), where those
    with files are, or why the region cannot train it."""

    names: tuple[str, ...]
    locations: Mapping[str, DatasetLocation]
    refusal: str | None = None

    @property
    def without_files(self) -> tuple[str, ...]:
        """The datasets the round trains on that the agent config gives no files for."""
        return tuple(name for name in self.names if name not in self.locations)


def round_datasets(
    announcement: RoundAnnouncement,
    region: str,
    held: Collection[str],
    locations: Mapping[str, DatasetLocation],
) -> RoundDatasets:
    """The locations of the datasets ``announcement`` names for ``region``.

    ``held``: the datasets this region trains on; ``locations``: where those with files
    live. A coordinator that does not name datasets (it predates them) gets every
    dataset held, and every located one. A named dataset without a location is not an
    error here: a task with data of its own needs none, and one that reads files is told
    which it lacks (:attr:`RoundDatasets.without_files`, the workers' ``DataShard``).
    """
    named = announcement.datasets.get(region) if announcement.datasets else None
    if named is None:
        return RoundDatasets(tuple(sorted(held)), dict(sorted(locations.items())))
    missing = sorted(set(named) - set(held))
    if missing:
        return RoundDatasets(
            (),
            {},
            f"job {announcement.job} trains region {region} on {', '.join(missing)}, which "
            f"this agent does not train on (its datasets: {', '.join(sorted(held)) or 'none'})",
        )
    chosen = tuple(sorted(named))
    return RoundDatasets(chosen, {name: locations[name] for name in chosen if name in locations})
