"""A WAN link as people write it: ``5mbit,100ms`` (bandwidth, round-trip time).

:func:`parse_link` reads it (``geofed demo --wan``, the utilization benchmark);
:meth:`WanLink.settings` turns it into the :class:`~geofed.wanemu.LinkSettings` of each
direction of the emulator: the bandwidth in each direction, half the RTT one way.
Bandwidth units: ``bit``, ``kbit``, ``mbit``, ``gbit`` (decimal, per second; ``/s`` may
follow, and ``mbps`` means ``mbit``). Time units: ``us``, ``ms``, ``s``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Final

from geofed.wanemu import LinkSettings

__all__ = ["WanLink", "WanSpecError", "parse_bandwidth", "parse_duration", "parse_link"]

BANDWIDTH_UNITS: Final = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
DURATION_UNITS: Final = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_QUANTITY = re.compile(r"^\s*(?P<number>[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(?P<unit>[a-z/]*)\s*$")
EXAMPLE: Final = "5mbit,100ms"


class WanSpecError(ValueError):
    """A WAN link that cannot be read; the message says what was expected."""


@dataclass(frozen=True, slots=True)
class WanLink:
    """One region's link to the coordinator: bandwidth each way and round-trip time."""

    bandwidth_bits_per_s: float
    rtt_s: float

    def settings(self) -> LinkSettings:
        """The emulator's settings of each direction (bytes per second, one-way delay)."""
        return LinkSettings(latency_s=self.rtt_s / 2, bandwidth_bps=self.bandwidth_bits_per_s / 8)

    def scaled(self, factor: float) -> WanLink:
        """The same RTT with the bandwidth divided by ``factor`` (a model ``factor`` times
        smaller then takes as long to send as the original over this link)."""
        if not (math.isfinite(factor) and factor > 0):
            raise WanSpecError(f"a scale factor must be a finite number > 0, got {factor}")
        return WanLink(self.bandwidth_bits_per_s / factor, self.rtt_s)

    def describe(self) -> str:
        return f"{format_bandwidth(self.bandwidth_bits_per_s)}, {self.rtt_s * 1e3:g} ms RTT"


def _quantity(text: str, units: dict[str, float], what: str, example: str) -> float:
    match = _QUANTITY.match(text.lower())
    if match is None or match["unit"] == "":
        raise WanSpecError(
            f"{what} {text!r}: expected a number and a unit ({', '.join(units)}), e.g. {example}"
        )
    unit = match["unit"]
    if what == "bandwidth":
        unit = unit.removesuffix("/s")
        if unit.endswith("bps"):  # 5mbps: bits per second as well
            unit = unit.removesuffix("bps") + "bit"
    if unit not in units:
        raise WanSpecError(
            f"{what} {text!r}: unknown unit {match['unit']!r}; use one of {', '.join(units)}"
        )
    value = float(match["number"]) * units[unit]
    if not math.isfinite(value):
        raise WanSpecError(f"{what} {text!r} is not a finite number")
    return value


def parse_bandwidth(text: str) -> float:
    """Bits per second of ``text`` (``5mbit``, ``1gbit/s``, ``800kbps``); must be > 0."""
    value = _quantity(text, BANDWIDTH_UNITS, "bandwidth", "5mbit")
    if value <= 0:
        raise WanSpecError(f"bandwidth {text!r} must be more than 0")
    return value


def parse_duration(text: str) -> float:
    """Seconds of ``text`` (``100ms``, ``0.08s``); may be 0."""
    return _quantity(text, DURATION_UNITS, "round-trip time", "100ms")


def parse_link(text: str) -> WanLink:
    """``BANDWIDTH,RTT`` such as ``5mbit,100ms``; raises :class:`WanSpecError` saying why."""
    parts = text.split(",")
    if len(parts) != 2:
        raise WanSpecError(
            f"WAN link {text!r}: expected BANDWIDTH,RTT (bandwidth per region link and "
            f"round-trip time), e.g. {EXAMPLE}"
        )
    return WanLink(parse_bandwidth(parts[0]), parse_duration(parts[1]))


def format_bandwidth(bits_per_s: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g} {unit}"
    return f"{bits_per_s:g} bit/s"
