"""θ_0 of a new job: built by its task (bounded) or read from the source it starts from,
checked to be a model of the task, then published as round 0 and recorded.

The job's round engine calls :func:`create_theta_zero` once, when it finds no version of
the job in the store; a :class:`ThetaZeroRefused` carries the reason the job fails with.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from torch import Tensor

from coordinator.aggregation.outer_optimizer import OuterOptimizer
from coordinator.aggregation.outer_round import publish_initial
from coordinator.jobs.context import JobContext, JobContextError, job_initial_parameters
from coordinator.jobs.init_source import InitError, check_shapes, load_initial
from coordinator.jobs.spec import InitFrom
from coordinator.services import Services
from coordinator.state.transactions import record_initial
from coordinator.storage.working_state import WorkingState
from geofed.params import shapes_mismatch

__all__ = ["ThetaZeroRefused", "create_theta_zero"]


class ThetaZeroRefused(Exception):
    """θ_0 cannot be made; the message is why, as the failed job states it."""


async def create_theta_zero(services: Services, ctx: JobContext) -> WorkingState:
    """θ_0 (from ``init_from`` or the task's build), its snapshot as round 0 and the job's
    first pointers, committed; raises :class:`ThetaZeroRefused` when θ_0 cannot be made."""
    spec = ctx.spec
    if spec.init_from is not None:
        params = await _from_source(services, ctx, spec.init_from)
    else:
        params = await _built(services, ctx)
    optimizer = OuterOptimizer(spec.outer_optimizer)
    state, pointers, snapshot = await services.executors.compute(
        publish_initial, ctx.publishing, params, optimizer, datetime.now(UTC)
    )
    details = {
        "snapshot": snapshot.bundle_digest,
        "size": snapshot.size,
        "params_hash": state.params_hash,
        "location": ctx.location_name,
    }
    await services.db.run(record_initial, ctx.job, pointers, services.actor, details)
    services.metrics.last_checkpoint.labels(job=ctx.job).set(time.time())
    return state


async def _built(services: Services, ctx: JobContext) -> dict[str, Tensor]:
    """The task's ``build_model(seed)``, bounded, and of the shapes its meta build had."""
    try:
        params = await services.executors.compute(
            job_initial_parameters, ctx.task, ctx.spec, services.config, ctx.meta_parameters
        )
    except JobContextError as exc:
        raise ThetaZeroRefused(f"θ_0: {exc}") from None
    differs = shapes_mismatch(ctx.shapes, {name: tuple(t.shape) for name, t in params.items()})
    if differs is not None:  # the shapes came from its build on the meta device
        raise ThetaZeroRefused(f"θ_0: the task's model is not its meta build: {differs}")
    return params


async def _from_source(services: Services, ctx: JobContext, source: InitFrom) -> dict[str, Tensor]:
    """θ_0 read again from the source the submission verified, and checked to be the same
    (its hash) and a model of the job's task."""
    runtime = services.runtime
    location = runtime.locations.get(source.location) if source.location else None
    try:
        state = await services.executors.files(
            load_initial,
            source,
            job_location=location,
            job_version=source.round,
            import_dirs=services.config.import_dirs,
            trust=runtime.bundle,
        )
        check_shapes(state, ctx.shapes)
    except InitError as exc:
        raise ThetaZeroRefused(str(exc)) from None
    return state.params
