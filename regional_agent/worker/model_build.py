"""A job's model on one rank: built on the ``meta`` device wherever the task allows it.

A model built on the ``meta`` device (:func:`geofed.meta_build.on_meta`) has shapes and no
storage; the worker shards it, allocates only its own shards on its device (``to_empty``)
and loads θ into them, so no rank ever holds the whole model in fp32
(:func:`regional_agent.worker.parallelism.wrap`). The tensors θ does not carry (a complex
RoPE table, an integer counter, a non-persistent buffer) are then filled by the task's
:meth:`~geofed.task.Task.init_non_federated`.

:func:`meta_refusal` is the pure decision, with its reason, over what a meta build gave;
:func:`build_model` acts on it and falls back to building the whole model on the host
(as before) when the task cannot build on meta, saying why.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from geofed.meta_build import on_meta
from geofed.params import federated_names
from geofed.task import Task


@dataclass(frozen=True, slots=True)
class BuiltModel:
    """A rank's model and how it was built.

    ``materialize`` is set when ``model`` is on the meta device: it fills the tensors θ
    does not carry once the model's storage is allocated. None: built on the device.
    """

    model: nn.Module
    materialize: Callable[[nn.Module], None] | None
    reason: str


def non_federated_names(model: nn.Module) -> list[str]:
    """The parameters and buffers of ``model`` that θ does not carry."""
    carried = federated_names(model)
    tensors = itertools.chain(model.named_parameters(), model.named_buffers())
    return sorted(name for name, _ in tensors if name not in carried)


def overrides_init_non_federated(task: Task[Any]) -> bool:
    """Whether ``task`` defines :meth:`~geofed.task.Task.init_non_federated`."""
    return type(task).init_non_federated is not Task.init_non_federated


def meta_refusal(model: nn.Module, can_init_non_federated: bool) -> str | None:
    """Why a model ``build_model`` made under the meta device cannot be used; None if it can.

    Refused: tensors made off the meta device (an explicit ``device=``), parameters
    shared by two names (``to_empty`` would untie them), and tensors θ does not carry
    when the task cannot fill them.
    """
    tensors = list(
        itertools.chain(
            model.named_parameters(remove_duplicate=False),
            model.named_buffers(remove_duplicate=False),
        )
    )
    off_meta = sorted(name for name, tensor in tensors if not tensor.is_meta)
    if off_meta:
        return f"it made tensors off the meta device ({', '.join(off_meta[:5])})"
    seen: dict[int, str] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        first = seen.setdefault(id(tensor), name)
        if first != name:
            return f"{first} and {name} are one shared parameter"
    others = non_federated_names(model)
    if others and not can_init_non_federated:
        return (
            f"it has tensors θ does not carry ({', '.join(others[:5])}) and does not "
            "define init_non_federated"
        )
    return None


def build_model(task: Task[Any], seed: int, device: torch.device) -> BuiltModel:
    """Build ``task``'s model for a rank on ``device``: on meta when the task allows it."""
    name = type(task).__name__
    try:
        with on_meta():
            model = task.build_model(seed=seed)
    except Exception as exc:
        refusal: str | None = f"build_model failed there ({type(exc).__name__}: {exc})"
    else:
        refusal = meta_refusal(model, overrides_init_non_federated(task))
    if refusal is None:
        others = non_federated_names(model)
        materialize = task.init_non_federated if others else _nothing
        return BuiltModel(model, materialize, f"{name}: built on the meta device")
    model = task.build_model(seed=seed).to(device)
    return BuiltModel(
        model,
        None,
        f"{name} cannot build on the meta device: {refusal}; built whole on {device}",
    )


def _nothing(model: nn.Module) -> None:
    del model
