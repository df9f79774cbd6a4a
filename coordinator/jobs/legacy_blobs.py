"""Each job adopts the blobs it still needs from the store every job shared before.

Working blobs used to lie in one store under ``<state_dir>/blobs/``; each job now has its
own (:mod:`coordinator.storage.job_blobs`). When the coordinator starts, before any job
runs, each stored job adopts (hard-links) the older blobs it can still read: its saved
working state (the ``params``, ``outer_state`` and ``ef_residual`` pointers) and the
deltas of every round from that saved state on (those a restart replays, and those of
the round still open). After that, nothing reads the shared store's blobs any more.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from coordinator.services import Services
from coordinator.storage.working_state import BLOB_POINTERS, ParamsError, read_pointers

__all__ = ["adopt_legacy_blobs", "needed_blobs"]

log = logging.getLogger(__name__)


async def needed_blobs(services: Services, job: str) -> list[str]:
    """The digests of the working blobs ``job`` may read: its saved working state and the
    deltas accepted in the rounds from it on."""
    db = services.db
    pointers = await db.list_pointers(job)
    digests = [pointers[name] for name in BLOB_POINTERS if pointers.get(name)]
    try:
        since = read_pointers(pointers).saved.version
    except ParamsError:
        since = 0  # no state saved, or pointers this version cannot read: keep every delta
    latest = await db.latest_round(job)
    last = latest.round + 1 if latest is not None else since
    for round_ in range(since, last + 1):
        digests += [receipt.blob_digest for receipt in await db.list_receipts(job, round_)]
    return digests


async def adopt_legacy_blobs(services: Services, jobs: Iterable[str]) -> int:
    """Let every job of ``jobs`` adopt the shared store's blobs it still needs; how many."""
    stores = services.runtime.job_blobs
    if not await services.executors.files(stores.legacy_count):
        return 0
    adopted = 0
    for job in jobs:
        digests = await needed_blobs(services, job)
        count = await services.executors.files(stores.for_job(job).adopt_legacy, digests)
        if count:
            log.info("job %s: adopted %d blob(s) of the shared store into its own", job, count)
        adopted += count
    log.info(
        "the blobs directly under %s are no longer read (%d adopted by the jobs that need "
        'them); they may be removed with the coordinator stopped (docs/operations.md, "Working '
        'blobs")',
        stores.legacy.root,
        adopted,
    )
    return adopted
