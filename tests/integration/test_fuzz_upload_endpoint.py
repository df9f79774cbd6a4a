"""Property-based fuzzing of the delta upload endpoints of one running coordinator.

Hypothesis draws bodies (random bytes, random JSON, byte and structural mutations of a
valid signed manifest, mutations of a valid bundle and of its frames) and sends each to
one of the four upload endpoints of eu-west for the open round. The coordinator runs on
an event loop in a thread of its own, so the synchronous ``@given`` test can drive it.

Every answer must be a 4xx JSON error with a code of the protocol, within a time limit;
and the job's parameters, latest checkpoint and delivered list must stay as they were.
The one 2xx a mutation may earn is for bytes that mean exactly the valid delta (base64
and PEM leave a few bits of slack), or a commit once earlier examples stored every
verified frame of that delta: then what is accepted is the valid delta itself.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from coordinator.errors import CODES
from geofed.artifact_bundle import HEADER_SIZE, BundleError, pack_bundle, split_bundle
from geofed.manifest import ManifestError, SignedManifest
from tests.support import fuzz
from tests.support.coordinator import (
    JOB,
    FakeRegion,
    Running,
    coordinator,
    job_yaml,
    mosquitto_setup,
    request,
    wait_collecting,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

T = TypeVar("T")
#: Far beyond any answer of a healthy coordinator here; reaching it is a hang.
ANSWER_TIMEOUT_S = 30.0
ENDPOINTS = ("manifest", "chunk", "commit", "bundle")


class LoopThread:
    """An event loop running in its own thread; coroutines are submitted from outside."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop")
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


@dataclass
class Target:
    """The running coordinator, eu-west's valid delta for the open round, and what must
    not change."""

    loop: LoopThread
    observer: aiohttp.ClientSession
    eu: FakeRegion
    manifest: bytes
    frames: list[bytes]
    digest: str
    baseline: dict[str, Any]
    accepted: bool = False
    answers: dict[tuple[str, int, str], int] = field(default_factory=dict)

    @property
    def signed(self) -> SignedManifest:
        return SignedManifest.from_bytes(self.manifest)

    @property
    def bundle(self) -> bytes:
        return pack_bundle(self.manifest, self.frames)

    def send(self, endpoint: str, index: int, body: bytes) -> tuple[int, Any]:
        path = self.eu.path(JOB, 0)
        method, suffix = {
            "manifest": ("PUT", "/manifest"),
            "chunk": ("PUT", f"/chunks/{index}"),
            "commit": ("POST", "/commit"),
            "bundle": ("PUT", ""),
        }[endpoint]

        async def answer() -> tuple[int, Any]:
            async with (
                asyncio.timeout(ANSWER_TIMEOUT_S),
                self.eu.session.request(method, path + suffix, data=body) as response,
            ):
                text = await response.text()
            try:
                return response.status, json.loads(text)
            except ValueError:
                return response.status, text

        return self.loop.run(answer(), ANSWER_TIMEOUT_S + 5)

    def state(self) -> dict[str, Any]:
        return self.loop.run(_state(self.observer, self.eu))


async def _state(observer: aiohttp.ClientSession, region: FakeRegion) -> dict[str, Any]:
    status, job = await request(observer, "GET", f"/v1/jobs/{JOB}")
    assert status == 200, job
    status, latest = await request(region.session, "GET", f"/v1/jobs/{JOB}/checkpoints/latest")
    assert status == 200, latest
    return {
        "round": job["round"],
        "params_hash": job["params_hash"],
        "latest": latest,
        "delivered": job["current"]["delivered"],
    }


async def _prepare(
    running: Running,
) -> tuple[aiohttp.ClientSession, FakeRegion, bytes, list[bytes]]:
    observer = running.session(running.setup.observer)
    status, body = await request(
        running.session(running.setup.operator), "POST", "/v1/jobs", data=job_yaml(deadline=60)
    )
    assert status == 201, body
    base = (await wait_collecting(observer, 0))["params_hash"]
    eu = running.region("eu-west")
    manifest, stream = eu.delta(JOB, 0, base, seed=1)
    # An open upload of the valid delta, so chunk and commit bodies reach their checks.
    status, body = await request(eu.session, "PUT", eu.path(JOB, 0) + "/manifest", data=manifest)
    assert (status, body["state"]) == (200, "open"), body
    return observer, eu, manifest, list(stream.frames())


@pytest.fixture
def target(tmp_path: Path) -> Iterator[Target]:
    """One coordinator for every example of a test (hypothesis runs them in one call)."""
    with mosquitto_setup(tmp_path) as setup:
        loop = LoopThread()
        context = coordinator(setup)
        try:
            running = loop.run(context.__aenter__())
            try:
                observer, eu, manifest, frames = loop.run(_prepare(running))
                digest = SignedManifest.from_bytes(manifest).manifest.digest()
                baseline = loop.run(_state(observer, eu))
                assert baseline["delivered"] == []
                fuzzed = Target(loop, observer, eu, manifest, frames, digest, baseline)
                yield fuzzed
                # Shown with -s: which answers the examples reached.
                for key, count in sorted(fuzzed.answers.items()):
                    print("answers", *key, count)
            finally:
                loop.run(context.__aexit__(None, None, None))
        finally:
            loop.close()


# -- strategies ----------------------------------------------------------------------

json_values = fuzz.json_values()


@st.composite
def byte_mutation(draw: st.DrawFn, template: str) -> tuple[str, Any]:
    """Edits, a cut and an appended tail, applied later to the named template."""
    edits = draw(fuzz.byte_edits())
    cut = draw(st.none() | st.integers(min_value=0))
    tail = draw(st.binary(max_size=32))
    return template, (edits, cut, tail)


@st.composite
def structural_mutation(draw: st.DrawFn) -> tuple[str, Any]:
    """A JSON path of the signed manifest to set, drop or extend, and a value."""
    action = draw(st.sampled_from(fuzz.ACTIONS))
    return "structure", (draw(st.integers(min_value=0)), action, draw(json_values))


metrics = st.fixed_dictionaries(
    {"metrics": st.dictionaries(st.text(max_size=12), st.floats() | st.integers(), max_size=3)}
)

bodies = st.one_of(
    st.binary(max_size=1024).map(lambda data: ("bytes", data)),
    json_values.map(lambda value: ("json", value)),
    metrics.map(lambda value: ("json", value)),
    byte_mutation("manifest"),
    byte_mutation("bundle"),
    byte_mutation("stream"),
    st.tuples(st.integers(min_value=0), byte_mutation("frame")).map(
        lambda pair: ("frame", (pair[0], pair[1][1]))
    ),
    structural_mutation(),
)


def _restructure(manifest: bytes, choice: int, action: str, value: Any) -> bytes:
    document = json.loads(manifest)
    paths = fuzz.json_paths(document)[1:]
    fuzz.edit_at(document, paths[choice % len(paths)], action, value)
    return json.dumps(document).encode()


def materialize(target: Target, kind: str, spec: Any) -> bytes:
    """The body a drawn description stands for, built from the target's valid delta."""
    if kind == "bytes":
        data: bytes = spec
        return data
    if kind == "json":
        return json.dumps(spec).encode()
    if kind == "structure":
        return _restructure(target.manifest, *spec)
    if kind == "frame":
        index, (edits, cut, tail) = spec
        return fuzz.mutated(target.frames[index % len(target.frames)], edits, cut, tail)
    edits, cut, tail = spec
    if kind == "manifest":
        return fuzz.mutated(target.manifest, edits, cut, tail)
    # "stream" mutates only the frames of the bundle, after its intact manifest.
    keep = HEADER_SIZE + len(target.manifest) if kind == "stream" else 0
    return fuzz.mutated(target.bundle, edits, cut, tail, keep)


# -- the oracle ----------------------------------------------------------------------


def _means_the_valid_delta(target: Target, endpoint: str, body: bytes) -> bool:
    """Whether ``body`` (a manifest or a bundle) carries exactly the valid signed manifest."""
    try:
        manifest = split_bundle(body)[0] if endpoint == "bundle" else body
        return SignedManifest.from_bytes(manifest) == target.signed
    except (BundleError, ManifestError):
        return False


def problems_with(target: Target, endpoint: str, index: int, body: bytes) -> list[str]:
    status, answer = target.send(endpoint, index, body)
    code = str(answer.get("error") if isinstance(answer, dict) else answer)[:40]
    target.answers[(endpoint, status, code)] = target.answers.get((endpoint, status, code), 0) + 1
    problems = []
    if status == 200:
        receipt = answer.get("receipt") if isinstance(answer, dict) else None
        if endpoint in ("manifest", "bundle") and not _means_the_valid_delta(
            target, endpoint, body
        ):
            problems.append(f"{endpoint} answered 200 for a body that is not the valid delta")
        if endpoint == "chunk" and (
            not 0 <= index < len(target.frames) or body != target.frames[index]
        ):
            problems.append(f"chunk {index} answered 200 for a frame that is not the valid one")
        if receipt is not None:
            if receipt["manifest_digest"] != target.digest:
                problems.append(f"accepted a delta other than the valid one: {receipt}")
            target.accepted = True
    elif not (
        400 <= status < 500
        and isinstance(answer, dict)
        and answer.get("error") in CODES
        and isinstance(answer.get("message"), str)
    ):
        problems.append(f"answered {status} {answer!r}")
    state = target.state()
    expected = {**target.baseline, "delivered": ["eu-west"] if target.accepted else []}
    if state != expected:
        problems.append(f"the job changed: {state} (expected {expected})")
    return problems


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(endpoint=st.sampled_from(ENDPOINTS), index=st.integers(-1, 7), drawn=bodies)
def test_any_upload_body_gets_a_4xx_with_a_known_code_and_changes_nothing(
    target: Target, endpoint: str, index: int, drawn: tuple[str, Any]
) -> None:
    body = materialize(target, *drawn)
    assume(body not in (target.manifest, target.bundle, *target.frames))
    problems = problems_with(target, endpoint, index, body)
    assert not problems, f"{endpoint} {drawn[0]} ({len(body)} bytes): {problems}"
