"""Loaded policies of a federation, checked against each other, with lookups by name."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from geofed.located_yaml import KeyPath, LineMap, format_key_path
from policies.decisions import RuleRef
from policies.destinations import (
    Endpoint,
    EndpointKind,
    PatternKind,
    parse_endpoint_reference,
    validate_jurisdiction,
)
from policies.errors import PolicyLoadError, Problem, Severity, UnknownEndpoint
from policies.schema import Dataset, ExportRules, RegionPolicy, Storage


@dataclass(frozen=True, slots=True)
class LoadedPolicy:
    """A validated region policy with the file and line of each of its keys."""

    policy: RegionPolicy
    file: str
    lines: LineMap
    warnings: tuple[Problem, ...] = ()

    @property
    def region(self) -> str:
        return self.policy.region

    def origin(self, path: KeyPath) -> str:
        return f"{self.file}:{self.lines.line_of(path)}"

    def rule_ref(self, path: KeyPath) -> RuleRef:
        return RuleRef(f"{self.region}:{format_key_path(path)}", self.origin(path))

    def problem(self, path: KeyPath, message: str, severity: Severity = Severity.ERROR) -> Problem:
        return Problem(
            self.file, self.lines.line_of(path), format_key_path(path), message, severity
        )


@dataclass(frozen=True, slots=True)
class DatasetRef:
    owner: LoadedPolicy
    index: int
    dataset: Dataset

    @property
    def path(self) -> KeyPath:
        return ("datasets", self.index)


@dataclass(frozen=True, slots=True)
class StorageRef:
    owner: LoadedPolicy
    index: int
    storage: Storage

    @property
    def path(self) -> KeyPath:
        return ("storage", self.index)

    def endpoint(self) -> Endpoint:
        return Endpoint.of_storage(self.storage.name, self.storage.jurisdiction, self.owner.region)


class PolicySet(Mapping[str, LoadedPolicy]):
    """The policies of a federation by region, consistent with each other.

    Construction checks what no single file can: one policy per region, dataset and
    storage names unique across the federation (errors, raised together as
    :class:`PolicyLoadError`), and ``region:``/``storage:`` references that name nothing
    loaded (warnings, kept in ``warnings``: a partial set may be checked on its own).
    """

    def __init__(self, policies: Iterable[LoadedPolicy]) -> None:
        self._by_region: dict[str, LoadedPolicy] = {}
        self._datasets: dict[str, DatasetRef] = {}
        self._storage: dict[str, StorageRef] = {}
        problems: list[Problem] = []
        for loaded in policies:
            problems.extend(self._add(loaded))
        if problems:
            raise PolicyLoadError(problems)
        in_files = [w for loaded in self._by_region.values() for w in loaded.warnings]
        self.warnings: tuple[Problem, ...] = (*in_files, *self._dangling_references())

    def _add(self, loaded: LoadedPolicy) -> list[Problem]:
        problems: list[Problem] = []
        other = self._by_region.get(loaded.region)
        if other is not None:
            where = other.origin(("region",))
            return [
                loaded.problem(("region",), f"region {loaded.region} is already defined at {where}")
            ]
        self._by_region[loaded.region] = loaded
        for index, dataset in enumerate(loaded.policy.datasets):
            ref = DatasetRef(loaded, index, dataset)
            first = self._datasets.setdefault(dataset.name, ref)
            if first is not ref:
                where = first.owner.origin((*first.path, "name"))
                problems.append(
                    loaded.problem(
                        (*ref.path, "name"), f"dataset {dataset.name} is already defined at {where}"
                    )
                )
        for index, storage in enumerate(loaded.policy.storage):
            sref = StorageRef(loaded, index, storage)
            sfirst = self._storage.setdefault(storage.name, sref)
            if sfirst is not sref:
                where = sfirst.owner.origin((*sfirst.path, "name"))
                problems.append(
                    loaded.problem(
                        (*sref.path, "name"),
                        f"storage location {storage.name} is already defined at {where}",
                    )
                )
        return problems

    def _dangling_references(self) -> Iterator[Problem]:
        for loaded in self._by_region.values():
            for path, rules in rule_lists(loaded.policy):
                for kind, entries in rules.items():
                    for i, rule in enumerate(entries):
                        for j, pattern in enumerate(rule.to):
                            missing = self._missing(pattern.kind, pattern.value)
                            if missing:
                                yield loaded.problem(
                                    (*path, kind.value, i, "to", j), missing, Severity.WARNING
                                )

    def _missing(self, kind: PatternKind, value: str | None) -> str | None:
        if kind is PatternKind.REGION and value not in self._by_region:
            return f"no loaded policy defines region {value}; this pattern matches nothing"
        if kind is PatternKind.STORAGE and value not in self._storage:
            return (
                f"no loaded policy declares storage location {value}; this pattern matches nothing"
            )
        return None

    def __getitem__(self, region: str) -> LoadedPolicy:
        return self._by_region[region]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._by_region))

    def __len__(self) -> int:
        return len(self._by_region)

    def dataset(self, name: str) -> DatasetRef | None:
        return self._datasets.get(name)

    def storage(self, name: str) -> StorageRef | None:
        return self._storage.get(name)

    def jurisdiction_of(self, region: str) -> str | None:
        loaded = self._by_region.get(region)
        return loaded.policy.jurisdiction if loaded is not None else None

    def endpoint(self, text: str, coordinator_jurisdiction: str | None = None) -> Endpoint:
        """Resolve ``coordinator``, ``region:NAME`` or ``storage:NAME`` to an endpoint.

        Regions and storage locations take their jurisdiction (and owner) from the
        policies; raise :class:`UnknownEndpoint` when none declares the name.
        """
        kind, name = parse_endpoint_reference(text)
        if kind is EndpointKind.COORDINATOR:
            if coordinator_jurisdiction is not None:
                validate_jurisdiction(coordinator_jurisdiction)
            return Endpoint.coordinator(coordinator_jurisdiction)
        if kind is EndpointKind.REGION:
            loaded = self._by_region.get(name)
            if loaded is None:
                raise UnknownEndpoint(f"no loaded policy defines region {name}")
            return Endpoint.of_region(name, loaded.policy.jurisdiction)
        ref = self._storage.get(name)
        if ref is None:
            raise UnknownEndpoint(f"no loaded policy declares storage location {name}")
        return ref.endpoint()


def rule_lists(policy: RegionPolicy) -> Iterator[tuple[KeyPath, ExportRules]]:
    yield ("exports",), policy.exports
    for index, dataset in enumerate(policy.datasets):
        yield ("datasets", index, "exports"), dataset.exports
