"""A spot notice (SIGTERM) mid-round: drain within the grace, or stop at a step boundary.

Two real agents (``python -m geofed_cli agent``, one gloo rank each) and a real
coordinator train a job whose inner steps take measurable time. Once both regions have
delivered round 0 (so each agent has measured its step time and delivery time), each
agent gets SIGTERM while it trains round 1:

- eu-west has the default grace (120 s): the rest of the round fits, so it finishes
  round 1, delivers it and exits 0 on its own;
- us-east has ``drain: {grace_s: 0}``: it stops at the next step at once, keeping the
  round's inner state at that step, exits 0 without delivering round 1, and, restarted,
  resumes round 1 at that step (not step 0) and delivers it.

Both then finish the job, every round trained from the θ the coordinator announced. Last,
a reference worker group trains us-east's round 1 uninterrupted from the same θ_1 and
regional checkpoint: its parameters hash exactly as those us-east delivered after the
resume.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import re
import shutil
import signal
from pathlib import Path

import pytest

from geofed.control.broker import EmbeddedBroker
from geofed.theta_chain import read_params
from geofed.theta_file import write_theta
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.messages import RoundInstruction
from regional_agent.launch.launcher import LocalElasticLauncher
from regional_agent.launch.worker_group import WorkerGroup, WorkerGroupConfig
from regional_agent.worker.inner_checkpoint import read_inner_checkpoint
from tests.support.agent_processes import (
    JOB,
    REGIONS,
    TIMEOUTS,
    ControlWatcher,
    agents,
)
from tests.support.coordinator import coordinator, job_yaml, write_setup
from tests.support.worker_group import launcher_config, wait_for_progress

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# 16 steps of 0.15 s: about 2.4 s of training a round, long enough to be hit mid-round.
SLOW_JOB = (
    job_yaml(JOB, rounds=3, deadline=40)
    .replace("options: {hidden: 8}", "options: {hidden: 8, step_delay_s: 0.15}")
    .replace("inner_steps: 2", "inner_steps: 16")
)


def accepted(watcher: ControlWatcher, region: str, round_: int) -> bool:
    """Whether ``region`` ever said its delta of ``round_`` was accepted."""
    return any(
        s.region == region
        and s.job == JOB
        and s.round == round_
        and s.detail.startswith("delta accepted")
        for s in watcher.statuses
    )


def keep_for_reference(workers: Path, reference: Path) -> RoundInstruction:
    """Copy round 1's θ, instruction and the regional checkpoint it started from."""
    handoff, copy = HandoffDir(workers), HandoffDir(reference)
    instruction = handoff.read_instruction(JOB, 1)
    reference.mkdir()
    base = reference / "theta-1.safetensors"  # written whole: the agent's chain moves on
    write_theta(base, read_params(instruction.base_params))
    copy.job_dir(JOB).mkdir(parents=True)
    shutil.copyfile(handoff.checkpoint_path(JOB), copy.checkpoint_path(JOB))
    record = handoff.read_checkpoint(JOB)
    assert record is not None
    assert record.optimizer_round is not None  # saved with the first round
    saved = handoff.optimizer_path(JOB, record.optimizer_round)
    shutil.copytree(saved, copy.optimizer_path(JOB, record.optimizer_round))
    # The residual the round's delta starts from: the agent's, as round 0 left it, a held
    # file naming the residual the ranks kept, which the stopped group wrote out.
    assert instruction.delta is not None
    feedback = reference / "feedback.pt"
    shutil.copyfile(instruction.delta.feedback, feedback)
    shutil.copyfile(handoff.held_residual_path(JOB), copy.held_residual_path(JOB))
    request = dataclasses.replace(instruction.delta, feedback=str(feedback))
    return dataclasses.replace(instruction, base_params=str(base), delta=request)


async def uninterrupted_params_hash(reference: Path, instruction: RoundInstruction) -> str:
    """What one gloo rank (the agent's workers) trains for ``instruction`` in one go."""
    launcher = LocalElasticLauncher(reference, launcher_config(nproc_per_node=1))
    group = WorkerGroup(reference, launcher, WorkerGroupConfig(start_timeout_s=120.0))
    await group.start()
    try:
        result = await group.run_round(instruction, 120)
    finally:
        await group.stop()
    assert "resuming" not in HandoffDir(reference).rank_log_path(0).read_text()
    return result.summary.params_hash


def training(watcher: ControlWatcher, region: str, round_: int) -> bool:
    status = watcher.latest(region)
    return (
        status is not None
        and status.job == JOB
        and status.round == round_
        and status.state == "training"
    )


async def test_a_spot_notice_finishes_the_round_in_the_grace_or_stops_at_a_step(
    tmp_path: Path,
) -> None:
    async with EmbeddedBroker(port=0) as broker:
        setup = write_setup(tmp_path, broker.port, timeouts=TIMEOUTS)
        watcher = ControlWatcher(broker.port)
        await watcher.start()
        try:
            no_grace = {"us-east": "drain: {grace_s: 0}\n"}
            async with (
                coordinator(setup) as running,
                agents(setup, running.port, no_grace) as group,
            ):

                def ready() -> bool:
                    latest = [watcher.latest(r) for r in REGIONS]
                    return all(s is not None and s.detail == "ready" for s in latest)

                await watcher.until(ready, 90, "both agents to start their worker groups")
                operator = running.session(setup.operator)
                async with operator.post("/v1/jobs", data=SLOW_JOB.encode()) as answer:
                    assert answer.status == 201, await answer.text()
                # Ever said, not said last: the region that delivers first may already
                # report round 1 when the other's delivery closes round 0.
                await watcher.until(
                    lambda: all(accepted(watcher, r, 0) for r in REGIONS), 90, "round 0"
                )

                us_workers = setup.root / "agents" / "us-east" / "workers"

                async def notice(region: str) -> None:
                    """SIGTERM ``region``'s agent as soon as it says it trains round 1
                    (us-east: a few steps in, so there is inner state to keep)."""
                    await watcher.until(
                        functools.partial(training, watcher, region, 1), 30, f"{region} training 1"
                    )
                    if region == "us-east":
                        await wait_for_progress(HandoffDir(us_workers), JOB, 1, 2)
                    group.procs[region].send_signal(signal.SIGTERM)

                await asyncio.gather(*(notice(r) for r in REGIONS))

                # eu-west finishes round 1 in its grace; us-east stops at once.
                codes = await asyncio.wait_for(
                    asyncio.gather(*(group.procs[r].wait() for r in REGIONS)), 60
                )
                assert codes == [0, 0]
                eu_log, us_log = group.log("eu-west"), group.log("us-east")
                assert "drain on SIGTERM: job tiny round 1: finishing" in eu_log, eu_log[-4000:]
                # The status reporter publishes the latest status only, so the delivery
                # between the notice and the goodbye is read from the agent's log.
                after_notice = eu_log.split("drain on SIGTERM", 1)[1]
                assert "delta accepted" in after_notice, after_notice
                assert "drain on SIGTERM: job tiny round 1: no drain grace" in us_log, us_log[
                    -4000:
                ]
                assert "delta accepted" not in us_log.split("drain on SIGTERM", 1)[1]
                assert not accepted(watcher, "us-east", 1)
                # eu-west finished its round: no inner state to keep. us-east kept round
                # 1's at the step it stopped before.
                eu_workers = setup.root / "agents" / "eu-west" / "workers"
                assert not HandoffDir(eu_workers).inner_checkpoint_path(JOB).exists()
                kept = read_inner_checkpoint(HandoffDir(us_workers).inner_checkpoint_path(JOB))
                assert kept is not None
                assert (kept.identity.job, kept.identity.round) == (JOB, 1)
                assert 0 < kept.step < 16, kept.step
                reference = keep_for_reference(us_workers, tmp_path / "reference")
                us_rank_log = HandoffDir(us_workers).rank_log_path(0)
                log_offset = us_rank_log.stat().st_size

                # Restarted, us-east resumes round 1 (eu-west rejoins) and the job ends.
                for region in REGIONS:
                    await group.start(region)
                await watcher.until(
                    lambda: accepted(watcher, "us-east", 1),
                    90,
                    "us-east to deliver the round it stopped",
                )
                await watcher.until(
                    lambda: all(accepted(watcher, r, 2) for r in REGIONS),
                    90,
                    "both regions to deliver round 2",
                )
        finally:
            await watcher.stop()

    # us-east resumed round 1 where it stopped, and delivered what an uninterrupted
    # round trains, bit for bit (the hash is of the quantized delta's bytes).
    since = us_rank_log.read_text()[log_offset:]
    assert f"job {JOB} round 1: resuming at step {kept.step} of 16" in since, since
    published = re.findall(rf"job {JOB} round 1: 16 steps, .*, params ([0-9a-f]+)", since)
    assert len(published) == 1, since
    assert published[0] == await uninterrupted_params_hash(tmp_path / "reference", reference)
    assert not HandoffDir(us_workers).inner_checkpoint_path(JOB).exists()

    announced = {
        a.round: a.base_hash for a in watcher.announcements if a.job == JOB and a.state == "open"
    }
    assert sorted(announced) == [0, 1, 2]
    for round_, base in announced.items():
        for region in REGIONS:
            seen = {
                s.params_hash
                for s in watcher.statuses
                if s.region == region and s.job == JOB and s.round == round_ and s.params_hash
            }
            # Every round, the retrained one included, trained from the announced θ_r.
            assert seen == {base}, (region, round_, seen)
