"""The coordinator state store's contract: the behaviour every implementation must have.

:class:`StoreContract` is run by a test class that subclasses it in a module providing
two fixtures: ``store_factory`` (a :class:`~tests.support.stores.StoreFactory`) and
``store`` (one store from it). ``tests/unit/test_store.py`` runs it against SQLite,
``tests/integration/test_postgres_store.py`` against the machine's PostgreSQL.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from coordinator.state.audit import AuditEvent, AuditVerdict
from coordinator.state.store import (
    AlreadyExists,
    ConflictError,
    DeltaTotals,
    InvalidValue,
    MissingRecord,
    Store,
    StoreClosed,
    StoreError,
)
from tests.support.stores import B1, B2, JOB, M1, M2, OPERATOR, SPEC, C, StoreFactory, with_job


class StoreContract:
    """Behaviour shared by every Store implementation."""

    def test_is_a_store(self, store: Store) -> None:
        assert isinstance(store, Store)

    # Jobs.

    def test_create_get_and_list_jobs(self, store: Store) -> None:
        job = store.create_job(JOB, SPEC, "pending")
        assert (job.job_id, job.spec, job.state) == (JOB, SPEC, "pending")
        assert store.get_job(JOB) == job
        store.create_job("job-b", {}, "running")
        assert [j.job_id for j in store.list_jobs()] == [JOB, "job-b"]
        assert [j.job_id for j in store.list_jobs(state="running")] == ["job-b"]
        assert store.get_job("job-missing") is None

    def test_job_ids_are_unique(self, store: Store) -> None:
        with_job(store)
        with pytest.raises(AlreadyExists, match=JOB):
            store.create_job(JOB, {"other": True}, "pending")
        assert isinstance(AlreadyExists(""), ConflictError)
        job = store.get_job(JOB)
        assert job is not None
        assert job.spec == SPEC

    @pytest.mark.parametrize(
        ("job_id", "spec", "state"),
        [
            ("Bad_Id", {}, "pending"),
            ("", {}, "pending"),
            (JOB, {"x": float("nan")}, "pending"),
            (JOB, {"x": object()}, "pending"),
            (JOB, ["not", "a", "mapping"], "pending"),
            (JOB, {}, "Not A State"),
        ],
    )
    def test_bad_job_input_writes_nothing(
        self, store: Store, job_id: str, spec: Any, state: str
    ) -> None:
        with pytest.raises(InvalidValue):
            store.create_job(job_id, spec, state)
        assert store.list_jobs() == []

    def test_set_job_state(self, store: Store) -> None:
        created = with_job(store).get_job(JOB)
        assert created is not None
        paused = store.set_job_state(JOB, "paused")
        assert paused.state == "paused"
        assert paused.spec == SPEC
        assert paused.created_at == created.created_at
        assert store.get_job(JOB) == paused
        with pytest.raises(ConflictError, match="'paused', not 'running'"):
            store.set_job_state(JOB, "cancelled", expected="running")
        assert store.set_job_state(JOB, "running", expected="paused").state == "running"
        with pytest.raises(MissingRecord, match="job-missing"):
            store.set_job_state("job-missing", "running")

    # Rounds.

    def test_save_load_and_latest_round(self, store: Store) -> None:
        with_job(store)
        assert store.latest_round(JOB) is None
        store.save_round(JOB, 0, {"phase": "open", "participants": ["eu-west"]})
        store.save_round(JOB, 1, {"phase": "open"})
        replaced = store.save_round(JOB, 0, {"phase": "published"})
        loaded = store.load_round(JOB, 0)
        assert loaded == replaced
        assert loaded.state == {"phase": "published"}
        latest = store.latest_round(JOB)
        assert latest is not None
        assert (latest.round, latest.state) == (1, {"phase": "open"})
        assert store.load_round(JOB, 7) is None

    def test_round_input_is_checked(self, store: Store) -> None:
        with pytest.raises(MissingRecord):
            store.save_round("job-missing", 0, {})
        with_job(store)
        with pytest.raises(InvalidValue):
            store.save_round(JOB, -1, {})
        with pytest.raises(InvalidValue):
            store.save_round(JOB, 0, {"bad": float("inf")})
        assert store.latest_round(JOB) is None

    # Receipts.

    def test_receipts_are_idempotent(self, store: Store) -> None:
        with_job(store)
        first = store.record_receipt(JOB, 3, "us-east", M1, B1, 1000, 512)
        again = store.record_receipt(JOB, 3, "us-east", M1, B1, 1000, 512)
        assert again == first  # the stored one, with its original time
        store.record_receipt(JOB, 3, "eu-west", M2, B2, 2000, 256)
        store.record_receipt(JOB, 4, "eu-west", M1, B1, 3000, 128)
        assert [r.region for r in store.list_receipts(JOB, 3)] == ["eu-west", "us-east"]
        assert store.list_receipts(JOB, 3)[1] == first
        assert store.list_receipts(JOB, 9) == []

    def test_receipt_totals_add_up_every_round_per_region(self, store: Store) -> None:
        with_job(store)
        assert store.receipt_totals(JOB) == {}
        store.record_receipt(JOB, 3, "us-east", M1, B1, 1000, 512)
        store.record_receipt(JOB, 3, "eu-west", M2, B2, 2000, 256)
        store.record_receipt(JOB, 4, "eu-west", M1, B1, 3000, 128)
        store.record_receipt(JOB, 4, "eu-west", M1, B1, 3000, 128)  # the same one again
        assert store.receipt_totals(JOB) == {
            "eu-west": DeltaTotals(deltas=2, bytes=5000, tokens=384),
            "us-east": DeltaTotals(deltas=1, bytes=1000, tokens=512),
        }
        with pytest.raises(InvalidValue):
            store.receipt_totals("Not A Job")

    @pytest.mark.parametrize(
        "changed",
        [(M2, B1, 1000, 512), (M1, B2, 1000, 512), (M1, B1, 1001, 512), (M1, B1, 1000, 513)],
    )
    def test_a_different_receipt_for_the_same_key_conflicts(
        self, store: Store, changed: tuple[str, str, int, int]
    ) -> None:
        with_job(store)
        first = store.record_receipt(JOB, 3, "us-east", M1, B1, 1000, 512)
        with pytest.raises(ConflictError, match="us-east"):
            store.record_receipt(JOB, 3, "us-east", *changed)
        assert store.list_receipts(JOB, 3) == [first]

    def test_receipt_input_is_checked(self, store: Store) -> None:
        with pytest.raises(MissingRecord):
            store.record_receipt("job-missing", 0, "eu-west", M1, B1, 1, 1)
        with_job(store)
        bad = [
            (0, "EU", M1, B1, 1, 1),
            (0, "eu-west", "short", B1, 1, 1),
            (0, "eu-west", M1, B1.upper(), 1, 1),
            (0, "eu-west", M1, B1, -1, 1),
            (0, "eu-west", M1, B1, 1, -5),
            (-1, "eu-west", M1, B1, 1, 1),
        ]
        for args in bad:
            with pytest.raises(InvalidValue):
                store.record_receipt(JOB, *args)
        assert store.list_receipts(JOB, 0) == []

    # Resumable uploads.

    def test_upload_progress(self, store: Store) -> None:
        with_job(store)
        key = (JOB, 2, "eu-west")
        assert store.uploaded_chunks(*key, M1) == {}
        store.record_upload_chunk(*key, M1, 0, C[0], 1024)
        store.record_upload_chunk(*key, M1, 2, C[2], 1024)
        store.record_upload_chunk(*key, M1, 0, C[0], 1024)  # a retried chunk is a no-op
        store.record_upload_chunk(*key, M2, 0, C[3], 512)  # another attempt's manifest
        store.record_upload_chunk(JOB, 2, "us-east", M1, 0, C[1], 1024)
        assert store.uploaded_chunks(*key, M1) == {0: C[0], 2: C[2]}
        assert store.uploaded_chunks(*key, M2) == {0: C[3]}
        with pytest.raises(ConflictError, match="chunk 2"):
            store.record_upload_chunk(*key, M1, 2, C[3], 1024)
        with pytest.raises(ConflictError):
            store.record_upload_chunk(*key, M1, 2, C[2], 999)
        assert store.clear_upload(*key, M2) == 1
        assert store.uploaded_chunks(*key, M1) == {0: C[0], 2: C[2]}
        assert store.clear_upload(*key) == 2
        assert store.uploaded_chunks(*key, M1) == {}
        assert store.uploaded_chunks(JOB, 2, "us-east", M1) == {0: C[1]}

    def test_upload_input_is_checked(self, store: Store) -> None:
        with pytest.raises(MissingRecord):
            store.record_upload_chunk("job-missing", 0, "eu-west", M1, 0, C[0], 1)
        with_job(store)
        with pytest.raises(InvalidValue):
            store.record_upload_chunk(JOB, 0, "eu-west", M1, -1, C[0], 1)
        with pytest.raises(InvalidValue):
            store.record_upload_chunk(JOB, 0, "eu-west", M1, 0, "../../x", 1)
        with pytest.raises(InvalidValue):
            store.uploaded_chunks(JOB, 0, "eu-west", "nope")
        assert store.uploaded_chunks(JOB, 0, "eu-west", M1) == {}

    # Pointers.

    def test_pointers(self, store: Store) -> None:
        with_job(store)
        assert store.get_pointer(JOB, "params") is None
        store.set_pointer(JOB, "params", B1)
        store.set_pointer(JOB, "outer.momentum", B2)
        store.set_pointer(JOB, "params", B2)
        assert store.get_pointer(JOB, "params") == B2
        assert store.list_pointers(JOB) == {"outer.momentum": B2, "params": B2}
        with pytest.raises(MissingRecord):
            store.set_pointer("job-missing", "params", B1)
        with pytest.raises(InvalidValue):
            store.set_pointer(JOB, "Bad Name", B1)
        with pytest.raises(InvalidValue):
            store.set_pointer(JOB, "params", "x" * 5000)
        assert store.get_pointer(JOB, "params") == B2

    # Transactions.

    def test_transaction_commits_together(self, store: Store) -> None:
        with_job(store)
        with store.transaction():
            store.save_round(JOB, 1, {"phase": "published"})
            store.set_pointer(JOB, "params", B1)
            store.append_audit(AuditEvent(OPERATOR, "round.publish", "ok", round=1))
        assert store.load_round(JOB, 1) is not None
        assert store.get_pointer(JOB, "params") == B1
        assert store.audit_entries()[-1].action == "round.publish"

    def test_exception_rolls_back_everything(self, store: Store) -> None:
        with_job(store)
        store.append_audit(AuditEvent(OPERATOR, "job.create", "ok", job=JOB))

        def publish_then_fail() -> None:
            with store.transaction():
                store.create_job("job-b", SPEC, "running")
                store.set_job_state(JOB, "paused")
                store.save_round(JOB, 1, {"phase": "published"})
                store.record_receipt(JOB, 1, "eu-west", M1, B1, 10, 10)
                store.record_upload_chunk(JOB, 1, "eu-west", M1, 0, C[0], 10)
                store.set_pointer(JOB, "params", B1)
                store.append_audit(AuditEvent(OPERATOR, "round.publish", "ok"))
                raise RuntimeError("outer optimizer failed")

        with pytest.raises(RuntimeError, match="outer optimizer"):
            publish_then_fail()
        job = store.get_job(JOB)
        assert job is not None
        assert job.state == "running"
        assert store.get_job("job-b") is None
        assert store.latest_round(JOB) is None
        assert store.list_receipts(JOB, 1) == []
        assert store.uploaded_chunks(JOB, 1, "eu-west", M1) == {}
        assert store.get_pointer(JOB, "params") is None
        assert [e.seq for e in store.audit_entries()] == [1]
        nxt = store.append_audit(AuditEvent(OPERATOR, "round.retry", "ok"))
        assert nxt.seq == 2
        assert store.verify_audit().ok

    def test_a_failed_write_inside_a_transaction_aborts_it(self, store: Store) -> None:
        with_job(store)
        store.record_receipt(JOB, 1, "eu-west", M1, B1, 10, 10)

        def conflicting() -> None:
            with store.transaction():
                store.set_pointer(JOB, "params", B1)
                store.record_receipt(JOB, 1, "eu-west", M2, B2, 10, 10)

        with pytest.raises(ConflictError):
            conflicting()
        assert store.get_pointer(JOB, "params") is None

    def test_nested_transaction_rolls_back_only_itself(self, store: Store) -> None:
        with_job(store)

        def inner() -> None:
            with store.transaction():
                store.set_pointer(JOB, "b", "2")
                raise ValueError("inner")

        with store.transaction():
            store.set_pointer(JOB, "a", "1")
            with pytest.raises(ValueError, match="inner"):
                inner()
            store.set_pointer(JOB, "c", "3")
        assert store.list_pointers(JOB) == {"a": "1", "c": "3"}

    def test_serialized_across_threads(self, store: Store) -> None:
        with_job(store)
        store.set_pointer(JOB, "counter", "0")

        def bump(_: int) -> None:
            with store.transaction():
                value = int(store.get_pointer(JOB, "counter") or "0")
                store.set_pointer(JOB, "counter", str(value + 1))

        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(bump, range(80)))
        assert store.get_pointer(JOB, "counter") == "80"

    def test_usable_from_a_worker_thread(self, store_factory: StoreFactory) -> None:
        store = store_factory()  # created here, used only by the executor's thread
        with ThreadPoolExecutor(max_workers=1) as executor:
            executor.submit(with_job, store).result()
            receipt = executor.submit(
                store.record_receipt, JOB, 0, "eu-west", M1, B1, 1, 1
            ).result()
        assert store.list_receipts(JOB, 0) == [receipt]

    # Audit log.

    def test_audit_log(self, store: Store) -> None:
        with_job(store)
        entries = [
            store.append_audit(
                AuditEvent(OPERATOR, "job.create", AuditVerdict.OK, job=JOB, details={"n": 1})
            ),
            store.append_audit(
                AuditEvent(
                    actor="spiffe://fed/region/eu-west",
                    action="policy.transfer",
                    verdict=AuditVerdict.DENY,
                    job="job-b",
                    round=2,
                    region="eu-west",
                    details={"reason": "personal data may not leave the EU"},
                )
            ),
        ]
        assert store.audit_entries() == entries
        assert store.audit_entries(job="job-b") == entries[1:]
        assert store.audit_entries(after_seq=1) == entries[1:]
        assert store.verify_audit().ok
        assert store.audit_head() == (2, entries[1].hash)
        assert store.verify_audit(expect_head=(2, entries[1].hash)).ok
        with pytest.raises(InvalidValue):
            store.append_audit(AuditEvent(OPERATOR, "x", "perhaps"))
        with pytest.raises(InvalidValue):
            store.audit_entries(limit=0)
        assert len(store.audit_entries()) == 2

    # Durability and lifecycle.

    def test_reopen_after_close_keeps_everything(self, store_factory: StoreFactory) -> None:
        first = store_factory()
        job = with_job(first).get_job(JOB)
        rnd = first.save_round(JOB, 4, {"phase": "collecting", "deadline": 1234.5})
        receipt = first.record_receipt(JOB, 4, "eu-west", M1, B1, 100, 7)
        first.record_upload_chunk(JOB, 4, "us-east", M2, 1, C[1], 64)
        first.set_pointer(JOB, "params", B1)
        entry = first.append_audit(AuditEvent(OPERATOR, "job.create", "ok", job=JOB))
        first.close()
        second = store_factory()
        assert second.get_job(JOB) == job
        assert second.latest_round(JOB) == rnd
        assert second.list_receipts(JOB, 4) == [receipt]
        assert second.uploaded_chunks(JOB, 4, "us-east", M2) == {1: C[1]}
        assert second.get_pointer(JOB, "params") == B1
        assert second.audit_entries() == [entry]
        assert second.verify_audit(expect_head=(1, entry.hash)).ok

    def test_closed_store_refuses_calls(self, store: Store) -> None:
        store.close()
        store.close()  # idempotent
        with pytest.raises(StoreClosed):
            store.get_job(JOB)
        with pytest.raises(StoreClosed):
            store.create_job(JOB, SPEC, "running")
        with pytest.raises(StoreClosed), store.transaction():
            pass
        assert issubclass(StoreClosed, StoreError)
