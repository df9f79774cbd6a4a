"""The state store's share of a round: SQLite against PostgreSQL, with and without fencing.

    python -m benchmarks.state_store [--regions 2,4,8,16] [--rounds 5] [--chunks 64]
        [--smoke] [--out PATH] [--note TEXT]

For R regions, one round's bookkeeping as the coordinator writes it, through the same
functions (:mod:`coordinator.state.transactions`,
:func:`coordinator.intake.chunk_commit.record_chunks`): each region opens its upload, its
``--chunks`` frames are recorded in group commits of
:data:`coordinator.intake.chunk_commit.MAX_BATCH` or fewer (8 per commit here, as a window of 8
uploads gives), its delta's policy decision is audited and the delta accepted (receipt,
round record, audit entry); then the round is published (round record, pointers, audit
entry). Every call commits as the daemon's would, one after another (the daemon runs its
store in one thread). Measured on three stores, in one process: ``sqlite`` (the default,
the baseline of the ratios), ``postgresql`` (a fresh database on the tests' server,
``tests/support/stores.py``: ``GEOFED_TEST_POSTGRES`` or the machine's) and
``postgresql+lease`` (the same with a leader lease's fence, checked by every
transaction). No file of a delta is written: the figures are the database's alone. The
failover time itself is measured by ``tests/integration/test_coordinator_failover.py``
with real processes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks._machine import describe_machine, machine_line
from benchmarks._report import publish
from benchmarks.round_overhead import region_counts
from coordinator.ha.postgres_lease import PostgresLease
from coordinator.intake.chunk_commit import ChunkWrite, record_chunks
from coordinator.state.audit import AuditEvent, AuditVerdict
from coordinator.state.postgres import PostgresStore
from coordinator.state.sqlite import SqliteStore
from coordinator.state.store import Store
from coordinator.state.transactions import (
    DeltaOffer,
    accept_delta,
    open_upload,
    record_admitted_job,
    record_publication,
)
from geofed.blobstore import sha256_hex
from geofed.types import Identity, Role
from tests.support.stores import PostgresSpec

RESULTS = Path(__file__).parent / "results"
STORES = ("sqlite", "postgresql", "postgresql+lease")
BATCH = 8
COORDINATOR = Identity("bench", Role.COORDINATOR, "main")


def one_round(store: Store, job: str, round_: int, regions: int, chunks: int) -> dict[str, float]:
    """Write round ``round_``'s bookkeeping; seconds spent in uploads and in publication."""
    started = time.perf_counter()
    for r in range(regions):
        region = f"region-{r:02d}"
        actor = Identity("bench", Role.REGION, region)
        manifest = sha256_hex(f"{job}/{round_}/{region}".encode())
        open_upload(store, job, round_, region, manifest)
        for first in range(0, chunks, BATCH):
            writes = [
                ChunkWrite(
                    job,
                    round_,
                    region,
                    manifest,
                    index,
                    sha256_hex(f"{manifest}/{index}".encode()),
                    400_000,
                )
                for index in range(first, min(chunks, first + BATCH))
            ]
            assert all(outcome is None for outcome in record_chunks(store, writes))
        store.append_audit(
            AuditEvent(actor, "policy.model_delta", AuditVerdict.ALLOW, job=job, round=round_)
        )
        offer = DeltaOffer(
            region, round_, manifest, sha256_hex(manifest.encode()), 1, 1000, 2.0, actor
        )
        accept_delta(store, job, offer, {"phase": "collecting", "accepted": r + 1}, "quorum")
    uploads_s = time.perf_counter() - started
    started = time.perf_counter()
    record_publication(
        store,
        job,
        round_,
        {"phase": "published"},
        {"params": sha256_hex(f"θ{round_ + 1}".encode()), "version": str(round_ + 1)},
        completed=False,
        actor=COORDINATOR,
        details={"round": round_},
    )
    return {"uploads_s": uploads_s, "publish_s": time.perf_counter() - started}


def measure(
    open_store: Callable[[], Store], regions: int, rounds: int, chunks: int
) -> dict[str, Any]:
    """``rounds`` rounds of ``regions`` regions on a fresh store; per-round figures."""
    store = open_store()
    try:
        job = "bench"
        record_admitted_job(store, job, {"job_id": job}, "ckpt", COORDINATOR, 0)
        samples = [one_round(store, job, r, regions, chunks) for r in range(rounds)]
    finally:
        store.close()
    round_s = [s["uploads_s"] + s["publish_s"] for s in samples]
    transactions = regions * (2 + -(-chunks // BATCH) + 1) + 1
    return {
        "round_s_median": statistics.median(round_s),
        "round_s": round_s,
        "publish_s_median": statistics.median(s["publish_s"] for s in samples),
        "transactions_per_round": transactions,
        "ms_per_transaction": 1000 * statistics.median(round_s) / transactions,
    }


def run_store(kind: str, regions: int, rounds: int, chunks: int, tmp: Path) -> dict[str, Any]:
    if kind == "sqlite":
        path = tmp / f"sqlite-{regions}" / "coordinator.db"
        path.parent.mkdir(parents=True)
        return measure(lambda: SqliteStore(path), regions, rounds, chunks)
    database = PostgresSpec.fresh(tmp / f"{kind}-{regions}")
    try:
        if kind == "postgresql":
            return measure(lambda: PostgresStore(database.dsn), regions, rounds, chunks)
        lease = PostgresLease(database.dsn, "bench-leader", ttl_s=60.0)
        try:
            assert lease.attempt().leading
            fence = lease.fence
            return measure(
                lambda: PostgresStore(database.dsn, fence=fence), regions, rounds, chunks
            )
        finally:
            lease.close()
    finally:
        database.drop()


def render(report: dict[str, Any]) -> str:
    settings = report["settings"]
    lines = [
        "# State store: a round's bookkeeping on SQLite and PostgreSQL",
        "",
        machine_line(report["machine"]),
        "",
        f"{settings['rounds']} rounds per cell, {settings['chunks']} frames per delta in "
        f"commits of {BATCH}; median round. Ratio: against SQLite with the same regions.",
        "",
        "| regions | store | round (ms) | publication (ms) | transactions | ms/transaction "
        "| vs SQLite |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for regions, cells in report["results"].items():
        base = cells["sqlite"]["round_s_median"]
        for kind, cell in cells.items():
            lines.append(
                f"| {regions} | {kind} | {1000 * cell['round_s_median']:.1f} | "
                f"{1000 * cell['publish_s_median']:.2f} | {cell['transactions_per_round']} | "
                f"{cell['ms_per_transaction']:.2f} | {cell['round_s_median'] / base:.2f}x |"
            )
    if report.get("note"):
        lines += ["", report["note"]]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regions", type=region_counts, default=(2, 4, 8, 16))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=64, help="frames per delta (default 64)")
    parser.add_argument("--smoke", action="store_true", help="2 regions, 2 rounds, 8 frames")
    parser.add_argument("--out", type=Path, default=RESULTS / "state_store.json")
    parser.add_argument("--note", default="")
    args = parser.parse_args(argv)
    if args.smoke:
        args.regions, args.rounds, args.chunks = (2,), 2, 8
    if args.rounds < 1 or args.chunks < 1:
        parser.error("--rounds and --chunks must be >= 1")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="geofed-bench-store-") as tmp:
        for regions in args.regions:
            results[str(regions)] = {
                kind: run_store(kind, regions, args.rounds, args.chunks, Path(tmp))
                for kind in STORES
            }
    report = {
        "benchmark": "state_store",
        "machine": describe_machine(),
        "settings": {
            "regions": args.regions,
            "rounds": args.rounds,
            "chunks": args.chunks,
            "batch": BATCH,
            "smoke": args.smoke,
        },
        "results": results,
        "note": args.note,
    }
    publish(report, args.out, render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
