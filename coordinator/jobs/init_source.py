"""Where a job's θ_0 comes from when its spec says ``init_from``: a version of another job
this coordinator holds, or an export file under one of the config's ``import_dirs``.

:func:`load_initial` reads and verifies it (no I/O elsewhere): a job's version is rebuilt
from its signed chain exactly as ``geofed export`` does (every signature, chunk digest and
parameter hash checked); a file is a ``geofed export`` of either format, or a
``--format hf`` directory, whose recorded parameters hash must match what it holds. What
the source derives from (its regions and their datasets) comes back with it: the new job
inherits it, so admission decides on both, and the new job's artifacts carry both.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from coordinator.jobs.spec import InitFrom
from coordinator.storage.artifacts import Location, chain_at
from geofed.export import ChainPart, ExportError, Rebuilt, plan_parts, rebuild
from geofed.params import parameters_vector_hash, shapes_mismatch
from geofed.pki import TrustBundle
from geofed.types import ArtifactKind

__all__ = [
    "InitError",
    "InitialState",
    "check_shapes",
    "file_source",
    "load_initial",
    "rebuild_version",
]


class InitError(Exception):
    """The ``init_from`` source cannot give the job's θ_0; the message says why."""


@dataclass(frozen=True)
class InitialState:
    """θ_0 from a source, its hash, what it derives from, and where it came from."""

    params: dict[str, Tensor]
    params_hash: str
    provenance: dict[str, tuple[str, ...]]
    source: str


def rebuild_version(location: Location, job: str, version: int, trust: TrustBundle) -> Rebuilt:
    """θ_version of ``job`` rebuilt from ``location``'s signed chain and verified."""
    chain = chain_at(location, job, version)
    if chain is None:
        raise ExportError(f"{location.name} holds no restorable chain of θ_{version} of {job}")
    snapshot, updates = chain
    parts = [
        ChainPart(
            ArtifactKind.GLOBAL_CHECKPOINT if entry is snapshot else ArtifactKind.GLOBAL_UPDATE,
            entry.round,
            entry.payload_digest,
            entry.manifest_digest,
        )
        for entry in (snapshot, *updates)
    ]
    plan = plan_parts(job, version, parts, None)
    bundles = (location.blobs.path_of(part.payload_digest).read_bytes() for part in plan.parts)
    return rebuild(plan, bundles, trust, now=datetime.now(UTC))


def file_source(path: str, import_dirs: Sequence[Path]) -> Path:
    """``path`` resolved, when it lies under one of ``import_dirs`` (links followed)."""
    if not import_dirs:
        raise InitError(
            f"init_from: {path}: this coordinator imports no files; list the directory in "
            "its config's import_dirs"
        )
    resolved = Path(path).resolve()
    for directory in import_dirs:
        if resolved.is_relative_to(directory.resolve()):
            return resolved
    allowed = ", ".join(str(d) for d in import_dirs)
    raise InitError(f"init_from: {path} is not under the config's import_dirs ({allowed})")


def load_initial(
    source: InitFrom,
    *,
    job_location: Location | None,
    job_version: int | None,
    import_dirs: Sequence[Path],
    trust: TrustBundle,
) -> InitialState:
    """θ_0 as ``source`` names it, verified (see the module docstring).

    For a job source, ``job_location`` is where that job's checkpoints are and
    ``job_version`` its newest published version (the default round).
    """
    if source.job is not None:
        if job_location is None or job_version is None:
            raise InitError(f"init_from: job {source.job} is not a job of this coordinator")
        version = job_version if source.round is None else source.round
        if version > job_version:
            raise InitError(
                f"init_from: θ_{version} of job {source.job} is not published "
                f"(θ_{job_version} is its newest)"
            )
        try:
            rebuilt = rebuild_version(job_location, source.job, version, trust)
        except (ExportError, OSError, ValueError) as exc:
            raise InitError(f"init_from: job {source.job} round {version}: {exc}") from None
        provenance = {
            p.region: tuple(p.datasets) for p in rebuilt.final_manifest.manifest.provenance
        }
        where = f"job {source.job} θ_{version}"
        state = InitialState(rebuilt.params, rebuilt.params_hash, provenance, where)
    else:
        assert source.path is not None  # the model allows one of job and path
        state = _from_file(file_source(source.path, import_dirs))
    if source.params_hash is not None and state.params_hash != source.params_hash:
        raise InitError(
            f"init_from: {state.source} has parameters hash {state.params_hash}, not the "
            f"{source.params_hash} the spec expects"
        )
    return state


def check_shapes(state: InitialState, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raise :class:`InitError` unless θ_0 has exactly the task model's tensors."""
    given = {name: tuple(t.shape) for name, t in state.params.items()}
    differs = shapes_mismatch(shapes, given)
    if differs is not None:
        raise InitError(f"init_from: {state.source} is not a model of this job's task: {differs}")


def _from_file(path: Path) -> InitialState:
    try:
        if path.is_dir():
            params, metadata = _hf_directory(path)
        elif path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as file:
                params = {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118
                metadata = dict(file.metadata() or {})
        else:
            params, metadata = _torch_export(path)
    except InitError:
        raise
    except Exception as exc:  # a damaged or foreign file: say which and why
        raise InitError(f"init_from: {path}: cannot read it: {type(exc).__name__}: {exc}") from None
    recorded = metadata.get("parameters_hash")
    if not isinstance(recorded, str):
        raise InitError(f"init_from: {path} records no parameters hash: not a geofed export")
    params = {name: t.to(torch.float32) for name, t in params.items()}
    actual = parameters_vector_hash(params)
    if actual != recorded:
        raise InitError(
            f"init_from: {path} holds parameters hashing to {actual}, not the {recorded} it "
            "records: it was changed or exported in another precision"
        )
    return InitialState(params, actual, _provenance(metadata.get("provenance"), path), str(path))


def _torch_export(path: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    loaded = torch.load(path, weights_only=True, map_location="cpu")
    if not isinstance(loaded, dict) or "state_dict" not in loaded:
        raise InitError(f"init_from: {path} is not a geofed export")
    return dict(loaded["state_dict"]), dict(loaded.get("metadata") or {})


def _hf_directory(path: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """A ``geofed export --format hf`` directory: its weights as the model names them."""
    from geofed.params import federated_state
    from geofed.tasks.hf_export import EXPORT_FILE
    from geofed.tasks.hf_model import transformers_module

    described = path / EXPORT_FILE
    if not described.is_file():
        raise InitError(f"init_from: {path} has no {EXPORT_FILE}: not a geofed export")
    metadata = json.loads(described.read_text())
    transformers = transformers_module()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, local_files_only=True
    )
    return {k: v.detach().clone() for k, v in federated_state(model).items()}, metadata


def _provenance(raw: Any, path: Path) -> dict[str, tuple[str, ...]]:
    entries = json.loads(raw) if isinstance(raw, str) else raw
    if not isinstance(entries, list):
        raise InitError(f"init_from: {path} records no provenance: not a geofed export")
    try:
        return {str(e["region"]): tuple(str(d) for d in e["datasets"]) for e in entries}
    except (KeyError, TypeError) as exc:
        raise InitError(f"init_from: {path}: malformed provenance ({exc!r})") from None
