"""May this artifact go from here to there? The pure transfer decision.

An artifact inherits the restrictions of everything it was derived from: it may move
only if the policy of every contributing region allows the kind to the destination,
every contributing dataset's own rules (if any) allow it, no built-in classification
rule forbids it, and the policy of the region it leaves from allows it too. The
decision lists every rule consulted; the first denial decides.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from geofed.located_yaml import KeyPath, format_key_path
from geofed.types import ArtifactKind
from policies.decisions import Decision, RuleRef, Verdict
from policies.destinations import Endpoint, EndpointKind
from policies.policy_set import LoadedPolicy, PolicySet
from policies.provenance import Provenance
from policies.schema import Effect, ExportRules


@dataclass(frozen=True, slots=True)
class Transfer:
    """An artifact of ``kind`` derived from ``provenance``, moving ``source`` -> ``destination``."""

    kind: ArtifactKind
    source: Endpoint
    destination: Endpoint
    provenance: Provenance

    def describe(self) -> str:
        return (
            f"{self.kind.value} from {self.source} to {self.destination} "
            f"(provenance {self.provenance})"
        )


def decide_transfer(policies: PolicySet, transfer: Transfer) -> Decision:
    """Allow or deny ``transfer`` under ``policies``; default deny, first denial decides."""
    return Decision.of(transfer.describe(), _verdicts(policies, transfer))


def _verdicts(policies: PolicySet, transfer: Transfer) -> Iterator[Verdict]:
    for region, datasets in transfer.provenance.contributions:
        loaded = policies.get(region)
        if loaded is None:
            yield no_policy(region, "contributing region")
            continue
        yield from _region_verdicts(policies, loaded, transfer, datasets, contributed=True)
    source_region = transfer.source.region
    if source_region is not None and source_region not in transfer.provenance.region_names:
        loaded = policies.get(source_region)
        if loaded is None:
            yield no_policy(source_region, "source region")
        else:
            yield from _region_verdicts(policies, loaded, transfer, frozenset(), contributed=False)


def no_policy(region: str, role: str = "region") -> Verdict:
    """The verdict on ``region`` (in ``role``), which no loaded policy covers: denied."""
    return Verdict(
        False,
        RuleRef(f"{region}:no-policy"),
        f"no policy is loaded for {role} {region}; default is deny",
    )


def _region_verdicts(
    policies: PolicySet,
    loaded: LoadedPolicy,
    transfer: Transfer,
    datasets: frozenset[str] | None,
    *,
    contributed: bool,
) -> Iterator[Verdict]:
    region = loaded.region
    destination = transfer.destination
    if destination.kind is EndpointKind.REGION and destination.name == region:
        yield Verdict(
            True,
            RuleRef(f"{region}:home", loaded.origin(("region",))),
            f"{destination} is {region} itself; nothing leaves it",
        )
        return
    yield _match(loaded, ("exports",), loaded.policy.exports, transfer, region)
    if not contributed:
        return
    names = [d.name for d in loaded.policy.datasets] if datasets is None else sorted(datasets)
    for name in names:
        ref = policies.dataset(name)
        if ref is None or ref.owner.region != region:
            owner = f"; it belongs to {ref.owner.region}" if ref is not None else ""
            yield Verdict(
                False,
                RuleRef(f"{region}:datasets", loaded.origin(("datasets",))),
                f"{region} declares no dataset {name}{owner}; default is deny",
            )
            continue
        dataset = ref.dataset
        pinned = transfer.kind is ArtifactKind.RAW_DATA and dataset.classification.pins_raw_data
        own_storage = destination.kind is EndpointKind.STORAGE and destination.region == region
        if pinned and not own_storage:
            yield Verdict(
                False,
                loaded.rule_ref((*ref.path, "classification")),
                f"dataset {name} is classified {dataset.classification.value}: its raw_data "
                f"never leaves {region} (only {region}'s own storage may hold it)",
            )
        if transfer.kind in dataset.exports:
            yield _match(
                loaded,
                (*ref.path, "exports"),
                dataset.exports,
                transfer,
                f"{region} dataset {name}",
            )


def _match(
    loaded: LoadedPolicy, base: KeyPath, rules: ExportRules, transfer: Transfer, who: str
) -> Verdict:
    """The first rule of ``rules[kind]`` matching the destination, else default deny."""
    kind = transfer.kind.value
    destination = transfer.destination
    path: KeyPath = (*base, kind)
    entries = rules.get(transfer.kind)
    for index, rule in enumerate(entries or ()):
        pattern = next((p for p in rule.to if p.matches(destination)), None)
        if pattern is None:
            continue
        allowed = rule.effect is Effect.ALLOW
        reason = (
            f"{who} {'allows' if allowed else 'denies'} {kind} to {destination.describe()} "
            f"(matches {pattern})"
        )
        if rule.note:
            reason += f": {rule.note}"
        return Verdict(allowed, loaded.rule_ref((*path, index)), reason)
    default = RuleRef(f"{loaded.region}:{format_key_path(path)}[default]", loaded.origin(path))
    if entries is None:
        return Verdict(False, default, f"{who} has no rules for {kind}; default is deny")
    return Verdict(
        False,
        default,
        f"no rule of {who} for {kind} matches {destination.describe()}; default is deny",
    )
