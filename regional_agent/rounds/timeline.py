"""Where a region's round time goes: a per-(job, round) timeline of its phases.

Phases, as this region sees them:

- ``sync``: download and apply θ_r;
- ``train``: waiting for the worker group to train the round;
- ``encode``: encoding, signing and spooling the delta;
- ``upload``: sending the delta until the coordinator accepts it;
- ``wait``: from the delta's acceptance until the next announcement of the job reaches
  the agent (quorum, aggregation, the outer step and publication).

Besides the phases, the worker's own inner-loop interval (``RoundSummary``'s
``train_started_at``/``train_finished_at``), which compute utilization is measured on
(:mod:`regional_agent.handoff.utilization`). All times are Unix seconds on the wall clock, so the
agent's and the workers' timelines line up.

:class:`TimelineBook` is the pure part: it collects phases on an injected clock and hands
back each round's :class:`RoundTimeline` once it is over (the next announcement of the job
arrived). :class:`TimelineLog` appends them as JSON lines to ``round_timeline.jsonl`` in
the agent's state directory, moving the file to ``round_timeline.jsonl.1`` when it outgrows
its bound, so at most twice the bound is kept. :class:`Timeline` joins the two for the
daemon: recording is cheap and happens on the event loop, writing runs in a thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

log = logging.getLogger(__name__)

Phase = Literal["sync", "train", "encode", "upload", "wait"]
PHASES: Final[tuple[Phase, ...]] = ("sync", "train", "encode", "upload", "wait")
FILE_NAME: Final = "round_timeline.jsonl"
#: Rotate past 1 MiB: some ten thousand rounds, and bounded whatever the run's length.
MAX_BYTES: Final = 1 << 20
#: Rounds whose timeline is still open; older ones are dropped (a job that vanished).
MAX_OPEN: Final = 64

Clock = Callable[[], float]


class TimelineError(ValueError):
    """A timeline line that cannot be read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Interval:
    """A span of wall-clock time in Unix seconds; ``seconds`` may be less than
    ``end - start`` when a phase ran in several pieces (a retried upload)."""

    start: float
    end: float
    seconds: float

    def to_json(self) -> dict[str, float]:
        return {"start": self.start, "end": self.end, "seconds": self.seconds}


@dataclass(frozen=True, slots=True)
class RoundTimeline:
    """One finished round of one job as this region lived it."""

    job: str
    round: int
    phases: dict[str, Interval]
    #: The worker's inner loop (rank 0), when the workers reported it.
    worker: Interval | None

    def seconds(self, phase: str) -> float:
        found = self.phases.get(phase)
        return found.seconds if found is not None else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "round": self.round,
            "seconds": {name: round(self.phases[name].seconds, 6) for name in self.phases},
            "phases": {name: interval.to_json() for name, interval in self.phases.items()},
            "worker": self.worker.to_json() if self.worker is not None else None,
        }

    @classmethod
    def from_json(cls, data: object) -> RoundTimeline:
        """Read back :meth:`to_json`'s mapping; raises ``ValueError`` or ``TypeError``
        saying what is wrong."""
        if not isinstance(data, dict):
            raise TypeError(f"expected a mapping, got {type(data).__name__}")
        job, round_ = data.get("job"), data.get("round")
        if not isinstance(job, str) or not job:
            raise ValueError(f"job must be a non-empty string, got {job!r}")
        if isinstance(round_, bool) or not isinstance(round_, int) or round_ < 0:
            raise ValueError(f"round must be an integer >= 0, got {round_!r}")
        phases = data.get("phases")
        if not isinstance(phases, dict):
            raise TypeError("phases must be a mapping")
        worker = data.get("worker")
        return cls(
            job,
            round_,
            {str(name): _interval(f"phases.{name}", value) for name, value in phases.items()},
            None if worker is None else _interval("worker", worker),
        )


def _interval(what: str, value: object) -> Interval:
    if not isinstance(value, dict):
        raise TypeError(f"{what} must be a mapping")
    numbers: list[float] = []
    for key in ("start", "end", "seconds"):
        number = value.get(key)
        if isinstance(number, bool) or not isinstance(number, int | float):
            raise TypeError(f"{what}.{key} must be a number, got {number!r}")
        if not math.isfinite(number):
            raise ValueError(f"{what}.{key} must be finite, got {number!r}")
        numbers.append(float(number))
    start, end, seconds = numbers
    if end < start or seconds < 0:
        raise ValueError(f"{what}: end {end} is before start {start}, or seconds < 0")
    return Interval(start, end, seconds)


@dataclass(slots=True)
class _Open:
    """A round whose timeline is still being written."""

    phases: dict[str, Interval] = field(default_factory=dict)
    worker: Interval | None = None
    accepted_at: float | None = None


class TimelineBook:
    """The pure part: phases collected per (job, round) until the round is over."""

    def __init__(self, clock: Clock, *, max_open: int = MAX_OPEN) -> None:
        self._clock = clock
        self._max_open = max_open
        self._open: dict[tuple[str, int], _Open] = {}
        #: job -> the newest round already over (written out): late marks are dropped.
        self._over: dict[str, int] = {}
        #: (job, round, phase) -> when the phase began, for the phases under way.
        self._active: dict[tuple[str, int, str], float] = {}

    def _entry(self, job: str, round_: int) -> _Open:
        key = (job, round_)
        found = self._open.get(key)
        if found is None:
            while len(self._open) >= self._max_open:
                oldest = min(self._open, key=lambda k: (k[1], k[0]))
                log.debug("round timeline: dropping the open round %s", oldest)
                del self._open[oldest]
            found = self._open[key] = _Open()
        return found

    def record(self, job: str, round_: int, phase: Phase, start: float, end: float) -> None:
        """Add ``[start, end]`` to ``phase``; repeated pieces add up (a retry). A round
        already over (written out) takes no more pieces."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; expected one of {', '.join(PHASES)}")
        if round_ <= self._over.get(job, -1):
            return
        _add(self._entry(job, round_), phase, start, end)

    @contextmanager
    def phase(self, job: str, round_: int, phase: Phase) -> Iterator[None]:
        """Time the enclosed block as ``phase`` of the round, however it ends. A round
        that is over while the phase goes on (its upload finishing after the next round
        was announced) keeps the phase until then."""
        start = self._clock()
        key = (job, round_, phase)
        self._active[key] = start
        try:
            yield
        finally:
            self._active.pop(key, None)
            self.record(job, round_, phase, start, self._clock())

    def worker_trained(self, job: str, round_: int, start: float | None, end: float | None) -> None:
        """The worker's inner-loop interval; ignored when the workers did not report it."""
        if start is None or end is None or end < start or round_ <= self._over.get(job, -1):
            return
        self._entry(job, round_).worker = Interval(start, end, end - start)

    def accepted(self, job: str, round_: int) -> None:
        """The coordinator accepted this region's delta: the ``wait`` phase begins.

        The next round's announcement may come first (the acceptance's answer is still
        on its way when the round closes and publishes): the round is then over already,
        with no wait, and this mark is dropped.
        """
        if round_ <= self._over.get(job, -1):
            return
        self._entry(job, round_).accepted_at = self._clock()

    def announced(self, job: str, round_: int, *, final: bool = False) -> list[RoundTimeline]:
        """An announcement of ``round_`` of ``job`` reached the agent: the rounds before
        it (every open round of the job when ``final``: done or cancelled) are over.

        Returns them, oldest first, their ``wait`` closed now.
        """
        now = self._clock()
        over = sorted(key for key in self._open if key[0] == job and (final or key[1] < round_))
        finished = []
        for key in over:
            entry = self._open.pop(key)
            for (job_, round_, phase), start in self._active.items():
                if (job_, round_) == key:
                    _add(entry, phase, start, now)
            if entry.accepted_at is not None:
                start = entry.accepted_at
                entry.phases["wait"] = Interval(start, max(start, now), max(0.0, now - start))
            elif "upload" in entry.phases:
                # Announced before the acceptance's answer arrived: nothing was waited for.
                entry.phases["wait"] = Interval(now, now, 0.0)
            finished.append(RoundTimeline(key[0], key[1], entry.phases, entry.worker))
        if over:
            self._over[job] = max(self._over.get(job, -1), max(key[1] for key in over))
        return finished


def _add(entry: _Open, phase: str, start: float, end: float) -> None:
    """Add ``[start, end]`` to ``entry``'s ``phase`` (pieces add up)."""
    seconds = max(0.0, end - start)
    found = entry.phases.get(phase)
    if found is None:
        entry.phases[phase] = Interval(start, max(start, end), seconds)
    else:
        entry.phases[phase] = Interval(
            min(found.start, start), max(found.end, end), found.seconds + seconds
        )


def trimmed(lines: Sequence[bytes], max_bytes: int) -> list[bytes]:
    """The newest of ``lines`` that fit in ``max_bytes`` (at least the newest one)."""
    kept: list[bytes] = []
    size = 0
    for line in reversed(lines):
        if kept and size + len(line) > max_bytes:
            break
        kept.append(line)
        size += len(line)
    return kept[::-1]


class TimelineLog:
    """``round_timeline.jsonl`` in ``directory``, one finished round a line, bounded."""

    def __init__(self, directory: Path, *, max_bytes: int = MAX_BYTES) -> None:
        self.path = Path(directory) / FILE_NAME
        self.rotated = self.path.with_name(FILE_NAME + ".1")
        self._max_bytes = max_bytes
        self._lock = threading.Lock()

    def append(self, rounds: Sequence[RoundTimeline]) -> None:
        """Append ``rounds`` (blocking: call it from a thread)."""
        if not rounds:
            return
        lines = [
            json.dumps(r.to_json(), sort_keys=True, separators=(",", ":")).encode() + b"\n"
            for r in rounds
        ]
        with self._lock:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            try:
                size = self.path.stat().st_size
            except FileNotFoundError:
                size = 0
            if size and size + sum(map(len, lines)) > self._max_bytes:
                self.path.replace(self.rotated)
            lines = trimmed(lines, self._max_bytes)
            with self.path.open("ab") as out:
                out.write(b"".join(lines))


def read_timeline(directory: Path) -> list[RoundTimeline]:
    """Every round recorded in the agent state ``directory`` (rotated file first).

    Raises :class:`TimelineError` naming the file and line of a line it cannot read; a
    last line cut short (the agent died while writing it) is skipped.
    """
    found: list[RoundTimeline] = []
    for path in (Path(directory) / (FILE_NAME + ".1"), Path(directory) / FILE_NAME):
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            continue
        lines = raw.split(b"\n")
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                found.append(RoundTimeline.from_json(json.loads(line)))
            except (ValueError, TypeError) as exc:
                if number == len(lines) and not raw.endswith(b"\n"):
                    continue  # cut short while being written
                raise TimelineError(f"{path}:{number}: {exc}") from None
    return found


class Timeline:
    """The daemon's timeline: a :class:`TimelineBook` whose finished rounds are written
    by a :class:`TimelineLog` off the event loop, and observed by ``on_round``."""

    def __init__(
        self,
        directory: Path,
        *,
        clock: Clock = time.time,
        max_bytes: int = MAX_BYTES,
        on_round: Callable[[RoundTimeline], None] | None = None,
    ) -> None:
        self.book = TimelineBook(clock)
        self.log = TimelineLog(directory, max_bytes=max_bytes)
        self._on_round = on_round
        self._writes: set[asyncio.Task[None]] = set()

    def phase(self, job: str, round_: int, phase: Phase) -> AbstractContextManager[None]:
        """Context manager timing ``phase`` of the round (see :meth:`TimelineBook.phase`)."""
        return self.book.phase(job, round_, phase)

    def worker_trained(self, job: str, round_: int, start: float | None, end: float | None) -> None:
        self.book.worker_trained(job, round_, start, end)

    def accepted(self, job: str, round_: int) -> None:
        self.book.accepted(job, round_)

    def announced(self, job: str, round_: int, *, final: bool = False) -> None:
        """Close the rounds before ``round_`` and write them in a thread (event loop only)."""
        finished = self.book.announced(job, round_, final=final)
        if not finished:
            return
        if self._on_round is not None:
            for done in finished:
                try:
                    self._on_round(done)
                except ValueError as exc:  # a metric refused: the timeline is still written
                    log.warning("round %d of %s: %s", done.round, done.job, exc)
        task = asyncio.get_running_loop().create_task(self._write(finished))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, finished: list[RoundTimeline]) -> None:
        try:
            await asyncio.to_thread(self.log.append, finished)
        except OSError as exc:
            # The timeline is an observation: a full disk must not stop the rounds.
            log.warning("could not write the round timeline: %s", exc)

    async def flush(self) -> None:
        """Wait for the writes under way (at shutdown)."""
        if self._writes:
            await asyncio.wait(list(self._writes))
