"""Job placement: which datasets each region trains on and where checkpoints may go.

The coordinator builds a :class:`JobPlacement` from a job; operators can also write one
as YAML for ``geofed policy admit``:

.. code-block:: yaml

    coordinator_jurisdiction: EU
    regions:                        # region -> datasets it trains on
      eu-west: [eu-support-chats]
      us-east: [us-public-domain-books]
    checkpoint_storage:             # candidates for global checkpoints
      - name: eu-ckpt               # declared in a policy: jurisdiction and owner from there
      - {name: scratch, jurisdiction: EU, region: eu-west}
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from pydantic import Field

from geofed.located_yaml import KeyPath, format_key_path
from geofed.types import InvalidName, validate_name
from policies.destinations import Endpoint, validate_jurisdiction
from policies.errors import InvalidDestination, PlacementError, PolicyLoadError, Problem
from policies.policy_set import PolicySet
from policies.schema import DatasetName, Jurisdiction, RegionName, StorageName, StrictModel
from policies.validation import validate_document
from policies.yaml_loader import load_located


@dataclass(frozen=True, slots=True)
class StorageLocation:
    """A candidate place for global checkpoints; ``region`` is its owner, if any."""

    name: str
    jurisdiction: str
    region: str | None = None

    def __post_init__(self) -> None:
        try:
            validate_name("storage location", self.name)
            validate_jurisdiction(self.jurisdiction)
            if self.region is not None:
                validate_name("region", self.region)
        except (InvalidName, InvalidDestination) as exc:
            raise PlacementError(str(exc)) from None

    def endpoint(self) -> Endpoint:
        return Endpoint.of_storage(self.name, self.jurisdiction, self.region)


@dataclass(frozen=True, slots=True)
class JobPlacement:
    """Regions with the datasets each trains on, the coordinator's jurisdiction, and
    the candidate storage locations for global checkpoints."""

    regions: Mapping[str, frozenset[str]]
    coordinator_jurisdiction: str
    checkpoint_storage: tuple[StorageLocation, ...] = field(default=())
    #: What the job's initial parameters already derive from (its ``init_from``): region
    #: -> datasets; the job's global artifacts carry it as well as its own regions'.
    inherited: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.regions:
            raise PlacementError("a placement needs at least one region")
        try:
            validate_jurisdiction(self.coordinator_jurisdiction)
            for region, datasets in self.regions.items():
                validate_name("region", region)
                if not datasets:
                    raise PlacementError(f"region {region} is assigned no datasets")
                for dataset in datasets:
                    validate_name("dataset", dataset)
        except (InvalidName, InvalidDestination) as exc:
            raise PlacementError(str(exc)) from None
        names = [storage.name for storage in self.checkpoint_storage]
        if len(set(names)) != len(names):
            raise PlacementError(f"checkpoint storage candidates repeat a name: {names}")
        frozen = {region: frozenset(self.regions[region]) for region in sorted(self.regions)}
        object.__setattr__(self, "regions", MappingProxyType(frozen))

    @classmethod
    def build(
        cls,
        regions: Mapping[str, Iterable[str]],
        coordinator_jurisdiction: str,
        checkpoint_storage: Iterable[StorageLocation] = (),
        *,
        inherited: Mapping[str, Iterable[str]] | None = None,
    ) -> JobPlacement:
        return cls(
            {region: frozenset(datasets) for region, datasets in regions.items()},
            coordinator_jurisdiction,
            tuple(checkpoint_storage),
            {region: frozenset(sets) for region, sets in (inherited or {}).items()},
        )


class _StorageCandidate(StrictModel):
    name: StorageName
    jurisdiction: Jurisdiction | None = Field(
        default=None, description="required unless a loaded policy declares the name"
    )
    region: RegionName | None = None


class _PlacementFile(StrictModel):
    coordinator_jurisdiction: Jurisdiction
    regions: dict[RegionName, tuple[DatasetName, ...]] = Field(min_length=1)
    checkpoint_storage: tuple[_StorageCandidate, ...] = ()


def parse_placement(text: str, file: str, policies: PolicySet) -> JobPlacement:
    """Parse a placement document; storage declared in ``policies`` may be named only."""
    document = load_located(text, file)
    spec = validate_document(_PlacementFile, document, file)
    problems: list[Problem] = []
    storage: list[StorageLocation] = []
    for index, candidate in enumerate(spec.checkpoint_storage):
        declared = policies.storage(candidate.name)
        jurisdiction = candidate.jurisdiction
        region = candidate.region
        if declared is not None:
            jurisdiction = jurisdiction or declared.storage.jurisdiction
            region = region or declared.owner.region
        if jurisdiction is None:
            path: KeyPath = ("checkpoint_storage", index, "name")
            problems.append(
                Problem(
                    file,
                    document.lines.line_of(path),
                    format_key_path(path),
                    f"no loaded policy declares storage location {candidate.name}; "
                    "give its jurisdiction",
                )
            )
            continue
        storage.append(StorageLocation(candidate.name, jurisdiction, region))
    for name, datasets in spec.regions.items():
        if not datasets:
            where: KeyPath = ("regions", name)
            problems.append(
                Problem(
                    file,
                    document.lines.line_of(where),
                    format_key_path(where),
                    f"region {name} is assigned no datasets",
                )
            )
    if problems:
        raise PolicyLoadError(problems)
    try:
        return JobPlacement.build(spec.regions, spec.coordinator_jurisdiction, storage)
    except PlacementError as exc:
        raise PolicyLoadError([Problem(file, 1, "(document)", str(exc))]) from None


def load_placement(path: Path | str, policies: PolicySet) -> JobPlacement:
    """Read and parse a placement file (see the module docstring)."""
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyLoadError([Problem(file, None, "(file)", str(exc))]) from None
    return parse_placement(text, file, policies)
