"""The agent's resumable upload against a fake coordinator that drops connections.

``FakeChunkCoordinator`` is a fake at the outer edge: a real aiohttp server on loopback
implementing just the three upload endpoints of the protocol (manifest, chunks, commit),
which can cut the connection after a given number of stored chunks, lose a chunk, or
answer with the protocol's error codes.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer

from geofed.codec import ErrorFeedback
from geofed.codec_params import CodecParams
from geofed.manifest import SignedManifest
from geofed.params import parameters_vector_hash, state_to_fp32
from geofed.ports import unused_port
from geofed.timeouts import Timeout, Timeouts
from regional_agent.rounds.delta import DeltaOrigin, delta_manifest, encode_delta, sign_delta
from regional_agent.state import DeltaMeta, JobDirectory, SpooledDelta
from regional_agent.transfer.coordinator_client import CoordinatorClient
from regional_agent.transfer.uploader import BaseMismatch, RoundClosed, Uploader, UploadRefused
from tests.support.agent_credentials import agent_credentials
from tests.support.pki import make_federation
from tests.support.tiny_task import TinyTask
from tests.support.waiting import eventually

JOB = "tiny"
REGION = "eu-west"
ROUND = 4
TIMEOUTS = Timeouts(connect_s=1, heartbeat_s=0.5, request_s=2, upload_s=20, download_s=20)


@dataclass
class FakeChunkCoordinator:
    """The coordinator's upload endpoints, in memory, with faults on demand."""

    drop_after_stored: int | None = None
    outage_requests: int = 2
    """Chunk requests cut off once ``drop_after_stored`` chunks are stored; two, because
    the HTTP client itself repeats an idempotent request once on a dropped connection."""
    lose_once: int | None = None
    forget_upload_at: int | None = None
    refuse_manifest: tuple[int, str] | None = None
    refuse_chunk: int | None = None
    manifest: SignedManifest | None = None
    stored: dict[int, bytes] = field(default_factory=dict)
    chunk_puts: dict[int, int] = field(default_factory=dict)
    manifest_puts: int = 0
    answered_received: list[list[int]] = field(default_factory=list)
    """The chunks each open-upload answer said this coordinator held."""
    commits: int = 0
    accepted: bool = False
    chunk_delay_s: float = 0.0
    """How long each chunk PUT takes to answer, so that concurrent ones overlap."""
    in_flight: int = 0
    max_in_flight: int = 0
    sent_after_ack: list[int] = field(default_factory=list)
    """Chunks PUT again after this coordinator had acknowledged them."""

    def app(self) -> web.Application:
        app = web.Application()
        base = "/v1/jobs/{job}/rounds/{round}/deltas/{region}"
        app.router.add_put(base + "/manifest", self._manifest)
        app.router.add_put(base + "/chunks/{index}", self._chunk)
        app.router.add_post(base + "/commit", self._commit)
        return app

    async def _manifest(self, request: web.Request) -> web.Response:
        self.manifest_puts += 1
        if self.refuse_manifest is not None:
            status, code = self.refuse_manifest
            return web.json_response({"error": code, "message": "refused"}, status=status)
        if self.accepted:
            return web.json_response({"state": "accepted", "receipt": {"round": ROUND}})
        self.manifest = SignedManifest.from_bytes(await request.read())
        self.answered_received.append(sorted(self.stored))
        return web.json_response({"state": "open", "received": sorted(self.stored)})

    async def _chunk(self, request: web.Request) -> web.Response:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.chunk_delay_s:
                await asyncio.sleep(self.chunk_delay_s)
            return await self._store_chunk(request)
        finally:
            self.in_flight -= 1

    async def _store_chunk(self, request: web.Request) -> web.Response:
        index = int(request.match_info["index"])
        self.chunk_puts[index] = self.chunk_puts.get(index, 0) + 1
        if index in self.stored:
            self.sent_after_ack.append(index)
        body = await request.read()
        if self.drop_after_stored is not None and len(self.stored) >= self.drop_after_stored:
            self.outage_requests -= 1
            if self.outage_requests == 0:
                self.drop_after_stored = None
            assert request.transport is not None
            request.transport.close()  # the connection dies before any answer
            return web.Response(status=500)
        if self.forget_upload_at == index:
            self.forget_upload_at = None
            self.manifest = None  # as if a new manifest replaced it, or it expired
            self.stored.clear()
        if self.manifest is None:
            return web.json_response(
                {"error": "not_found", "message": "no open upload"}, status=404
            )
        record = self.manifest.manifest.chunks[index]
        if hashlib.sha256(body).hexdigest() != record.sha256 or index == self.refuse_chunk:
            return web.json_response({"error": "corrupt_chunk", "message": "sha"}, status=400)
        self.stored[index] = body
        return web.json_response({"index": index})

    async def _commit(self, request: web.Request) -> web.Response:
        self.commits += 1
        assert self.manifest is not None
        if self.lose_once is not None:
            self.stored.pop(self.lose_once, None)
            self.lose_once = None
        if len(self.stored) != len(self.manifest.manifest.chunks):
            return web.json_response({"error": "incomplete", "message": "gaps"}, status=409)
        self.accepted = True
        metrics = (await request.json())["metrics"]
        return web.json_response({"state": "accepted", "receipt": {"metrics": metrics}})


class RecordingSleep:
    """Back-off without waiting: records each delay."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


class PacedSleep(RecordingSleep):
    """Records each delay and waits a fixed 50 ms, so retry loops do not spin."""

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        await asyncio.sleep(0.05)


def spooled_delta(tmp_path: Path) -> SpooledDelta:
    """A real encoded, signed and spooled delta of the tiny task, in several frames."""
    fed = make_federation(tmp_path / "pki")
    region = fed.region(REGION)
    credentials = agent_credentials(fed, region)
    task = TinyTask()
    base = state_to_fp32(task.build_model(seed=1))
    local = {n: t + 0.01 * torch.randn(t.shape) for n, t in base.items()}
    encoded = encode_delta(base, local, ErrorFeedback(), CodecParams(), chunk_elements=128)
    origin = DeltaOrigin(
        job=JOB,
        round=ROUND,
        base_round=ROUND,
        base_hash=parameters_vector_hash(base),
        tokens=64,
        producer=region.identity,
        jurisdiction="EU",
        datasets=("eu-support-chats",),
    )
    manifest = delta_manifest(origin, encoded.stream, now=datetime.now(UTC))
    signed = sign_delta(manifest, credentials)
    state = JobDirectory(tmp_path / "state", JOB)
    meta = DeltaMeta(train_loss=0.5, tokens=64, params_hash=origin.base_hash)
    return state.write_spool(ROUND, signed.to_bytes(), encoded.frames, encoded.feedback, meta)


@pytest.fixture(scope="module")
def delta(tmp_path_factory: pytest.TempPathFactory) -> SpooledDelta:
    spooled = spooled_delta(tmp_path_factory.mktemp("delta"))
    assert spooled.frame_count >= 6
    return spooled


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[tuple[FakeChunkCoordinator, str]]:
    coordinator = FakeChunkCoordinator()
    server = TestServer(coordinator.app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield coordinator, str(server.make_url("/"))
    finally:
        await server.close()


@pytest_asyncio.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client_session:
        yield client_session


def uploader(
    session: aiohttp.ClientSession,
    url: str,
    sleep: RecordingSleep,
    window: int = 1,
    clock: Callable[[], float] = time.monotonic,
) -> Uploader:
    client = CoordinatorClient(session, url, TIMEOUTS)
    return Uploader(client, REGION, sleep=sleep, window=window, clock=clock)


@pytest.mark.parametrize("drop_after", [0, 2, 5])
async def test_upload_resumes_without_resending_acknowledged_chunks(
    fake: tuple[FakeChunkCoordinator, str],
    session: aiohttp.ClientSession,
    delta: SpooledDelta,
    drop_after: int,
) -> None:
    coordinator, url = fake
    coordinator.drop_after_stored = drop_after
    sleep = RecordingSleep()
    ticks = iter(range(100))  # each reading of the clock one second later
    report = await uploader(session, url, sleep, clock=lambda: float(next(ticks))).upload(
        JOB, delta, {"train_loss": 0.5}
    )
    frames = delta.frame_count
    assert coordinator.accepted
    # The commit tells the seconds from the upload's start to the commit, retries included.
    assert report.receipt == {"metrics": {"train_loss": 0.5, "upload_s": 1.0}}
    # Every acknowledged chunk went exactly once; only the one cut off went again.
    expected = dict.fromkeys(range(frames), 1)
    expected[drop_after] = 1 + 2
    assert coordinator.chunk_puts == expected
    assert report.chunks_sent == frames
    assert report.attempts == 2
    assert coordinator.manifest_puts == 2
    assert len(sleep.delays) == 1
    assert [coordinator.stored[i] for i in range(frames)] == [
        delta.read_frame(i) for i in range(frames)
    ]


async def test_a_restarted_upload_sends_only_what_the_coordinator_lacks(
    fake: tuple[FakeChunkCoordinator, str], session: aiohttp.ClientSession, delta: SpooledDelta
) -> None:
    coordinator, url = fake
    # The coordinator becomes unreachable after 3 chunks; the first agent gives up at
    # its upload deadline (as if it had died there).
    coordinator.drop_after_stored = 3
    coordinator.outage_requests = 10**6
    # Generous enough that 3 chunks are stored before the deadline on a loaded machine.
    short = Timeouts(connect_s=1, heartbeat_s=0.1, request_s=1.5, upload_s=4.0, download_s=2)
    with pytest.raises(Timeout, match="upload of the delta"):
        await Uploader(CoordinatorClient(session, url, short), REGION, sleep=PacedSleep()).upload(
            JOB, delta, {}
        )
    await eventually(lambda: coordinator.in_flight == 0)
    assert sorted(coordinator.stored) == [0, 1, 2]
    coordinator.drop_after_stored = None
    report = await uploader(session, url, RecordingSleep()).upload(JOB, delta, {})
    assert coordinator.accepted
    # A chunk the given-up agent wrote to its socket just before its deadline may still
    # reach the coordinator after the outage ends (the server reads it later); the restarted
    # upload then lacks one chunk fewer. What it sends is exactly what the coordinator said
    # it lacked when the upload was opened again.
    held = coordinator.answered_received[-1]
    assert set(held) >= {0, 1, 2}
    assert report.chunks_sent == delta.frame_count - len(held)
    assert all(coordinator.chunk_puts[i] == 1 for i in (0, 1, 2))


async def test_an_accepted_delta_is_not_sent_again(
    fake: tuple[FakeChunkCoordinator, str], session: aiohttp.ClientSession, delta: SpooledDelta
) -> None:
    coordinator, url = fake
    await uploader(session, url, RecordingSleep()).upload(JOB, delta, {})
    puts = dict(coordinator.chunk_puts)
    report = await uploader(session, url, RecordingSleep()).upload(JOB, delta, {})
    assert report.already_accepted
    assert report.chunks_sent == 0
    assert coordinator.chunk_puts == puts


async def test_a_chunk_lost_before_the_commit_is_sent_again(
    fake: tuple[FakeChunkCoordinator, str], session: aiohttp.ClientSession, delta: SpooledDelta
) -> None:
    coordinator, url = fake
    coordinator.lose_once = 1
    report = await uploader(session, url, RecordingSleep()).upload(JOB, delta, {})
    assert coordinator.accepted
    assert coordinator.commits == 2
    assert coordinator.chunk_puts[1] == 2
    assert report.chunks_sent == delta.frame_count + 1


async def test_a_vanished_open_upload_is_offered_again(
    fake: tuple[FakeChunkCoordinator, str], session: aiohttp.ClientSession, delta: SpooledDelta
) -> None:
    coordinator, url = fake
    coordinator.forget_upload_at = 2
    report = await uploader(session, url, RecordingSleep()).upload(JOB, delta, {})
    assert coordinator.accepted
    assert coordinator.manifest_puts == 2
    expected = {i: 2 if i <= 2 else 1 for i in range(delta.frame_count)}
    assert coordinator.chunk_puts == expected
    assert report.attempts == 2


@pytest.mark.parametrize(
    ("status", "code", "error"),
    [
        (409, "round_closed", RoundClosed),
        (409, "base_mismatch", BaseMismatch),
        (403, "policy_denied", UploadRefused),
    ],
)
async def test_refusals_end_the_upload_without_retrying(
    fake: tuple[FakeChunkCoordinator, str],
    session: aiohttp.ClientSession,
    delta: SpooledDelta,
    status: int,
    code: str,
    error: type[Exception],
) -> None:
    coordinator, url = fake
    coordinator.refuse_manifest = (status, code)
    sleep = RecordingSleep()
    with pytest.raises(error, match=code):
        await uploader(session, url, sleep).upload(JOB, delta, {})
    assert coordinator.manifest_puts == 1
    assert coordinator.chunk_puts == {}
    assert sleep.delays == []


async def test_an_unreachable_coordinator_is_retried_until_the_upload_deadline(
    session: aiohttp.ClientSession, delta: SpooledDelta
) -> None:
    url = f"http://127.0.0.1:{unused_port()}/"
    sleep = PacedSleep()
    client = CoordinatorClient(
        session, url, Timeouts(connect_s=0.2, heartbeat_s=0.1, request_s=0.3, upload_s=0.5)
    )
    with pytest.raises(Timeout, match="upload of the delta of job tiny round 4"):
        await Uploader(client, REGION, sleep=sleep).upload(JOB, delta, {})
    assert len(sleep.delays) >= 2
    assert sleep.delays[1] > sleep.delays[0] / 2  # exponential back-off, jittered


@pytest.mark.parametrize("window", [1, 4])
async def test_the_window_bounds_the_chunks_in_flight(
    fake: tuple[FakeChunkCoordinator, str],
    session: aiohttp.ClientSession,
    delta: SpooledDelta,
    window: int,
) -> None:
    coordinator, url = fake
    coordinator.chunk_delay_s = 0.05
    report = await uploader(session, url, RecordingSleep(), window).upload(JOB, delta, {})
    assert coordinator.accepted
    assert coordinator.max_in_flight == window
    assert coordinator.chunk_puts == dict.fromkeys(range(delta.frame_count), 1)
    assert report.chunks_sent == delta.frame_count
    assert [coordinator.stored[i] for i in range(delta.frame_count)] == [
        delta.read_frame(i) for i in range(delta.frame_count)
    ]


@pytest.mark.parametrize("drop_after", [0, 3])
async def test_a_windowed_upload_resumes_without_resending_acknowledged_chunks(
    fake: tuple[FakeChunkCoordinator, str],
    session: aiohttp.ClientSession,
    delta: SpooledDelta,
    drop_after: int,
) -> None:
    coordinator, url = fake
    coordinator.chunk_delay_s = 0.01
    coordinator.drop_after_stored = drop_after
    coordinator.outage_requests = 6  # several chunks in flight are cut off together
    sleep = RecordingSleep()
    report = await uploader(session, url, sleep, window=4).upload(JOB, delta, {})
    assert coordinator.accepted
    assert coordinator.sent_after_ack == []
    assert report.attempts >= 2
    assert report.chunks_sent == delta.frame_count
    assert [coordinator.stored[i] for i in range(delta.frame_count)] == [
        delta.read_frame(i) for i in range(delta.frame_count)
    ]


async def test_a_refused_chunk_ends_a_windowed_upload(
    fake: tuple[FakeChunkCoordinator, str], session: aiohttp.ClientSession, delta: SpooledDelta
) -> None:
    coordinator, url = fake
    coordinator.chunk_delay_s = 0.01
    coordinator.refuse_chunk = 2
    sleep = RecordingSleep()
    with pytest.raises(UploadRefused, match="corrupt_chunk"):
        await uploader(session, url, sleep, window=4).upload(JOB, delta, {})
    assert sleep.delays == []
    assert coordinator.commits == 0
    assert coordinator.manifest_puts == 1
