"""The state-store contract against the machine's real PostgreSQL, and its own checks.

Each test gets a fresh database on the server (``tests/support/stores.py:PostgresSpec``;
``GEOFED_TEST_POSTGRES`` names another server), dropped afterwards. A writer killed
mid-transaction is covered for every implementation in
``tests/integration/test_killed_writers.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from coordinator.config import ConfigError
from coordinator.state.audit import AuditEvent
from coordinator.state.postgres import SCHEMA_VERSION, PostgresStore, describe_dsn
from coordinator.state.store import SchemaError, StoreFailure
from geofed.control.broker import EmbeddedBroker
from tests.support.coordinator import Announcements, coordinator, job_yaml, request, write_setup
from tests.support.store_contract import StoreContract
from tests.support.stores import B1, JOB, OPERATOR, PostgresSpec, StoreFactory, with_job

pytestmark = pytest.mark.integration


@pytest.fixture
def store_factory(tmp_path: Path) -> Iterator[StoreFactory]:
    factory = StoreFactory(PostgresSpec.fresh(tmp_path))
    yield factory
    factory.close_all()


@pytest.fixture
def store(store_factory: StoreFactory) -> PostgresStore:
    store = store_factory()
    assert isinstance(store, PostgresStore)
    return store


class TestPostgresStoreContract(StoreContract):
    """The contract every store keeps, on PostgreSQL."""


def test_two_coordinators_see_each_others_commits_and_never_interleave_writes(
    store_factory: StoreFactory,
) -> None:
    first, second = store_factory(), store_factory()
    with_job(first)
    assert second.get_job(JOB) is not None
    # A writer holds the database's writer lock for its whole transaction: the other
    # coordinator's write waits for the commit, then sees it (as SQLite's BEGIN IMMEDIATE).
    with first.transaction():
        first.set_pointer(JOB, "params", B1)
        assert second.get_pointer(JOB, "params") is None  # not committed yet
    assert second.get_pointer(JOB, "params") == B1
    entries = [
        store.append_audit(AuditEvent(OPERATOR, "job.create", "ok", job=JOB))
        for store in (first, second, first)
    ]
    assert [e.seq for e in entries] == [1, 2, 3]
    assert [e.prev_hash for e in entries[1:]] == [e.hash for e in entries[:2]]
    assert second.verify_audit(expect_head=(3, entries[-1].hash)).ok


def test_the_audit_log_is_append_only_in_the_database(store_factory: StoreFactory) -> None:
    store = store_factory()
    store.append_audit(AuditEvent(OPERATOR, "job.create", "ok", job=JOB))
    with psycopg.connect(_dsn(store_factory), autocommit=True) as conn:
        for statement in (b"UPDATE audit_log SET actor = 'mallory'", b"DELETE FROM audit_log"):
            with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
                conn.execute(statement)
    assert store.verify_audit().ok


def test_schema_version_and_a_newer_schema_is_refused(store_factory: StoreFactory) -> None:
    store = store_factory()
    assert isinstance(store, PostgresStore)
    assert store.schema_version() == SCHEMA_VERSION
    with psycopg.connect(_dsn(store_factory), autocommit=True) as conn:
        conn.execute(
            b"INSERT INTO geofed_schema_migrations (version, applied_at) VALUES (%s, 0)",
            (SCHEMA_VERSION + 1,),
        )
    with pytest.raises(SchemaError, match="upgrade the coordinator"):
        store_factory()


def test_an_unreachable_server_is_a_clear_failure_that_names_no_password() -> None:
    dsn = "postgresql://geofed:s3cret@127.0.0.1:1/state?connect_timeout=1"
    with pytest.raises(StoreFailure) as caught:
        PostgresStore(dsn, connect_timeout_s=1)
    message = str(caught.value)
    assert "cannot connect to the state database postgresql://127.0.0.1:1/state" in message
    assert "s3cret" not in message
    assert describe_dsn("host=db.example port=6432 dbname=geofed password=x") == (
        "postgresql://db.example:6432/geofed"
    )


def _dsn(factory: StoreFactory) -> str:
    """The connection string of the test's database (a second, plain client)."""
    assert isinstance(factory.spec, PostgresSpec)
    return factory.spec.dsn


async def test_a_coordinator_keeps_its_state_in_postgresql_across_a_restart(
    tmp_path: Path,
) -> None:
    spec = PostgresSpec.fresh(tmp_path / "db")
    try:
        async with EmbeddedBroker() as broker, Announcements(broker.port) as announcements:
            setup = write_setup(tmp_path, broker.port)
            with setup.config_path.open("a") as config:
                config.write(f'state_store: {{kind: postgresql, dsn: "{spec.dsn}"}}\n')
            async with coordinator(setup) as running:
                operator = running.session(setup.operator)
                status, body = await request(operator, "POST", "/v1/jobs", data=job_yaml())
                assert status == 201, body
                first = await announcements.until(round=0, state="open")
                for seed, name in enumerate(("eu-west", "us-east"), start=1):
                    region = running.region(name)
                    manifest, stream = region.delta("tiny", 0, first.base_hash, seed=seed)
                    status, body = await region.single_shot("tiny", 0, manifest, stream)
                    assert (status, body["state"]) == (200, "accepted"), body
                second = await announcements.until(round=1, state="open")
            # The coordinator's state is in the database, not in state_dir.
            assert not (setup.root / "state" / "coordinator.db").exists()
            with psycopg.connect(spec.dsn, autocommit=True) as conn:
                receipts = conn.execute(b"SELECT region FROM receipts ORDER BY region").fetchall()
                actions = conn.execute(b"SELECT action FROM audit_log ORDER BY seq").fetchall()
            assert receipts == [("eu-west",), ("us-east",)]
            assert ("round.publish",) in actions
            # Restarted on the same database: the job resumes at round 1, the chain verifies.
            async with coordinator(setup) as running:
                observer = running.session(setup.observer)
                # Ready once the job's state is read back (θ_1 replayed from θ_0's save).
                deadline = time.monotonic() + 30
                while (await request(observer, "GET", "/readyz"))[0] != 200:
                    assert time.monotonic() < deadline, "the job was not recovered in 30 s"
                    await asyncio.sleep(0.05)
                status, job = await request(observer, "GET", "/v1/jobs/tiny")
                assert (status, job["round"], job["params_hash"]) == (200, 1, second.base_hash)
                status, audit = await request(observer, "GET", "/v1/audit?limit=1000&verify=1")
                assert status == 200
                assert audit["verify"]["ok"], audit["verify"]
    finally:
        spec.drop()


def test_the_config_refuses_a_postgresql_store_without_a_dsn_or_with_a_password(
    tmp_path: Path,
) -> None:
    setup = write_setup(tmp_path, 1883)
    text = setup.config_path.read_text()
    for line, reason in (
        ("state_store: {kind: postgresql}\n", "needs a dsn"),
        ('state_store: {kind: postgresql, dsn: "host=db password=hunter2"}\n', "holds a password"),
        ('state_store: {kind: sqlite, dsn: "host=db"}\n', "dsn is for kind: postgresql"),
    ):
        setup.config_path.write_text(text + line)
        with pytest.raises(ConfigError, match=reason) as caught:
            setup.config()
        assert "coordinator.yaml" in str(caught.value)
        assert "hunter2" not in str(caught.value)
