"""A job whose model is larger than the coordinator takes is refused at submission,
counted on the meta device: a spec asking for a huge model allocates nothing."""

from __future__ import annotations

import resource
from typing import Any

import torch

from coordinator.jobs.context import size_refusal
from coordinator.jobs.initial_build import meta_count
from geofed.task import Task, load_task
from tests.support.tiny_task import TinyTask

CHARLM = "geofed.examples.charlm:CharLMTask"


def test_a_huge_model_is_refused_before_anything_is_allocated() -> None:
    # 100 M positions x 96 wide: ~9.6 G parameters, 36 GiB in float32.
    task = load_task(CHARLM, {"seq_len": 100_000_000})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    counted = meta_count(task, 0)
    assert counted is not None
    refusal = size_refusal(counted, 2_000_000_000)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 200 * 1024, grown_kib
    assert refusal is not None
    assert refusal.startswith("its model has 9,600,")
    assert "this coordinator takes at most 2,000,000,000 (limits.max_parameters" in refusal
    # The figures: the model in float32 and what the coordinator holds of it per job.
    assert f"({4 * counted / 2**30:,.1f} GiB in float32;" in refusal
    assert "18 bytes a parameter of a job while it publishes a round, " in refusal
    assert f"{18 * counted / 2**30:,.1f} GiB)" in refusal


def test_a_model_within_the_budget_passes_and_one_off_meta_is_counted_later() -> None:
    counted = meta_count(load_task(CHARLM, {}), 0)
    assert counted is not None
    assert size_refusal(counted, 2_000_000_000) is None

    class OffMeta(TinyTask):
        def build_model(self, seed: int | None = None) -> torch.nn.Module:
            if torch.get_default_device().type == "meta":
                raise RuntimeError("cannot build on meta")
            return super().build_model(seed)

    task: Task[Any] = OffMeta()
    assert meta_count(task, 0) is None  # its real build is what counts then
