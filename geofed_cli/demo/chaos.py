"""``geofed demo --chaos``: real faults while the demo's job runs, and what they cost.

:func:`plan_chaos` spreads one of each fault over the job's rounds: ``kill -9`` of a
regional agent, of one of a region's worker processes and of the coordinator; a restart
of the MQTT broker; a partition of one region's link to the coordinator (through its WAN
emulator) for a while, then healed. :class:`ChaosMonkey` injects them, for real, when the
job has published the planned number of rounds; the demo's supervision restarts what was
killed, as the shipped systemd units would.

At the end :func:`judge_chaos` reads the audit log and the regions' statuses, as an
operator would, and says what was lost (an accepted delta that no published round
included, a round published twice) and whether every region's parameters agree with the
coordinator's (each region's reported θ hash against the hash the coordinator published
for that version). Planning and judging are pure; :class:`ChaosMonkey` does the I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from geofed.control.broker import EmbeddedBroker
from geofed.wanemu import WanProxy
from geofed_cli.demo.processes import ChildSet
from regional_agent.launch.spec import RANK_MODULE, is_launcher_command

__all__ = [
    "FAULTS",
    "BrokerHolder",
    "ChaosMonkey",
    "ChaosReport",
    "InjectedFault",
    "PlannedFault",
    "judge_chaos",
    "plan_chaos",
]

FaultKind = Literal[
    "kill-agent", "kill-worker", "kill-coordinator", "restart-broker", "partition-region"
]
#: The faults a chaos run injects, in this order.
FAULTS: Final[tuple[FaultKind, ...]] = (
    "kill-agent",
    "kill-worker",
    "kill-coordinator",
    "restart-broker",
    "partition-region",
)
#: How long the broker stays down, and a region stays cut off.
BROKER_DOWN_S: Final = 3.0
PARTITION_S: Final = 8.0


@dataclass(frozen=True, slots=True)
class PlannedFault:
    """Inject ``kind`` on ``target`` once the job has published ``after_round`` rounds."""

    kind: FaultKind
    target: str
    after_round: int


@dataclass(frozen=True, slots=True)
class InjectedFault:
    """A fault that was injected: when (job round, seconds into the run) and how it went."""

    kind: FaultKind
    target: str
    round: int
    at_s: float
    detail: str


def plan_chaos(rounds: int, regions: Sequence[str]) -> list[PlannedFault]:
    """One of each fault, spread evenly over the job: fault i after round ⌈(i+1)·R/(n+1)⌉.

    The agents' faults go to different regions where there are several; faults share a
    round when the job has fewer rounds than faults.
    """
    if rounds < 1 or not regions:
        raise ValueError("a chaos run needs at least one round and one region")
    count = len(FAULTS)
    targets = {
        "kill-agent": f"agent-{regions[0]}",
        "kill-worker": f"agent-{regions[1 % len(regions)]}",
        "kill-coordinator": "coordinator",
        "restart-broker": "broker",
        "partition-region": regions[-1],
    }
    plan = []
    for index, kind in enumerate(FAULTS):
        after = max(1, min(rounds - 1, -(-(index + 1) * rounds // (count + 1))))
        plan.append(PlannedFault(kind, targets[kind], after if rounds > 1 else 0))
    return plan


@dataclass
class ChaosReport:
    """What a chaos run injected, what it cost, and whether the federation agrees."""

    injected: list[InjectedFault] = field(default_factory=list)
    #: Accepted deltas no published round included, and rounds published more than once.
    lost: list[str] = field(default_factory=list)
    #: Region -> "agrees with θ_r" or why not.
    regions: dict[str, str] = field(default_factory=dict)
    #: Deltas the audit log records as accepted (each round and region once).
    accepted: int = 0

    @property
    def regions_agree(self) -> bool:
        return bool(self.regions) and all(v.startswith("agrees") for v in self.regions.values())

    @property
    def ok(self) -> bool:
        return not self.lost and self.regions_agree

    def to_json(self) -> dict[str, Any]:
        return {
            "injected": [asdict(fault) for fault in self.injected],
            "lost": self.lost,
            "regions": self.regions,
            "regions_agree": self.regions_agree,
            "accepted": self.accepted,
        }


#: Audit verdicts of an action that took place (``coordinator.state.audit.AuditVerdict``).
_DONE: Final = frozenset({"allow", "ok"})


def judge_chaos(
    job: str,
    regions: Sequence[str],
    audit: Sequence[Mapping[str, Any]],
    statuses: Sequence[Mapping[str, Any]],
    injected: Sequence[InjectedFault],
) -> ChaosReport:
    """Judge a run of ``regions`` from its audit entries (``GET /v1/audit``) and the
    regions' statuses (``GET /v1/regions``, which also lists regions outside the job).

    Lost: a delta the coordinator accepted (``delta.accept``) that the publication of its
    round did not include, or a round published more than once. Agreement: each region's
    last reported (round, params hash) against θ_round's hash as the coordinator published
    it (``round.publish`` of round r names θ_{r+1}'s).
    """
    report = ChaosReport(injected=list(injected))
    published: dict[int, list[Mapping[str, Any]]] = {}
    accepted: set[tuple[int, str]] = set()
    for entry in audit:
        # The coordinator records an acceptance as a decision ("allow") and a publication
        # as an operation ("ok"); a refusal or a failure is neither.
        if entry.get("job") != job or entry.get("verdict") not in _DONE:
            continue
        if entry.get("action") == "round.publish":
            published.setdefault(int(entry["round"]), []).append(entry.get("details") or {})
        elif entry.get("action") == "delta.accept" and entry.get("region"):
            accepted.add((int(entry["round"]), str(entry["region"])))
    report.accepted = len(accepted)
    for round_, entries in sorted(published.items()):
        if len(entries) > 1:
            report.lost.append(f"round {round_} was published {len(entries)} times")
    for number, region in sorted(accepted):
        publications = published.get(number)
        if not publications:
            report.lost.append(f"{region}'s accepted delta of round {number}: never published")
        elif region not in publications[-1].get("included", []):
            report.lost.append(f"{region}'s accepted delta of round {number} was not included")
    hashes = {number + 1: str(e[-1].get("params_hash")) for number, e in published.items()}
    by_region = {str(status.get("region")): status for status in statuses}
    for region in regions:
        status = by_region.get(region, {})
        if status.get("job") != job:
            report.regions[region] = f"reports no state of job {job}"
            continue
        version, reported = status.get("round"), status.get("params_hash")
        expected = hashes.get(version) if isinstance(version, int) else None
        if not isinstance(reported, str) or expected is None:
            report.regions[region] = f"reports θ_{version} without a hash to compare"
        elif reported == expected:
            report.regions[region] = f"agrees with θ_{version} ({reported[:12]})"
        else:
            report.regions[region] = (
                f"differs: θ_{version} is {reported[:12]} there, {expected[:12]} published"
            )
    return report


class BrokerHolder:
    """The demo's embedded broker, restartable on the same port."""

    def __init__(self) -> None:
        self.broker = EmbeddedBroker(port=0)

    @property
    def port(self) -> int:
        return self.broker.port

    async def start(self) -> None:
        await self.broker.start()

    async def restart(self, down_s: float) -> None:
        """Stop the broker (every client drops), wait ``down_s``, serve the same port again."""
        port = self.broker.port
        await self.broker.stop()
        await asyncio.sleep(down_s)
        self.broker = EmbeddedBroker(port=port)
        await self.broker.start()

    async def stop(self) -> None:
        await self.broker.stop()


class ChaosMonkey:
    """Injects a :func:`plan_chaos` plan into a running demo (see the module docstring)."""

    def __init__(
        self,
        plan: Sequence[PlannedFault],
        children: ChildSet,
        broker: BrokerHolder,
        links: Mapping[str, WanProxy],
        echo: Callable[[str], None],
        *,
        started: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._plan = list(plan)
        self._children = children
        self._broker = broker
        self._links = links
        self._echo = echo
        self._started = started
        self._clock = clock
        self.injected: list[InjectedFault] = []

    async def run(self, published_rounds: Callable[[], Awaitable[int | None]]) -> None:
        """Inject each planned fault once ``published_rounds()`` reaches its round."""
        for fault in self._plan:
            while True:
                reached = await published_rounds()
                if reached is not None and reached >= fault.after_round:
                    break
                await asyncio.sleep(0.5)
            detail = await self._inject(fault)
            done = InjectedFault(
                fault.kind, fault.target, reached, round(self._clock() - self._started, 1), detail
            )
            self.injected.append(done)
            self._echo(f"  ~ chaos: {fault.kind} {fault.target} at round {reached}: {detail}")

    async def _inject(self, fault: PlannedFault) -> str:
        if fault.kind in ("kill-agent", "kill-coordinator"):
            return self._kill(fault.target)
        if fault.kind == "kill-worker":
            return await self._kill_worker(fault.target)
        if fault.kind == "restart-broker":
            await self._broker.restart(BROKER_DOWN_S)
            return f"broker down {BROKER_DOWN_S:.0f} s, back on port {self._broker.port}"
        link = self._links.get(fault.target)
        if link is None:
            return "no WAN link to cut"
        link.partition()
        await asyncio.sleep(PARTITION_S)
        link.heal()
        return f"cut off from the coordinator for {PARTITION_S:.0f} s, then healed"

    def _kill(self, name: str) -> str:
        child = next((c for c in self._children.children if c.name == name), None)
        if child is None or child.pid is None or child.returncode is not None:
            return "not running"
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)
        return f"SIGKILL to pid {child.pid}"

    async def _kill_worker(self, agent: str) -> str:
        child = next((c for c in self._children.children if c.name == agent), None)
        if child is None or child.pid is None:
            return "agent not running"
        # Reading every process's /proc entries is file I/O: off the demo's event loop.
        workers = await asyncio.to_thread(worker_pids, child.pid)
        if not workers:
            return "no worker process found"
        with contextlib.suppress(ProcessLookupError):
            os.kill(workers[0], signal.SIGKILL)
        return f"SIGKILL to worker pid {workers[0]} of {len(workers)}"


def worker_pids(ancestor: int, proc: Path = Path("/proc")) -> list[int]:
    """Worker processes (``regional_agent.worker.rank``) descended from ``ancestor``, by pid.

    The agent starts its launcher in a session of its own, so descent, not the session,
    tells its workers apart; the launcher's own command line names the worker module, so
    only the leaves count, and a launcher's command line only as its child's (a rank it
    forked).
    """
    parents: dict[int, int] = {}
    commands: dict[int, bytes] = {}
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            commands[int(entry.name)] = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        # Fields after the parenthesised command: state ppid ...
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1:
            parents[int(entry.name)] = int(fields[1])

    def descends(pid: int) -> bool:
        seen = set()
        while pid in parents and pid not in seen:
            seen.add(pid)
            pid = parents[pid]
            if pid == ancestor:
                return True
        return False

    named = {
        pid
        for pid, command in commands.items()
        if RANK_MODULE.encode() in command and descends(pid)
    }

    def is_worker(pid: int) -> bool:
        # The launcher names the worker module too: a worker is a leaf among them. A
        # launcher that has not started its ranks yet is a leaf as well; a rank it forked
        # has its very command line, but the launcher for parent.
        if any(parents.get(other) == pid for other in named):
            return False
        command = commands[pid].replace(b"\0", b" ").decode(errors="replace")
        return not is_launcher_command(command) or parents.get(pid) in named

    return sorted(pid for pid in named if is_worker(pid))
