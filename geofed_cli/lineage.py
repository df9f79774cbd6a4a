"""``geofed lineage JOB [--round N]``: what made a global version, as the coordinator signed it.

Prints the record of ``GET /v1/jobs/{job}/lineage`` (:mod:`geofed.lineage`): the job
spec's hash, the task and its code fingerprint, the coordinator's and each contributing
region's software, each region's delta (manifest digest, tokens, datasets, jurisdiction)
and the settings that shaped the update. ``--json`` prints it whole. Connection flags and
exit codes as ``geofed job`` (see :mod:`geofed_cli.jobs`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from geofed.api_paths import ApiPaths
from geofed_cli.jobs import _connection_arguments, show, version_number


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    lineage = subparsers.add_parser(
        "lineage",
        help="show what made a job's global version",
        description="Show the signed lineage of θ_N: contributing regions and their deltas, "
        "software, task code fingerprint, job spec hash and settings. Exit codes: 0 shown, "
        "1 refused or unreachable, 2 usage error.",
    )
    lineage.add_argument("job", metavar="JOB", help="job id")
    lineage.add_argument(
        "--round", type=version_number, default=None, help="the version θ_N (default: the newest)"
    )
    _connection_arguments(lineage)
    lineage.set_defaults(handler=_lineage)


def _lineage(args: argparse.Namespace) -> int:
    path = ApiPaths.lineage(args.job)
    if args.round is not None:
        path += f"?round={args.round}"
    return show(args, path, lambda body: print_lineage(body, sys.stdout))


def _software(software: Any) -> str:
    if not isinstance(software, dict):
        return "software unknown"
    task = software.get("task", {})
    return (
        f"torch {software.get('torch')}, geofed {software.get('geofed')}, "
        f"python {software.get('python')}, task code {str(task.get('fingerprint'))[:16]}"
    )


def print_lineage(body: dict[str, Any], out: TextIO) -> None:
    """The lineage answer, readable."""
    record = body["lineage"]
    print(
        f"job {body['job']} θ_{body['version']}: made by round {record.get('round')}, "
        f"signed by {body['signed_by']} (update manifest {body['update_manifest'][:16]})",
        file=out,
    )
    task = record.get("task") or {}
    coordinator = record.get("coordinator") or {}
    code = coordinator.get("task") or {}
    print(f"  job spec sha256 {record.get('spec_hash')}", file=out)
    print(
        f"  task {task.get('spec')} (package {code.get('package')} "
        f"{code.get('version') or 'unversioned'}, code fingerprint {code.get('fingerprint')})",
        file=out,
    )
    print(f"  coordinator: {_software(coordinator)}", file=out)
    for entry in record.get("contributors", []):
        flag = "" if entry.get("code_matches") else "  [task code differs]"
        print(
            f"  {entry['region']} ({entry.get('jurisdiction')}; datasets "
            f"{', '.join(entry.get('datasets', [])) or 'none'}): delta "
            f"{str(entry.get('delta_manifest'))[:16]}, {entry.get('tokens')} tokens; "
            f"{_software(entry.get('software'))}{flag}",
            file=out,
        )
    for key in ("codec", "training", "outer_optimizer", "aggregation"):
        if record.get(key) is not None:
            print(f"  {key}: {readable(record[key])}", file=out)


def readable(value: Any) -> str:
    """A setting as a person reads it: ``key value`` pairs, nested ones in parentheses,
    lists comma-separated (never a Python repr)."""
    if isinstance(value, dict):
        if not value:
            return "none"
        parts = []
        for key, item in value.items():
            shown = readable(item)
            parts.append(
                f"{key} ({shown})" if isinstance(item, dict) and item else f"{key} {shown}"
            )
        return ", ".join(parts)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(readable(item) for item in value) + "]"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)
