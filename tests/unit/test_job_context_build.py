"""A job's context learns its tensors from the model built on the meta device: θ_0 is not
built for it (a model that cannot be built on meta is built for real, in a bounded child
process: tests/integration/test_bounded_initial_build.py)."""

from __future__ import annotations

from pathlib import Path

from coordinator.jobs.context import build_context
from coordinator.jobs.spec import parse_job_spec
from coordinator.runtime import load_runtime
from tests.support.coordinator import job_yaml, write_setup
from tests.support.off_meta_task import META_ONLY_SPEC

#: TinyTask (hidden 8): two linear layers, 8 -> 8 -> 2.
TINY_SHAPES = {"0.weight": (8, 8), "0.bias": (8,), "2.weight": (2, 8), "2.bias": (2,)}


def test_a_model_built_on_meta_gives_the_shapes_and_no_theta_is_built(tmp_path: Path) -> None:
    runtime = load_runtime(write_setup(tmp_path, broker_port=1).config())
    spec = parse_job_spec(job_yaml("tiny", task=META_ONLY_SPEC), "job.yaml")
    ctx = build_context(spec, runtime, "eu-ckpt")  # a real build would raise
    assert ctx.shapes == TINY_SHAPES
    assert ctx.meta_parameters == ctx.numel == 64 + 8 + 16 + 2
