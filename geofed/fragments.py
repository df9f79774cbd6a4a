"""Streaming overlap's fragments: which tensors each round synchronizes. Pure.

Under ``overlap: streaming`` (Streaming DiLoCo) a model's federated tensors are split
into F fragments of about equal size and round r synchronizes fragment ``r mod F`` only:
regions send the delta of that fragment's tensors, the coordinator steps those tensors
and publishes an update that names only them, and every other tensor of θ stays as it
was. Each tensor is thus synchronized once every F rounds, and a round carries about 1/F
of the model, so the peak bandwidth drops by about F.

The split depends only on the tensors' names and element counts (never on the order a
party happens to list them in), so the coordinator, the agents and the workers compute
the same fragments from their own copy of the shapes: largest tensors first, each to the
fragment with the fewest elements so far (ties to the lower index, equal sizes by name).
Within a fragment the names keep the order the caller gave.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "FragmentError",
    "FragmentPlan",
    "fragment_plan",
    "round_fragment",
]


class FragmentError(ValueError):
    """The model cannot be split as asked; the message says why."""


def round_fragment(round_: int, fragments: int) -> int:
    """The index of the fragment round ``round_`` synchronizes."""
    if fragments < 1:
        raise FragmentError(f"fragments must be >= 1, got {fragments}")
    return round_ % fragments


@dataclass(frozen=True, slots=True)
class FragmentPlan:
    """A model's tensors split into fragments (each a tuple of names, in the caller's order)."""

    fragments: tuple[tuple[str, ...], ...]
    elements: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.fragments)

    def names(self, round_: int) -> tuple[str, ...]:
        """The tensors round ``round_`` synchronizes."""
        return self.fragments[round_fragment(round_, self.count)]

    def largest_share(self) -> float:
        """The largest fragment's share of the model's elements (1/F when balanced)."""
        total = sum(self.elements)
        return max(self.elements) / total if total else 0.0


def _numel(shape: int | Sequence[int]) -> int:
    if isinstance(shape, int):
        return shape
    return math.prod(shape)


def fragment_plan(shapes: Mapping[str, int | Sequence[int]], fragments: int) -> FragmentPlan:
    """Split the tensors ``shapes`` names (name -> shape or element count) into ``fragments``.

    :class:`FragmentError` when there are fewer tensors than fragments (a fragment would
    be empty) or ``fragments`` is below 1.
    """
    if fragments < 1:
        raise FragmentError(f"fragments must be >= 1, got {fragments}")
    if len(shapes) < fragments:
        raise FragmentError(
            f"a model of {len(shapes)} tensors cannot be split into {fragments} fragments "
            "(each needs at least one tensor); use fewer fragments"
        )
    sizes = {name: _numel(shape) for name, shape in shapes.items()}
    loads = [0] * fragments
    owner: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        index = min(range(fragments), key=lambda i: (loads[i], i))
        owner[name] = index
        loads[index] += sizes[name]
    groups = tuple(
        tuple(name for name in shapes if owner[name] == index) for index in range(fragments)
    )
    return FragmentPlan(fragments=groups, elements=tuple(loads))
