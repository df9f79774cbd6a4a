"""Job admission: may this job train where it is placed, under every region's policy?

Admission runs every check and returns every reason to refuse, not only the first:

- each dataset is declared by some region, may be processed in the region it is
  assigned to, and (when that is not its home) its raw data may travel there;
- each region's ``model_delta`` and ``metrics`` may go to the coordinator;
- the ``global_update`` (derived from every participant's data) may go to each region;
- ``global_checkpoint`` (derived from every participant's data) may be stored at one or
  more of the candidate storage locations; the allowed ones are returned so the
  coordinator places checkpoints only there.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from geofed.types import ArtifactKind
from policies.decisions import Decision, RuleRef, Verdict
from policies.destinations import Endpoint
from policies.placement import JobPlacement, StorageLocation
from policies.policy_set import PolicySet
from policies.provenance import Provenance
from policies.transfer import Transfer, decide_transfer, no_policy


@dataclass(frozen=True, slots=True)
class Admission:
    """The outcome of admission.

    ``decisions`` holds every check in order; ``denials`` those that refuse the job;
    ``checkpoint_storage`` the candidates allowed to hold global checkpoints.
    """

    admitted: bool
    decisions: tuple[Decision, ...]
    denials: tuple[Decision, ...]
    checkpoint_storage: tuple[StorageLocation, ...]


def admit_job(policies: PolicySet, placement: JobPlacement) -> Admission:
    """Decide whether ``placement`` is admissible under ``policies`` (pure, no I/O)."""
    decisions: list[Decision] = []
    # Initial parameters from another job or an export carry what they derive from.
    provenance = Provenance.of({r: tuple(d) for r, d in placement.inherited.items()})
    coordinator = Endpoint.coordinator(placement.coordinator_jurisdiction)
    for region, datasets in placement.regions.items():
        here = Endpoint.of_region(region, policies.jurisdiction_of(region))
        if region not in policies:
            # Said first and alone: its datasets' checks would only echo it.
            decisions.append(Decision.of(f"training in region {region}", [no_policy(region)]))
        else:
            decisions.extend(_dataset_checks(policies, here, datasets))
        # The region itself contributes (its deltas carry its training), whatever data it uses.
        local = Provenance.of({region: ()}).union(_provenance_of(policies, datasets))
        provenance = provenance.union(local)
        for kind in (ArtifactKind.MODEL_DELTA, ArtifactKind.METRICS):
            decisions.append(decide_transfer(policies, Transfer(kind, here, coordinator, local)))
    for region in placement.regions:
        there = Endpoint.of_region(region, policies.jurisdiction_of(region))
        update = Transfer(ArtifactKind.GLOBAL_UPDATE, coordinator, there, provenance)
        decisions.append(decide_transfer(policies, update))
    denials = [decision for decision in decisions if not decision.allowed]
    storage_decisions = list(_storage_checks(policies, placement, coordinator, provenance))
    decisions.extend(decision for _, decision in storage_decisions)
    allowed = tuple(location for location, decision in storage_decisions if decision.allowed)
    if not allowed:
        denials.extend(decision for _, decision in storage_decisions)
        refusal = _no_storage(placement)
        decisions.append(refusal)
        denials.append(refusal)
    return Admission(not denials, tuple(decisions), tuple(denials), allowed)


def _provenance_of(policies: PolicySet, datasets: frozenset[str]) -> Provenance:
    """Group datasets by the region that declares them; unknown ones are left out
    (their own check already refuses the job)."""
    by_home: dict[str, set[str]] = {}
    for name in datasets:
        ref = policies.dataset(name)
        if ref is not None:
            by_home.setdefault(ref.owner.region, set()).add(name)
    return Provenance.of(by_home)


def _dataset_checks(
    policies: PolicySet, here: Endpoint, datasets: frozenset[str]
) -> Iterator[Decision]:
    for name in sorted(datasets):
        subject = f"processing of dataset {name} in {here}"
        ref = policies.dataset(name)
        if ref is None:
            reason = f"no loaded policy declares dataset {name}; default is deny"
            yield Decision.of(subject, [Verdict(False, RuleRef(f"{here.name}:datasets"), reason)])
            continue
        owner, path = ref.owner, (*ref.path, "processed_in")
        patterns = ref.dataset.processed_in
        index = next((i for i, p in enumerate(patterns) if p.matches(here)), None)
        if index is None:
            allowed_in = ", ".join(str(p) for p in patterns)
            verdict = Verdict(
                False,
                owner.rule_ref(path),
                f"dataset {name} may be processed only in {allowed_in}, not in {here.describe()}",
            )
        else:
            verdict = Verdict(
                True,
                owner.rule_ref((*path, index)),
                f"dataset {name} may be processed in {here.describe()} (matches {patterns[index]})",
            )
        yield Decision.of(subject, [verdict])
        if owner.region != here.name:
            home = Endpoint.of_region(owner.region, owner.policy.jurisdiction)
            move = Transfer(
                ArtifactKind.RAW_DATA, home, here, Provenance.of({owner.region: [name]})
            )
            yield decide_transfer(policies, move)


def _storage_checks(
    policies: PolicySet, placement: JobPlacement, coordinator: Endpoint, provenance: Provenance
) -> Iterator[tuple[StorageLocation, Decision]]:
    for location in placement.checkpoint_storage:
        declared = policies.storage(location.name)
        if declared is not None and (
            declared.storage.jurisdiction != location.jurisdiction
            or (location.region is not None and declared.owner.region != location.region)
        ):
            reason = (
                f"storage location {location.name} is declared with jurisdiction "
                f"{declared.storage.jurisdiction} owned by {declared.owner.region}; the "
                f"placement says jurisdiction {location.jurisdiction} owned by "
                f"{location.region or 'nobody'}"
            )
            verdict = Verdict(False, declared.owner.rule_ref(declared.path), reason)
            yield location, Decision.of(f"checkpoint storage {location.name}", [verdict])
            continue
        # A declared location's owner comes from its policy, whatever the placement says.
        there = declared.endpoint() if declared is not None else location.endpoint()
        move = Transfer(ArtifactKind.GLOBAL_CHECKPOINT, coordinator, there, provenance)
        yield location, decide_transfer(policies, move)


def _no_storage(placement: JobPlacement) -> Decision:
    names = ", ".join(location.name for location in placement.checkpoint_storage)
    if names:
        reason = f"none of the candidate storage locations ({names}) may hold global checkpoints"
    else:
        reason = "the placement names no candidate storage for global checkpoints"
    verdict = Verdict(False, RuleRef("job:checkpoint_storage"), reason)
    return Decision.of("placement of global checkpoints", [verdict])
