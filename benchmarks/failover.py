"""Coordinator failover: from the leader's loss to the new leader's first accepted delta.

    python -m benchmarks.failover [--ttls 2,4,8] [--repeats 2] [--smoke] [--out PATH]
        [--note TEXT]

Two coordinator daemons (real processes, mutual TLS, Mosquitto with TLS, a fresh
database on the tests' PostgreSQL server: ``GEOFED_TEST_POSTGRES`` or the machine's; one
state directory) share a leader lease of ``ttl_s`` (``state_store.leader_lease``); test
code acting as two regions feeds them fixed deltas
(``tests/support/coordinator_daemon.py``). Per trial: A leads and B stands by; round 0
is published; in round 1 one region's delta is accepted, then A is killed with SIGKILL
(mid-collection) and the clock starts. Measured from the kill: when B first answers
``/readyz`` (takeover), when B accepts the other region's delta (the first accepted
request on the new leader; the region retries its upload until then) and when round 1 is
published. The round delay is that last figure minus the same job's last-delta-to-
publication time with no failover, measured in the same run on round 0 (the baseline).

Writes ``benchmarks/results/failover.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks._machine import describe_machine, machine_line
from benchmarks._report import publish
from tests.support.coordinator_daemon import (
    JOB,
    REGIONS,
    Daemon,
    lease_pair,
    standing_by,
)
from tests.support.pki import make_federation
from tests.support.stores import PostgresSpec

RESULTS = Path(__file__).parent / "results"
POLL_S = 0.05


async def _upload(daemon: Daemon, round_: int, index: int, base: str) -> bool:
    """One attempt of region ``index``'s fixed delta for ``round_``: accepted or not."""
    region = daemon.region(REGIONS[index])
    seed, tokens = 1000 * round_ + index, 100 + 200 * index
    manifest, stream = region.delta(JOB, round_, base, seed=seed, tokens=tokens)
    try:
        status, body = await region.three_step(JOB, round_, manifest, stream)
    except (OSError, aiohttp.ClientError):  # refused, reset: no leader there yet
        return False
    return status == 200 and body.get("state") == "accepted"


async def _collecting(daemon: Daemon, round_: int) -> str:
    job = await daemon.wait_job(
        f"round {round_} to collect",
        lambda s: s["round"] == round_ and s.get("current", {}).get("phase") == "collecting",
    )
    return str(job["params_hash"])


async def trial(root: Path, ttl_s: float) -> dict[str, float]:
    """One failover at ``ttl_s``; seconds from the kill, and the round-0 baseline."""
    fed = make_federation(root / "fed", "acme")
    database = PostgresSpec.fresh(root)  # a fresh database on the tests' server
    try:
        async with lease_pair(root / "ha", fed, database.dsn, ttl_s) as (a, b):
            await a.start()
            await b.start(wait_ready=False)
            await standing_by(b, 0)
            await a.submit()
            base = await _collecting(a, 0)
            assert await _upload(a, 0, 0, base)
            last = time.monotonic()
            assert await _upload(a, 0, 1, base)
            await a.wait_published(0)
            baseline_s = time.monotonic() - last
            base = await _collecting(a, 1)
            assert await _upload(a, 1, 0, base)
            killed = time.monotonic()
            await a.kill()
            await b.wait_ready()
            takeover_s = time.monotonic() - killed
            for _ in range(int(30 / POLL_S)):  # the region retries its upload
                if await _upload(b, 1, 1, base):
                    break
                await asyncio.sleep(POLL_S)
            else:
                raise AssertionError("the new leader never accepted the delta")
            accepted_s = time.monotonic() - killed
            await b.wait_published(1)
            published_s = time.monotonic() - killed
        return {
            "takeover_s": takeover_s,
            "first_accept_s": accepted_s,
            "published_s": published_s,
            "baseline_publish_s": baseline_s,
            "round_delay_s": published_s - baseline_s,
        }
    finally:
        database.drop()


def render(report: dict[str, Any]) -> str:
    lines = [
        "# Coordinator failover (two coordinators, PostgreSQL, leader lease)",
        "",
        machine_line(report["machine"]),
        "",
        "Seconds from SIGKILL of the leader mid-collection; median of "
        f"{report['settings']['repeats']} trials (each trial's figures in the JSON). "
        "Baseline: the same job's last delta to publication without a failover.",
        "",
        "| lease ttl (s) | standby serving | first accepted delta | round published "
        "| baseline publication | round delay |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for ttl, cell in report["results"].items():
        lines.append(
            f"| {ttl} | {cell['takeover_s']:.2f} | {cell['first_accept_s']:.2f} | "
            f"{cell['published_s']:.2f} | {cell['baseline_publish_s']:.2f} | "
            f"{cell['round_delay_s']:.2f} |"
        )
    if report.get("note"):
        lines += ["", report["note"]]
    return "\n".join(lines) + "\n"


def _floats(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list like 2,4,8") from None
    if not values or any(not 0.5 <= v <= 60 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: each ttl must be 0.5..60 s")
    return values


async def run(ttls: Sequence[float], repeats: int) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for ttl in ttls:
        trials = []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory(prefix="geofed-bench-failover-") as tmp:
                trials.append(await trial(Path(tmp), ttl))
        cell: dict[str, Any] = {key: statistics.median(t[key] for t in trials) for key in trials[0]}
        cell["trials"] = trials
        results[f"{ttl:g}"] = cell
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ttls", type=_floats, default=[2.0, 4.0, 8.0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="one trial at ttl 2 s")
    parser.add_argument("--out", type=Path, default=RESULTS / "failover.json")
    parser.add_argument("--note", default="")
    args = parser.parse_args(argv)
    if args.smoke:
        args.ttls, args.repeats = [2.0], 1
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    results = asyncio.run(run(args.ttls, args.repeats))
    report = {
        "benchmark": "failover",
        "machine": describe_machine(),
        "settings": {"ttls": args.ttls, "repeats": args.repeats, "smoke": args.smoke},
        "results": results,
        "note": args.note,
    }
    publish(report, args.out, render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
