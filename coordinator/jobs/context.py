"""Everything the coordinator derives once from a job's spec: task, tensors, placement.

Building a context imports the job's task and builds its model on the meta device, to
learn the exact tensors (names, shapes, float32) every delta and update of the job must
carry without allocating them; a model that cannot be built there is built for real,
within the coordinator's budget. That is blocking work: call :func:`build_context` from a
worker thread.

Which of those tensors a round carries is said in one place, :meth:`JobContext.round_shapes`:
all of them, or for an ``overlap: streaming`` job the round's fragment
(:mod:`geofed.fragments`); the delta checks, the round's running sum, the publication
and the size limits all take it from there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from coordinator.aggregation.outer_round import JobPublishing, stored_delta
from coordinator.aggregation.weighted import Feed
from coordinator.config import CoordinatorConfig
from coordinator.intake.delta_checks import DeltaExpectation
from coordinator.jobs.initial_build import (
    BuildFailed,
    BuildLimits,
    bounded_initial_parameters,
    meta_shapes,
    parameter_count,
)
from coordinator.jobs.spec import JobSpec
from coordinator.rounds.layout import RoundLayout, fp32_bytes
from coordinator.runtime import Runtime
from coordinator.storage.working_state import ParamsStore
from geofed.fragments import FragmentError, round_fragment
from geofed.manifest import ArtifactProvenance, ManifestTensor
from geofed.task import Task, TaskError, load_task
from policies import Endpoint, Provenance

__all__ = [
    "JobContext",
    "JobContextError",
    "build_context",
    "job_initial_parameters",
    "size_refusal",
]


class JobContextError(Exception):
    """The job's task cannot be loaded or its model cannot be federated."""


@dataclass(frozen=True)
class JobContext:
    """A job's spec with what follows from it (see the module docstring)."""

    spec: JobSpec
    task: Task[Any]
    shapes: dict[str, tuple[int, ...]]
    jurisdictions: dict[str, str]
    coordinator_jurisdiction: str
    #: The tensors each round synchronizes (publishing shares it).
    layout: RoundLayout
    publishing: JobPublishing
    #: Every region the parameters derive from, with its datasets, when regions left the
    #: job (:mod:`coordinator.jobs.regions`); None: the spec's regions.
    contributors: Mapping[str, tuple[str, ...]] | None = None
    #: The task's :meth:`~geofed.task.Task.fingerprint` as this coordinator read it.
    task_fingerprint: str | None = None
    #: The model's parameters counted on the meta device (None: it cannot be built there).
    meta_parameters: int | None = None

    @property
    def job(self) -> str:
        return self.spec.job

    @property
    def numel(self) -> int:
        return parameter_count(self.shapes)

    @property
    def fp32_bytes(self) -> int:
        return 4 * self.numel

    @property
    def location_name(self) -> str:
        return self.publishing.location.name

    def tensor_specs(self) -> tuple[ManifestTensor, ...]:
        """Every tensor of the job's model, in order (what a full delta declares)."""
        return _manifest_tensors(self.shapes)

    def round_shapes(self, round_: int) -> dict[str, tuple[int, ...]]:
        """The tensors round ``round_`` synchronizes, in the model's order: the round's
        fragment for a streaming job, every tensor otherwise."""
        return self.layout.round_specs(round_)

    def round_tensor_specs(self, round_: int) -> tuple[ManifestTensor, ...]:
        """What every delta's manifest for round ``round_`` must declare, in order."""
        return _manifest_tensors(self.round_shapes(round_))

    def round_fp32_bytes(self, round_: int) -> int:
        """The float32 size of round ``round_``'s delta (and of its update)."""
        return fp32_bytes(self.round_shapes(round_))

    def stored_delta(self, round_: int, blob_digest: str) -> Feed:
        """A stored delta of round ``round_``, decoded piece by piece when fed
        (:func:`coordinator.aggregation.outer_round.stored_delta`)."""
        return stored_delta(self.publishing.deltas, blob_digest, self.round_fp32_bytes(round_))

    def round_scope(self, round_: int) -> str:
        """What round ``round_``'s tensors are, for messages."""
        plan = self.layout.plan
        if plan is None:
            return "the job's model"
        index = round_fragment(round_, plan.count)
        return (
            f"the tensors round {round_} synchronizes (fragment {index} of F={plan.count}, "
            "numbered from 0)"
        )

    def delta_expectation(
        self, config: CoordinatorConfig, round_: int, region: str, base_hash: str
    ) -> DeltaExpectation:
        """What ``region``'s delta for round ``round_`` (trained from θ ``base_hash``) must
        be, under the coordinator's ``config`` limits."""
        spec, limits = self.spec, config.limits
        return DeltaExpectation(
            job=self.job,
            round=round_,
            region=region,
            federation=config.federation,
            base_hash=base_hash,
            tensors=self.round_tensor_specs(round_),
            scope=self.round_scope(round_),
            codec=spec.codec,
            datasets=spec.regions[region],
            jurisdiction=self.jurisdictions.get(region),
            max_upload_bytes=limits.max_upload_bytes,
            max_chunk_bytes=limits.max_chunk_bytes,
            training=spec.training,
            max_tokens=spec.aggregation.token_bound(spec.inner_steps),
            refuse_code_of=spec.task.spec if spec.code_mismatch == "refuse" else None,
        )

    def region_endpoint(self, region: str) -> Endpoint:
        return Endpoint.of_region(region, self.jurisdictions.get(region))

    def coordinator_endpoint(self) -> Endpoint:
        return Endpoint.coordinator(self.coordinator_jurisdiction)

    def storage_endpoint(self) -> Endpoint:
        location = self.publishing.location
        return Endpoint.of_storage(location.name, location.jurisdiction, location.region)

    def provenance(self) -> Provenance:
        """Every region of the job with its datasets: what global artifacts derive from."""
        regions = self.spec.regions if self.contributors is None else self.contributors
        return Provenance.of(dict(regions))


def with_inherited(
    spec: JobSpec, regions: Mapping[str, Sequence[str]]
) -> dict[str, tuple[str, ...]]:
    """``regions`` (region -> datasets) with what the job's ``init_from`` source derives
    from: everything the job publishes derives from both."""
    merged = {region: set(datasets) for region, datasets in regions.items()}
    inherited = spec.init_from.provenance if spec.init_from is not None else None
    for region, datasets in (inherited or {}).items():
        merged.setdefault(region, set()).update(datasets)
    return {region: tuple(sorted(merged[region])) for region in sorted(merged)}


#: Bytes a parameter of one job costs the coordinator at its peak, while it publishes a
#: round: θ, the outer momentum, the error-feedback residual and the round's mean (4 each;
#: the outer step is taken in them), and the update's codes (about 1 with int8); measured
#: 17.1 on the 25M Llama (``benchmarks/results/scale.md``). A snapshot round adds its
#: lossless stream (4), an evaluation in the coordinator a copy of θ (4).
PEAK_BYTES_PER_PARAMETER = 18


def size_refusal(count: int, max_parameters: int) -> str | None:
    """Why a model of ``count`` parameters is too large for this coordinator, or None."""
    if count <= max_parameters:
        return None
    return (
        f"its model has {count:,} parameters ({4 * count / 2**30:,.1f} GiB in float32; the "
        f"coordinator holds about {PEAK_BYTES_PER_PARAMETER} bytes a parameter of a job while "
        f"it publishes a round, {PEAK_BYTES_PER_PARAMETER * count / 2**30:,.1f} GiB); this "
        f"coordinator takes at most {max_parameters:,} (limits.max_parameters in its config)"
    )


def job_initial_parameters(
    task: Task[Any], spec: JobSpec, config: CoordinatorConfig, counted: int | None
) -> dict[str, Tensor]:
    """θ_0 of the job's task, built within the coordinator's budget
    (:mod:`coordinator.jobs.initial_build`); :class:`JobContextError` says why not."""
    limits = BuildLimits(config.limits.max_task_bytes, config.limits.build_timeout_s)
    try:
        return bounded_initial_parameters(
            task,
            spec.task.spec,
            spec.task.options,
            spec.seed,
            limits,
            config.state_dir / "build",
            counted=counted,
        )
    except BuildFailed as exc:
        raise JobContextError(str(exc)) from None


def _refuse_oversized(shapes: Mapping[str, tuple[int, ...]], runtime: Runtime) -> None:
    refusal = size_refusal(parameter_count(shapes), runtime.config.limits.max_parameters)
    if refusal is not None:
        raise JobContextError(refusal)


def build_context(spec: JobSpec, runtime: Runtime, location: str) -> JobContext:
    """Load the task and derive the job's tensors; :class:`JobContextError` if unusable."""
    try:
        task = load_task(spec.task.spec, spec.task.options)
    except Exception as exc:  # the task is the operator's code: report whatever it raised
        raise _failed(spec, exc) from exc
    shapes = meta_shapes(task, spec.seed)
    counted = None if shapes is None else parameter_count(shapes)
    if shapes is not None:
        _refuse_oversized(shapes, runtime)
    try:
        fingerprint = task.fingerprint()
        if shapes is None:  # nothing bounded it in advance: its real build, bounded, does
            params = job_initial_parameters(task, spec, runtime.config, None)
            shapes = {name: tuple(tensor.shape) for name, tensor in params.items()}
            del params  # built again when the job starts: a queued job holds no θ_0
            _refuse_oversized(shapes, runtime)
    except JobContextError:
        raise
    except Exception as exc:
        raise _failed(spec, exc) from exc
    derived = with_inherited(spec, spec.regions)
    jurisdictions = {region: runtime.policies.jurisdiction_of(region) or "" for region in derived}
    provenance = tuple(
        ArtifactProvenance(
            region=region,
            jurisdiction=jurisdictions[region] or "unknown",
            datasets=derived[region],
        )
        for region in derived
    )
    layout = RoundLayout(shapes, spec.fragments if spec.overlap == "streaming" else None)
    try:
        layout.plan  # noqa: B018  (a model with fewer tensors than F fails here, at start)
    except FragmentError as exc:
        raise JobContextError(str(exc)) from None
    blobs = runtime.job_blobs.for_job(spec.job)
    publishing = JobPublishing(
        job=spec.job,
        codec=spec.codec.rounding_to_nearest(),
        # With snapshot_every: auto the round publisher decides each snapshot
        # (coordinator.publication.snapshots); the bound only serves callers that do not.
        snapshot_every=spec.fixed_snapshot_every or spec.snapshot_max_rounds,
        provenance=provenance,
        layout=layout,
        location=runtime.locations[location],
        signer=runtime.signer,
        params_store=ParamsStore(blobs),
        deltas=blobs,
        aggregation=spec.aggregation,
    )
    return JobContext(
        spec=spec,
        task=task,
        shapes=shapes,
        jurisdictions={r: j for r, j in jurisdictions.items() if j},
        coordinator_jurisdiction=runtime.config.jurisdiction,
        layout=layout,
        publishing=publishing,
        task_fingerprint=fingerprint,
        meta_parameters=counted,
        contributors=derived if spec.init_from is not None else None,
    )


def _failed(spec: JobSpec, exc: Exception) -> JobContextError:
    """What the task's own code raised, said once: a task error as it is, anything else
    with the task named."""
    if isinstance(exc, TaskError):
        return JobContextError(str(exc))
    return JobContextError(f"task {spec.task.spec!r} failed: {type(exc).__name__}: {exc}")


def _manifest_tensors(shapes: Mapping[str, tuple[int, ...]]) -> tuple[ManifestTensor, ...]:
    return tuple(
        ManifestTensor(name=name, dtype="float32", shape=shape) for name, shape in shapes.items()
    )
