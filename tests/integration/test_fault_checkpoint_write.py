"""A full disk under the global checkpoint store while the coordinator publishes a round.

The checkpoint locations live on a small tmpfs mounted for the test (a real filesystem
that really runs out of space; mounting needs root, which this project's machines are).
After round 0 is published the test fills the tmpfs, entirely or all but the room for
part of round 1's publication, so a write of that publication fails with ENOSPC.
Throughout, a watcher verifies every visible file of the checkpoint store: blobs hash to
their names and every index entry names stored blobs. Each test configures a small
``publication_retry`` back-off, so failed publications are retried within seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import sqlite3
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from coordinator.config import PublicationRetryConfig
from coordinator.state.sqlite import DB_FILENAME
from coordinator.storage.job_blobs import JobBlobStores
from coordinator.storage.working_state import PARAMS
from tests.support.coordinator import (
    JOB,
    FakeRegion,
    Running,
    Setup,
    audit_after,
    coordinator,
    job_yaml,
    metric_value,
    mosquitto_setup,
    request,
    wait_collecting,
)
from tests.support.disks import ENOSPC_TEXT, PAGE, fill, tmpfs

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def visible_problems(root: Path) -> list[str]:
    """Every visible file of the checkpoint stores (directories of ``root``) that does not
    verify. Temp files (``.name.tmp``, the ``.incoming`` directory) are a writer's private
    business; anything else is what a reader could see and must be whole.
    """
    problems = []
    stores = [path for path in root.iterdir() if path.is_dir()]
    for path in sorted(p for store in stores for p in store.rglob("*")):
        relative = path.relative_to(root)
        if any(part.startswith(".") for part in relative.parts) or not path.is_file():
            continue
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue  # deleted since the listing (an old index replaced, a blob pruned)
        if path.name == "index.json":
            problems += _index_problems(path, data)
        elif path.parent.parent.name == "blobs":
            digest = path.parent.name + path.name
            if hashlib.sha256(data).hexdigest() != digest:
                problems.append(f"{relative}: content does not hash to its name")
        else:
            problems.append(f"{relative}: unexpected file")
    return problems


def _index_problems(path: Path, data: bytes) -> list[str]:
    try:
        entries = json.loads(data)["entries"]
    except (ValueError, KeyError) as exc:
        return [f"{path}: unreadable index ({exc})"]
    blobs = path.parents[2] / "blobs"
    return [
        f"{path}: {entry['kind']} {entry['round']} names missing blob {digest}"
        for entry in entries
        for digest in (entry["payload_digest"], entry["manifest_digest"])
        if not (blobs / digest[:2] / digest[2:]).is_file()
    ]


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.name.endswith(".tmp")]


class Watcher:
    """Scans the checkpoint stores over and over while a block runs; collects problems."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.problems: set[str] = set()
        self.scans = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while not self._stop.is_set():
            self.problems.update(await asyncio.to_thread(visible_problems, self.root))
            self.scans += 1
            await asyncio.sleep(0.005)

    async def __aenter__(self) -> Watcher:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task


@dataclass
class Clients:
    """Sessions on one running coordinator: its observer and the job's two regions."""

    running: Running
    observer: aiohttp.ClientSession = field(init=False)
    eu: FakeRegion = field(init=False)
    us: FakeRegion = field(init=False)

    def __post_init__(self) -> None:
        self.observer = self.running.session(self.running.setup.observer)
        self.eu = self.running.region("eu-west")
        self.us = self.running.region("us-east")

    async def submit(self, spec: str) -> None:
        operator = self.running.session(self.running.setup.operator)
        status, body = await request(operator, "POST", "/v1/jobs", data=spec)
        assert status == 201, body

    async def command(self, action: str) -> None:
        """Pause, resume or cancel the job as its operator."""
        operator = self.running.session(self.running.setup.operator)
        status, body = await request(operator, "POST", f"/v1/jobs/{JOB}/{action}")
        assert status == 200, body

    async def deltas(self, round: int, base: str) -> None:
        """Honest deltas of both regions for ``round``, accepted."""
        for region, seed in ((self.eu, 2 * round + 1), (self.us, 2 * round + 2)):
            manifest, stream = region.delta(JOB, round, base, seed=seed)
            status, body = await region.single_shot(JOB, round, manifest, stream)
            assert (status, body["state"]) == (200, "accepted"), body

    async def latest(self) -> dict[str, Any]:
        status, body = await request(self.us.session, "GET", f"/v1/jobs/{JOB}/checkpoints/latest")
        assert status == 200, body
        return body

    async def restores(self) -> tuple[str, int]:
        """What a joiner restores from the latest checkpoint, every signature checked."""
        _, params_hash, version = await self.us.download_params(JOB)
        return params_hash, version

    async def until(self, predicate: Any, what: str, timeout_s: float = 30.0) -> Any:
        """Poll the job's status until ``predicate(status)`` holds; return that status."""
        body: dict[str, Any] = {}
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    status, body = await request(self.observer, "GET", f"/v1/jobs/{JOB}")
                    if status == 200 and predicate(body):
                        return body
                    await asyncio.sleep(0.02)
        except TimeoutError:
            raise AssertionError(f"{what} did not happen: {body}") from None


async def first_round(clients: Clients) -> tuple[dict[str, Any], dict[str, Any]]:
    """Publish round 0 with honest deltas; the job status and latest checkpoint after it."""
    await clients.deltas(0, (await wait_collecting(clients.observer, 0))["params_hash"])
    job = await wait_collecting(clients.observer, 1)
    latest = await clients.latest()
    assert (latest["round"], latest["parameters_hash"]) == (1, job["params_hash"])
    return job, latest


def failing_with_enospc(status: dict[str, Any]) -> bool:
    return bool(status["error"]) and ENOSPC_TEXT in status["error"]


def configure_retry(setup: Setup, initial_s: float, max_s: float, max_attempts: int) -> None:
    """Give the coordinator of ``setup`` this publication back-off (before it starts)."""
    with setup.config_path.open("a") as file:
        file.write(
            f"publication_retry: {{initial_s: {initial_s}, max_s: {max_s}, "
            f"max_attempts: {max_attempts}}}\n"
        )
    retry = setup.config().publication_retry
    assert (retry.initial_s, retry.max_s, retry.max_attempts) == (initial_s, max_s, max_attempts)


def audit_time(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)


def check_backoff(fails: list[dict[str, Any]], retry: PublicationRetryConfig) -> list[float]:
    """Each failed attempt waited the configured back-off after the one before it (the
    next attempt started no earlier than the announced ``retry_at``). The gaps, seconds."""
    numbers = [e["details"]["publication_failures"] for e in fails]
    assert numbers == list(range(1, len(fails) + 1)), fails
    for entry, number in zip(fails, numbers, strict=True):
        if entry["details"]["retry_at"] is None:  # the last allowed attempt
            assert number == retry.max_attempts, entry
            continue
        assert entry["details"]["retry_in_s"] == retry.delay_s(number), entry
        assert audit_time(entry["details"]["retry_at"]) > audit_time(entry["time"]), entry
    for before, after in itertools.pairwise(fails):
        assert audit_time(after["time"]) >= audit_time(before["details"]["retry_at"])
    return [
        (audit_time(after["time"]) - audit_time(before["time"])).total_seconds()
        for before, after in itertools.pairwise(fails)
    ]


async def test_a_full_disk_fails_the_publication_and_the_previous_checkpoint_restores(
    tmp_path: Path,
) -> None:
    with mosquitto_setup(tmp_path) as setup, tmpfs(tmp_path / "ckpt") as ckpt:
        # More publication attempts than the job's round attempts (3 by default): the
        # coordinator's storage trouble has its own bound.
        configure_retry(setup, initial_s=0.05, max_s=0.2, max_attempts=5)
        retry = setup.config().publication_retry
        async with coordinator(setup) as running:
            clients = Clients(running)
            await clients.submit(job_yaml())
            job, latest = await first_round(clients)
            filler = fill(ckpt)
            async with Watcher(ckpt) as watcher:
                started = time.monotonic()
                await clients.deltas(1, job["params_hash"])
                failed = await clients.until(lambda b: b["state"] == "failed", "job failure")
                elapsed = time.monotonic() - started
            assert watcher.scans > 0
            assert not watcher.problems, sorted(watcher.problems)
            assert not temp_files(ckpt), temp_files(ckpt)

            # The failure is reported: job error, round.fail and job.fail entries, a metric.
            error = failed["error"]
            assert ENOSPC_TEXT in error, failed
            assert f"all {retry.max_attempts} attempt(s)" in error, error
            assert "publication_retry.max_attempts" in error, error
            assert "Free space" in error, error
            assert "submit the job again" in error, error
            assert (failed["round"], failed["params_hash"]) == (1, job["params_hash"])
            # The closed round was retried as it was, never re-opened.
            assert (failed["current"]["attempt"], failed["current"]["phase"]) == (1, "failed")
            entries = await audit_after(clients.observer, 0)
            fails = [e for e in entries if e["action"] == "round.fail"]
            assert len(fails) == retry.max_attempts, fails
            assert all(ENOSPC_TEXT in e["details"]["reason"] for e in fails), fails
            gaps = check_backoff(fails, retry)
            assert [e["round"] for e in entries if e["action"] == "round.publish"] == [0]
            job_fails = [e for e in entries if e["action"] == "job.fail"]
            assert [e["details"]["reason"] for e in job_fails] == [error]
            assert entries.index(job_fails[0]) > entries.index(fails[-1])
            metric = f'geofed_rounds_failed_total{{job="{JOB}"}}'
            assert await metric_value(running, clients.observer, metric) == retry.max_attempts
            print(
                f"{retry.max_attempts} failed publications and the job's failure took "
                f"{elapsed:.2f} s; gaps between attempts (s): "
                + ", ".join(f"{gap:.3f}" for gap in gaps)
            )

            # The previous checkpoint is still the latest, and a joiner restores it.
            assert await clients.latest() == latest
            assert await clients.restores() == (job["params_hash"], 1)

        # Space back, coordinator restarted: the same checkpoint restores.
        filler.unlink()
        async with coordinator(setup) as running:
            clients = Clients(running)
            # The engine loads the job's parameters in the background after the start.
            await clients.until(lambda b: b["params_hash"] is not None, "recovery")
            assert await clients.latest() == latest
            assert await clients.restores() == (job["params_hash"], 1)
        assert not visible_problems(ckpt)


def pages(size: int) -> int:
    return -(-size // PAGE)


def leave_free(filler: Path, count: int) -> None:
    """Free exactly ``count`` pages of a full tmpfs by shortening its filler file."""
    root = filler.parent
    os.truncate(filler, filler.stat().st_size - count * PAGE)
    assert os.statvfs(root).f_bavail == count


def room_for_the_update_and_not_the_snapshot(location: Path) -> int:
    """Free pages that hold round 1's update, its manifest, the new index and the snapshot
    bundle, but not the snapshot's manifest (sizes taken from round 0's artifacts)."""
    index = location / "jobs" / JOB / "index.json"
    entries = json.loads(index.read_bytes())["entries"]

    def size(digest: str) -> int:
        return (location / "blobs" / digest[:2] / digest[2:]).stat().st_size

    update = next(e for e in entries if e["kind"] == "update")
    snapshot = next(e for e in entries if e["kind"] == "snapshot")
    new_index = pages(index.stat().st_size + 1024)  # one entry more
    bundle = pages(size(snapshot["payload_digest"]))
    # The new index is written beside the old one, whose pages return on the rename.
    return (
        pages(size(update["payload_digest"]))
        + pages(size(update["manifest_digest"]))
        + max(new_index, bundle)
    )


async def statuses_until_failures(clients: Clients, count: int) -> list[dict[str, Any]]:
    """The job's status, polled until the audit log holds ``count`` failed attempts."""
    statuses: list[dict[str, Any]] = []
    async with asyncio.timeout(60):
        while True:
            status, body = await request(clients.observer, "GET", f"/v1/jobs/{JOB}")
            assert status == 200, body
            statuses.append(body)
            entries = await audit_after(clients.observer, 0)
            if sum(e["action"] == "round.fail" for e in entries) >= count:
                return statuses
            await asyncio.sleep(0.02)


async def test_a_snapshot_that_does_not_fit_leaves_the_chain_whole_and_publishes_later(
    tmp_path: Path,
) -> None:
    with mosquitto_setup(tmp_path) as setup, tmpfs(tmp_path / "ckpt") as ckpt:
        configure_retry(setup, initial_s=0.1, max_s=0.4, max_attempts=1000)
        retry = setup.config().publication_retry
        async with coordinator(setup) as running:
            clients = Clients(running)
            await clients.submit(job_yaml(rounds=2))  # max_round_attempts: 3, the default
            job, latest = await first_round(clients)
            storage = setup.config().storage_named(job["checkpoint_location"])
            assert storage is not None
            location = storage.path
            filler = fill(ckpt)
            leave_free(filler, room_for_the_update_and_not_the_snapshot(location))
            async with Watcher(ckpt) as watcher:
                await clients.deltas(1, job["params_hash"])
                failing = await clients.until(failing_with_enospc, "ENOSPC")
                # Round 1's update is in the index, its snapshot is not; the latest
                # checkpoint is still θ_1, which a joiner restores.
                index = json.loads((location / "jobs" / JOB / "index.json").read_bytes())
                recorded = [(e["kind"], e["round"]) for e in index["entries"]]
                assert recorded == [("snapshot", 0), ("update", 0), ("update", 1)], recorded
                assert (failing["round"], failing["params_hash"]) == (1, job["params_hash"])
                assert await clients.latest() == latest
                assert await clients.restores() == (job["params_hash"], 1)
                # More failed publications than the job's round attempts: the job keeps
                # running, the round stays closed (never re-opened), the error says when
                # the next attempt is.
                statuses = await statuses_until_failures(clients, 5)
                for status in [failing, *statuses]:
                    assert status["state"] == "running", status
                    current = status["current"]
                    assert (current["round"], current["phase"]) == (1, "aggregating"), status
                    assert current["attempt"] == 1, status
                    assert ENOSPC_TEXT in status["error"], status
                    assert "publication of round 1 failed" in status["error"], status
                    assert "retrying at" in status["error"], status
                filler.unlink()
                freed = time.monotonic()
                done = await clients.until(lambda b: b["state"] == "completed", "completion")
                recovery_s = time.monotonic() - freed
            assert watcher.scans > 0
            assert not watcher.problems, sorted(watcher.problems)
            assert not temp_files(ckpt), temp_files(ckpt)
            assert done["error"] is None, done  # the retries are over

            entries = await audit_after(clients.observer, 0)
            assert not [e for e in entries if e["action"] == "job.fail"], entries
            fails = [e for e in entries if e["action"] == "round.fail"]
            assert len(fails) >= 5, fails
            assert all(ENOSPC_TEXT in e["details"]["reason"] for e in fails), fails
            assert all(e["round"] == 1 for e in fails), fails
            gaps = check_backoff(fails, retry)
            # Applied exactly once, reusing the update recorded by the failed attempt, at
            # the attempt the back-off scheduled after the last failure.
            publishes = [e for e in entries if e["action"] == "round.publish"]
            assert [e["round"] for e in publishes] == [0, 1]
            assert publishes[1]["details"]["update"] == index["entries"][2]["payload_digest"]
            assert audit_time(publishes[1]["time"]) >= audit_time(fails[-1]["details"]["retry_at"])
            metric = f'geofed_rounds_failed_total{{job="{JOB}"}}'
            assert await metric_value(running, clients.observer, metric) == len(fails)
            now = await clients.latest()
            assert (now["round"], now["snapshot"]["round"], now["updates"]) == (2, 2, [])
            assert await clients.restores() == (done["params_hash"], 2)
            print(
                f"round 1's publication failed {len(fails)} time(s) before space returned, "
                "the job running throughout; gaps between attempts (s): "
                + ", ".join(f"{gap:.3f}" for gap in gaps)
                + f"; published {recovery_s:.2f} s after space returned"
            )
        assert not visible_problems(ckpt)


def backing_off(round: int) -> Any:
    """A predicate on the job's status: ``round``'s publication waits for its next try."""

    def predicate(status: dict[str, Any]) -> bool:
        current = status.get("current") or {}
        return (
            failing_with_enospc(status)
            and "retrying at" in status["error"]
            and (current.get("round"), current.get("phase")) == (round, "aggregating")
        )

    return predicate


async def test_a_publication_backing_off_answers_pause_resume_and_cancel_at_once(
    tmp_path: Path,
) -> None:
    with mosquitto_setup(tmp_path) as setup, tmpfs(tmp_path / "ckpt") as ckpt:
        # A back-off far longer than the test's waits: anything that happens before it
        # ends happened because of an operator's command, not because the wait was over.
        configure_retry(setup, initial_s=600, max_s=600, max_attempts=3)
        async with coordinator(setup) as running:
            clients = Clients(running)
            await clients.submit(job_yaml(rounds=3))
            job, _ = await first_round(clients)

            # Paused while it backs off, space freed, resumed: published at once.
            filler = fill(ckpt)
            await clients.deltas(1, job["params_hash"])
            backing = await clients.until(backing_off(1), "round 1 backing off")
            assert "(in 600 s)" in backing["error"], backing
            await clients.command("pause")
            paused = await clients.until(lambda b: b["state"] == "paused", "pause")
            assert (paused["round"], paused["current"]["phase"]) == (1, "aggregating"), paused
            filler.unlink()
            await clients.command("resume")
            resumed_at = time.monotonic()
            job = await wait_collecting(clients.observer, 2, timeout_s=60)
            print(f"round 1 published {time.monotonic() - resumed_at:.2f} s after the resume")
            assert job["error"] is None, job
            entries = await audit_after(clients.observer, 0)
            assert [e["round"] for e in entries if e["action"] == "round.fail"] == [1]
            assert [e["round"] for e in entries if e["action"] == "round.publish"] == [0, 1]

            # Cancelled while it backs off: the closed round is abandoned, nothing published.
            filler = fill(ckpt)
            await clients.deltas(2, job["params_hash"])
            await clients.until(backing_off(2), "round 2 backing off")
            await clients.command("cancel")
            cancelled = await clients.until(
                lambda b: b["state"] == "cancelled" and b["current"]["phase"] == "abandoned",
                "cancellation",
                timeout_s=60,
            )
            assert cancelled["round"] == 2, cancelled
            entries = await audit_after(clients.observer, 0)
            assert [e["round"] for e in entries if e["action"] == "round.fail"] == [1, 2]
            assert [e["round"] for e in entries if e["action"] == "round.publish"] == [0, 1]
            assert not [e for e in entries if e["action"] == "job.fail"], entries
        filler.unlink()

        # A restart does not publish the abandoned round of the cancelled job.
        async with coordinator(setup) as running:
            clients = Clients(running)
            status = await clients.until(lambda b: b.get("current") is not None, "recovery")
            assert (status["state"], status["round"]) == ("cancelled", 2), status
            assert status["current"]["phase"] == "abandoned", status
            latest = await clients.latest()
            assert latest["round"] == 2, latest
        assert not visible_problems(ckpt)


def saved_params_blob(setup: Setup) -> Path:
    """The file of the job's saved θ (its working state's ``params`` blob), as the
    coordinator's state store names it."""
    state_dir = setup.config().state_dir
    with contextlib.closing(sqlite3.connect(state_dir / DB_FILENAME)) as db:
        row = db.execute(
            "SELECT value FROM pointers WHERE job_id = ? AND name = ?", (JOB, PARAMS)
        ).fetchone()
    assert row is not None
    assert row[0]
    return JobBlobStores(state_dir).for_job(JOB).path_of(row[0])


async def test_a_retry_whose_state_cannot_be_rebuilt_backs_off_and_publishes_once_it_can(
    tmp_path: Path,
) -> None:
    with mosquitto_setup(tmp_path) as setup, tmpfs(tmp_path / "ckpt") as ckpt:
        configure_retry(setup, initial_s=0.05, max_s=0.2, max_attempts=1000)
        async with coordinator(setup) as running:
            clients = Clients(running)
            await clients.submit(job_yaml(rounds=2))
            job, _ = await first_round(clients)
            # The first try's outer step is taken in the working state's tensors, so each
            # later try rebuilds θ_1 from the saved θ_0 and round 0's delta: hide θ_0.
            blob = saved_params_blob(setup)
            hidden = blob.with_name(blob.name + ".hidden")
            blob.rename(hidden)
            filler = fill(ckpt)
            await clients.deltas(1, job["params_hash"])
            unrebuilt = await clients.until(
                lambda b: "is missing" in (b["error"] or ""), "a failed rebuild"
            )
            assert unrebuilt["state"] == "running", unrebuilt
            assert "publication of round 1 failed" in unrebuilt["error"], unrebuilt
            assert "retrying at" in unrebuilt["error"], unrebuilt
            hidden.rename(blob)
            filler.unlink()
            done = await clients.until(lambda b: b["state"] == "completed", "completion")
            entries = await audit_after(clients.observer, 0)
            reasons = [e["details"]["reason"] for e in entries if e["action"] == "round.fail"]
            assert any(ENOSPC_TEXT in reason for reason in reasons), reasons
            assert any("is missing" in reason for reason in reasons), reasons
            assert [e["round"] for e in entries if e["action"] == "round.publish"] == [0, 1]
            assert not [e for e in entries if e["action"] == "job.fail"], entries
            # θ_2 is the round's, bit for bit: what a joiner restores hashes as published.
            assert await clients.restores() == (done["params_hash"], 2)
