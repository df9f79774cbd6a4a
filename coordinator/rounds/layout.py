"""Which tensors each round of a job synchronizes: all of θ, or for an ``overlap:
streaming`` job one of its F fragments per round (:mod:`geofed.fragments`).

The rounds own it: a delta is accepted against its round's tensors, and the publication
steps and publishes over the same ones. Pure; built once per job with its context.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from geofed.fragments import FragmentPlan, fragment_plan


def fp32_bytes(specs: Mapping[str, tuple[int, ...]]) -> int:
    """The float32 size of the tensors ``specs`` names."""
    return 4 * sum(math.prod(shape) for shape in specs.values())


@dataclass(frozen=True)
class RoundLayout:
    """θ's tensors by name, in order, and F of a streaming job (None: every round
    synchronizes all of θ)."""

    specs: dict[str, tuple[int, ...]]
    fragments: int | None = None

    @property
    def fp32_bytes(self) -> int:
        """The float32 size of all of θ: the most any of its rounds decodes."""
        return fp32_bytes(self.specs)

    @cached_property
    def plan(self) -> FragmentPlan | None:
        """The streaming job's fragments (:class:`~geofed.fragments.FragmentError` when
        θ has fewer tensors than F); None for any other job."""
        if self.fragments is None:
            return None
        return fragment_plan(self.specs, self.fragments)

    def round_specs(self, round_: int) -> dict[str, tuple[int, ...]]:
        """The tensors round ``round_`` synchronizes, in θ's order: its fragment for a
        streaming job, every tensor otherwise. Every delta of the round names exactly
        these, and its update does too."""
        plan = self.plan
        if plan is None:
            return dict(self.specs)
        return {name: self.specs[name] for name in plan.names(round_)}

    def own_steps(self, round_: int) -> int | None:
        """The outer steps round ``round_``'s fragment took before it (it steps once every
        F rounds), which set its momentum warm-up; None: all of θ steps every round."""
        return None if self.plan is None else round_ // self.plan.count

    def round_names(self, round_: int) -> tuple[str, ...] | None:
        """The tensors round ``round_`` steps when it is a fragment; None: all of θ."""
        return None if self.plan is None else tuple(self.round_specs(round_))
