"""A region joins a running job and another leaves it, with real processes.

A coordinator and three agents (embedded broker, mTLS HTTPS). The job is submitted on
eu-west and us-east with ``max_regions: 3``. An operator adds ap-south (with the CLI):
the round in progress keeps its participants, ap-south takes data shard 2 from the next
round, trains from the job's latest θ, and its deltas are accepted; eu-west and us-east
keep shards 0 and 1. Then eu-west is removed: later rounds run without it, and the
others keep their shards, also across a coordinator restart. Removing one more (below
``min_regions``), adding a region whose dataset its policy forbids there (residency), and
adding beyond ``max_regions`` are refused, audited, and change nothing. The job completes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.federation import FederationRun, operator_cli, running_federation
from tests.support.observe import audit_entries

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# The job must outlast the operator calls below: the refusals come by about round 7 and
# the coordinator's restart by about round 10 on a busy machine (a quiet one trains more
# rounds in that time, hence the margin); later rounds only show that the restarted
# coordinator runs on the durable assignment.
ROUNDS = 32
REGIONS = ("eu-west", "us-east", "ap-south")
DATASETS = {
    "eu-west": ["eu-parliament-proceedings"],
    "us-east": ["us-public-domain-books"],
    "ap-south": ["in-indic-wikipedia"],
}


async def change(fed: FederationRun, job: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    url = f"{fed.base}/v1/jobs/{job}/regions"
    async with fed.http.post(url, json=body) as response:
        return response.status, await response.json()


def shards_of(status: dict[str, Any]) -> dict[str, int] | None:
    current = status.get("current") or {}
    shards: dict[str, int] | None = current.get("shards")
    return shards


async def test_regions_join_and_leave_a_running_job(tmp_path: Path) -> None:
    async with running_federation(tmp_path, regions=REGIONS, rounds=ROUNDS, inner_steps=3) as fed:
        spec = {
            **fed.job_spec(),
            "regions": {r: DATASETS[r] for r in ("eu-west", "us-east")},
            "min_regions": 2,
            "max_regions": 3,
            "snapshot_every": 2,
        }
        status, body = await fed.submit(spec)
        assert status == 201, body
        job = spec["job"]
        first = await fed.wait_round(1)
        assert first["shards"]["assignment"] == {"eu-west": 0, "us-east": 1}
        assert first["shards"]["count"] == 3

        # Join, with the CLI. The round in progress keeps its participants.
        before = await fed.status()
        joined = await operator_cli(
            fed,
            "job",
            "regions",
            job,
            "--add",
            "ap-south",
            "--datasets",
            DATASETS["ap-south"][0],
            "--json",
        )
        assert joined.returncode == 0, joined.stderr
        answer = json.loads(joined.stdout)
        assert "joins" in answer["reason"], answer
        # The reason says when it takes effect, as "effective" does.
        when = {"now": ", now (", "next_round": ", from the next round boundary ("}
        assert when[answer["effective"]] in answer["reason"], answer
        assert answer["slot"] == 2, answer
        kept = answer["round_in_progress"]
        assert kept is None or kept >= before["round"], answer
        # A round on ap-south (its deltas are checked in the audit log below).
        grown = await fed.wait_for(
            lambda s: "ap-south" in (s.get("current") or {}).get("participants", []),
            timeout_s=120,
            what="a round on ap-south",
        )
        assert shards_of(grown) == {"eu-west": 0, "us-east": 1, "ap-south": 2}, grown
        assert grown["shards"]["assignment"] == {"eu-west": 0, "us-east": 1, "ap-south": 2}
        shown = await operator_cli(fed, "job", "status", job)
        assert "ap-south 2, eu-west 0, us-east 1" in shown.stdout, shown.stdout

        # Adding a region twice is refused.
        status, body = await change(fed, job, {"add": "ap-south", "datasets": ["x"]})
        assert (status, body.get("refusal")) == (409, "already_member"), body

        # Leave: later rounds run without eu-west; nobody else's shard moves.
        status, body = await change(fed, job, {"remove": "eu-west"})
        assert status == 202, body
        assert body["shards"]["next"] == {"us-east": 1, "ap-south": 2}, body
        removed_at = body["round_in_progress"]  # eu-west still delivers it
        # Any phase: rounds take well under a second here, and the job may even have
        # run its last round by the time this looks.
        shrunk = await fed.wait_for(
            lambda s: (
                s.get("current") is not None and "eu-west" not in s["current"]["participants"]
            ),
            timeout_s=120,
            what="a round without eu-west",
        )
        assert shards_of(shrunk) == {"us-east": 1, "ap-south": 2}, shrunk
        assert shrunk["shards"]["left"] == ["eu-west"]

        # Refusals change nothing and are audited.
        status, body = await change(fed, job, {"remove": "us-east"})
        assert (status, body.get("refusal")) == (409, "min_regions"), body
        status, body = await change(fed, job, {"add": "eu-west", "datasets": ["in-news-articles"]})
        assert (status, body["error"]) == (403, "policy_denied"), body
        assert "in-news-articles" in body["message"], body
        status, body = await change(fed, job, {"add": "mars-1", "datasets": ["x"]})
        assert (status, body.get("refusal")) == (404, "unknown_region"), body
        status, body = await change(fed, job, {"add": "eu-west"})
        assert status == 400, body
        status, body = await change(fed, "no-such-job", {"remove": "eu-west"})
        assert status == 404, body
        assert (await fed.status())["shards"]["next"] == {"us-east": 1, "ap-south": 2}

        # Over max_regions: a job that stays queued (its needs never fit), on its 2 slots.
        beta = {**spec, "job": "beta", "max_regions": 2, "needs": {"cpu_slots": 99}}
        status, body = await fed.submit(beta)
        assert (status, body["state"]) == (201, "queued"), body
        status, body = await change(fed, "beta", {"add": "ap-south", "datasets": ["x"]})
        assert (status, body.get("refusal")) == (409, "max_regions"), body
        code, output = await cli_cancel(fed, "beta")
        assert code == 0, output

        # The assignment is durable: a restarted coordinator runs on it.
        await fed.kill("coordinator")
        await fed.restart("coordinator")
        restarted = await fed.status()
        assert restarted["shards"]["next"] == {"us-east": 1, "ap-south": 2}, restarted
        assert restarted["shards"]["left"] == ["eu-west"]

        final = await fed.wait_completed(timeout_s=180)
        assert final["state"] == "completed"
        assert shards_of(final) in (None, {"us-east": 1, "ap-south": 2}), final

        entries = await audit_entries(fed, job=job)
        accepted = [
            (e.round, e.region)
            for e in entries
            if e.action == "delta.accept" and e.round is not None
        ]
        ap_rounds = sorted(r for r, region in accepted if region == "ap-south")
        eu_rounds = sorted(r for r, region in accepted if region == "eu-west")
        assert ap_rounds, accepted
        # From the round after the one in progress (else from the next one opened).
        assert min(ap_rounds) == (kept + 1 if kept is not None else min(ap_rounds)), accepted
        assert min(ap_rounds) >= before["round"], accepted
        assert ap_rounds[-1] == ROUNDS - 1, accepted  # it trained to the end
        assert eu_rounds, accepted
        if removed_at is not None:
            assert max(eu_rounds) == removed_at, (removed_at, accepted)
        changes = [e for e in entries if e.action == "job.regions"]
        verdicts = [(e.verdict, e.region, e.details["action"]) for e in changes]
        assert verdicts[:2] == [("allow", "ap-south", "add"), ("deny", "ap-south", "add")]
        assert ("allow", "eu-west", "remove") in verdicts
        assert ("deny", "us-east", "remove") in verdicts
        denied = [e for e in changes if e.verdict == "deny" and e.region == "eu-west"]
        assert denied, changes
        assert "in-news-articles" in denied[0].details["reason"], denied
        beta_changes = [
            e for e in await audit_entries(fed, job="beta") if e.action == "job.regions"
        ]
        assert [e.verdict for e in beta_changes] == ["deny"]
        assert "max_regions" in beta_changes[0].details["reason"]


async def cli_cancel(fed: FederationRun, job: str) -> tuple[int, str]:
    done = await operator_cli(fed, "job", "cancel", job)
    return done.returncode, done.stdout + done.stderr
