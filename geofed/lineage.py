"""What made each global version: software fingerprints and the lineage record of a round.

Each region signs, with its delta, the :class:`Software` that trained it (its torch and
geofed versions and the task's code fingerprint: :func:`local_software`). The coordinator
compares that fingerprint with its own (:func:`code_mismatch`) and, when it publishes
round r, puts a lineage record (:func:`round_lineage`) in the signed manifest of the
global update θ_r -> θ_{r+1}: the contributing regions with their delta manifests'
digests, tokens, datasets, jurisdictions and software, the job spec's hash, the task,
and the codec, training, aggregation and outer-optimizer settings. So the lineage is
covered by the coordinator's signature, and ``GET /v1/jobs/{job}/lineage`` and
``geofed export`` read it from the very manifests the regions verify.

The task's *code fingerprint* is the sha256 over the Python sources of the directory
holding the module that defines the task class (its package, for a task in a package),
in sorted relative-path order, each file's path and bytes length-prefixed; the *package*
is the task spec's top-level package and its *version* that of the installed
distribution providing it, when there is one.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import platform
import struct
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Final

from pydantic import BaseModel, ConfigDict, Field, JsonValue, StrictStr

import geofed
from geofed.canonical_json import canonical_json

__all__ = [
    "LINEAGE_FORMAT",
    "Software",
    "TaskCode",
    "code_fingerprint",
    "code_mismatch",
    "contributor",
    "local_software",
    "round_lineage",
    "spec_hash",
    "task_code",
]

LINEAGE_FORMAT: Final = 1
Version = Annotated[StrictStr, Field(pattern=r"^[!-~]{1,128}$")]
Sha256Hex = Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{64}$")]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TaskCode(_Record):
    """The task a job trains, as code: spec, package, its version, the source fingerprint."""

    spec: Annotated[StrictStr, Field(pattern=r"^[!-~]{1,256}$")]
    package: Annotated[StrictStr, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]
    version: Version | None = None
    fingerprint: Sha256Hex


class Software(_Record):
    """What one party ran: its torch, geofed and Python versions and the task's code."""

    torch: Version
    geofed: Version
    python: Version
    task: TaskCode


def code_fingerprint(root: Path, files: Sequence[Path]) -> str:
    """sha256 over ``files`` (paths relative to ``root``, sorted), each path and content."""
    digest = hashlib.sha256(b"geofed-code-v1\0")
    for path in sorted(files, key=lambda p: p.relative_to(root).as_posix()):
        name = path.relative_to(root).as_posix().encode("utf-8")
        data = path.read_bytes()
        digest.update(struct.pack("<Q", len(name)) + name)
        digest.update(struct.pack("<Q", len(data)) + data)
    return digest.hexdigest()


@functools.lru_cache(maxsize=16)
def task_code(spec: str) -> TaskCode:
    """The :class:`TaskCode` of task spec ``package.module:Class`` as installed here."""
    from geofed.task import load_task_class

    cls = load_task_class(spec)
    module = sys.modules[cls.__module__]
    source = Path(module.__file__ or "")
    if not source.is_file():
        raise ValueError(f"task {spec!r}: its module {cls.__module__} has no source file")
    # A task inside a package is the package's code (its data, model and corpus modules).
    root = source.parent
    files = sorted(root.rglob("*.py")) if module.__package__ else [source]
    package = spec.split(":", 1)[0].split(".", 1)[0]
    return TaskCode(
        spec=spec,
        package=package,
        version=_distribution_version(package),
        fingerprint=code_fingerprint(root, files),
    )


def _distribution_version(package: str) -> str | None:
    for distribution in importlib.metadata.packages_distributions().get(package, []):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def local_software(task_spec: str) -> Software:
    """The :class:`Software` of this process for ``task_spec``."""
    import torch

    return Software(
        torch=torch.__version__,
        geofed=geofed.__version__,
        python=platform.python_version(),
        task=task_code(task_spec),
    )


def code_mismatch(region: str, theirs: Software | None, ours: TaskCode) -> str | None:
    """Why ``region``'s task code differs from the coordinator's, or None when it agrees."""
    if theirs is None:
        return f"region {region} sent no software fingerprint with its delta"
    if theirs.task.fingerprint != ours.fingerprint:
        return (
            f"region {region} trains {theirs.task.spec} with code fingerprint "
            f"{theirs.task.fingerprint[:16]} (package {theirs.task.package} "
            f"{theirs.task.version or 'unversioned'}); the coordinator has "
            f"{ours.fingerprint[:16]} ({ours.package} {ours.version or 'unversioned'})"
        )
    return None


def spec_hash(spec_json: Mapping[str, Any]) -> str:
    """sha256 of the job spec's canonical JSON (sorted keys, no whitespace)."""
    return hashlib.sha256(canonical_json(dict(spec_json))).hexdigest()


def contributor(
    region: str,
    jurisdiction: str,
    datasets: Sequence[str],
    delta_manifest: str,
    tokens: int,
    software: Software | None,
    code_matches: bool,
    data_fingerprints: Mapping[str, str] | None = None,
) -> dict[str, JsonValue]:
    """One contributing region's entry of a lineage record; ``data_fingerprints``: each
    dataset's fingerprint as the region's delta manifest gave it (never a path)."""
    return {
        "region": region,
        "jurisdiction": jurisdiction,
        "datasets": list(datasets),
        "delta_manifest": delta_manifest,
        "tokens": tokens,
        "software": None if software is None else software.model_dump(mode="json"),
        "code_matches": code_matches,
        "data_fingerprints": None if data_fingerprints is None else dict(data_fingerprints),
    }


def round_lineage(
    *,
    job: str,
    round_: int,
    spec: Mapping[str, Any],
    coordinator: Software,
    contributors: Sequence[Mapping[str, JsonValue]],
) -> dict[str, JsonValue]:
    """The lineage record of round ``round_``'s update (θ_round -> θ_round+1).

    ``spec`` is the job spec's JSON form; its settings that shape the model are repeated
    so a reader needs nothing else.
    """
    settings = {
        key: spec.get(key)
        for key in ("codec", "training", "outer_optimizer", "aggregation", "inner_steps", "seed")
    }
    return {
        "format": LINEAGE_FORMAT,
        "job": job,
        "round": round_,
        "version": round_ + 1,
        "spec_hash": spec_hash(spec),
        "task": spec.get("task"),
        "coordinator": coordinator.model_dump(mode="json"),
        "contributors": [dict(c) for c in contributors],
        **settings,
    }
