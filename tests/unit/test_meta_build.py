"""Models built under ``on_meta``: the shapes of a real build, and fills that never run."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from geofed.examples.charlm.task import CharLMTask
from geofed.meta_build import on_meta
from geofed.params import federated_state


class CallLog(TorchFunctionMode):
    """Records every torch call that reaches it (entered outside ``on_meta``, it sees
    what ``on_meta`` lets through)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        self.names.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def test_a_meta_build_has_the_shapes_of_a_real_one_and_no_storage() -> None:
    task = CharLMTask()
    with on_meta():
        meta = federated_state(task.build_model(seed=3))
    real = federated_state(task.build_model(seed=3))
    assert {n: t.shape for n, t in meta.items()} == {n: t.shape for n, t in real.items()}
    assert all(t.is_meta for t in meta.values())
    assert torch.empty(1).device.type == "cpu"  # the default device is back


def test_fills_of_meta_tensors_return_them_without_running() -> None:
    with CallLog() as log, on_meta():
        embedding = nn.Embedding(10, 4)  # nn.init.normal_ in its reset_parameters
        tensor = torch.empty(3, 3)
        filled = [
            tensor.normal_(),
            tensor.exponential_(),
            tensor.log_normal_(),
            tensor.cauchy_(),
            tensor.geometric_(0.5),
            nn.init.normal_(tensor, std=0.02),
            nn.init.xavier_normal_(tensor),
        ]
    assert embedding.weight.is_meta
    assert embedding.weight.shape == (10, 4)
    assert all(result is tensor for result in filled)
    ran = {"normal_", "exponential_", "log_normal_", "cauchy_", "geometric_"} & set(log.names)
    assert not ran, ran
    assert "empty" in log.names  # everything else goes through


def test_other_ops_and_tensors_off_meta_run_as_usual() -> None:
    with on_meta():
        angles = torch.outer(torch.arange(4.0), torch.arange(2.0))
        host = torch.zeros(2, 3, device="cpu")
        nn.init.normal_(host)
        host_method: Tensor = torch.zeros(5, device="cpu").normal_()
    assert angles.is_meta
    assert angles.shape == (4, 2)
    assert host.abs().sum() > 0
    assert host_method.abs().sum() > 0
