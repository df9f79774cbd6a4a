"""Read the demo's WAN byte counts from the coordinator's Prometheus exposition.

Counters start again at zero when the coordinator restarts (``--chaos`` restarts it):
:class:`RestartSafeTotals` carries what they had reached across such restarts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from coordinator.metrics import FP32_EQUIVALENT_BYTES, RECEIVED_BYTES, SENT_BYTES


def _total(text: str, spec_name: str) -> int:
    family_name = spec_name.removesuffix("_total")
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != family_name:
            continue
        for sample in family.samples:
            if sample.name == spec_name:
                total += sample.value
    return int(total)


def wan_bytes(text: str) -> tuple[int, int, int]:
    """Return (bytes received, bytes sent, fp32-equivalent bytes) from ``/metrics`` text."""
    return (
        _total(text, RECEIVED_BYTES.name),
        _total(text, SENT_BYTES.name),
        _total(text, FP32_EQUIVALENT_BYTES.name),
    )


@dataclass
class RestartSafeTotals:
    """Counter readings summed across the restarts of the process that exports them.

    A reading below the previous one means the counters began again at zero: what the
    previous reading had reached is kept as a base (what was counted between the last
    reading and the restart is not seen; read often).
    """

    _base: list[int] = field(default_factory=list)
    _last: list[int] = field(default_factory=list)

    def observe(self, reading: tuple[int, ...]) -> tuple[int, ...]:
        """The totals since the first reading, given the counters' values now."""
        if not self._last:
            self._base, self._last = [0] * len(reading), list(reading)
        if len(reading) != len(self._last):
            raise ValueError(f"{len(reading)} counters read, {len(self._last)} before")
        if any(now < before for now, before in zip(reading, self._last, strict=True)):
            self._base = [b + last for b, last in zip(self._base, self._last, strict=True)]
        self._last = list(reading)
        return tuple(b + now for b, now in zip(self._base, reading, strict=True))
