"""Read the demo's WAN byte counts from the coordinator's Prometheus exposition."""

from __future__ import annotations

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
