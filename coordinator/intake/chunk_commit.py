"""Recording received frames in shared commits (the chunk step of an upload).

A chunk PUT is answered only once its frame is durable: written at its offset of the
upload's stream file and fdatasync'd (:meth:`coordinator.intake.spool.Spool.write_chunk`, in
parallel, one per request), then its row committed in the state store (the manifest
step answers which frames a region need not send again from those rows, so a row must
never be committed before its frame is durable). :class:`ChunkCommitter` records every
frame that arrives together as one batch (:mod:`coordinator.intake.group_commit`): every row in
one store transaction (one WAL fsync).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.intake.group_commit import CommitStats, GroupCommit
from coordinator.state.async_store import AsyncStore
from coordinator.state.store import ConflictError, InvalidValue, MissingRecord, Store

__all__ = ["COMMIT_WINDOW_S", "ChunkCommitter", "ChunkWrite", "record_chunks"]

#: How long the first frame of a batch waits for others. Frames arriving while a commit
#: runs join the next one anyway, so this only needs to gather frames that arrive together.
COMMIT_WINDOW_S = 0.001
#: At most this many frames per commit (bounds one commit's time and its rows).
MAX_BATCH = 64


@dataclass(frozen=True, slots=True)
class ChunkWrite:
    """A frame checked against its manifest record and durable in the stream file."""

    job: str
    round: int
    region: str
    manifest_digest: str
    index: int
    digest: str
    size: int


def record_chunks(store: Store, writes: Sequence[ChunkWrite]) -> list[Exception | None]:
    """Record every frame's row in one transaction; one outcome per frame.

    A frame refused on its own (another digest already recorded at its index, its job
    gone) fails alone: its savepoint is rolled back and the others commit. A failure of
    the database itself fails the whole transaction, so none is acknowledged.
    """
    outcomes: list[Exception | None] = []
    with store.transaction():
        for w in writes:
            try:
                store.record_upload_chunk(
                    w.job, w.round, w.region, w.manifest_digest, w.index, w.digest, w.size
                )
            except (ConflictError, InvalidValue, MissingRecord) as exc:
                outcomes.append(exc)
            else:
                outcomes.append(None)
    return outcomes


class ChunkCommitter:
    """Records durable frames, several per commit (see the module docstring)."""

    def __init__(
        self,
        db: AsyncStore,
        *,
        window_s: float = COMMIT_WINDOW_S,
        max_batch: int = MAX_BATCH,
    ) -> None:
        self._db = db
        self._group: GroupCommit[ChunkWrite, None] = GroupCommit(
            self._commit, window_s=window_s, max_batch=max_batch
        )

    @property
    def stats(self) -> CommitStats:
        return self._group.stats

    async def commit(self, write: ChunkWrite) -> None:
        """Return once ``write`` is recorded (or raise why it is not)."""
        await self._group.submit(write)

    async def _commit(self, batch: Sequence[ChunkWrite]) -> list[BaseException | None]:
        return list(await self._db.run(record_chunks, batch))
