"""Timeout hierarchy validation and the one waiting helper."""

import asyncio
import gc
import warnings
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from geofed.timeouts import Timeout, Timeouts, wait_event, wait_for


def test_defaults_nest() -> None:
    t = Timeouts()
    assert t.heartbeat_s < t.request_s < t.upload_s < t.round_deadline_s
    assert t.connect_s <= t.request_s
    assert t.request_s < t.download_s < t.round_deadline_s


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"upload_s": 30, "request_s": 60}, "upload_s (30) must be greater than request_s (60)"),
        ({"heartbeat_s": 30}, "request_s (30) must be greater than heartbeat_s (30)"),
        ({"round_deadline_s": 200}, "round_deadline_s (200) must be greater than upload_s (300)"),
        (
            {"download_s": 2000},
            "round_deadline_s (1800) must be greater than download_s (2000)",
        ),
        ({"download_s": 20}, "download_s (20) must be greater than request_s (30)"),
        ({"connect_s": 31}, "connect_s (31) must be at most request_s (30)"),
    ],
)
def test_inconsistent_hierarchy_names_the_wrong_bound(fields, message) -> None:
    with pytest.raises(ValidationError) as info:
        Timeouts.model_validate(fields)
    assert message in str(info.value)


def test_every_wrong_bound_is_reported_at_once() -> None:
    with pytest.raises(ValidationError) as info:
        Timeouts(heartbeat_s=40, upload_s=2000)
    text = str(info.value)
    assert "request_s (30) must be greater than heartbeat_s (40)" in text
    assert "round_deadline_s (1800) must be greater than upload_s (2000)" in text


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"request_s": 0}, "greater than 0"),
        ({"upload_s": float("inf")}, "finite number"),
        ({"heartbeat_s": "soon"}, "valid number"),
        ({"keepalive_s": 5}, "Extra inputs are not permitted"),
    ],
)
def test_malformed_values_are_refused(fields, needle) -> None:
    with pytest.raises(ValidationError, match=needle):
        Timeouts.model_validate(fields)


@given(st.lists(st.floats(0.01, 1e5), min_size=6, max_size=6))
def test_accepted_exactly_when_the_hierarchy_holds(values) -> None:
    connect, heartbeat, request, upload, download, deadline = values
    fields = dict(
        zip(
            ["connect_s", "heartbeat_s", "request_s", "upload_s", "download_s", "round_deadline_s"],
            values,
            strict=True,
        )
    )
    nests = (
        connect <= request
        and heartbeat < request < min(upload, download)
        and max(upload, download) < deadline
    )
    if nests:
        assert Timeouts.model_validate(fields).upload_s == upload
    else:
        with pytest.raises(ValidationError, match="inconsistent timeouts"):
            Timeouts.model_validate(fields)


async def test_wait_for_returns_the_result() -> None:
    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    assert await wait_for(answer(), 1.0, "answer") == 42


async def test_wait_for_names_what_timed_out_and_cancels_it() -> None:
    cancelled = asyncio.Event()

    async def slow_upload() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(Timeout) as info:
        await wait_for(slow_upload(), 0.02, "upload of delta r5/eu-west")
    assert str(info.value) == "upload of delta r5/eu-west timed out after 0.02 s"
    assert info.value.what == "upload of delta r5/eu-west"
    assert info.value.timeout_s == 0.02
    assert isinstance(info.value, TimeoutError)
    assert info.value.__cause__ is None
    assert cancelled.is_set()


async def test_nested_shorter_wait_keeps_its_name() -> None:
    async def inner() -> None:
        await wait_for(asyncio.sleep(60), 0.01, "chunk 3")

    with pytest.raises(Timeout, match=r"^chunk 3 timed out after 0.01 s$"):
        await wait_for(inner(), 5.0, "whole upload")


async def test_outer_wait_names_itself_when_it_expires_first() -> None:
    async def inner() -> None:
        await wait_for(asyncio.sleep(60), 5.0, "chunk 3")

    with pytest.raises(Timeout, match=r"^whole upload timed out after 0.02 s$"):
        await wait_for(inner(), 0.02, "whole upload")


async def test_foreign_timeout_inside_becomes_a_timeout_for_the_wait() -> None:
    async def socket_read() -> None:
        raise TimeoutError("read timed out")

    with pytest.raises(Timeout, match=r"^broker connect timed out after 5 s$") as info:
        await wait_for(socket_read(), 5.0, "broker connect")
    assert isinstance(info.value.__cause__, TimeoutError)


async def test_other_errors_pass_through() -> None:
    async def refused() -> None:
        raise ConnectionRefusedError("no broker")

    with pytest.raises(ConnectionRefusedError, match="no broker"):
        await wait_for(refused(), 1.0, "broker connect")


async def test_caller_cancellation_is_not_a_timeout() -> None:
    task = asyncio.ensure_future(wait_for(asyncio.sleep(60), 30.0, "download"))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan"), float("inf")])
async def test_bad_timeout_is_refused_without_leaking_the_coroutine(timeout_s) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="timeout for upload must be a positive number"):
            await wait_for(asyncio.sleep(0), timeout_s, "upload")
        gc.collect()  # a never-awaited coroutine would warn here


async def test_wait_event_says_whether_the_event_came() -> None:
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    asyncio.get_running_loop().call_soon(event.set)
    assert await wait_event(event, 5.0) is True
    assert await wait_event(event, None) is True  # already set: at once


async def test_a_loop_cancelled_as_its_event_is_set_ends() -> None:
    # The race that left a coordinator's admission loop running after its shutdown had
    # cancelled it: the event's waiter finishes in the loop turn the cancellation arrives
    # in. asyncio.wait_for on Python 3.11 then returns the result instead, the loop goes
    # round again, and the task never ends.
    for timeout_s in (None, 10.0):
        event = asyncio.Event()

        async def loop(event: asyncio.Event = event, timeout_s: float | None = timeout_s) -> None:
            while True:
                await wait_event(event, timeout_s)
                event.clear()

        task = asyncio.create_task(loop())
        await asyncio.sleep(0)  # waiting now
        event.set()
        await asyncio.sleep(0)  # the event's own waiter has run
        task.cancel()
        await asyncio.wait([task], timeout=2.0)
        assert task.cancelled()


def test_no_daemon_waits_with_asyncio_wait_for() -> None:
    root = Path(__file__).resolve().parents[2]
    offenders = [
        f"{path.relative_to(root)}:{number}"
        for package in ("geofed", "geofed_cli", "coordinator", "regional_agent", "policies")
        for path in sorted((root / package).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "asyncio.wait_for(" in line
    ]
    assert offenders == [], "use geofed.timeouts.wait_for / wait_event or asyncio.timeout"
