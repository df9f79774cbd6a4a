"""The standby's read-only app over real HTTP, on a real SQLite state store.

In insecure loopback mode (callers named by header) so that it runs in-process: reads and
``/metrics`` by the leader's role rules, everything else and a store that cannot be read
answered ``503 standby`` naming the leader. TLS and the takeover are covered with real
coordinator processes in ``test_coordinator_failover.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from coordinator.api.auth import IDENTITY_HEADER
from coordinator.api.standby import create_standby_app
from coordinator.config import load_config
from coordinator.jobs.spec import parse_job_spec
from coordinator.runtime import load_runtime
from coordinator.state.sqlite import SqliteStore
from coordinator.state.store import Store, StoreFailure
from tests.support.coordinator import FEDERATION, job_yaml, write_setup

pytestmark = pytest.mark.integration

LEADER = "spiffe://acme/coordinator/main@host-a:4242"


@dataclass
class Lease:
    leader: str = LEADER
    standby_reason: str = f"{LEADER} leads (token 3) for another 2.0 s unless it renews"


async def _client(tmp_path: Path, opener: Callable[[], Store]) -> TestClient[Any, Any]:
    setup = write_setup(tmp_path, 1883, insecure=True)
    runtime = load_runtime(load_config(setup.config_path))
    client: TestClient[Any, Any] = TestClient(
        TestServer(create_standby_app(runtime, Lease(), opener=opener))
    )
    await client.start_server()
    return client


@pytest.fixture
async def standby(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    state = tmp_path / "shared-state"
    store = SqliteStore.in_state_dir(state)
    store.create_job("tiny", parse_job_spec(job_yaml(), "job.yaml").to_json(), "running")
    store.set_pointer("tiny", "version", "0")
    store.record_receipt("tiny", 0, "us-east", "a" * 64, "b" * 64, 1000, 512)
    store.record_receipt("tiny", 0, "eu-west", "c" * 64, "d" * 64, 2000, 256)
    store.close()
    client = await _client(tmp_path, lambda: SqliteStore.in_state_dir(state))
    yield client
    await client.close()


def who(role_name: str) -> dict[str, str]:
    return {IDENTITY_HEADER: f"spiffe://{FEDERATION}/{role_name}"}


async def answer(
    client: TestClient[Any, Any], method: str, path: str, caller: str
) -> tuple[int, dict[str, Any]]:
    response: aiohttp.ClientResponse = await client.request(method, path, headers=who(caller))
    return response.status, await response.json()


async def test_reads_follow_the_leaders_role_rules(standby: TestClient[Any, Any]) -> None:
    status, body = await answer(standby, "GET", "/v1/jobs/tiny", "observer/grafana")
    assert (status, body["state"], body["round"], body["served_by"]) == (
        200,
        "running",
        0,
        "standby",
    )
    assert body["spec"]["job"] == "tiny"
    # The accepted deltas, as the leader shows them to readers: from the durable receipts.
    assert body["deltas"] == {
        "accepted": 2,
        "bytes": 3000,
        "tokens": 768,
        "regions": {
            "eu-west": {"accepted": 1, "bytes": 2000, "tokens": 256},
            "us-east": {"accepted": 1, "bytes": 1000, "tokens": 512},
        },
    }
    status, body = await answer(standby, "GET", "/v1/jobs/tiny", "region/eu-west")
    assert (status, "spec" in body, "deltas" in body) == (200, False, False)
    for path in ("/v1/jobs/tiny", "/v1/jobs/nothing"):  # not its job: as if none existed
        status, body = await answer(standby, "GET", path, "region/ap-south")
        assert (status, body["error"]) == (404, "not_found"), body
    status, body = await answer(standby, "GET", "/v1/jobs/Bad!Name", "observer/grafana")
    assert (status, body["error"]) == (400, "bad_request"), body
    status, body = await answer(standby, "GET", "/v1/jobs", "region/eu-west")
    assert (status, body["error"]) == (403, "forbidden"), body
    status, body = await answer(standby, "GET", "/v1/audit?verify=1", "operator/alice")
    assert (status, body["verify"]["ok"], body["served_by"]) == (200, True, "standby")
    status, body = await answer(standby, "GET", "/v1/jobs", "operator/alice")
    assert [job["job"] for job in body["jobs"]] == ["tiny"]


async def test_everything_else_is_refused_naming_the_leader(
    standby: TestClient[Any, Any],
) -> None:
    assert (await answer(standby, "GET", "/healthz", "observer/grafana"))[0] == 200
    status, body = await answer(standby, "GET", "/readyz", "observer/grafana")
    assert (status, body["ready"], body["leader"]) == (503, False, LEADER)
    for method, path, caller in [
        ("POST", "/v1/jobs", "operator/alice"),
        ("POST", "/v1/jobs/tiny/pause", "operator/alice"),
        ("POST", "/metrics", "operator/alice"),
        ("POST", "/v1/jobs/tiny/rounds/0/uploads", "region/eu-west"),
    ]:
        status, body = await answer(standby, method, path, caller)
        assert (status, body["error"], body["leader"]) == (503, "standby", LEADER), body
        assert LEADER in body["message"]
    response = await standby.get("/v1/jobs/tiny")  # no identity: refused before anything
    assert response.status == 403


async def test_every_answer_closes_its_connection(standby: TestClient[Any, Any]) -> None:
    # Once it leads, the address is the full app's: no client keeps the standby's app.
    for path, caller in [("/readyz", "observer/grafana"), ("/v1/jobs/tiny", "operator/alice")]:
        response = await standby.get(path, headers=who(caller))
        await response.read()
        assert response.headers.get("Connection", "").lower() == "close", (path, response.headers)


async def test_metrics_say_it_stands_by_and_whom_it_sees_leading(
    standby: TestClient[Any, Any],
) -> None:
    for caller in ("observer/grafana", "operator/alice"):
        response = await standby.get("/metrics", headers=who(caller))
        assert response.status == 200, await response.text()
        assert response.headers["Content-Type"] == CONTENT_TYPE_LATEST
        samples = {
            (sample.name, tuple(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(await response.text())
            for sample in family.samples
        }
        assert samples == {
            ("geofed_coordinator_leader", ()): 0.0,
            ("geofed_coordinator_standby_info", (("leader", LEADER),)): 1.0,
        }
    # As the leader's: a region learns nothing of other regions' jobs from metrics.
    status, body = await answer(standby, "GET", "/metrics", "region/eu-west")
    assert (status, body["error"]) == (403, "forbidden"), body
    assert (await standby.get("/metrics")).status == 403  # no identity


async def test_a_store_that_cannot_be_read_answers_standby_and_is_tried_again(
    tmp_path: Path,
) -> None:
    tries: list[int] = []

    def unreachable() -> Store:
        tries.append(1)
        raise StoreFailure("cannot connect to the state database")

    client = await _client(tmp_path, unreachable)
    try:
        for _ in range(2):
            status, body = await answer(client, "GET", "/v1/jobs", "observer/grafana")
            assert (status, body["error"]) == (503, "standby"), body
            assert "cannot connect to the state database" in body["message"]
        assert len(tries) == 2
    finally:
        await client.close()
