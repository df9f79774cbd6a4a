"""Resumable, idempotent upload of a spooled delta (protocol: "Upload a delta").

One upload is: ``PUT .../manifest`` (the coordinator answers which chunks it already
holds), ``PUT .../chunks/{i}`` for each missing frame, ``POST .../commit``. Up to
``window`` chunk PUTs are in flight at once (agent config ``transfer.upload_window``),
each on a keep-alive connection of the one client session, answered in any order; the
coordinator answers each only once it is durable. When a chunk's connection drops or
times out, no further chunk starts, the ones in flight finish (each answer counts), and
the uploader backs off and starts again from the manifest, so it re-sends only what the
coordinator did not acknowledge; a delta the
coordinator already accepted is answered ``accepted`` at once. Everything is keyed by
(job, round, region), so retrying after an agent restart is harmless too.

Answers that retrying cannot change end the upload with a specific error:
:class:`RoundClosed` (a straggler: wait for the next announcement), :class:`BaseMismatch`
(the coordinator's θ_r is not ours: resync), :class:`UploadRefused` (anything else the
coordinator refuses, with its code). The whole upload is bounded by ``upload_s``.

With :class:`~regional_agent.metrics.AgentMetrics`, every upload that ends (accepted,
refused or timed out; not one cancelled by the agent) counts its bytes, its retries and
its duration.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from asyncio import FIRST_COMPLETED
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from geofed.api_paths import ApiPaths
from geofed.backoff import Backoff, Retry, Sleep
from geofed.timeouts import Timeout, wait_for
from regional_agent.metrics import AgentMetrics
from regional_agent.state import SpooledDelta
from regional_agent.transfer.coordinator_client import CoordinatorClient, HttpError, TransportError

log = logging.getLogger(__name__)

#: Codes meaning the delta no longer belongs to an open round.
_CLOSED_CODES = frozenset({"round_closed", "wrong_round"})
#: An ``incomplete`` commit (a chunk lost after its acknowledgement) or a vanished open
#: upload means starting over from the manifest; not forever.
_MAX_INCOMPLETE = 3


class UploadError(Exception):
    """Base class of upload failures that retrying will not fix."""


class RoundClosed(UploadError):
    """The round closed before the delta was accepted: this region is a straggler."""


class BaseMismatch(UploadError):
    """The coordinator's θ_r differs from the one the delta was trained from."""


class UploadRefused(UploadError):
    """The coordinator refused the delta; ``code`` is its error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class UploadReport:
    """How an upload went: the receipt, and what it took."""

    receipt: Mapping[str, Any]
    chunks_sent: int = 0
    bytes_sent: int = 0
    attempts: int = 0
    already_accepted: bool = False
    retried_after: list[str] = field(default_factory=list)


class Uploader:
    """Uploads spooled deltas of one region to the coordinator."""

    def __init__(
        self,
        client: CoordinatorClient,
        region: str,
        *,
        backoff: Backoff | None = None,
        sleep: Sleep = asyncio.sleep,
        rng: random.Random | None = None,
        metrics: AgentMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        window: int = 1,
    ) -> None:
        if window < 1:
            raise ValueError(f"upload window must be >= 1, got {window}")
        self._window = window
        self._client = client
        self._region = region
        self._backoff = backoff or Backoff(initial_s=0.2, max_s=10.0)
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._metrics = metrics
        self._clock = clock

    def delta_path(self, job: str, round_: int) -> str:
        return ApiPaths.delta(job, round_, self._region)

    async def upload(
        self, job: str, delta: SpooledDelta, metrics: Mapping[str, float]
    ) -> UploadReport:
        """Upload ``delta`` of ``job`` until accepted; raise :class:`UploadError` or ``Timeout``."""
        what = f"upload of the delta of job {job} round {delta.round}"
        report = UploadReport(receipt={})
        limit = self._client.timeouts.upload_s
        started = self._clock()
        cancelled = False
        try:
            return await wait_for(
                self._upload(job, delta, dict(metrics), report, started), limit, what
            )
        except asyncio.CancelledError:
            cancelled = True  # not an upload's duration: the agent stopped it
            raise
        finally:
            if self._metrics is not None and not cancelled:
                seconds = max(0.0, self._clock() - started)
                self._metrics.upload_finished(report.bytes_sent, max(1, report.attempts), seconds)

    async def _upload(
        self,
        job: str,
        delta: SpooledDelta,
        metrics: dict[str, float],
        report: UploadReport,
        started: float,
    ) -> UploadReport:
        base = self.delta_path(job, delta.round)
        retry = Retry(self._backoff, rng=self._rng, sleep=self._sleep)
        incomplete = 0
        while True:
            report.attempts += 1
            try:
                if await self._attempt(job, delta, metrics, report, started):
                    return report
                incomplete += 1
                if incomplete >= _MAX_INCOMPLETE:
                    raise UploadRefused(
                        "incomplete",
                        f"upload of {base} lost chunks or its open upload {incomplete} times "
                        "in a row",
                    )
            except (TransportError, Timeout) as exc:
                delay = retry.failed()
                report.retried_after.append(str(exc))
                log.warning("%s: %s; resuming in %.2f s", base, exc, delay)
                await retry.wait(delay)
            except HttpError as exc:
                raise _refusal(exc) from exc

    async def _attempt(
        self,
        job: str,
        delta: SpooledDelta,
        metrics: dict[str, float],
        report: UploadReport,
        started: float,
    ) -> bool:
        """One pass: manifest, missing chunks, commit. False to start over from the manifest.

        The commit's metrics gain ``upload_s``: the seconds from the upload's start (its
        retries included) to the commit.
        """
        base = self.delta_path(job, delta.round)
        manifest = ApiPaths.delta_manifest(job, delta.round, self._region)
        answer = await self._client.request(
            "PUT", manifest, data=delta.manifest_bytes, what=f"PUT {manifest}"
        )
        state = answer.json()
        if state.get("state") == "accepted":
            report.receipt = state.get("receipt") or state
            report.already_accepted = True
            return True
        received = _received(state, delta.frame_count)
        missing = [i for i in range(delta.frame_count) if i not in received]
        if not await self._send_chunks(job, delta, missing, report):
            return False
        try:
            commit = await self._client.request(
                "POST",
                ApiPaths.delta_commit(job, delta.round, self._region),
                json_body={
                    "metrics": {**metrics, "upload_s": round(max(0.0, self._clock() - started), 3)}
                },
                what=f"commit {base}",
            )
        except HttpError as exc:
            if exc.code == "incomplete":
                log.warning("%s: %s; asking again which chunks are missing", base, exc.message)
                return False
            raise
        body = commit.json()
        if body.get("state") != "accepted":
            raise UploadRefused("bad_answer", f"commit of {base} answered {body!r}")
        report.receipt = body.get("receipt") or body
        return True

    async def _send_chunks(
        self, job: str, delta: SpooledDelta, missing: list[int], report: UploadReport
    ) -> bool:
        """PUT the ``missing`` frames, ``window`` at a time; False if the open upload vanished.

        A transport failure stops new chunks but lets those in flight finish (the
        coordinator may acknowledge them), then raises; a refusal cancels the rest.
        """
        base = self.delta_path(job, delta.round)
        queue = iter(missing)
        in_flight: set[asyncio.Task[int]] = set()
        failure: BaseException | None = None
        vanished = False
        try:
            while True:
                while failure is None and not vanished and len(in_flight) < self._window:
                    index = next(queue, None)
                    if index is None:
                        break
                    in_flight.add(asyncio.create_task(self._send_chunk(job, delta, index)))
                if not in_flight:
                    break
                done, in_flight = await asyncio.wait(in_flight, return_when=FIRST_COMPLETED)
                for task in done:
                    error = task.exception()
                    if error is None:
                        report.chunks_sent += 1
                        report.bytes_sent += task.result()
                    elif isinstance(error, HttpError) and error.code == "not_found":
                        if not vanished:
                            # The open upload is gone (replaced or expired): offer the
                            # manifest again.
                            log.warning("%s: %s; offering the manifest again", base, error)
                        vanished = True
                    elif failure is None:
                        failure = error
                if isinstance(failure, HttpError):
                    break  # a refusal: what is still in flight cannot change it
        finally:
            for task in in_flight:
                task.cancel()
            if in_flight:
                await asyncio.wait(in_flight)
                for task in in_flight:
                    if not task.cancelled():
                        task.exception()  # read: the upload already failed for another reason
        if failure is not None:
            raise failure
        return not vanished

    async def _send_chunk(self, job: str, delta: SpooledDelta, index: int) -> int:
        """PUT frame ``index``; its size once the coordinator acknowledged it."""
        frame = await asyncio.to_thread(delta.read_frame, index)
        chunk = ApiPaths.delta_chunk(job, delta.round, self._region, index)
        await self._client.request("PUT", chunk, data=frame, what=f"PUT {chunk}")
        return len(frame)


def _received(state: Mapping[str, Any], count: int) -> set[int]:
    if state.get("state") != "open":
        raise UploadRefused("bad_answer", f"manifest answer has state {state.get('state')!r}")
    received = state.get("received", [])
    if not isinstance(received, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < count for i in received
    ):
        raise UploadRefused("bad_answer", f"manifest answer lists received={received!r}")
    return set(received)


def _refusal(error: HttpError) -> UploadError:
    if error.code in _CLOSED_CODES:
        return RoundClosed(str(error))
    if error.code == "base_mismatch":
        return BaseMismatch(str(error))
    return UploadRefused(error.code, str(error))
