"""Model FLOPs utilisation: the peak FLOPs of known accelerators, and the ratio achieved.

MFU is the training FLOPs a region achieved per second over what its devices could do
at most: ``tokens/s x flops_per_token / (peak per device x devices)``.
``flops_per_token`` is the task's (:meth:`geofed.task.Task.flops_per_token`, by default
``6 x parameters``). The peak is the dense figure of the device for the job's precision:
``bf16`` runs on the tensor cores; ``fp32`` is plain fp32 arithmetic (torch leaves TF32
off for matrix products by default). A device the table does not know, the CPU
included, has no peak unless the operator gives one (``workers.peak_flops``): MFU is then
left out, never guessed.
"""

from __future__ import annotations

import math
from typing import Final

from geofed.training_config import Precision

__all__ = ["PEAK_FLOPS", "flops_utilisation", "peak_flops"]

#: Dense peak FLOPs per device by precision, from the vendors' data sheets, keyed by a
#: fragment of ``torch.cuda.get_device_name()``; the first fragment found wins, so the
#: more specific come first.
PEAK_FLOPS: Final[tuple[tuple[str, dict[Precision, float]], ...]] = (
    ("H200", {"bf16": 989e12, "fp32": 67e12}),
    ("H100 PCIe", {"bf16": 756e12, "fp32": 51e12}),
    ("H100 NVL", {"bf16": 835e12, "fp32": 60e12}),
    ("H100", {"bf16": 989e12, "fp32": 67e12}),  # SXM ("NVIDIA H100 80GB HBM3")
    ("A100", {"bf16": 312e12, "fp32": 19.5e12}),
)


def peak_flops(
    accelerator: str | None, precision: Precision, override: float | None = None
) -> float | None:
    """The peak FLOPs/s of one device, or None when unknown.

    ``override`` (the operator's figure for this node's devices) wins; otherwise the
    table is searched for ``accelerator``, a device name as torch reports it (None for
    the CPU).
    """
    if override is not None:
        return override
    if accelerator is None:
        return None
    for fragment, peaks in PEAK_FLOPS:
        if fragment.lower() in accelerator.lower():
            return peaks[precision]
    return None


def flops_utilisation(
    tokens_per_second: float, flops_per_token: float, peak_per_device: float, devices: int
) -> float:
    """The fraction of ``devices`` x ``peak_per_device`` that the training achieved."""
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    for name, value in (
        ("tokens_per_second", tokens_per_second),
        ("flops_per_token", flops_per_token),
    ):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    if not (math.isfinite(peak_per_device) and peak_per_device > 0):
        raise ValueError(f"peak_per_device must be a finite number > 0, got {peak_per_device}")
    return tokens_per_second * flops_per_token / (peak_per_device * devices)
