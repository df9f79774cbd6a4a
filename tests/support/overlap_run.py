"""Helpers of the federation test of the overlap modes (``delayed``, ``streaming``): what
the agents' logs and the workers' hand-off files say about a job's rounds trained ahead of
θ, and a worker killed in such a round."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any

from tests.support.federation import FederationRun
from tests.support.observe import WAIT_S, ControlObserver, poll

_AHEAD = re.compile(
    r"job (\S+) round (\d+): trained ahead of θ \(started at ([0-9.]+), "
    r"θ folded in before step (\d+) of (\d+)"
)


def ahead(fed: FederationRun, region: str, job: str) -> dict[int, tuple[float, int]]:
    """Round -> (training start, fold step) of the rounds the region trained ahead of θ."""
    text = (fed.work / "logs" / f"agent-{region}.log").read_text(errors="replace")
    return {
        int(m.group(2)): (float(m.group(3)), int(m.group(4)))
        for m in _AHEAD.finditer(text)
        if m.group(1) == job
    }


def opened_at(observer: ControlObserver, job: str, round_: int) -> float:
    """When the coordinator announced ``job``'s round ``round_`` open: θ_round exists from then."""
    return min(
        a.sent_at.timestamp()
        for a in observer.announcements
        if a.job == job and a.state == "open" and a.round == round_
    )


def workers_dir(fed: FederationRun, region: str) -> Path:
    return fed.work / "agents" / region / "workers"


def rank_status(fed: FederationRun, region: str, rank: int) -> dict[str, Any]:
    """What ``rank`` of the region's worker group last recorded of itself (pid, launch,
    restart count, state)."""
    data: dict[str, Any] = json.loads(
        (workers_dir(fed, region) / "ranks" / f"rank-{rank}.json").read_text()
    )
    return data


def speculating(fed: FederationRun, region: str, job: str, round_: int) -> bool:
    """The region's workers hold ``job``'s round ``round_``'s speculative instruction,
    unanswered."""
    jobs = workers_dir(fed, region) / "jobs" / job
    try:
        instruction = json.loads((jobs / f"round-{round_}.instruction.json").read_text())
    except (FileNotFoundError, ValueError):
        return False
    return bool(instruction.get("base_pending")) and not (
        (jobs / f"round-{round_}.done.json").exists()
        or (jobs / f"round-{round_}.base.json").exists()
    )


async def kill_rank0_ahead_of_theta(fed: FederationRun, region: str, job: str, round_: int) -> None:
    """SIGKILL ``region``'s rank 0 once it trains ``job``'s round ``round_`` ahead of θ."""
    await poll(
        fed,
        lambda: speculating(fed, region, job, round_),
        f"{region} to train round {round_} of {job} ahead of θ",
        timeout_s=WAIT_S,
    )
    os.kill(rank_status(fed, region, 0)["pid"], signal.SIGKILL)
