"""The compute precision of a region's training: where bf16 applies, and where it never does.

The parameters a region trains, exchanges and averages are fp32 whatever the precision.
``bf16`` changes only the arithmetic: under FSDP2 the sharded fp32 parameters are
all-gathered as bf16 for the forward and backward and the gradients reduced in fp32
(:func:`mixed_precision_policy`); under DDP the forward and the loss run under
``torch.autocast`` (:func:`autocast`) while DDP all-reduces the fp32 gradients.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from geofed.training_config import Parallelism, Precision


def mixed_precision_policy(precision: Precision) -> MixedPrecisionPolicy:
    """FSDP2's policy: bf16 compute with fp32 gradient reduction, or fp32 throughout."""
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def autocast(
    precision: Precision, parallelism: Parallelism, device: torch.device
) -> AbstractContextManager[object]:
    """The context the forward and the loss run in.

    Autocast only for bf16 under DDP: FSDP2 already computes in the policy's dtype, and
    autocast on top would cast its bf16 parameters again for nothing.
    """
    if precision == "bf16" and parallelism == "ddp":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
