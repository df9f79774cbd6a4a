"""The region's status record: what it says, how it changes, and the offline goodbye."""

from __future__ import annotations

from typing import Any, cast

import pytest

from geofed.control import ControlClient, HardwareSummary, RegionStatus, Topics, decode
from regional_agent.status import AGENT_VERSION, StatusReporter

TOPICS = Topics("acme")


def reporter() -> StatusReporter:
    # Never started: these tests publish nothing.
    control = ControlClient("127.0.0.1", 1, client_id="region.eu-west")
    return StatusReporter(control, TOPICS, "eu-west", interval_s=1.0, timeout_s=1.0)


def test_fields_persist_and_the_detail_resets() -> None:
    status = reporter()
    status.update("training", job="llm", round=3, params_hash="ab" * 32, detail="50 steps")
    status.update("uploading", train_loss=2.5)
    current = status.current(worker_restarts=2)
    assert (current.state, current.job, current.round) == ("uploading", "llm", 3)
    assert current.params_hash == "ab" * 32
    assert current.train_loss == 2.5
    assert current.detail == ""
    assert current.worker_restarts == 2
    assert current.agent_version == AGENT_VERSION
    assert status.state == "uploading"


def test_a_diverged_loss_is_reported_in_words() -> None:
    status = reporter()
    status.update("error", job="llm", round=1, train_loss=float("nan"), detail="diverged")
    current = status.current()
    assert current.train_loss is None
    assert current.detail == "diverged (train loss nan)"


def test_unknown_fields_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown status fields"):
        reporter().update("online", colour="green")


def test_the_goodbye_is_a_retained_offline_status() -> None:
    goodbye = reporter().offline("stopped")
    assert goodbye.topic == TOPICS.region_status("eu-west")
    assert goodbye.retain
    message = decode(goodbye.payload, RegionStatus)
    assert (message.region, message.state, message.detail) == ("eu-west", "offline", "stopped")


class Publishes:
    """Stands in for the MQTT client (an outer edge): keeps what would be published."""

    def __init__(self) -> None:
        self.sent: list[RegionStatus] = []

    async def publish(self, topic: str, payload: bytes, **options: object) -> None:
        self.sent.append(decode(payload, RegionStatus))


async def test_each_run_numbers_its_statuses() -> None:
    first, second = Publishes(), Publishes()
    for fake in (first, second):
        status = StatusReporter(cast(Any, fake), TOPICS, "eu-west", interval_s=1.0, timeout_s=1.0)
        for state in ("online", "training", "uploading"):
            status.update(state)
            await status.publish_now()
    assert [s.seq for s in first.sent] == [1, 2, 3]
    assert len({s.boot for s in first.sent}) == 1
    assert {s.boot for s in second.sent} != {s.boot for s in first.sent}


def test_a_refusal_is_said_for_the_status_that_carries_it_only() -> None:
    status = reporter()
    status.update("error", job="llm", round=0, refused=True, detail="no such dataset here")
    assert status.current().refused
    status.update("online", job="llm")
    assert not status.current().refused


async def test_each_status_carries_the_nodes_hardware_as_last_read() -> None:
    readings: list[HardwareSummary | None] = [
        HardwareSummary(host="gpu-node-1", gpus=8, gpu_utilization=0.9),
        None,  # nothing new (a driver still busy): the last reading stays
    ]

    async def hardware() -> HardwareSummary | None:
        if not readings:
            raise OSError("/proc is gone")
        return readings.pop(0)

    fake = Publishes()
    status = StatusReporter(
        cast(Any, fake), TOPICS, "eu-west", interval_s=1.0, timeout_s=1.0, hardware=hardware
    )
    for _ in range(3):  # the third reading fails: the status goes out all the same
        await status.publish_now()
    assert [s.hardware for s in fake.sent] == [
        HardwareSummary(host="gpu-node-1", gpus=8, gpu_utilization=0.9)
    ] * 3
    # Without a reader (and in the Last Will) there is none.
    assert reporter().current().hardware is None
