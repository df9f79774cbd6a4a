"""θ_0 from the task's ``build_model``, within a memory and time budget.

A job's task is the operator's code: its ``build_model`` may allocate far more than its
parameters (buffers, data read at construction) or never return. A model counted on the
meta device at up to :data:`IN_PROCESS_MAX_PARAMETERS` parameters is built in the
coordinator's own process, as cheap as it is bounded. Any other (a larger one, or one
that cannot be built on the meta device, so nothing bounded it in advance) is built in a
child process of its own: the coordinator samples the child's resident memory every
:data:`POLL_S` and stops it past ``limits.max_task_bytes``, or past
``limits.build_timeout_s`` from when its interpreter is up (the task's import and
construction count, the interpreter's start does not); the child dies with the
coordinator. θ_0 comes back as a file in the coordinator's scratch directory, read and
removed.

Blocking: call :func:`bounded_initial_parameters` from a worker thread.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
from torch import Tensor

from coordinator.memory_budget import POLL_S, gib, resident_bytes
from geofed.meta_build import on_meta
from geofed.params import federated_state, state_to_fp32
from geofed.parent_death import die_with_parent
from geofed.task import Task, TaskError, load_task

__all__ = [
    "IN_PROCESS_MAX_PARAMETERS",
    "BuildFailed",
    "BuildLimits",
    "bounded_initial_parameters",
    "initial_parameters",
    "meta_count",
    "meta_shapes",
    "parameter_count",
]

#: The largest model (counted on the meta device) built in the coordinator's process.
IN_PROCESS_MAX_PARAMETERS: Final = 1 << 26
#: How long a child build's interpreter may take to start (torch imported), besides the
#: build's own ``timeout_s``, which runs once it has.
STARTUP_S: Final = 120.0


class BuildFailed(Exception):
    """θ_0 could not be built: the task failed, or its build went past the budget."""


@dataclass(frozen=True, slots=True)
class BuildLimits:
    """A child build's budget: resident memory (bytes) and wall time (seconds)."""

    max_bytes: int
    timeout_s: float


def initial_parameters(task: Task[Any], seed: int) -> dict[str, Tensor]:
    """θ_0: the federated state of the task's model for the job's seed, float32 on CPU.

    Buffers outside the federated state (complex, integer) are left out: every side's
    ``build_model`` rebuilds them.
    """
    params = state_to_fp32(task.build_model(seed=seed))
    if not params:
        raise BuildFailed("the model has no floating-point parameters to federate")
    return params


def meta_shapes(task: Task[Any], seed: int) -> dict[str, tuple[int, ...]] | None:
    """The shapes of the task model's federated tensors, built on the meta device (nothing
    is allocated); None when the model cannot be built there."""
    try:
        with on_meta():
            model = task.build_model(seed=seed)
    except Exception:  # the task's own code: its real build reports what is wrong
        return None
    return {name: tuple(tensor.shape) for name, tensor in federated_state(model).items()}


def parameter_count(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """How many parameters tensors of ``shapes`` hold."""
    return sum(math.prod(shape) for shape in shapes.values())


def meta_count(task: Task[Any], seed: int) -> int | None:
    """The federated parameters of the task's model, counted on the meta device; None when
    the model cannot be built there."""
    shapes = meta_shapes(task, seed)
    return None if shapes is None else parameter_count(shapes)


def bounded_initial_parameters(
    task: Task[Any],
    task_spec: str,
    options: Mapping[str, Any],
    seed: int,
    limits: BuildLimits,
    scratch: Path,
    *,
    counted: int | None,
) -> dict[str, Tensor]:
    """θ_0 of ``task`` (``task_spec`` with ``options``) for ``seed``; ``counted``: its
    parameters as :func:`meta_count` found them. In this process when ``counted`` is at
    most :data:`IN_PROCESS_MAX_PARAMETERS`, else in a bounded child process;
    :class:`BuildFailed` says why not."""
    if counted is not None and counted <= IN_PROCESS_MAX_PARAMETERS:
        return initial_parameters(task, seed)
    return _build_in_child(task_spec, options, seed, limits, scratch)


def _build_in_child(
    spec: str, options: Mapping[str, Any], seed: int, limits: BuildLimits, scratch: Path
) -> dict[str, Tensor]:
    scratch.mkdir(parents=True, exist_ok=True)
    out = scratch / f"theta0-{os.getpid()}-{time.monotonic_ns()}.pt"
    error = out.with_suffix(".error")
    context = multiprocessing.get_context("spawn")
    child = context.Process(
        target=_child_main,
        args=(os.getpid(), spec, dict(options), seed, str(out), str(error)),
        name="geofed-build-theta0",
        daemon=True,
    )
    try:
        child.start()
        _watch(child, limits, out.with_suffix(".started"))
        if child.exitcode != 0:
            raise BuildFailed(_child_error(error, child.exitcode))
        return dict(torch.load(out, map_location="cpu", weights_only=True))
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        for path in (out, out.with_suffix(".tmp"), out.with_suffix(".started"), error):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _watch(child: Any, limits: BuildLimits, started: Path) -> None:
    """Wait for ``child`` to end; kill it past the memory or time budget. The time runs
    from ``started``'s appearance (the child's interpreter is up: the task's code runs
    next); until then the child has :data:`STARTUP_S` more."""
    deadline = time.monotonic() + limits.timeout_s + STARTUP_S
    building = False
    peak = 0
    while child.is_alive():
        if not building and started.exists():
            building = True
            deadline = time.monotonic() + limits.timeout_s
        peak = max(peak, resident_bytes(child.pid))
        if peak > limits.max_bytes:
            child.kill()
            child.join()
            raise BuildFailed(
                f"building θ_0 took more than {gib(limits.max_bytes)} of memory "
                f"({gib(peak)} seen; limits.max_task_bytes in the coordinator's config)"
            )
        if time.monotonic() > deadline:
            child.kill()
            child.join()
            raise BuildFailed(
                f"building θ_0 took longer than {limits.timeout_s:g} s "
                "(limits.build_timeout_s in the coordinator's config)"
            )
        child.join(POLL_S)


def _child_error(path: Path, exitcode: int | None) -> str:
    try:
        return path.read_text(encoding="utf-8").strip() or f"exit status {exitcode}"
    except OSError:
        return f"the build process ended with status {exitcode}"


def _child_main(
    parent: int, spec: str, options: dict[str, Any], seed: int, out: str, error: str
) -> None:
    """The child: build θ_0 and write it to ``out`` (via a temporary file), or say why
    not in ``error`` and exit 1."""
    in_child = die_with_parent(parent)
    if in_child is not None:
        in_child()
    Path(out).with_suffix(".started").touch()
    try:
        params = initial_parameters(load_task(spec, options), seed)
        tmp = Path(out).with_suffix(".tmp")
        torch.save(params, tmp)
        tmp.replace(out)
    except Exception as exc:  # the task's own code: report whatever it raised
        if isinstance(exc, BuildFailed | TaskError):
            message = str(exc)
        else:
            message = f"task {spec!r} failed: {type(exc).__name__}: {exc}"
        Path(error).write_text(message, encoding="utf-8")
        raise SystemExit(1) from None
