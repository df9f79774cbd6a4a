"""A whole federation, for real: Mosquitto with mTLS and ACLs, a coordinator and three
regional agents as processes (two gloo workers each), five rounds of the example task.

What it proves, end to end: a job that breaks a region's policy is refused with the rule
named; the global validation loss falls, evaluated by a region before it trains from each
θ and by the coordinator only for the last; every region trains each round from exactly
the parameters the coordinator announced (same hash); the bytes the coordinator received
are the bytes of the deltas it accepted; the audit chain verifies; ``/metrics`` counts
the rounds; an upload under another region's identity is refused and changes nothing.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from coordinator.state.audit import verify_chain
from geofed.pki import client_ssl_context, load_trust_bundle
from tests.support.federation import FederationRun, running_federation
from tests.support.observe import ControlObserver, audit_entries, sample

pytestmark = pytest.mark.integration

ROUNDS = 5


async def test_federation_trains_over_mosquitto_with_mtls(tmp_path: Path) -> None:
    async with (
        running_federation(
            tmp_path,
            rounds=ROUNDS,
            inner_steps=8,
            broker="mosquitto",
            start_agents=False,
            ranks=None,
        ) as fed,
        ControlObserver.with_certificate(fed).running() as observer,
    ):
        await _run_and_check(fed, observer)


async def _run_and_check(fed: FederationRun, observer: ControlObserver) -> None:
    # A job whose checkpoints could only be stored in the US breaks eu-west's and
    # ap-south's policies: refused at admission, with the deciding rule named.
    spec = fed.job_spec()
    us_only = {**spec, "job": "us-only", "checkpoint_storage": ["us-ckpt"]}
    status, body = await fed.submit(us_only)
    assert status == 403, body
    assert body["error"] == "policy_denied"
    assert re.search(r"(eu-west|ap-south):exports\.global_checkpoint\[1\]", body["message"])

    for region in fed.regions:
        await fed.start_agent(region)
    status, body = await fed.submit()
    assert status == 201, body

    final = await fed.wait_completed(timeout_s=420)
    history = {e["round"]: e["value"] for e in final["val_loss_history"]}
    assert set(history) == set(range(ROUNDS + 1))
    assert history[ROUNDS] < history[0] - 0.5, history

    # Every region trained each round from the parameters the coordinator announced.
    announced = {a.round: a.base_hash for a in observer.announcements if a.job == fed.job}
    assert set(announced) >= set(range(ROUNDS)), sorted(announced)
    reported: dict[tuple[int, str], set[str]] = defaultdict(set)
    for _, s in observer.statuses:
        if s.job == fed.job and s.round is not None and s.params_hash is not None:
            reported[(s.round, s.region)].add(s.params_hash)
    for round_ in range(ROUNDS):
        for region in fed.regions:
            assert reported[(round_, region)] == {announced[round_]}, (round_, region)

    # The coordinator counted the rounds, and received exactly the accepted deltas' bytes.
    metrics = await fed.metrics_text()
    assert sample(metrics, "geofed_rounds_completed_total", job=fed.job) == ROUNDS
    # θ_0..θ_{ROUNDS-1} were evaluated by a region on its workers before it trained from
    # them; the coordinator evaluated only the last parameters, in its evaluation process.
    evaluations = "geofed_evaluations_total"
    assert sample(metrics, evaluations, job=fed.job, where="region") == ROUNDS
    assert sample(metrics, evaluations, job=fed.job, where="coordinator") == 1
    entries = await audit_entries(fed)
    accepted = [e for e in entries if e.action == "delta.accept" and e.job == fed.job]
    assert len(accepted) == ROUNDS * len(fed.regions)
    uploaded = sum(int(e.details["size"]) for e in accepted)
    assert sample(metrics, "geofed_received_bytes_total", kind="model_delta") == uploaded
    # The job status adds up the same deltas from the durable receipts.
    deltas = final["deltas"]
    assert (deltas["accepted"], deltas["bytes"]) == (len(accepted), uploaded), deltas
    for region in fed.regions:
        assert deltas["regions"][region]["accepted"] == ROUNDS, deltas
    # ... which is far less than the fp32 deltas would weigh (int8: about 4x).
    fp32 = sample(metrics, "geofed_fp32_equivalent_bytes_total", direction="received")
    assert fp32 > 3.5 * uploaded, (fp32, uploaded)

    result = verify_chain(entries, start_seq=1)
    assert result.ok, result
    assert (await fed.get("/v1/audit?limit=1&verify=1"))["verify"]["ok"]

    await _forged_upload_changes_nothing(fed, final, len(entries))


async def _forged_upload_changes_nothing(
    fed: FederationRun, before: dict[str, Any], audit_count: int
) -> None:
    """us-east's certificate cannot upload eu-west's delta: 403, and nothing changes."""
    metrics_before = await fed.metrics_text()
    bundle = load_trust_bundle(fed.federation.trust_bundle)
    us_east = fed.federation.regions["us-east"]
    tls = client_ssl_context(bundle, us_east.cert, us_east.key)
    url = f"{fed.base}/v1/jobs/{fed.job}/rounds/{ROUNDS - 1}/deltas/eu-west/manifest"
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls)) as session,
        session.put(url, data=b'{"manifest": {}}') as response,
    ):
        assert response.status == 403
        assert (await response.json())["error"] == "forbidden"

    after = await fed.status()
    assert (after["round"], after["params_hash"], after["state"]) == (
        before["round"],
        before["params_hash"],
        before["state"],
    )
    metrics_after = await fed.metrics_text()
    rejected = "geofed_deltas_rejected_total"
    assert sample(metrics_after, rejected, code="forbidden") == (
        sample(metrics_before, rejected, code="forbidden") + 1
    )
    entries = await audit_entries(fed)
    accepted = [e for e in entries if e.action == "delta.accept"]
    assert len(accepted) == ROUNDS * len(fed.regions)
    assert len(entries) >= audit_count
