"""A standby's reader of the PostgreSQL state: reads only, the schema left as it is.

On the machine's real PostgreSQL (``tests/support/stores.py:PostgresSpec``): a store
opened ``read_only`` (``coordinator/api/standby.py`` opens one) never migrates a
database, reads what the leader's store wrote, and every write it attempts is refused by
the server, changing nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.state.postgres import PostgresStore
from coordinator.state.store import StoreError, StoreFailure
from tests.support.stores import B1, B2, JOB, PostgresSpec, with_job

pytestmark = pytest.mark.integration


@pytest.fixture
def spec(tmp_path: Path) -> Iterator[PostgresSpec]:
    spec = PostgresSpec.fresh(tmp_path)
    yield spec
    spec.drop()


def test_a_read_only_store_reads_the_leaders_state_and_writes_nothing(spec: PostgresSpec) -> None:
    with pytest.raises(StoreError):  # an empty database: nothing to read, nothing created
        PostgresStore(spec.dsn, read_only=True)
    leader = with_job(PostgresStore(spec.dsn))
    leader.set_pointer(JOB, "params", B1)
    reader = PostgresStore(spec.dsn, read_only=True)
    try:
        record = reader.get_job(JOB)
        assert record is not None
        assert record.state == "running"
        assert reader.list_pointers(JOB) == {"params": B1}
        with pytest.raises(StoreFailure, match="read-only"):
            reader.set_pointer(JOB, "params", B2)
        with pytest.raises(StoreFailure, match="read-only"):
            reader.set_job_state(JOB, "paused")
        leader.set_pointer(JOB, "params", B2)  # the leader's writes go on, and show
        assert reader.list_pointers(JOB) == {"params": B2}
        assert leader.get_job(JOB) == record
    finally:
        reader.close()
        leader.close()
