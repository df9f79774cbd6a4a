"""Activation checkpointing: which modules recompute their activations in backward.

With ``training.activation_checkpointing`` a region keeps only the inputs of the chosen
modules through the forward and recomputes the rest in the backward, trading compute
for memory. The modules are the task's :meth:`~geofed.task.Task.checkpoint_units`, or,
when it declares none, the members of the model's direct ``nn.ModuleList`` children
(where transformer blocks usually live); a model with neither is refused rather than
trained without the memory saving the job asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from geofed.task import Task


class ActivationCheckpointingError(ValueError):
    """The job asks for activation checkpointing and the model offers nothing to checkpoint."""


def checkpointed_modules(task: Task[Any], model: nn.Module) -> Sequence[nn.Module]:
    """The modules to recompute: the task's declared units, else the model's block lists."""
    declared = tuple(task.checkpoint_units(model))
    if declared:
        return declared
    blocks = tuple(
        block for child in model.children() if isinstance(child, nn.ModuleList) for block in child
    )
    if not blocks:
        raise ActivationCheckpointingError(
            f"training.activation_checkpointing is set, but {type(task).__name__} declares no "
            f"checkpoint_units and {type(model).__name__} has no nn.ModuleList of blocks"
        )
    return blocks


def checkpoint_activations(modules: Sequence[nn.Module]) -> None:
    """Make each module's forward recompute in backward (non-reentrant checkpointing).

    The forward is replaced on the instance, so parameter names, and with them the
    federated state and FSDP's units, stay as they were.
    """
    for module in modules:
        module.forward = _recomputing(module.forward)


def _recomputing(forward: Callable[..., Any]) -> Callable[..., Any]:
    def recomputed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return recomputed
