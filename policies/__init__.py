"""The region-policy engine: region policy files and pure residency decisions.

Load a federation's policies once (:func:`load_policies`), then ask pure questions:
:func:`decide_transfer` (may this artifact go there?) and :func:`admit_job` (may this job
run as placed?). Every answer is a :class:`Decision` with the deciding rule's stable id,
its ``file:line`` and a human reason. The file format is documented in
:mod:`policies.schema`, the destination syntax in :mod:`policies.destinations`.
"""

from policies.admission import Admission, admit_job
from policies.decisions import Decision, RuleRef, Verdict
from policies.destinations import DestinationPattern, Endpoint, EndpointKind
from policies.errors import (
    InvalidDestination,
    InvalidProvenance,
    PlacementError,
    PolicyError,
    PolicyLoadError,
    Problem,
    Severity,
    UnknownEndpoint,
)
from policies.loading import load_policies, load_policy_file, parse_policy, policy_files
from policies.placement import JobPlacement, StorageLocation, load_placement, parse_placement
from policies.policy_set import LoadedPolicy, PolicySet
from policies.provenance import Provenance
from policies.schema import Classification, Effect, RegionPolicy
from policies.transfer import Transfer, decide_transfer

__all__ = [
    "Admission",
    "Classification",
    "Decision",
    "DestinationPattern",
    "Effect",
    "Endpoint",
    "EndpointKind",
    "InvalidDestination",
    "InvalidProvenance",
    "JobPlacement",
    "LoadedPolicy",
    "PlacementError",
    "PolicyError",
    "PolicyLoadError",
    "PolicySet",
    "Problem",
    "Provenance",
    "RegionPolicy",
    "RuleRef",
    "Severity",
    "StorageLocation",
    "Transfer",
    "UnknownEndpoint",
    "Verdict",
    "admit_job",
    "decide_transfer",
    "load_placement",
    "load_policies",
    "load_policy_file",
    "parse_placement",
    "parse_policy",
    "policy_files",
]
