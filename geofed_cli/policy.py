"""``geofed policy``: validate region policy files and explain residency decisions.

Exit codes: ``check`` 0 when every file is valid, 1 otherwise; ``explain`` and ``admit``
0 for allow, 1 for deny, 2 for usage or load errors (argparse also exits 2).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

from geofed.types import ArtifactKind
from policies import (
    Decision,
    EndpointKind,
    PolicyError,
    PolicyLoadError,
    PolicySet,
    Problem,
    Provenance,
    Transfer,
    admit_job,
    decide_transfer,
    load_placement,
    load_policies,
)

EXIT_ALLOW = 0
EXIT_DENY = 1
EXIT_USAGE = 2

_DESTINATIONS = "coordinator, region:NAME or storage:NAME"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "policy",
        help="validate region policies and explain residency decisions",
        description="Validate region policy files and explain residency decisions.",
    )
    commands = parser.add_subparsers(dest="policy_command", metavar="ACTION", required=True)

    check = commands.add_parser(
        "check",
        help="validate policy files (exit 1 on any error)",
        description="Validate policy files and directories of *.yaml files, each on its "
        "own and against each other; print every problem as file:line: key: message.",
    )
    check.add_argument("paths", nargs="+", metavar="PATH", help="policy file or directory")
    check.add_argument("--strict", action="store_true", help="treat warnings as errors")
    check.set_defaults(handler=_check)

    explain = commands.add_parser(
        "explain",
        help="may this artifact go there? (exit 0 allow, 1 deny, 2 error)",
        description="Decide one transfer and print allow or deny, the deciding rule and why.",
    )
    _add_policies_argument(explain)
    explain.add_argument(
        "--kind",
        required=True,
        metavar="KIND",
        choices=[kind.value for kind in ArtifactKind],
        help="artifact kind: " + ", ".join(kind.value for kind in ArtifactKind),
    )
    explain.add_argument("--source", required=True, help=f"where it is: {_DESTINATIONS}")
    explain.add_argument("--destination", required=True, help=f"where it goes: {_DESTINATIONS}")
    explain.add_argument(
        "--provenance",
        help="contributing regions, REGION or REGION/DATASET, comma-separated "
        "(default: the source region, with all its datasets)",
    )
    explain.add_argument(
        "--coordinator-jurisdiction",
        metavar="CODE",
        help="jurisdiction of the coordinator, for jurisdiction: rules (default: unknown)",
    )
    explain.set_defaults(handler=_explain)

    admit = commands.add_parser(
        "admit",
        help="may this job run as placed? (exit 0 admit, 1 refuse, 2 error)",
        description="Run job admission for a placement file (see policies.placement).",
    )
    _add_policies_argument(admit)
    admit.add_argument("--job", required=True, metavar="FILE", help="job placement YAML")
    admit.set_defaults(handler=_admit)


def _add_policies_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policies",
        required=True,
        action="append",
        metavar="PATH",
        help="policy file or directory (repeatable)",
    )


def _check(args: argparse.Namespace) -> int:
    try:
        policies = load_policies(args.paths)
    except PolicyLoadError as exc:
        _print_problems(exc.problems, sys.stdout)
        print(f"failed: {len(exc.problems)} error(s)")
        return EXIT_DENY
    _print_problems(policies.warnings, sys.stdout)
    if args.strict and policies.warnings:
        print(f"failed: {len(policies.warnings)} warning(s) with --strict")
        return EXIT_DENY
    print(f"ok: {len(policies)} policies")
    return EXIT_ALLOW


def _explain(args: argparse.Namespace) -> int:
    policies = _load_or_report(args.policies)
    if policies is None:
        return EXIT_USAGE
    try:
        source = policies.endpoint(args.source, args.coordinator_jurisdiction)
        destination = policies.endpoint(args.destination, args.coordinator_jurisdiction)
        if args.provenance is not None:
            provenance = Provenance.parse(args.provenance)
        elif source.kind is EndpointKind.REGION:
            provenance = Provenance.regions(source.name)
        else:
            print(
                "error: --provenance is required when the source is not a region", file=sys.stderr
            )
            return EXIT_USAGE
    except PolicyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    decision = decide_transfer(
        policies, Transfer(ArtifactKind(args.kind), source, destination, provenance)
    )
    _print_decision(decision)
    return EXIT_ALLOW if decision.allowed else EXIT_DENY


def _admit(args: argparse.Namespace) -> int:
    policies = _load_or_report(args.policies)
    if policies is None:
        return EXIT_USAGE
    try:
        placement = load_placement(args.job, policies)
    except PolicyLoadError as exc:
        _print_problems(exc.problems, sys.stderr)
        return EXIT_USAGE
    admission = admit_job(policies, placement)
    if admission.admitted:
        print("admit")
        names = ", ".join(location.name for location in admission.checkpoint_storage)
        print(f"checkpoint storage: {names}")
        print(f"checks passed: {len(admission.decisions)}")
        return EXIT_ALLOW
    print("deny")
    for decision in admission.denials:
        print(f"{decision.subject}:")
        for verdict in decision.verdicts:
            if not verdict.allowed:
                print(f"  {verdict.rule}: {verdict.reason}")
    allowed = ", ".join(location.name for location in admission.checkpoint_storage)
    print(f"checkpoint storage allowed: {allowed or '(none)'}")
    return EXIT_DENY


def _load_or_report(paths: Sequence[str]) -> PolicySet | None:
    try:
        return load_policies(paths)
    except PolicyLoadError as exc:
        _print_problems(exc.problems, sys.stderr)
        return None


def _print_decision(decision: Decision) -> None:
    print(decision.verb)
    print(f"rule: {decision.rule}")
    print(f"reason: {decision.reason}")
    print(f"transfer: {decision.subject}")
    print("rules consulted:")
    for verdict in decision.verdicts:
        print(f"  {verdict}")


def _print_problems(problems: Sequence[Problem], stream: TextIO) -> None:
    for problem in problems:
        print(problem, file=stream)
