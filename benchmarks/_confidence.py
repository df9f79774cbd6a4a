"""How sure a gap between two configurations is: paired differences over seeds (pure).

Two configurations run with the same seed start from the same initial model (and, with
the same regions, read the same data in the same order), so their final losses are
compared seed by seed: the
gap is the mean of the per-seed differences, and its 95 % confidence interval is
Student's t over those differences (``mean ± t(0.975, n - 1) · sd / √n``). A gap whose
interval excludes zero is *resolved*: the seeds say which configuration is better; one
whose interval holds zero is not, whatever its mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Gap", "paired_gap", "t_975"]

#: Student's t at 0.975 (two-sided 95 %) by degrees of freedom; between rows, the next
#: smaller degrees of freedom (a wider interval: never optimistic).
_T_975: tuple[tuple[int, float], ...] = (
    (1, 12.706),
    (2, 4.303),
    (3, 3.182),
    (4, 2.776),
    (5, 2.571),
    (6, 2.447),
    (7, 2.365),
    (8, 2.306),
    (9, 2.262),
    (10, 2.228),
    (12, 2.179),
    (15, 2.131),
    (20, 2.086),
    (30, 2.042),
    (60, 2.000),
    (120, 1.980),
)


def t_975(df: int) -> float:
    """Student's t quantile at 0.975 for ``df`` >= 1 degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    value = _T_975[0][1]
    for at, t in _T_975:
        if at > df:
            break
        value = t
    return value


@dataclass(frozen=True, slots=True)
class Gap:
    """``other`` minus ``base``, seed by seed: the mean, its 95 % interval (None with one
    seed), the mean relative difference, and whether the interval excludes zero."""

    mean: float
    low: float | None
    high: float | None
    relative: float
    n: int

    @property
    def resolved(self) -> bool | None:
        """Whether the seeds tell the two apart (None: one seed cannot say)."""
        if self.low is None or self.high is None:
            return None
        return self.low > 0 or self.high < 0

    @property
    def half_width(self) -> float | None:
        return None if self.low is None or self.high is None else (self.high - self.low) / 2

    def describe(self) -> str:
        """``+1.23% (+0.0270, 95% CI +0.0101..+0.0439, n=3)``."""
        text = f"{self.relative:+.2%} ({self.mean:+.4f}"
        if self.low is not None and self.high is not None:
            text += f", 95% CI {self.low:+.4f}..{self.high:+.4f}"
        return text + f", n={self.n})"


def paired_gap(base: Sequence[float], other: Sequence[float]) -> Gap:
    """The gap of ``other`` over ``base``, where position i of each is seed i's result."""
    if len(base) != len(other) or not base:
        raise ValueError(
            f"paired results need the same seeds on both sides, got {len(base)} and {len(other)}"
        )
    differences = [o - b for b, o in zip(base, other, strict=True)]
    n = len(differences)
    mean = sum(differences) / n
    relative = sum(d / b for d, b in zip(differences, base, strict=True)) / n
    if n == 1:
        return Gap(mean, None, None, relative, n)
    sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1))
    half = t_975(n - 1) * sd / math.sqrt(n)
    return Gap(mean, mean - half, mean + half, relative, n)
