"""Provenance: which regions' data (and which of their datasets) went into an artifact."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from geofed.types import InvalidName, validate_name
from policies.errors import InvalidProvenance


@dataclass(frozen=True, slots=True)
class Provenance:
    """Contributing regions, each with the datasets it used.

    A region whose datasets are ``None`` may have used any of its datasets, so every
    dataset it declares is assumed to have contributed (the cautious reading).
    """

    contributions: tuple[tuple[str, frozenset[str] | None], ...]

    def __post_init__(self) -> None:
        regions = [region for region, _ in self.contributions]
        if len(set(regions)) != len(regions) or regions != sorted(regions):
            raise InvalidProvenance("contributions must be sorted by region, one entry each")
        try:
            for region, datasets in self.contributions:
                validate_name("region", region)
                for dataset in datasets or ():
                    validate_name("dataset", dataset)
        except InvalidName as exc:
            raise InvalidProvenance(str(exc)) from None

    @classmethod
    def of(cls, regions: Mapping[str, Iterable[str] | None]) -> Provenance:
        """``{"eu-west": ["eu-support-chats"], "us-east": None}`` (None: any dataset)."""
        return cls(
            tuple(
                (region, None if datasets is None else frozenset(datasets))
                for region, datasets in sorted(regions.items())
            )
        )

    @classmethod
    def regions(cls, *regions: str) -> Provenance:
        """Provenance of whole regions: every dataset each declares may have contributed."""
        return cls.of(dict.fromkeys(regions))

    @classmethod
    def parse(cls, text: str) -> Provenance:
        """Parse ``eu-west,us-east/us-books,us-east/us-forums`` (``REGION[/DATASET]`` items).

        A bare ``REGION`` means any of its datasets and wins over ``REGION/DATASET``.
        """
        found: dict[str, set[str] | None] = {}
        for item in text.split(","):
            region, sep, dataset = item.strip().partition("/")
            if not region or (sep and not dataset):
                raise InvalidProvenance(
                    f"invalid provenance {text!r}: use comma-separated REGION or REGION/DATASET"
                )
            if not sep:
                found[region] = None
                continue
            datasets = found.setdefault(region, set())
            if datasets is not None:
                datasets.add(dataset)
        return cls.of(found)

    @property
    def region_names(self) -> tuple[str, ...]:
        return tuple(region for region, _ in self.contributions)

    def datasets_of(self, region: str) -> frozenset[str] | None:
        for name, datasets in self.contributions:
            if name == region:
                return datasets
        raise KeyError(region)

    def union(self, other: Provenance) -> Provenance:
        merged: dict[str, frozenset[str] | None] = dict(self.contributions)
        for region, datasets in other.contributions:
            if region not in merged:
                merged[region] = datasets
            else:
                mine = merged[region]
                merged[region] = None if mine is None or datasets is None else mine | datasets
        return Provenance.of(merged)

    def __bool__(self) -> bool:
        return bool(self.contributions)

    def __str__(self) -> str:
        items: list[str] = []
        for region, datasets in self.contributions:
            if datasets is None:
                items.append(region)
            else:
                items.extend(f"{region}/{dataset}" for dataset in sorted(datasets))
        return ",".join(items) if items else "(none)"
