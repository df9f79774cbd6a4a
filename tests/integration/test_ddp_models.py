"""Models wrapped in DistributedDataParallel, under a real one-rank gloo process group.

The parameter hash, the model state and evaluation look through the wrapper.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from geofed.examples.charlm import CharLMTask
from geofed.params import model_state, parameters_vector_hash, unwrap_model


def test_ddp_wrapper_is_removed(tmp_path: Path) -> None:
    init_method = (tmp_path / "store").as_uri()
    dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        inner = nn.Linear(3, 2)
        wrapped = nn.parallel.DistributedDataParallel(inner)
        assert unwrap_model(wrapped) is inner
        assert set(model_state(wrapped)) == {"weight", "bias"}
        assert parameters_vector_hash(wrapped) == parameters_vector_hash(inner)
    finally:
        dist.destroy_process_group()


def test_evaluate_looks_through_ddp(tmp_path: Path) -> None:
    stdlib_task = CharLMTask()
    model = stdlib_task.build_model()
    expected = stdlib_task.evaluate(model)
    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    try:
        wrapped = nn.parallel.DistributedDataParallel(model)
        assert stdlib_task.evaluate(wrapped) == expected
    finally:
        dist.destroy_process_group()
