"""Two real agents and a real coordinator train a job end to end over loopback.

The embedded MQTT broker runs in the test's event loop, the coordinator is served in it
on an ephemeral port with real TLS (``tests/support/coordinator.py``),
and each agent is a ``python -m geofed_cli agent`` subprocess with its own worker group
(one gloo rank, the tiny task). The test watches the regions' retained statuses and the
round announcements, submits a three-round job as an operator, kills one agent after
its first delivery and starts it again, drains the other at the end, and checks that
both regions trained every round from the parameters the coordinator announced.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from geofed.control import (
    Command,
    Topics,
    encode,
)
from geofed.control.broker import EmbeddedBroker
from geofed.training_config import LrSchedule, TrainingConfig
from tests.support.agent_processes import (
    JOB,
    REGIONS,
    TIMEOUTS,
    ControlWatcher,
    agents,
    delivered,
)
from tests.support.coordinator import (
    FEDERATION,
    HTTP_TIMEOUT,
    coordinator,
    job_yaml,
    write_setup,
)
from tests.support.waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Carried to the regions by every announcement; each delta's manifest must record it,
# or the coordinator refuses the delta.
TRAINING = TrainingConfig(
    grad_clip_norm=1.0,
    lr_schedule=LrSchedule(kind="warmup_cosine", warmup_steps=2, min_lr_ratio=0.5),
)
TRAINING_YAML = (
    "training: {grad_clip_norm: 1.0, "
    "lr_schedule: {kind: warmup_cosine, warmup_steps: 2, min_lr_ratio: 0.5}}\n"
)


async def test_two_agents_train_a_job_through_an_agent_crash(tmp_path: Path) -> None:
    async with EmbeddedBroker(port=0) as broker:
        setup = write_setup(tmp_path, broker.port, timeouts=TIMEOUTS)
        watcher = ControlWatcher(broker.port)
        await watcher.start()
        try:
            async with coordinator(setup) as running, agents(setup, running.port) as group:

                def ready() -> bool:
                    latest = [watcher.latest(r) for r in REGIONS]
                    return all(s is not None and s.detail == "ready" for s in latest)

                await watcher.until(ready, 90, "both agents to start their worker groups")
                operator = running.session(setup.operator)
                spec = job_yaml(JOB, rounds=3, extra=TRAINING_YAML)
                async with operator.post("/v1/jobs", data=spec.encode()) as answer:
                    assert answer.status == 201, await answer.text()

                # us-east dies (SIGKILL: no goodbye) right after delivering round 0, and
                # comes back: the broker publishes its Last Will, the old worker group stops
                # (its launcher gets the parent-death signal; the new agent reaps whatever
                # is left), the new agent resumes from its state directory and joins
                # round 1 before the deadline.
                await watcher.until(lambda: delivered(watcher, "us-east", 0), 60, "round 0")
                group.procs["us-east"].kill()
                assert await group.procs["us-east"].wait() == -signal.SIGKILL
                await watcher.until(
                    lambda: (s := watcher.latest("us-east")) is not None and s.state == "offline",
                    10,
                    "the Last Will of the killed agent",
                )
                await group.start("us-east")
                # While the job runs (round 2 waits for us-east), a checkpoint ask (a
                # hardware risk) is left for eu-west's workers, the agent running on.
                topic = Topics(FEDERATION).region_commands("eu-west")
                ask = Command(action="checkpoint", job=JOB, round=7, reason="hardware risk")
                await watcher.client.publish(topic, encode(ask))
                asked = setup.root / "agents" / "eu-west" / "workers" / "jobs" / JOB
                await eventually(lambda: (asked / "checkpoint-asked").is_file(), timeout_s=30)
                assert (asked / "checkpoint-asked").read_text() == "7\n"

                await watcher.until(
                    lambda: all(delivered(watcher, r, 2) for r in REGIONS),
                    90,
                    "both regions to deliver round 2",
                )
                async with asyncio.timeout(30):
                    while True:
                        async with operator.get(f"/v1/jobs/{JOB}", timeout=HTTP_TIMEOUT) as answer:
                            job = await answer.json()
                        if job["state"] != "running":
                            break
                        await asyncio.sleep(0.2)
                # The job's files (the ask among them) went with it; a drained agent
                # finishes what it does and exits 0.
                await eventually(lambda: not (asked / "checkpoint-asked").exists(), timeout_s=30)
                assert group.procs["eu-west"].returncode is None
                drain = Command(action="drain", reason="maintenance")
                await watcher.client.publish(topic, encode(drain))
                assert await asyncio.wait_for(group.procs["eu-west"].wait(), 30) == 0
                assert group.procs["us-east"].returncode is None
                restarted_log = group.log("us-east")
            await watcher.until(
                lambda: all(s.state == "offline" for s in map(watcher.latest, REGIONS) if s),
                10,
                "the agents' offline goodbye",
            )
        finally:
            await watcher.stop()

    # A group of its own: the old one stopped by itself or was reaped at this start.
    assert restarted_log.count("started worker group launch") >= 2
    announced = {
        a.round: a.base_hash for a in watcher.announcements if a.job == JOB and a.state == "open"
    }
    assert sorted(announced) == [0, 1, 2]
    opened = [a for a in watcher.announcements if a.job == JOB and a.state == "open"]
    assert {(a.training, a.total_rounds) for a in opened} == {(TRAINING, 3)}
    for round_ in announced:
        seen = {
            region: {
                s.params_hash
                for s in watcher.statuses
                if s.region == region and s.job == JOB and s.round == round_ and s.params_hash
            }
            for region in REGIONS
        }
        # Each region trained round r from exactly the θ_r the coordinator announced.
        assert seen == {region: {announced[round_]} for region in REGIONS}, (round_, seen)
    losses = [s.train_loss for s in watcher.statuses if s.job == JOB and s.train_loss is not None]
    assert losses
    assert job["state"] == "completed"
    assert job["round"] == 3
    assert [s for s in watcher.statuses if s.state == "error"] == []
