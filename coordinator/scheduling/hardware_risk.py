"""How likely a region is to fail soon, from what its hardware and its record say (pure).

Each region's status carries its node's hardware (:class:`~geofed.control.HardwareSummary`).
:func:`region_risk` turns it, with the region's recent failures, into a score in [0, 1]
and the reasons behind it: each sign is a chance of failure on its own, and they combine
as independent chances do (1 - Π(1 - pᵢ)):

- uncorrectable ECC errors new since the region's agent first saw each GPU (its hardware
  history, kept across restarts: :mod:`regional_agent.telemetry.history`) or since this
  coordinator process first saw the host, whichever is more (the latter covers an agent
  that keeps no history, or whose history began after the errors): 0.8, and 0.05 more for
  each error past the first (a GPU with them usually fails soon after);
- critical XID errors of the last day (the agent's history too): 0.5, and 0.1 more for
  each past the first;
- GPUs the hardware or heat slows down: 0.3, plus 0.4 times the share of the node's GPUs;
- the hottest GPU: 0.3 from 85 °C, 0.5 from 90 °C;
- failures of the region in the last hour (offline, or a deadline missed): 0.2 each;
- fewer GPUs read than its capacity offers (a GPU lost, or a driver no longer answering,
  which leaves the other figures out too): 0.5.

A job's risk is its riskiest region's (:func:`job_risk`). At :data:`SNAPSHOT_RISK` the
snapshot policy snapshots at once (:mod:`coordinator.publication.snapshot_policy`), and
again only once the risk rose by :data:`RISK_STEP` more, or fell below
:data:`REARM_RISK` and rose again; the regions at that risk are asked for a regional
checkpoint from the next round on. A region whose hardware alone scores the coordinator's
``hardware_risk.drain_at`` (:class:`~coordinator.config.HardwareRiskConfig`, 0.9 by
default) is drained: it finishes its round and its agent stops, as at a spot notice,
until an operator starts it again (:func:`drain_due`; the coordinator remembers the drain
across its restarts: :class:`~coordinator.publication.snapshot_policy.SnapshotStats`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from geofed.control import HardwareSummary

__all__ = [
    "FAILURE_WINDOW_S",
    "REARM_RISK",
    "RISK_STEP",
    "SNAPSHOT_RISK",
    "Risk",
    "drain_due",
    "job_risk",
    "region_risk",
]

#: The score at which a job snapshots at once.
SNAPSHOT_RISK: Final = 0.7
#: Below it, the next rise to :data:`SNAPSHOT_RISK` snapshots again.
REARM_RISK: Final = 0.5
#: A rise this much above the score last acted on snapshots again.
RISK_STEP: Final = 0.1
#: How far back a region's failures count.
FAILURE_WINDOW_S: Final = 3600.0


@dataclass(frozen=True, slots=True)
class Risk:
    """A score in [0, 1] and why (``region``: whose, for a job's)."""

    score: float
    reason: str
    region: str | None = None


def region_risk(
    hardware: HardwareSummary | None,
    ecc_seen_first: int | None,
    failures_at: Iterable[float],
    now: float,
    gpus_offered: int = 0,
) -> Risk:
    """A region's risk now: its node as last reported (None: not reported), the
    uncorrectable ECC count it had when first seen, when it failed, and the GPUs its
    capacity offers (``gpus_offered``)."""
    signs: list[tuple[float, str]] = []
    if hardware is not None and hardware.gpus is not None and hardware.gpus < gpus_offered:
        # A GPU lost, or a driver that no longer answers (its figures then missing too).
        missing = gpus_offered - hardware.gpus
        signs.append((0.5, f"{missing} of its {gpus_offered} GPU(s) not read"))
    if hardware is not None:
        ecc, baseline = hardware.ecc_uncorrected, ecc_seen_first
        seen_here = None if ecc is None or baseline is None else max(0, ecc - baseline)
        # The agent's history survives restarts; the coordinator's own count covers an
        # agent that keeps none, or whose history began after errors this process saw.
        counts = (hardware.ecc_uncorrected_new, seen_here)
        new = max((n for n in counts if n is not None), default=0)
        if new:
            signs.append(
                (min(1.0, 0.8 + 0.05 * (new - 1)), f"{new} new uncorrectable ECC error(s)")
            )
        xids = hardware.xid_errors_recent
        if xids:
            signs.append(
                (min(1.0, 0.5 + 0.1 * (xids - 1)), f"{xids} critical XID error(s) in the last day")
            )
        if hardware.slowed_gpus:
            share = hardware.slowed_gpus / hardware.gpus if hardware.gpus else 1.0
            signs.append(
                (0.3 + 0.4 * min(1.0, share), f"{hardware.slowed_gpus} GPU(s) slowed down")
            )
        hottest = hardware.max_temperature_c
        if hottest is not None and hottest >= 85:
            signs.append((0.5 if hottest >= 90 else 0.3, f"a GPU at {hottest:.0f} °C"))
    recent = sum(1 for at in failures_at if now - FAILURE_WINDOW_S <= at <= now)
    if recent:
        signs.append((min(1.0, 0.2 * recent), f"{recent} failure(s) in the last hour"))
    if not signs:
        return Risk(0.0, "no sign of trouble")
    score = 1.0 - math.prod(1.0 - p for p, _ in signs)
    return Risk(score, "; ".join(f"{why} ({p:.2f})" for p, why in signs))


def job_risk(risks: Mapping[str, Risk]) -> Risk:
    """The job's risk: its riskiest region's (ties: the first by name)."""
    if not risks:
        return Risk(0.0, "no region reported")
    region = max(sorted(risks), key=lambda name: risks[name].score)
    risk = risks[region]
    return Risk(risk.score, f"{region}: {risk.reason}", region)


def drain_due(risk: Risk, drain_at: float | None, drained: bool) -> tuple[str | None, bool]:
    """Why a region at ``risk`` (its hardware's alone: failures, a slow WAN's missed
    deadlines among them, never drain a region) is to be drained now (None: it is not),
    and whether it counts as drained after: at ``drain_at`` (None: never), once until its
    risk fell below :data:`REARM_RISK` (``drained``: it was drained since)."""
    drained = drained and risk.score >= REARM_RISK
    if drain_at is None or drained or risk.score < drain_at:
        return None, drained
    return f"hardware risk {risk.score:.2f} reached {drain_at}: {risk.reason}", drained
