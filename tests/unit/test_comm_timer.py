"""CommTimer's bookkeeping on the host clock: the union of the collectives' intervals, kept
small however many collectives a round issues. The collectives here are plain sleeps (no
process group is needed to time a call), and an asynchronous one is ``PendingWork``, a
fake at the edge standing in for a ``torch.distributed`` work in flight."""

from __future__ import annotations

import time
from typing import Any

import torch

from regional_agent.worker.comm_timer import COMPACT_AT, CommTimer

PAUSE_S = 0.0005


class PendingWork:
    """A fake ``dist.Work`` in flight until :meth:`finish` (the one method the timer uses:
    ``get_future``)."""

    def __init__(self) -> None:
        self.future: torch.futures.Future[Any] = torch.futures.Future()

    def get_future(self) -> torch.futures.Future[Any]:
        return self.future

    def finish(self) -> None:
        self.future.set_result(None)


def test_sequential_collectives_are_added_up_as_they_complete() -> None:
    timer = CommTimer(torch.device("cpu"))
    timer.start()
    started = time.perf_counter()
    count = 2 * COMPACT_AT + 7
    for _ in range(count):
        assert timer.issue(lambda: time.sleep(PAUSE_S)) is None
        time.sleep(PAUSE_S)  # not in flight: the union leaves it out
    wall = time.perf_counter() - started
    seconds = timer.seconds()
    assert seconds is not None
    assert count * PAUSE_S <= seconds <= wall - count * PAUSE_S
    # What is held does not grow with the count: the intervals noted since the last merge.
    assert len(timer._intervals) == count - 2 * COMPACT_AT
    assert timer._merged == []


def test_a_collective_in_flight_keeps_what_it_overlaps_from_being_counted_twice() -> None:
    timer = CommTimer(torch.device("cpu"))
    timer.start()
    outer = PendingWork()
    before = time.perf_counter()
    work: Any = outer  # a dist.Work as far as the timer can tell
    assert timer.issue(lambda: work) is work
    for _ in range(COMPACT_AT + 3):  # merged while the outer one is in flight
        timer.issue(lambda: time.sleep(PAUSE_S))
    outer.finish()
    after = time.perf_counter()
    seconds = timer.seconds()
    assert seconds is not None
    # The union is the outer collective's span, which covers every other.
    assert (COMPACT_AT + 3) * PAUSE_S <= seconds <= after - before


def test_a_new_round_forgets_the_last() -> None:
    timer = CommTimer(torch.device("cpu"))
    timer.start()
    for _ in range(COMPACT_AT + 1):
        timer.issue(lambda: time.sleep(PAUSE_S))
    timer.start()
    assert timer.seconds() == 0.0
