"""Command-line values the benchmarks share: lists of rates, and defaults that depend on
``--smoke``."""

from __future__ import annotations

import argparse

__all__ = ["given", "positive_floats"]


def positive_floats(text: str) -> tuple[float, ...]:
    """A comma-separated list of numbers > 0, sorted, each once."""
    try:
        values = tuple(sorted({float(part) for part in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be > 0")
    return values


def given(value: int | None, default: int) -> int:
    """``value`` as given on the command line (0 included, for the checks to refuse), else
    ``default``."""
    return default if value is None else value
