"""The WAN emulation proxy: pure pacing and reset planning, then real loopback traffic
through it to a real echo server and a real aiohttp server, and its process form.

Timing bounds are one-sided where the property is one-sided (added latency, a bandwidth
cap) and the other side gets generous slack, since the machines running this are shared.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web

from tests.support.waiting import eventually
from tests.support.wanproxy import (
    Direction,
    InvalidSettings,
    LinkSettings,
    TokenBucket,
    WanProxy,
    WanProxyError,
    plan_reset,
)
from tests.support.wanproxy_cli import (
    ControlRefused,
    main,
    parse_endpoint,
    updated_links,
    wanproxy_process,
)

HOST = "127.0.0.1"
TIMEOUT_S = 10.0
UP, DOWN = Direction.UPSTREAM, Direction.DOWNSTREAM


# ---------------------------------------------------------------- pure parts


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"latency_s": -0.1}, "latency_s must be >= 0"),
        ({"latency_s": math.inf}, "latency_s must be a finite number"),
        ({"latency_s": "0.1"}, "latency_s must be a finite number"),
        ({"bandwidth_bps": 0}, "bandwidth_bps must be a positive finite number"),
        ({"bandwidth_bps": math.nan}, "bandwidth_bps must be a positive finite number"),
        ({"reset_probability": 1.5}, r"reset_probability must be within \[0, 1\]"),
        ({"reset_probability": True}, r"reset_probability must be within \[0, 1\]"),
        ({"reset_after_bytes": (0, 10)}, "reset_after_bytes must be a pair"),
        ({"reset_after_bytes": (10, 5)}, "reset_after_bytes must be a pair"),
        ({"reset_after_bytes": [1, 5]}, "reset_after_bytes must be a pair"),
    ],
)
def test_link_settings_refuse_out_of_range_values(kwargs, message) -> None:
    with pytest.raises(InvalidSettings, match=message):
        LinkSettings(**kwargs)


def test_link_settings_from_mapping_overlays_a_base_and_refuses_unknown_names() -> None:
    base = LinkSettings(latency_s=0.2, bandwidth_bps=1e6)
    merged = LinkSettings.from_mapping({"reset_after_bytes": [5, 9], "bandwidth_bps": None}, base)
    assert merged == LinkSettings(latency_s=0.2, reset_after_bytes=(5, 9))
    assert LinkSettings.from_mapping(merged.to_mapping()) == merged
    with pytest.raises(InvalidSettings, match=r"unknown link setting.*latency_ms"):
        LinkSettings.from_mapping({"latency_ms": 5})


def test_plan_reset_is_a_function_of_seed_index_and_direction() -> None:
    half = LinkSettings(reset_probability=0.5, reset_after_bytes=(1, 10**9))
    plans = [plan_reset(7, i, UP, half) for i in range(64)]
    assert plans == [plan_reset(7, i, UP, half) for i in range(64)]
    assert plans != [plan_reset(8, i, UP, half) for i in range(64)]
    assert plans != [plan_reset(7, i, DOWN, half) for i in range(64)]


def test_plan_reset_edges_never_and_always_within_the_window() -> None:
    never = LinkSettings(reset_probability=0.0)
    always = LinkSettings(reset_probability=1.0, reset_after_bytes=(100, 200))
    assert all(plan_reset(1, i, UP, never) is None for i in range(500))
    points = [plan_reset(1, i, UP, always) for i in range(500)]
    assert all(p is not None and 100 <= p <= 200 for p in points)
    assert len(set(points)) > 50  # drawn, not constant


def test_plan_reset_higher_probability_resets_a_superset_at_the_same_points() -> None:
    low = LinkSettings(reset_probability=0.2, reset_after_bytes=(1, 5000))
    high = LinkSettings(reset_probability=0.6, reset_after_bytes=(1, 5000))
    low_plan = {i: plan_reset(3, i, UP, low) for i in range(300)}
    high_plan = {i: plan_reset(3, i, UP, high) for i in range(300)}
    assert {i for i, p in low_plan.items() if p} < {i for i, p in high_plan.items() if p}
    assert all(high_plan[i] == p for i, p in low_plan.items() if p is not None)


def test_plan_reset_rate_matches_the_probability() -> None:
    settings = LinkSettings(reset_probability=0.3)
    n = 4000
    resets = sum(plan_reset(11, i, UP, settings) is not None for i in range(n))
    sigma = math.sqrt(n * 0.3 * 0.7)
    assert abs(resets - 0.3 * n) < 4 * sigma


def test_token_bucket_allows_one_burst_then_paces_at_the_rate() -> None:
    bucket = TokenBucket(1_000_000, now=0.0)  # burst: 20 ms = 20 kB
    assert bucket.burst == 20_000
    assert bucket.reserve(20_000, now=0.0) == 0.0
    assert bucket.reserve(10_000, now=0.0) == pytest.approx(0.01)
    # After waiting its delay the caller is even; the next chunk waits its own size.
    assert bucket.reserve(5_000, now=0.01) == pytest.approx(0.005)


def test_token_bucket_savings_are_capped_at_one_burst() -> None:
    bucket = TokenBucket(1_000_000, now=0.0)
    bucket.reserve(20_000, now=0.0)
    # Idle for 10 s earns only one burst, not 10 MB.
    assert bucket.reserve(60_000, now=10.0) == pytest.approx(0.04)


def test_token_bucket_rate_change_takes_effect_from_then() -> None:
    bucket = TokenBucket(1_000_000, now=0.0)
    bucket.reserve(20_000, now=0.0)
    bucket.set_rate(100_000, now=0.0)
    assert bucket.burst == 4096  # the floor: 20 ms of 100 kB/s is less
    assert bucket.reserve(10_000, now=0.0) == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"listen_port": 70000}, "listen_port must be an integer"),
        ({"target_port": -1}, "target_port must be an integer"),
        ({"buffer_bytes": 0}, "buffer_bytes must be a positive integer"),
        ({"connect_timeout_s": math.inf}, "connect_timeout_s must be a positive number"),
    ],
)
def test_proxy_refuses_bad_arguments(kwargs, message) -> None:
    args = {"listen_port": 0, "target_port": 1, **kwargs}
    with pytest.raises(InvalidSettings, match=message):
        WanProxy(HOST, args.pop("listen_port"), HOST, args.pop("target_port"), seed=1, **args)


def test_updated_links_applies_both_then_each_direction_or_nothing() -> None:
    current = {UP: LinkSettings(latency_s=0.1), DOWN: LinkSettings()}
    new = updated_links(current, {"both": {"bandwidth_bps": 5e5}, "downstream": {"latency_s": 1}})
    assert new == {
        UP: LinkSettings(latency_s=0.1, bandwidth_bps=5e5),
        DOWN: LinkSettings(latency_s=1, bandwidth_bps=5e5),
    }
    with pytest.raises(InvalidSettings, match=r"unknown link group.*sideways"):
        updated_links(current, {"sideways": {}})
    with pytest.raises(InvalidSettings, match="reset_probability"):
        updated_links(current, {"upstream": {"latency_s": 2}, "both": {"reset_probability": 3}})
    assert current[UP] == LinkSettings(latency_s=0.1)


def test_parse_endpoint() -> None:
    assert parse_endpoint("127.0.0.1:0") == ("127.0.0.1", 0)
    for bad in ("127.0.0.1", ":80", "host:http", "host:70000"):
        with pytest.raises(ValueError, match="expected HOST:PORT"):
            parse_endpoint(bad)


# ---------------------------------------------------------------- real servers


class EchoServer:
    """A real TCP echo server on loopback that closes its own connections on exit."""

    def __init__(self) -> None:
        self.accepted = 0
        self.port = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> EchoServer:
        self._server = await asyncio.start_server(self._accept, HOST, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._writers.append(writer)
        task = asyncio.get_running_loop().create_task(self._echo(reader, writer), name="echo")
        self._tasks.add(task)

    async def _echo(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        writer.close()


@dataclass
class HttpTarget:
    port: int
    requests: int = 0


@asynccontextmanager
async def http_target() -> AsyncIterator[HttpTarget]:
    """A real aiohttp server: GET /blob?size=N, POST /sink (answers the byte count), GET /ping."""
    target = HttpTarget(port=0)

    async def blob(request: web.Request) -> web.Response:
        target.requests += 1
        return web.Response(body=b"b" * int(request.query["size"]))

    async def sink(request: web.Request) -> web.Response:
        received = len(await request.read())
        target.requests += 1  # only once the whole body has arrived
        return web.json_response({"received": received})

    async def ping(request: web.Request) -> web.Response:
        target.requests += 1
        return web.Response(text="pong")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/blob", blob)
    app.router.add_post("/sink", sink)
    app.router.add_get("/ping", ping)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    try:
        site = web.TCPSite(runner, HOST, 0)
        await site.start()
        target.port = runner.addresses[0][1]
        yield target
    finally:
        await runner.cleanup()


@pytest.fixture
async def echo() -> AsyncIterator[EchoServer]:
    async with EchoServer() as server:
        yield server


@asynccontextmanager
async def connection(port: int) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        yield reader, writer
    finally:
        writer.transport.abort()


async def round_trip(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes
) -> float:
    start = time.monotonic()
    writer.write(payload)
    await writer.drain()
    echoed = await asyncio.wait_for(reader.readexactly(len(payload)), TIMEOUT_S)
    assert echoed == payload
    return time.monotonic() - start


async def post(client: aiohttp.ClientSession, url: str, body: bytes) -> bytes:
    # POST, not PUT: aiohttp retries an idempotent request once on a reset connection.
    async with client.post(url, data=body) as response:
        return await response.read()


def session(**kwargs: float) -> aiohttp.ClientSession:
    """A client session that opens a fresh connection per request."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True),
        timeout=aiohttp.ClientTimeout(total=kwargs.get("total", TIMEOUT_S)),
    )


def wan_tasks() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("wanproxy")]


async def test_forwards_both_ways_and_counts_bytes(echo: EchoServer) -> None:
    async with WanProxy(HOST, 0, HOST, echo.port, seed=1) as wan:
        async with connection(wan.port) as (reader, writer):
            await round_trip(reader, writer, b"x" * 100_000)
            writer.write_eof()
            assert await asyncio.wait_for(reader.read(), TIMEOUT_S) == b""  # EOF relayed back
        stats = wan.stats()
        assert (stats.bytes_upstream, stats.bytes_downstream) == (100_000, 100_000)
        assert (stats.connections_accepted, stats.connections_reset) == (1, 0)
        assert echo.accepted == 1


async def test_latency_adds_the_configured_delay_to_a_round_trip(echo: EchoServer) -> None:
    async with (
        WanProxy(HOST, 0, HOST, echo.port, seed=1) as wan,
        connection(wan.port) as (reader, writer),
    ):
        baseline = min([await round_trip(reader, writer, b"ping") for _ in range(3)])
        wan.upstream = LinkSettings(latency_s=0.1)
        wan.downstream = LinkSettings(latency_s=0.15)
        delayed = [await round_trip(reader, writer, b"ping") for _ in range(3)]
    assert min(delayed) >= 0.25
    assert max(delayed) < 0.25 + baseline + 0.5


async def test_latency_does_not_serialise_throughput(echo: EchoServer) -> None:
    latency = LinkSettings(latency_s=0.2)
    async with (
        WanProxy(HOST, 0, HOST, echo.port, seed=1, upstream=latency, downstream=latency) as wan,
        connection(wan.port) as (reader, writer),
    ):
        # 40 separate writes 10 ms apart: delays overlap, so about 0.4 + 0.4 s, not 40 x 0.4.
        start = time.monotonic()
        for _ in range(40):
            writer.write(b"z" * 1000)
            await asyncio.sleep(0.01)
        await asyncio.wait_for(reader.readexactly(40_000), TIMEOUT_S)
        elapsed = time.monotonic() - start
    assert 0.4 + 0.39 <= elapsed < 2.5


async def test_latency_change_applies_to_an_open_connection_and_back(echo: EchoServer) -> None:
    async with (
        WanProxy(HOST, 0, HOST, echo.port, seed=1) as wan,
        connection(wan.port) as (reader, writer),
    ):
        await round_trip(reader, writer, b"a")
        wan.downstream = LinkSettings(latency_s=0.4)
        assert await round_trip(reader, writer, b"b") >= 0.4
        wan.downstream = LinkSettings()
        assert await round_trip(reader, writer, b"c") < 0.4


async def test_bandwidth_cap_bounds_upstream_throughput(echo: EchoServer) -> None:
    capped = LinkSettings(bandwidth_bps=2_000_000)
    async with (
        WanProxy(HOST, 0, HOST, echo.port, seed=1, upstream=capped) as wan,
        connection(wan.port) as (reader, writer),
    ):
        payload = b"u" * 1_000_000
        start = time.monotonic()
        writer.write(payload)
        assert await asyncio.wait_for(reader.readexactly(len(payload)), TIMEOUT_S) == payload
        elapsed = time.monotonic() - start
    assert 0.45 <= elapsed < 2.0  # 0.5 s at the cap, less one 40 kB burst


async def test_bandwidth_cap_bounds_downstream_http_throughput() -> None:
    capped = LinkSettings(bandwidth_bps=2_000_000)
    async with (
        http_target() as target,
        WanProxy(HOST, 0, HOST, target.port, seed=1, downstream=capped) as wan,
        session() as client,
    ):
        url = f"http://{HOST}:{wan.port}/blob?size=1000000"
        start = time.monotonic()
        async with client.get(url) as response:
            body = await response.read()
        elapsed = time.monotonic() - start
    assert len(body) == 1_000_000
    assert 0.45 <= elapsed < 2.0


async def test_every_connection_reset_mid_upload_and_client_sees_an_error() -> None:
    always = LinkSettings(reset_probability=1.0, reset_after_bytes=(1000, 200_000))
    async with (
        http_target() as target,
        WanProxy(HOST, 0, HOST, target.port, seed=5, upstream=always) as wan,
        session() as client,
    ):
        for _ in range(3):
            with pytest.raises(aiohttp.ClientError):
                await post(client, f"http://{HOST}:{wan.port}/sink", b"d" * 500_000)
        stats = wan.stats()
    assert (stats.connections_accepted, stats.connections_reset) == (3, 3)
    # Exactly the planned bytes crossed: what a test subtracts to count bytes re-sent.
    planned = [plan_reset(5, i, UP, always) for i in range(3)]
    assert stats.bytes_upstream == sum(p for p in planned if p is not None)
    assert target.requests == 0


async def test_reset_reaches_a_raw_client_as_connection_reset(echo: EchoServer) -> None:
    always = LinkSettings(reset_probability=1.0, reset_after_bytes=(1000, 30_000))
    async with WanProxy(HOST, 0, HOST, echo.port, seed=2, downstream=always) as wan:
        async with connection(wan.port) as (reader, writer):
            with pytest.raises(ConnectionResetError):
                await round_trip(reader, writer, b"r" * 60_000)
        assert wan.stats().bytes_downstream == plan_reset(2, 0, DOWN, always)
        assert wan.stats().connections_reset == 1


async def one_echo(port: int, size: int) -> bool:
    """Send ``size`` bytes and read them back; False if the connection was reset."""
    try:
        async with connection(port) as (reader, writer):
            await round_trip(reader, writer, b"s" * size)
    except (ConnectionError, asyncio.IncompleteReadError):
        return False
    return True


async def test_thirty_percent_of_200_connections_reset_as_the_seed_plans(
    echo: EchoServer,
) -> None:
    # Every planned reset point (<= 4096) falls within the 4096 bytes each client sends.
    settings = LinkSettings(reset_probability=0.3, reset_after_bytes=(1, 4096))
    planned = sum(plan_reset(42, i, UP, settings) is not None for i in range(200))
    assert 40 <= planned <= 80  # 60 +- 3 sigma of Binomial(200, 0.3)
    async with WanProxy(HOST, 0, HOST, echo.port, seed=42, upstream=settings) as wan:
        outcomes: list[bool] = []
        for _ in range(8):  # 25 at a time: accept order varies, the planned count does not
            outcomes += await asyncio.gather(*(one_echo(wan.port, 4096) for _ in range(25)))
        stats = wan.stats()
    assert stats.connections_accepted == 200
    assert stats.connections_reset == planned == outcomes.count(False)


async def test_same_seed_same_sequence_same_resets(echo: EchoServer) -> None:
    settings = LinkSettings(reset_probability=0.5, reset_after_bytes=(1, 3000))

    async def run(seed: int) -> tuple[list[bool], int]:
        async with WanProxy(HOST, 0, HOST, echo.port, seed=seed, upstream=settings) as wan:
            outcomes = [await one_echo(wan.port, 3000) for _ in range(16)]
            return outcomes, wan.stats().bytes_upstream

    first, again, other = await run(9), await run(9), await run(10)
    assert first == again
    assert first != other
    plan = [plan_reset(9, i, UP, settings) for i in range(16)]
    assert first[0] == [p is None for p in plan]
    assert first[1] == sum(3000 if p is None else p for p in plan)


async def test_partition_times_out_http_and_heal_lets_new_requests_through() -> None:
    async with http_target() as target, WanProxy(HOST, 0, HOST, target.port, seed=1) as wan:
        url = f"http://{HOST}:{wan.port}/ping"
        wan.partition()
        assert wan.blackhole
        async with session(total=0.5) as client:
            with pytest.raises(TimeoutError):
                async with client.get(url) as response:
                    await response.read()
        assert target.requests == 0
        wan.heal()
        async with session() as client, client.get(url) as response:
            assert (response.status, await response.text()) == (200, "pong")


async def test_partition_holds_new_connections_away_from_the_target(echo: EchoServer) -> None:
    async with WanProxy(HOST, 0, HOST, echo.port, seed=1) as wan:
        wan.partition()
        async with connection(wan.port) as (reader, writer):
            writer.write(b"held")
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader.read(1), 0.3)
            assert echo.accepted == 0
            assert wan.stats().connections_open == 1
            wan.heal()  # the held connection now reaches the target and delivers its data
            assert await asyncio.wait_for(reader.readexactly(4), TIMEOUT_S) == b"held"
        assert echo.accepted == 1


async def test_partition_stalls_an_open_connection_and_heal_resumes_it(echo: EchoServer) -> None:
    async with WanProxy(HOST, 0, HOST, echo.port, seed=1) as wan:
        async with connection(wan.port) as (reader, writer):
            await round_trip(reader, writer, b"before")
            wan.partition()
            writer.write(b"during")
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader.read(1), 0.3)
            assert wan.stats().bytes_upstream == 6
            wan.heal()
            assert await asyncio.wait_for(reader.readexactly(6), TIMEOUT_S) == b"during"
            await round_trip(reader, writer, b"after")
        assert wan.stats().connections_reset == 0


async def test_partition_also_holds_data_already_in_flight(echo: EchoServer) -> None:
    async with (
        WanProxy(HOST, 0, HOST, echo.port, seed=1) as wan,
        connection(wan.port) as (reader, writer),
    ):
        await round_trip(reader, writer, b"warm")
        wan.downstream = LinkSettings(latency_s=0.2)
        writer.write(b"inflight")
        await asyncio.sleep(0.1)  # echoed, now waiting out its latency inside the proxy
        wan.partition()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(1), 0.4)
        assert wan.stats().bytes_downstream == 4
        wan.blackhole = False
        assert await asyncio.wait_for(reader.readexactly(8), TIMEOUT_S) == b"inflight"


async def test_heal_with_reset_existing_resets_open_and_held_connections(
    echo: EchoServer,
) -> None:
    async with WanProxy(HOST, 0, HOST, echo.port, seed=1) as wan:
        async with connection(wan.port) as (open_r, open_w):
            await round_trip(open_r, open_w, b"x")
            wan.partition()
            async with connection(wan.port) as (held_r, held_w):
                held_w.write(b"y")
                await eventually(lambda: wan.stats().connections_open == 2)  # accepted
                wan.heal(reset_existing=True)
                for reader in (open_r, held_r):
                    with pytest.raises(ConnectionResetError):
                        await asyncio.wait_for(reader.read(1), TIMEOUT_S)
        assert wan.stats().connections_reset == 2
        assert echo.accepted == 1


async def test_unreachable_target_resets_the_client() -> None:
    async with EchoServer() as gone:
        port = gone.port
    async with WanProxy(HOST, 0, HOST, port, seed=1) as wan:
        async with connection(wan.port) as (reader, _writer):
            with pytest.raises(ConnectionResetError):
                await asyncio.wait_for(reader.read(1), TIMEOUT_S)
        assert wan.stats().connect_failures == 1


async def test_stop_closes_every_connection_and_leaves_no_task(echo: EchoServer) -> None:
    before = asyncio.all_tasks()
    wan = WanProxy(HOST, 0, HOST, echo.port, seed=1, downstream=LinkSettings(latency_s=5))
    await wan.start()
    async with connection(wan.port) as (busy_r, busy_w):
        busy_w.write(b"q" * 10_000)  # echoed, then waiting out its 5 s latency in the proxy
        await asyncio.sleep(0.1)
        wan.partition()
        async with connection(wan.port) as (held_r, _held_w):
            await eventually(lambda: wan.stats().connections_open == 2)
            assert len(wan_tasks()) == 2 + 5  # two connections; one's four pumps and watcher
            await wan.stop()
            assert wan_tasks() == []
            for reader in (busy_r, held_r):
                assert await asyncio.wait_for(reader.read(), TIMEOUT_S) == b""
    assert wan.stats().connections_open == 0
    assert {t for t in asyncio.all_tasks() - before if t.get_name() != "echo"} == set()


async def test_lifecycle_misuse_is_refused(echo: EchoServer) -> None:
    wan = WanProxy(HOST, 0, HOST, echo.port, seed=1)
    with pytest.raises(WanProxyError, match="has not been started"):
        _ = wan.port
    async with wan:
        with pytest.raises(WanProxyError, match="starts once"):
            await wan.start()
    await wan.stop()  # idempotent
    with pytest.raises(InvalidSettings, match="expected LinkSettings"):
        wan.set_link(UP, {"latency_s": 1})  # type: ignore[arg-type]


async def test_buffer_bounds_in_flight_bytes_like_a_tcp_window(echo: EchoServer) -> None:
    # About one 64 kB window (plus the read in hand) per 0.1 s latency: 1 MB needs several
    # latencies; with the default 4 MiB window it would cross in about one.
    latency = LinkSettings(latency_s=0.1)
    payload = b"w" * 1_000_000
    async with (
        WanProxy(HOST, 0, HOST, echo.port, seed=1, upstream=latency, buffer_bytes=65_536) as wan,
        connection(wan.port) as (reader, writer),
    ):
        start = time.monotonic()
        writer.write(payload)
        await asyncio.wait_for(reader.readexactly(len(payload)), TIMEOUT_S)
        elapsed = time.monotonic() - start
    assert elapsed >= 0.5


# ---------------------------------------------------------------- as a process


async def refuses_bad_json(control_port: int) -> None:
    url = f"http://127.0.0.1:{control_port}"
    async with aiohttp.ClientSession() as client:
        async with client.post(url + "/links", data="{not json") as response:
            assert response.status == 400
            assert (await response.json())["error"] == "invalid_json"
        async with client.post(url + "/heal", json={"reset_existing": "yes"}) as response:
            assert response.status == 400
            assert "reset_existing" in (await response.json())["message"]


async def test_process_proxy_is_steered_live_over_its_control_endpoint(echo: EchoServer) -> None:
    async with wanproxy_process(echo.port, seed=4, both={"latency_s": 0.05}) as proc:
        control = proc.control
        state = await control.state()
        assert state["upstream"]["latency_s"] == 0.05
        assert state["blackhole"] is False
        async with connection(proc.port) as (reader, writer):
            assert await round_trip(reader, writer, b"hello") >= 0.1
            await control.set_links(upstream={"latency_s": 0.3})
            assert await round_trip(reader, writer, b"slower") >= 0.35
            await control.partition()
            writer.write(b"lost?")
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader.read(1), 0.5)
            await control.heal()
            assert await asyncio.wait_for(reader.readexactly(5), TIMEOUT_S) == b"lost?"
            with pytest.raises(ControlRefused, match=r"invalid_settings.*reset_probability"):
                await control.set_links(both={"latency_s": 0}, upstream={"reset_probability": 2})
            assert (await control.state())["upstream"]["latency_s"] == 0.3  # unchanged
            await refuses_bad_json(proc.control_port)
        stats = await control.stats()
        assert stats.bytes_upstream == stats.bytes_downstream == len(b"helloslowerlost?")
        assert stats.connections_accepted == 1


def test_process_refuses_bad_arguments_with_exit_code_2(capsys) -> None:
    argv = ["--listen", "127.0.0.1:0", "--target", "127.0.0.1:9", "--seed", "1"]
    for extra, message in [
        (["--up", "latency_s=-1"], "latency_s must be >= 0"),
        (["--both", "latency_s"], "--both takes NAME=VALUE"),
        (["--down", "bandwidth_bps=fast"], "is not JSON"),
    ]:
        with pytest.raises(SystemExit) as info:
            main(argv + extra)
        assert info.value.code == 2
        assert message in capsys.readouterr().err
