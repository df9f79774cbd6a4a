"""What a round costs per parameter: memory and disk writes of every process of a federation.

    python -m benchmarks.scale [--sizes 0.1m,25m] [--parallelism fsdp,ddp] [--world-sizes 1,2,4]
        [--rounds 4] [--inner-steps 3] [--quick] [--before PATH] [--out PATH] [--note TEXT]

A coordinator and two regional agents run as processes (``tests/support/federation.py``, as
``geofed demo`` runs them: real HTTPS with client certificates), each agent with its own gloo
worker group of W CPU ranks, and train the Llama example (:mod:`geofed.examples.llama`) at
each model size of ``--sizes``, for every parallelism (``training.parallelism``) and world
size W. Evaluation is off (``evaluation: none``): what is measured is the round's data path.

Every process below this one is sampled from /proc about every 0.2 s (:class:`ProcessSampler`)
and given a role from its command line and parent: the coordinator, an agent, its elastic
launcher, a rank (``regional_agent.worker.rank``, its rank from ``RANK`` in its environment, or
for a rank its launcher forked, from its rank log), or other. Its peak RSS is ``VmHWM`` of
``/proc/PID/status``, its disk writes ``write_bytes`` of ``/proc/PID/io`` (the last values
seen before it exited).

Figures per parameter are slopes between the sizes (a least-squares line through each size's
figure against its parameter count), so what a Python process costs whatever the model drops
out. Bytes written per round are taken between the middle of the second round's inner loop
and the middle of the last one's (whole rounds in steady state, without the job's start and
end); the whole run's writes over its rounds are stated too. The job keeps the job spec's
defaults for ``snapshot_every`` and ``working_state_every`` (10 each), so with at most 10
rounds no snapshot and no save of the coordinator's working state falls inside that window:
the coordinator's figure adds them amortized, the bytes of the last working-state save and
of the last snapshot (their files' sizes after the run) over that interval. A region's
figure likewise adds its regional checkpoint (the inner optimizer state every rank saves
every ``workers.regional_checkpoint_every`` rounds, default 8, and when it stops; the
error-feedback residual's tensors are written only with a checkpoint the coordinator asks
for and when the group parks a job or stops, so not with these; no such save falls inside
the window of a run of at most 8 rounds) amortized: the size of its last one over that
interval; and the θ file its agent writes whole every ``transfer.theta_file_every``
rounds (default 8; in between θ is the last θ file and the updates after it, and the
window of a run of at most that many rounds holds no such write): 4 B per parameter over
that interval.

The round's gap is the seconds from a round's last inner step to the next round's first
(rank 0's ``train_finished_at`` and ``train_started_at``, from each agent's
``round_timeline.jsonl``), median over rounds and regions; its slope is given per GB of
fp32 model. Rank 0's training-loop tokens/s (its tokens over its inner loop, median over
rounds after the first) is compared with a plain single-process loop of the same model,
batches and optimizer run in this process on one thread (the workers' torch threads) before
each federation; the ranks of both regions share the machine's cores while they train.

Writes ``benchmarks/results/scale.json`` and ``.md`` with the machine, and prints the
markdown; ``--before PATH`` adds the figures of an earlier run's JSON as a column.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks._machine import describe_machine, machine_line
from benchmarks._report import publish
from coordinator.jobs.spec import JobSpec
from coordinator.storage.checkpoints import CheckpointStore, EntryKind
from geofed.examples.llama import LlamaOptions, LlamaTask
from geofed.task import DataShard
from regional_agent.config import WorkersConfig
from regional_agent.launch.spec import RANK_MODULE, is_launcher_command
from regional_agent.rounds.timeline import RoundTimeline, read_timeline
from regional_agent.transfer.config import TransferConfig
from tests.support.federation import running_federation

REGIONS = ("eu-west", "us-east")
LLAMA = "geofed.examples.llama:LlamaTask"
SAMPLE_INTERVAL_S = 0.2
_SHAPE = {"seq_len": 32, "batch_size": 2, "val_batches": 1}
#: Model sizes (Llama task options), named by their parameter count.
SIZES: dict[str, dict[str, Any]] = {
    "0.03m": {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 96, **_SHAPE},
    "0.1m": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 192, **_SHAPE},
    "3m": {"dim": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 768, **_SHAPE},
    "25m": {"dim": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 1536, **_SHAPE},
}  # fmt: skip
DEFAULT_SIZES = ("0.1m", "25m")
#: Rounds between the coordinator's saves of its working state and snapshots at the job
#: spec's defaults (``snapshot_every``, ``working_state_every``).
SAVE_INTERVAL = min(
    JobSpec.model_fields["snapshot_every"].default,
    JobSpec.model_fields["working_state_every"].default,
)
#: Rounds between a region's saves of its inner optimizer state, by default.
CHECKPOINT_INTERVAL: int = WorkersConfig.model_fields["regional_checkpoint_every"].default
#: Rounds between the θ files an agent writes whole, by default.
THETA_FILE_INTERVAL: int = TransferConfig.model_fields["theta_file_every"].default
#: A θ file: float32 per federated parameter.
THETA_FILE_BYTES_PER_PARAMETER = 4

ROLES = ("rank0", "rank0_extra", "other_rank", "agent", "coordinator")
ROLE_NAMES = {
    "rank0": "rank 0 peak RSS",
    "rank0_extra": "rank 0 extra over the other ranks",
    "other_rank": "any other rank",
    "agent": "agent peak RSS",
    "coordinator": "coordinator peak RSS per job",
    "region_writes": "bytes written per round by a region (agent + ranks), checkpoints amortized",
    "coordinator_writes": "bytes written per round by the coordinator, saves amortized",
}


# -- sampling the processes ----------------------------------------------------------------


@dataclass
class ProcessRecord:
    """One process (one program: a pid that execs again gets a new record)."""

    pid: int
    ppid: int
    cmdline: str
    role: str
    rank: int | None
    region: str | None
    first_seen: float
    #: Where its imports come from: its working directory and ``PYTHONPATH``.
    cwd: str | None = None
    pythonpath: str | None = None
    last_seen: float = 0.0
    peak_rss: int = 0
    write_bytes: int = 0
    cancelled_write_bytes: int = 0
    #: (time, write_bytes) at every sample, for writes between two moments.
    writes: list[tuple[float, int]] = field(default_factory=list)

    def written_at(self, moment: float) -> int:
        """``write_bytes`` at the last sample at or before ``moment`` (0 before the first)."""
        found = 0
        for at, value in self.writes:
            if at > moment:
                break
            found = value
        return found

    def summary(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "role": self.role,
            "rank": self.rank,
            "region": self.region,
            "peak_rss_bytes": self.peak_rss,
            "write_bytes": self.write_bytes,
            "cancelled_write_bytes": self.cancelled_write_bytes,
            "seconds_seen": round(self.last_seen - self.first_seen, 2),
            "cwd": self.cwd,
            "pythonpath": self.pythonpath,
            "cmdline": self.cmdline[:300],
        }


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return file.read()
    except OSError:
        return None


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        name = entry.name
        if not name.isdigit():
            continue
        stat = _read(f"/proc/{name}/stat")
        if stat is None:
            continue
        try:
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(name))
    return children


def _field(text: str, name: str) -> int | None:
    for line in text.splitlines():
        if line.startswith(name + ":"):
            try:
                return int(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None


_RANK_LOG = re.compile(r"rank-(\d+)\.log")


def _environ(pid: int, name: str) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as file:
            entries = file.read().split(b"\0")
    except OSError:
        return None
    prefix = name.encode() + b"="
    for entry in entries:
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


def _rank_of(pid: int) -> int | None:
    """A rank's number: ``RANK`` in its environment as it was started, or, for a rank
    forked by its launcher (which sets ``RANK`` after the fork, where /proc does not show
    it), the rank log its output goes to once it joined (``rank-N.log``); None before."""
    rank = _environ(pid, "RANK")
    if rank is None:
        with contextlib.suppress(OSError):
            log = _RANK_LOG.fullmatch(Path(f"/proc/{pid}/fd/1").readlink().name)
            rank = log.group(1) if log else None
    return int(rank) if rank and rank.isdigit() else None


class ProcessSampler:
    """Samples every descendant of ``root`` (this process) from /proc in a thread.

    A process's role comes from its command line and its parent's role, so that a forked
    child not yet exec'ed (it still shows its parent's command line) is not taken for one.
    """

    def __init__(self, root: int | None = None, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.root = os.getpid() if root is None else root
        self.interval_s = interval_s
        self.records: dict[tuple[int, str], ProcessRecord] = {}
        self._current: dict[int, ProcessRecord] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="scale-sampler", daemon=True)
        self.samples = 0

    def __enter__(self) -> ProcessSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def _classify(self, pid: int, ppid: int, cmdline: str) -> tuple[str, int | None, str | None]:
        parent = self._current.get(ppid)
        parent_role = "root" if ppid == self.root else (parent.role if parent else "other")
        region = parent.region if parent is not None else None
        words = cmdline.split()
        if parent_role == "root" and "geofed_cli" in words:
            if "coordinator" in words:
                return "coordinator", None, None
            if "agent" in words:
                config = next((w for w in words if w.endswith(".yaml")), "")
                name = Path(config).stem.removeprefix("agent-")
                return "agent", None, name or None
        if parent_role == "agent" and is_launcher_command(cmdline):
            return "launcher", None, region
        # A forked rank has its launcher's command line, which names the rank's module.
        if parent_role == "launcher" and RANK_MODULE in cmdline:
            return "rank", _rank_of(pid), region
        if parent_role in ("coordinator", "coordinator_child"):
            return "coordinator_child", None, None
        return "other", None, region

    def sample(self) -> None:
        now = time.time()
        children = _children()
        found: list[int] = []
        todo = list(children.get(self.root, ()))
        while todo:  # parents before children, so a child finds its parent's role
            pid = todo.pop(0)
            found.append(pid)
            todo.extend(children.get(pid, ()))
        parents = {child: pid for pid, kids in children.items() for child in kids}
        for pid in found:
            raw = _read(f"/proc/{pid}/cmdline")
            if raw is None:
                continue
            cmdline = raw.replace("\0", " ").strip()
            key = (pid, cmdline)
            record = self.records.get(key)
            if record is None:
                ppid = parents.get(pid, 0)
                role, rank, region = self._classify(pid, ppid, cmdline)
                record = ProcessRecord(pid, ppid, cmdline, role, rank, region, first_seen=now)
                with contextlib.suppress(OSError):
                    record.cwd = str(Path(f"/proc/{pid}/cwd").readlink())
                record.pythonpath = _environ(pid, "PYTHONPATH")
                self.records[key] = record
            if record.role == "rank" and record.rank is None:
                record.rank = _rank_of(pid)
            self._current[pid] = record
            status = _read(f"/proc/{pid}/status")
            io = _read(f"/proc/{pid}/io")
            if status is None or io is None:
                continue
            peak = _field(status, "VmHWM")
            written = _field(io, "write_bytes")
            cancelled = _field(io, "cancelled_write_bytes")
            if peak is not None:
                record.peak_rss = max(record.peak_rss, peak * 1024)
            if written is not None:
                record.write_bytes = written
                record.writes.append((now, written))
            if cancelled is not None:
                record.cancelled_write_bytes = cancelled
            record.last_seen = now
        self.samples += 1


# -- one federation --------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    sizes: tuple[str, ...]
    parallelisms: tuple[str, ...]
    world_sizes: tuple[int, ...]
    rounds: int
    inner_steps: int
    plain_steps: int
    timeout_s: float
    quick: bool
    before: Path | None
    out: Path
    note: str


def parameters(options: dict[str, Any]) -> int:
    model = LlamaTask(LlamaOptions(**options)).build_model()
    return sum(p.numel() for p in model.parameters())


def plain_loop(
    options: dict[str, Any], steps: int, repeats: int = 3, warmup: int = 3
) -> dict[str, Any]:
    """A plain single-process loop on one CPU thread: model, AdamW, loss, backward, step.

    ``warmup`` untimed steps, then ``repeats`` timed runs of ``steps``; the best is kept
    (the least disturbed on a shared machine).
    """
    task = LlamaTask(LlamaOptions(**options))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runs: list[float] = []
    tokens_per_step = 0.0
    try:
        model = task.build_model(seed=0)
        optimizer = task.build_optimizer(model.parameters())
        shard = DataShard(
            region=REGIONS[0], region_index=0, num_regions=len(REGIONS), rank=0, world_size=1,
            seed=0,
        )  # fmt: skip
        batches = task.batches(shard)
        model.train()

        def step() -> int:
            batch = next(batches)
            optimizer.zero_grad(set_to_none=True)
            loss = task.loss(model, batch)
            loss.backward()
            optimizer.step()
            return task.tokens(batch)

        for _ in range(warmup):
            step()
        for _ in range(repeats):
            started = time.perf_counter()
            tokens = sum(step() for _ in range(steps))
            runs.append(tokens / (time.perf_counter() - started))
            tokens_per_step = tokens / steps
    finally:
        torch.set_num_threads(threads)
    return {
        "tokens_per_s": max(runs),
        "tokens_per_s_runs": runs,
        "tokens_per_step": tokens_per_step,
        "threads": 1,
    }


def _customize(
    options: dict[str, Any], parallelism: str, world: int
) -> Callable[[str, dict[str, Any]], None]:
    def customize(name: str, data: dict[str, Any]) -> None:
        if name.startswith("agent-"):
            workers = data.setdefault("workers", {})
            workers["count"] = world
            workers["backend"] = "gloo"
        elif name == "job":
            data["task"] = {"spec": LLAMA, "options": dict(options)}
            for key in ("snapshot_every", "working_state_every"):
                data.pop(key, None)  # the defaults: SAVE_INTERVAL
            training = dict(data.get("training") or {})
            training["parallelism"] = parallelism
            data["training"] = training
            data["evaluation"] = {"where": "none"}

    return customize


async def run_federation(
    work: Path, settings: Settings, options: dict[str, Any], parallelism: str, world: int
) -> tuple[dict[str, list[RoundTimeline]], float, int, dict[str, int]]:
    """One federation to the end of its job: each region's timeline, the wall time, the
    bytes of the coordinator's last working-state save and last snapshot, and those of
    each region's last regional checkpoint."""
    started = time.monotonic()
    async with running_federation(
        work,
        regions=REGIONS,
        rounds=settings.rounds,
        inner_steps=settings.inner_steps,
        customize=_customize(options, parallelism, world),
        # As production starts them: the daemons' own memory and start are measured.
        fork=False,
    ) as fed:
        status, body = await fed.submit()
        if status != 201:
            raise RuntimeError(f"job refused ({status}): {body}")
        await fed.wait_for(
            lambda s: s.get("state") == "completed" and int(s.get("round", 0)) >= settings.rounds,
            timeout_s=settings.timeout_s,
            what="the job to complete",
        )
        wall = time.monotonic() - started
        job = fed.job
    # Read after the agents stopped: each writes its last rounds on the way out.
    timelines = {
        region: sorted(
            (r for r in read_timeline(work / "agents" / region) if r.job == job),
            key=lambda r: r.round,
        )
        for region in REGIONS
    }
    saves = {region: checkpoint_bytes(work / "agents" / region, job) for region in REGIONS}
    return timelines, wall, saved_bytes(work, job), saves


def checkpoint_bytes(agent_dir: Path, job: str) -> int:
    """The size of the region's newest regional checkpoint of ``job`` (every rank's part
    of the inner optimizer state), as its worker group left it."""
    newest: tuple[int, Path] | None = None
    for path in agent_dir.rglob(f"jobs/{job}/optimizer-round-*"):
        round_ = int(path.name.removeprefix("optimizer-round-"))
        if path.is_dir() and (newest is None or round_ > newest[0]):
            newest = (round_, path)
    if newest is None:
        return 0
    return sum(f.stat().st_size for f in newest[1].rglob("*") if f.is_file())


def saved_bytes(work: Path, job: str) -> int:
    """The size of the coordinator's working state left after the job (its last save: the
    kept deltas are gone by then) and of the job's newest snapshot."""
    state = sum(
        f.stat().st_size for f in (work / "coordinator" / "blobs").rglob("*") if f.is_file()
    )
    snapshot = 0
    for root in sorted((work / "checkpoints").iterdir()):
        store = CheckpointStore(root.name, root)
        entries = [e for e in store.entries(job) if e.kind is EntryKind.SNAPSHOT]
        if entries:
            newest = max(entries, key=lambda e: e.round)
            snapshot = max(snapshot, sum(store.blobs.size(d) for d in newest.digests()))
    return state + snapshot


# -- figures of one run ---------------------------------------------------------------------


def _written(records: Sequence[ProcessRecord], moment: float | None = None) -> int:
    """Bytes the processes wrote, by ``moment`` (else by their last sample).

    The counter is per process and survives ``exec``, so the records of one pid are one
    series: a pid counts once, with its latest value.
    """
    by_pid: dict[int, int] = {}
    for record in sorted(records, key=lambda r: r.first_seen):
        value = record.write_bytes if moment is None else record.written_at(moment)
        if moment is None or record.first_seen <= moment:
            by_pid[record.pid] = max(by_pid.get(record.pid, 0), value)
    return sum(by_pid.values())


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _mid(entry: RoundTimeline) -> float | None:
    worker = entry.worker
    return None if worker is None else (worker.start + worker.end) / 2


def run_figures(
    records: Sequence[ProcessRecord],
    timelines: dict[str, list[RoundTimeline]],
    rounds: int,
    tokens_per_step: float,
    inner_steps: int,
    saves: int = 0,
    checkpoints: dict[str, int] | None = None,
    theta_file: int = 0,
) -> dict[str, Any]:
    """Per role: peak RSS and bytes written of one run; the round's gap and rank 0's pace.
    ``saves``: the bytes of one working-state save and one snapshot, amortized over
    :data:`SAVE_INTERVAL` rounds into the coordinator's writes per round; ``checkpoints``:
    each region's regional checkpoint, amortized over :data:`CHECKPOINT_INTERVAL` rounds
    into its writes; ``theta_file``: a θ file's bytes, amortized over
    :data:`THETA_FILE_INTERVAL` rounds into each region's writes."""
    by_region: dict[str, dict[str, Any]] = {}
    for region in REGIONS:
        mine = [r for r in records if r.region == region]
        ranks = [r for r in mine if r.role == "rank"]
        rank0 = [r.peak_rss for r in ranks if r.rank == 0]
        others = [r.peak_rss for r in ranks if r.rank not in (0, None)]
        agent = [r.peak_rss for r in mine if r.role == "agent"]
        launcher = [r.peak_rss for r in mine if r.role == "launcher"]
        entries = [e for e in timelines.get(region, []) if e.worker is not None]
        mids = [m for m in (_mid(e) for e in entries) if m is not None]
        steady: float | None = None
        if len(mids) >= 3:  # from the middle of round 1's inner loop to the last one's
            first, last = mids[1], mids[-1]
            steady = (_written(mine, last) - _written(mine, first)) / (len(mids) - 2)
        gaps = [
            later.worker.start - earlier.worker.end
            for earlier, later in itertools.pairwise(entries)
            if earlier.worker is not None and later.worker is not None
        ]
        paces = [
            tokens_per_step * inner_steps / e.worker.seconds
            for e in entries[1:]
            if e.worker is not None and e.worker.seconds > 0
        ]
        checkpoint = (checkpoints or {}).get(region, 0)
        by_region[region] = {
            "rank0_peak_rss": max(rank0) if rank0 else None,
            "other_rank_peak_rss": max(others) if others else None,
            "agent_peak_rss": max(agent) if agent else None,
            "launcher_peak_rss": max(launcher) if launcher else None,
            "ranks_seen": sorted({r.rank for r in ranks if r.rank is not None}),
            "write_bytes": _written(mine),
            "write_bytes_per_round_whole_run": _written(mine) / rounds,
            "write_bytes_per_round_steady": steady,
            "checkpoint_bytes": checkpoint,
            "theta_file_bytes": theta_file,
            "write_bytes_per_round": (
                None
                if steady is None
                else steady + checkpoint / CHECKPOINT_INTERVAL + theta_file / THETA_FILE_INTERVAL
            ),
            "rounds_recorded": len(entries),
            "gaps_s": gaps,
            "rank0_tokens_per_s_rounds": paces,
        }
    coordinator = [r for r in records if r.role.startswith("coordinator")]
    coordinator_main = [r.peak_rss for r in coordinator if r.role == "coordinator"]
    mids_all = [
        [m for m in (_mid(e) for e in timelines.get(region, [])) if m is not None]
        for region in REGIONS
    ]
    coordinator_steady: float | None = None
    if all(len(m) >= 3 for m in mids_all):
        first = max(m[1] for m in mids_all)
        last = min(m[-1] for m in mids_all)
        count = min(len(m) for m in mids_all) - 2
        written = _written(coordinator, last) - _written(coordinator, first)
        coordinator_steady = written / count if last > first else None

    def most(key: str) -> float | None:
        values = [v[key] for v in by_region.values() if v[key] is not None]
        return max(values) if values else None

    extras = [
        v["rank0_peak_rss"] - v["other_rank_peak_rss"]
        for v in by_region.values()
        if v["rank0_peak_rss"] is not None and v["other_rank_peak_rss"] is not None
    ]
    gaps = [g for v in by_region.values() for g in v["gaps_s"]]
    paces = [p for v in by_region.values() for p in v["rank0_tokens_per_s_rounds"]]
    return {
        "rank0": most("rank0_peak_rss"),
        "rank0_extra": max(extras) if extras else None,
        "other_rank": most("other_rank_peak_rss"),
        "agent": most("agent_peak_rss"),
        "launcher": most("launcher_peak_rss"),
        "coordinator": max(coordinator_main) if coordinator_main else None,
        "region_writes": most("write_bytes_per_round"),
        "region_writes_steady": most("write_bytes_per_round_steady"),
        "region_checkpoint": most("checkpoint_bytes"),
        "region_theta_file": most("theta_file_bytes"),
        "region_writes_whole_run": most("write_bytes_per_round_whole_run"),
        "coordinator_writes": (
            None if coordinator_steady is None else coordinator_steady + saves / SAVE_INTERVAL
        ),
        "coordinator_writes_steady": coordinator_steady,
        "coordinator_saves": saves,
        "coordinator_writes_whole_run": _written(coordinator) / rounds,
        "gap_s": _median(gaps),
        "rank0_tokens_per_s": _median(paces),
        "regions": by_region,
    }


# -- slopes and the report ------------------------------------------------------------------

FIGURES = (
    "rank0",
    "rank0_extra",
    "other_rank",
    "agent",
    "launcher",
    "coordinator",
    "region_writes",
    "region_writes_steady",
    "region_checkpoint",
    "region_theta_file",
    "region_writes_whole_run",
    "coordinator_writes",
    "coordinator_writes_steady",
    "coordinator_saves",
    "coordinator_writes_whole_run",
)


def slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of ``(x, y)`` points; None below two distinct x."""
    if len({x for x, _ in points}) < 2:
        return None
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    num = sum((x - mean_x) * (y - mean_y) for x, y in points)
    den = sum((x - mean_x) ** 2 for x, _ in points)
    return num / den


def targets(world: int, regions: int) -> dict[str, tuple[str, float]]:
    """Each figure's target in bytes per parameter: its text and its bound."""
    return {
        "rank0": (f"<= 16/W + 2 B = {16 / world + 2:g}", 16 / world + 2),
        "rank0_extra": ("<= 2 B", 2.0),
        "other_rank": (f"<= 16/W + 1 B = {16 / world + 1:g}", 16 / world + 1),
        "agent": ("<= 2 B", 2.0),
        "coordinator": ("<= 20 B", 20.0),
        "region_writes": ("<= 4 B", 4.0),
        "coordinator_writes": (
            f"<= 2 B per region + 1 B = {2 * regions + 1:g}",
            2.0 * regions + 1,
        ),
    }


def combine(runs: dict[str, dict[str, Any]], world: int) -> dict[str, Any]:
    """Slopes per parameter between the sizes of one (parallelism, W)."""
    good = {size: run for size, run in runs.items() if "error" not in run}
    per_parameter: dict[str, float | None] = {}
    for name in FIGURES:
        points = [
            (float(run["parameters"]), float(run["figures"][name]))
            for run in good.values()
            if run["figures"].get(name) is not None
        ]
        per_parameter[name] = slope(points) if len(points) == len(good) else None
    gap_points = [
        (4 * run["parameters"] / 1e9, run["figures"]["gap_s"])
        for run in good.values()
        if run["figures"].get("gap_s") is not None
    ]
    ratios = {
        size: (
            run["figures"]["rank0_tokens_per_s"] / run["plain"]["tokens_per_s"]
            if run["figures"].get("rank0_tokens_per_s") is not None
            else None
        )
        for size, run in good.items()
    }
    checks = []
    for name, (text, bound) in targets(world, len(REGIONS)).items():
        value = per_parameter.get(name)
        checks.append(
            {
                "figure": name,
                "name": ROLE_NAMES[name],
                "target": text,
                "bytes_per_parameter": value,
                "met": None if value is None else value <= bound,
            }
        )
    return {
        "per_parameter": per_parameter,
        "gap_s_per_gb": slope(gap_points) if len(gap_points) == len(good) else None,
        "throughput_ratio": ratios,
        "checks": checks,
    }


async def measure(settings: Settings) -> dict[str, Any]:
    plain: dict[str, dict[str, Any]] = {}
    configs: dict[str, Any] = {}
    for parallelism in settings.parallelisms:
        for world in settings.world_sizes:
            name = f"{parallelism}-w{world}"
            runs: dict[str, Any] = {}
            for size in settings.sizes:
                options = SIZES[size]
                count = parameters(options)
                print(f"{name}, size {size} ({count / 1e6:.2f}M): plain loop ...", file=sys.stderr)
                plain[size] = plain_loop(options, settings.plain_steps)
                print(f"{name}, size {size}: federation ...", file=sys.stderr)
                with tempfile.TemporaryDirectory(prefix="geofed-scale-") as tmp:
                    sampler = ProcessSampler()
                    try:
                        with sampler:
                            timelines, wall, saves, checkpoints = await run_federation(
                                Path(tmp), settings, options, parallelism, world
                            )
                    except (AssertionError, RuntimeError, OSError) as exc:
                        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                        print(f"{name}, size {size}: failed: {exc}", file=sys.stderr)
                        runs[size] = {"error": first[:300], "parameters": count}
                        continue
                records = list(sampler.records.values())
                figures = run_figures(
                    records,
                    timelines,
                    settings.rounds,
                    plain[size]["tokens_per_step"],
                    settings.inner_steps,
                    saves,
                    checkpoints,
                    THETA_FILE_BYTES_PER_PARAMETER * count,
                )
                runs[size] = {
                    "task_options": options,
                    "parameters": count,
                    "wall_s": wall,
                    "samples": sampler.samples,
                    "plain": dict(plain[size]),
                    "figures": figures,
                    "processes": [r.summary() for r in records],
                    "other_processes": sum(1 for r in records if r.role == "other"),
                }
                print(
                    f"{name}, size {size}: {wall:.0f} s, rank 0 peak "
                    f"{_mib(figures['rank0'])} MiB, coordinator {_mib(figures['coordinator'])} MiB",
                    file=sys.stderr,
                )
            configs[name] = {
                "parallelism": parallelism,
                "world_size": world,
                "runs": runs,
                **combine(runs, world),
            }
    return {
        "benchmark": "scale",
        "machine": describe_machine(),
        "settings": {
            "regions": list(REGIONS),
            "sizes": list(settings.sizes),
            "parallelisms": list(settings.parallelisms),
            "world_sizes": list(settings.world_sizes),
            "rounds": settings.rounds,
            "inner_steps": settings.inner_steps,
            "plain_steps": settings.plain_steps,
            "sample_interval_s": SAMPLE_INTERVAL_S,
            "evaluation": "none",
            "codec": "the example job's (int8)",
            "save_interval_rounds": SAVE_INTERVAL,
            "checkpoint_interval_rounds": CHECKPOINT_INTERVAL,
            "theta_file_interval_rounds": THETA_FILE_INTERVAL,
            "quick": settings.quick,
            "note": settings.note,
        },
        "configs": configs,
    }


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _theta_file_text(per: dict[str, Any], settings: dict[str, Any]) -> str:
    """The θ file written whole every few rounds, when the run amortized one."""
    interval = settings.get("theta_file_interval_rounds")
    if interval is None:  # a run from before θ was kept as a chain
        return ""
    return f" + {_b(per.get('region_theta_file'))} every {interval} rounds"


def _b(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.1f}"


def _before_value(before: dict[str, Any] | None, config: str, figure: str) -> float | None:
    if before is None:
        return None
    found = before.get("configs", {}).get(config, {}).get("per_parameter", {})
    value = found.get(figure)
    return None if value is None else float(value)


def render(report: dict[str, Any], before: dict[str, Any] | None = None) -> str:
    settings = report["settings"]
    lines = [
        "# Per-parameter cost of a round: memory and disk writes of every process",
        "",
        f"Machine: {machine_line(report['machine'])}.",
        "",
        f"{len(settings['regions'])} regions, each a gloo worker group of W CPU ranks (one "
        f"torch thread each), training the Llama example ({settings['rounds']} rounds of "
        f"H = {settings['inner_steps']}, evaluation off, int8 deltas) at sizes "
        f"{', '.join(settings['sizes'])}. Peak RSS (VmHWM) and write_bytes of every process "
        f"from /proc every {settings['sample_interval_s']} s; figures per parameter are the "
        "slope between the sizes, so a process's fixed cost drops out. Writes per round: "
        "between the middle of round 1's inner loop and the last round's (steady state), "
        "plus what is saved only every few rounds, amortized: a region's regional checkpoint "
        "(its last inner optimizer state's size over its interval; the residual is written "
        "only when the coordinator asks or the group parks a job or stops) and the θ file "
        "its agent writes whole every few rounds (4 B a "
        "parameter; in between θ is the last θ file and the updates after it), the "
        "coordinator's working state and snapshot (over theirs); in brackets the steady "
        "state, the saves, and the whole run over its rounds. A region's writes are its "
        "agent's, its "
        "elastic launcher's and its ranks'. Each figure is the largest region's (and rank's).",
    ]
    if settings["quick"]:
        lines += ["", "**Quick run**: one configuration, few rounds; a smoke check."]
    if settings["note"]:
        lines += ["", f"Note: {settings['note']}"]
    if before is not None:
        lines += [
            "",
            f"Before: the figures of commit {before['machine']['git'].get('commit')} "
            "(same benchmark, same settings unless stated in its JSON).",
        ]
    for name, config in report["configs"].items():
        lines += ["", f"## {config['parallelism'].upper()}, W = {config['world_size']}", ""]
        errors = {s: r["error"] for s, r in config["runs"].items() if "error" in r}
        for size, error in errors.items():
            lines.append(f"Size {size} failed: {error}")
        header = "| per parameter | target |" + (" before |" if before else "") + " measured |"
        lines += [header, "|---|---|" + ("---|" if before else "") + "---|"]
        per = config["per_parameter"]
        for check in config["checks"]:
            figure = check["figure"]
            measured = _b(check["bytes_per_parameter"])
            if figure == "region_writes":
                measured += (
                    f" ({_b(per.get('region_writes_steady'))} a round + "
                    f"{_b(per.get('region_checkpoint'))} every "
                    f"{settings.get('checkpoint_interval_rounds', CHECKPOINT_INTERVAL)} rounds"
                    + _theta_file_text(per, settings)
                    + f"; {_b(per.get(figure + '_whole_run'))})"
                )
            elif figure == "coordinator_writes":
                measured += (
                    f" ({_b(per.get('coordinator_writes_steady'))} a round + "
                    f"{_b(per.get('coordinator_saves'))} every "
                    f"{settings.get('save_interval_rounds', SAVE_INTERVAL)} rounds; "
                    f"{_b(per.get(figure + '_whole_run'))})"
                )
            verdict = {True: "met", False: "NOT met", None: "-"}[check["met"]]
            row = f"| {check['name']} | {check['target']} |"
            if before:
                row += f" {_b(_before_value(before, name, figure))} |"
            lines.append(row + f" {measured} B, {verdict} |")
        gap = config["gap_s_per_gb"]
        lines += [
            "",
            f"Agent's worker launcher: {_b(per.get('launcher'))} B/param. Round gap (last "
            f"inner step to the next round's first): {_b(gap)} s per GB of fp32 model "
            "(slope).",
            "",
            "| size | params | wall s | rank 0 MiB | other rank MiB | agent MiB | coordinator MiB "
            "| region MB/round | coordinator MB/round | gap s | rank 0 tok/s | plain tok/s "
            "| ratio |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for size, run in config["runs"].items():
            if "error" in run:
                continue
            fig = run["figures"]
            ratio = config["throughput_ratio"].get(size)

            def mb(value: float | None) -> str:
                return "-" if value is None else f"{value / 1e6:.2f}"

            lines.append(
                f"| {size} | {run['parameters'] / 1e6:.2f}M | {run['wall_s']:.0f} "
                f"| {_mib(fig['rank0'])} | {_mib(fig['other_rank'])} | {_mib(fig['agent'])} "
                f"| {_mib(fig['coordinator'])} | {mb(fig['region_writes'])} "
                f"| {mb(fig['coordinator_writes'])} "
                f"| {_num(fig['gap_s'], 2)} | {_num(fig['rank0_tokens_per_s'], 0)} "
                f"| {run['plain']['tokens_per_s']:.0f} | {_num(ratio, 2)} |"
            )
        concurrent = len(settings["regions"]) * config["world_size"]
        lines += [
            "",
            f"Ratio: rank 0's training-loop tokens/s over the plain loop's (one thread, run "
            f"alone); {concurrent} ranks share {report['machine']['usable_cpus']} usable CPUs "
            "while they train.",
        ]
    return "\n".join(lines) + "\n"


# -- arguments --------------------------------------------------------------------------------


def _names(allowed: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        if not names or any(n not in allowed for n in names):
            raise argparse.ArgumentTypeError(f"a comma list of {', '.join(allowed)}; got {text!r}")
        return tuple(dict.fromkeys(names))

    return parse


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"world sizes must be >= 1: {text!r}")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _rounds(text: str) -> int:
    value = _positive(text)
    if value > SAVE_INTERVAL:
        # Beyond it a save would fall inside the steady-state window and count twice.
        raise argparse.ArgumentTypeError(
            f"at most {SAVE_INTERVAL} (the coordinator's save interval), got {value}"
        )
    return value


def settings_from(argv: Sequence[str] | None) -> Settings:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.scale", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--sizes", type=_names(tuple(SIZES)), help=f"of {', '.join(SIZES)}; default 0.1m,25m"
    )
    parser.add_argument("--parallelism", type=_names(("fsdp", "ddp")), help="default fsdp,ddp")
    parser.add_argument("--world-sizes", type=_ints, help="ranks per region; default 1,2,4")
    parser.add_argument("--rounds", type=_rounds, help="default 4; quick 3 (3 or more for "
                        "the steady-state writes and the gap; at most the save interval, "
                        f"{SAVE_INTERVAL})")  # fmt: skip
    parser.add_argument("--inner-steps", type=_positive, help="default 3; quick 2")
    parser.add_argument(
        "--plain-steps",
        type=_positive,
        default=10,
        help="plain loop: timed steps per run (best of 3 runs)",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="per federation, seconds")
    parser.add_argument(
        "--quick", action="store_true", help="FSDP at W = 2 only, the sizes given, 3 rounds"
    )
    parser.add_argument("--before", type=Path, help="an earlier run's JSON: a before column")
    parser.add_argument("--out", type=Path, help="JSON path; the markdown goes next to it")
    parser.add_argument("--note", default="", help="free text stored with the figures")
    args = parser.parse_args(argv)
    sizes = args.sizes or DEFAULT_SIZES
    if len(sizes) < 2:
        parser.error("--sizes: at least two sizes (the figures are slopes between them)")
    return Settings(
        sizes=sizes,
        parallelisms=args.parallelism or (("fsdp",) if args.quick else ("fsdp", "ddp")),
        world_sizes=args.world_sizes or ((2,) if args.quick else (1, 2, 4)),
        rounds=args.rounds or (3 if args.quick else 4),
        inner_steps=args.inner_steps or (2 if args.quick else 3),
        plain_steps=args.plain_steps,
        timeout_s=args.timeout,
        quick=args.quick,
        before=args.before,
        out=args.out or Path(__file__).resolve().parent / "results" / "scale.json",
        note=args.note,
    )


def main(argv: Sequence[str] | None = None) -> int:
    settings = settings_from(argv)
    print(f"machine: {machine_line(describe_machine())}", file=sys.stderr)
    before = json.loads(settings.before.read_text()) if settings.before is not None else None
    report = asyncio.run(measure(settings))
    if before is not None:
        report["before"] = {"path": str(settings.before), "git": before["machine"]["git"]}
    publish(report, settings.out, render(report, before))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
