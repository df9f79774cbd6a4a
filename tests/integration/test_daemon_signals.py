"""Signals to the daemons as real processes: SIGHUP reloads, SIGKILL leaves no worker.

A real federation (embedded broker, coordinator and agents as ``python -m geofed_cli``
processes, mutual TLS) whose policies are a copy the test edits.

* SIGHUP: a policy file that no longer loads is refused by both daemons (logged, old
  policies kept, both keep running); then a policy that denies eu-west's deltas, a new
  ``log_level`` and a key that needs a restart: both log what they reloaded and what waits
  for a restart, the coordinator refuses a job it admitted before, and eu-west's agent
  refuses its next round under its own reloaded policy.
* SIGKILL of an agent: its elastic launcher and every worker are gone within seconds
  (the kernel's parent-death signal), although the launcher leads a session of its own
  (eu-west); and with the launcher killed first, the workers stop because their launcher
  is gone (us-east).

One federation holds both regions, with two ranks each: the reloads first, then, with
the job cancelled and the worker groups idle, the kills.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from geofed.api_paths import ApiPaths
from regional_agent.handoff.directory import HandoffDir
from regional_agent.launch.launcher import descendants
from tests.support.federation import EXAMPLES, FederationRun, running_federation
from tests.support.waiting import alive

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WAIT_S = 120.0
#: What is killed in each region, each process alone (not its process group): in us-east
#: the launcher first, so that no parent-death signal reaches its workers and they must
#: notice by themselves that their launcher is gone.
VICTIMS = {"eu-west": ("agent",), "us-east": ("launcher", "agent")}
#: How long the worker group may outlive its killed agent.
ORPHAN_DEADLINE_S = 15.0


def copy_policies(work: Path) -> Path:
    target = work / "policies"
    shutil.copytree(EXAMPLES / "policies", target)
    return target


def use_policies(policies: Path) -> Callable[[str, dict[str, Any]], None]:
    """Point the coordinator and the agents at ``policies``, the test's own copy."""

    def customize(name: str, data: dict[str, Any]) -> None:
        if name == "coordinator":
            data["policies_dir"] = str(policies)
        elif name.startswith("agent-"):
            data["policy"] = str(policies / f"{name.removeprefix('agent-')}.yaml")

    return customize


def deny_eu_west_deltas(policies: Path) -> None:
    path = policies / "eu-west.yaml"
    data = yaml.safe_load(path.read_text())
    data["exports"]["model_delta"] = [
        {"effect": "deny", "to": ["*"], "note": "eu-west deltas stay in eu-west for now"}
    ]
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def edit_config(path: Path, **changes: Any) -> None:
    data = yaml.safe_load(path.read_text())
    data.update(changes)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def log_text(fed: FederationRun, name: str) -> str:
    child = next(c for c in fed.children.children if c.name == name)
    return child.log_file.read_text(errors="replace")


async def wait_log(fed: FederationRun, name: str, text: str, *, count: int = 1) -> str:
    """Wait until ``name``'s log holds ``text`` ``count`` times; its processes checked."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        fed.children.check_alive()
        log = log_text(fed, name)
        if log.count(text) >= count:
            return log
        await asyncio.sleep(0.2)
    raise AssertionError(f"{name} never logged {text!r}\n{fed.log_tails(40)}")


def hangup(fed: FederationRun, name: str) -> None:
    child = next(c for c in fed.children.children if c.name == name)
    assert child.pid is not None
    os.kill(child.pid, signal.SIGHUP)


async def job_action(fed: FederationRun, action: str) -> None:
    """Pause, resume or cancel the federation's job as its operator."""
    async with fed.http.post(f"{fed.base}{ApiPaths.job_action(fed.job, action)}") as response:
        assert response.status == 200, f"{action}: {response.status} {await response.text()}"


async def region_entry(fed: FederationRun, region: str) -> dict[str, Any]:
    body = await fed.get("/v1/regions")
    return next(entry for entry in body["regions"] if entry["region"] == region)


async def test_sighup_reloads_and_a_killed_agent_leaves_no_worker_behind(
    tmp_path: Path,
) -> None:
    policies = copy_policies(tmp_path)
    async with running_federation(
        tmp_path / "fed",
        regions=tuple(VICTIMS),
        rounds=50,
        inner_steps=2,
        customize=use_policies(policies),
        ranks=None,
    ) as fed:
        await sighup_reloads_both_daemons_and_a_policy_change_takes_effect(fed, policies)
        await job_action(fed, "cancel")
        await fed.wait_for(
            lambda s: s.get("state") == "cancelled", timeout_s=WAIT_S, what="cancelled"
        )
        await a_killed_agent_leaves_no_worker_behind(fed)


async def sighup_reloads_both_daemons_and_a_policy_change_takes_effect(
    fed: FederationRun, policies: Path
) -> None:
    status, body = await fed.submit()
    assert status == 201, body
    await fed.wait_round(1, timeout_s=WAIT_S)
    good = (policies / "eu-west.yaml").read_text()

    # A policy file that no longer loads: refused, nothing changes, both keep running.
    (policies / "eu-west.yaml").write_text("region: eu-west\nexports: [[[\n")
    for name in ("coordinator", "agent-eu-west"):
        hangup(fed, name)
    for name in ("coordinator", "agent-eu-west"):
        log = await wait_log(fed, name, "configuration reload refused, nothing changed")
        assert "eu-west.yaml" in log
    (policies / "eu-west.yaml").write_text(good)
    round_before = int((await fed.status())["round"])
    await fed.wait_round(round_before + 1, timeout_s=WAIT_S)  # the old policies hold

    # Paused while the policies change: a round trained under the old policy and
    # uploaded after the coordinator's reload would wait out its deadline instead.
    await job_action(fed, "pause")
    await fed.wait_for(lambda s: s.get("state") == "paused", timeout_s=WAIT_S, what="paused")

    # Deny eu-west's deltas; a new log level; a key only a restart applies.
    deny_eu_west_deltas(policies)
    edit_config(fed.configs.coordinator, log_level="DEBUG")
    limits = yaml.safe_load(fed.configs.coordinator.read_text()).get("limits", {})
    edit_config(fed.configs.coordinator, limits={**limits, "max_job_spec_bytes": 4096})
    edit_config(fed.configs.agents["eu-west"], log_level="DEBUG")
    for name in ("coordinator", "agent-eu-west"):
        hangup(fed, name)
    log = await wait_log(fed, "coordinator", "configuration reloaded: policies (3 regions")
    assert "log level DEBUG" in log
    assert "need a restart" in log
    assert "limits.max_job_spec_bytes" in log
    log = await wait_log(fed, "agent-eu-west", "configuration reloaded: policy ")
    assert "log level DEBUG" in log

    # The coordinator decides under the new policies: the same job is refused now.
    spec = fed.job_spec()
    spec["job"] = "second-job"
    status, body = await fed.submit(spec)
    assert status == 403, body
    assert body["error"] == "policy_denied", body
    assert "eu-west" in body["message"], body

    # eu-west's agent refuses its next round under its own reloaded policy.
    await job_action(fed, "resume")
    deadline = time.monotonic() + WAIT_S
    entry: dict[str, Any] = {}
    while time.monotonic() < deadline:
        fed.children.check_alive()
        entry = await region_entry(fed, "eu-west")
        if "own policy" in str(entry.get("detail")):
            break
        await asyncio.sleep(0.5)
    else:
        raise AssertionError(f"eu-west never refused a round: {entry}\n{fed.log_tails()}")
    await wait_log(fed, "agent-eu-west", "refusing to export the delta")
    fed.children.check_alive()


async def ready_worker_pids(fed: FederationRun, region: str) -> list[int]:
    """The pids of the region's worker ranks once every one of them is ready."""
    handoff = HandoffDir(fed.work / "agents" / region / "workers")
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        fed.children.check_alive()
        statuses = handoff.read_rank_statuses()
        if len(statuses) > 1 and all(s.state == "ready" for s in statuses):
            return [s.pid for s in statuses]
        await asyncio.sleep(0.3)
    raise AssertionError(f"{region}'s worker group never came up\n{fed.log_tails()}")


async def a_killed_agent_leaves_no_worker_behind(fed: FederationRun) -> None:
    # Both groups up before any kill: a killed agent fails the harness's liveness check.
    ready_groups = {region: await ready_worker_pids(fed, region) for region in VICTIMS}
    for region, victims in VICTIMS.items():
        ready = ready_groups[region]
        workers_dir = fed.work / "agents" / region / "workers"
        launcher = int((workers_dir / "launcher.pid").read_text().split()[0])
        group = descendants([launcher]) | set(ready)
        agent = next(c for c in fed.children.children if c.name == f"agent-{region}")
        assert agent.pid is not None
        assert agent.pid not in group
        pids = {"agent": agent.pid, "launcher": launcher}

        left: set[int] = set()
        try:
            for victim in victims:
                os.kill(pids[victim], signal.SIGKILL)
            killed_at = time.monotonic()
            while time.monotonic() - killed_at < ORPHAN_DEADLINE_S:
                left = {pid for pid in group if alive(pid)}
                if not left:
                    break
                await asyncio.sleep(0.1)
            assert not left, f"{region}: {sorted(left)} outlived the killed {victims}"
            print(
                f"{region}: worker group gone {time.monotonic() - killed_at:.1f} s "
                f"after the SIGKILL of its {' and '.join(victims)}"
            )
        finally:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
