"""What the agent and rank 0 agree on about a round's delta, whichever of them forms it.

The stochastic rounding of a round's delta draws from :func:`rounding_generator`, so
re-encoding a round gives the same bytes on either side; :class:`UnusableDelta` is the
refusal of parameters that cannot form a delta of the base.
"""

from __future__ import annotations

import hashlib

import torch


class UnusableDelta(ValueError):
    """The trained parameters cannot form a delta of the base (names, dtypes, shapes)."""


def rounding_generator(
    job: str, round_: int, region: str, device: torch.device | str = "cpu"
) -> torch.Generator:
    """A generator on ``device`` seeded from (job, round, region): re-encoding a round on
    the same kind of device gives the same bytes."""
    digest = hashlib.sha256(f"geofed-delta/{job}/{round_}/{region}".encode()).digest()
    generator = torch.Generator(device=device)
    return generator.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
