"""The agent's sync: apply the published update or resync from the checkpoint chain.

A fake coordinator at the outer edge (a real aiohttp server on loopback serving
artifact bundles) publishes a chain θ_0 (snapshot) → update 0 → update 1, built and
signed here the way the protocol describes them.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer

from geofed.artifact_bundle import pack_bundle, split_bundle
from geofed.codec import decode, encode_stream
from geofed.codec_params import CodecParams
from geofed.control import RoundAnnouncement
from geofed.deltas import apply_update
from geofed.manifest import ArtifactProvenance, Manifest, build_manifest, sign_manifest
from geofed.params import parameters_vector_hash, state_to_fp32
from geofed.theta_chain import ThetaChain, params_hash
from geofed.timeouts import Timeouts
from geofed.types import ArtifactKind
from regional_agent.state import AgentState, HeldTheta, JobDirectory, ParamsVersion
from regional_agent.transfer.coordinator_client import CoordinatorClient
from regional_agent.transfer.sync import (
    ArtifactRejected,
    ResyncFailed,
    Synchronizer,
    verify_artifact,
)
from tests.support.pki import Federation, Principal, make_federation
from tests.support.tiny_task import SPEC, TinyTask

JOB = "tiny"
NOW = datetime.now(UTC)


@pytest.fixture(autouse=True, scope="module")
def _fresh_now() -> None:
    """Take NOW when the module runs, not when it is imported: the certificates are issued
    then, and a long suite may collect this module minutes before running it."""
    global NOW
    NOW = datetime.now(UTC)


Params = dict[str, torch.Tensor]


def artifact_bundle(
    signer: Principal,
    kind: ArtifactKind,
    round_: int,
    tensors: Params,
    *,
    scheme: str = "int8",
    base_hash: str | None = None,
    parameters_hash: str | None = None,
    job: str = JOB,
) -> tuple[bytes, Manifest]:
    """An artifact bundle as the coordinator publishes it, signed by ``signer``."""
    stream = encode_stream(tensors, CodecParams(scheme=scheme))  # type: ignore[arg-type]
    frames = list(stream.frames())
    manifest = build_manifest(
        kind=kind,
        job=job,
        round=round_,
        producer=signer.identity,
        stream=stream,
        provenance=(ArtifactProvenance(region="eu-west", jurisdiction="EU", datasets=()),),
        created_at=NOW,
        base_round=round_ if kind is ArtifactKind.GLOBAL_UPDATE else None,
        base_hash=base_hash,
        parameters_hash=parameters_hash,
    )
    credential = signer.credential
    signed = sign_manifest(manifest, credential.private_key, credential.certificate)
    return pack_bundle(signed.to_bytes(), frames), manifest


@dataclass
class Chain:
    """θ_0..θ_2 and the published artifacts between them."""

    thetas: list[Params]
    hashes: list[str]
    snapshot: bytes
    updates: list[bytes]
    manifests: list[Manifest]

    @property
    def manifest_digests(self) -> list[str]:
        """sha256 of each update's signed manifest bytes, as announcements carry them."""
        return [hashlib.sha256(split_bundle(update)[0]).hexdigest() for update in self.updates]


def build_chain(coordinator: Principal, rounds: int = 2) -> Chain:
    theta = state_to_fp32(TinyTask().build_model(seed=3))
    thetas, hashes = [theta], [parameters_vector_hash(theta)]
    snapshot, _ = artifact_bundle(
        coordinator,
        ArtifactKind.GLOBAL_CHECKPOINT,
        0,
        theta,
        scheme="fp32",
        parameters_hash=hashes[0],
    )
    updates, manifests = [], []
    gen = torch.Generator().manual_seed(11)
    for r in range(rounds):
        intended = {n: 0.01 * torch.randn(t.shape, generator=gen) for n, t in theta.items()}
        stream = encode_stream(intended, CodecParams(scheme="int8"))
        following = apply_update(theta, decode(stream.frames()))
        digest = parameters_vector_hash(following)
        bundle, manifest = artifact_bundle(
            coordinator,
            ArtifactKind.GLOBAL_UPDATE,
            r,
            intended,
            base_hash=hashes[-1],
            parameters_hash=digest,
        )
        updates.append(bundle)
        manifests.append(manifest)
        theta = following
        thetas.append(theta)
        hashes.append(digest)
    return Chain(thetas, hashes, snapshot, updates, manifests)


def announce(chain: Chain, round_: int, **overrides: Any) -> RoundAnnouncement:
    fields: dict[str, Any] = {
        "job": JOB,
        "round": round_,
        "base_round": round_,
        "base_hash": chain.hashes[round_],
        "update_url": f"/v1/jobs/{JOB}/rounds/{round_ - 1}/update" if round_ else None,
        "update_digest": chain.manifest_digests[round_ - 1] if round_ else None,
        "participants": ("eu-west",),
        "min_regions": 1,
        "deadline": NOW + timedelta(minutes=5),
        "deadline_s": 300.0,
        "inner_steps": 5,
        "codec": CodecParams(),
        "task": SPEC,
        "seed": 3,
        "state": "open",
    }
    fields.update(overrides)
    return RoundAnnouncement(**fields)


@dataclass
class FakeCoordinatorFiles:
    """Fake of the coordinator's download endpoints: path -> bytes, with request counts."""

    files: dict[str, bytes] = field(default_factory=dict)
    latest: dict[str, Any] | None = None
    hits: dict[str, int] = field(default_factory=dict)
    delay_s: float = 0.0
    """How long each file takes to answer, so that concurrent downloads overlap."""
    in_flight: int = 0
    most_in_flight: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/jobs/{job}/checkpoints/latest", self._latest)
        app.router.add_get("/{tail:.*}", self._file)
        return app

    async def _latest(self, request: web.Request) -> web.Response:
        self.hits[request.path] = self.hits.get(request.path, 0) + 1
        if self.latest is None:
            return web.json_response({"error": "not_found", "message": "no checkpoint"}, status=404)
        return web.json_response(self.latest)

    async def _file(self, request: web.Request) -> web.Response:
        self.hits[request.path] = self.hits.get(request.path, 0) + 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        data = self.files.get(request.path)
        if data is None:
            return web.json_response({"error": "not_found", "message": request.path}, status=404)
        return web.Response(body=data)

    def publish(self, chain: Chain) -> None:
        self.files["/artifacts/snapshot-0"] = chain.snapshot
        for r, bundle in enumerate(chain.updates):
            self.files[f"/v1/jobs/{JOB}/rounds/{r}/update"] = bundle
            self.files[f"/artifacts/update-{r}"] = bundle
        self.latest = {
            "job": JOB,
            "round": len(chain.updates),
            "parameters_hash": chain.hashes[-1],
            "snapshot": {"round": 0, "url": "/artifacts/snapshot-0"},
            "updates": [
                {"round": r, "url": f"/artifacts/update-{r}"} for r in range(len(chain.updates))
            ],
        }


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Federation:
    return make_federation(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def coordinator(federation: Federation) -> Principal:
    return federation.coordinator()


@pytest.fixture(scope="module")
def chain(coordinator: Principal) -> Chain:
    return build_chain(coordinator)


@pytest_asyncio.fixture
async def served(chain: Chain) -> AsyncIterator[tuple[FakeCoordinatorFiles, str]]:
    fake = FakeCoordinatorFiles()
    fake.publish(chain)
    server = TestServer(fake.app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield fake, str(server.make_url("/"))
    finally:
        await server.close()


@asynccontextmanager
async def synchronizing(
    url: str, federation: Federation, *, download_window: int = 1, theta_file_every: int = 1
) -> AsyncIterator[Synchronizer]:
    """A synchronizer of the coordinator at ``url``, for as long as its HTTP session lasts."""
    timeouts = Timeouts(connect_s=2, heartbeat_s=1, request_s=5, upload_s=10, download_s=10)
    async with aiohttp.ClientSession() as session:
        client = CoordinatorClient(session, url, timeouts)
        yield Synchronizer(
            client,
            federation.bundle(),
            download_window=download_window,
            theta_file_every=theta_file_every,
        )


@pytest_asyncio.fixture
async def synchronizer(
    served: tuple[FakeCoordinatorFiles, str], federation: Federation
) -> AsyncIterator[Synchronizer]:
    async with synchronizing(served[1], federation) as sync:
        yield sync


def assert_same(left: Mapping[str, torch.Tensor], right: Mapping[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(left[name], right[name]), name


def place_in(root: Path) -> JobDirectory:
    """The agent's directory of the job, where the synchronizer writes each θ it reaches."""
    job = AgentState(root).job(JOB)
    job.prepare_params()
    return job


def held_theta(chain: Chain, round_: int, root: Path) -> HeldTheta:
    """θ_round of the chain, held in a θ file as the agent holds it."""
    version = ParamsVersion(round_, chain.hashes[round_])
    return HeldTheta(version, place_in(root).save_params(version, chain.thetas[round_]))


async def test_apply_update_and_resync_reconstruct_identical_theta(
    chain: Chain,
    synchronizer: Synchronizer,
    served: tuple[FakeCoordinatorFiles, str],
    tmp_path: Path,
) -> None:
    fake = served[0]
    held = held_theta(chain, 1, tmp_path / "update")
    by_update = await synchronizer.sync(announce(chain, 2), held, place_in(tmp_path / "update"))
    by_resync = await synchronizer.sync(announce(chain, 2), None, place_in(tmp_path / "resync"))
    assert by_update.method == "update"
    assert by_resync.method == "resync"
    assert by_update.version == by_resync.version == ParamsVersion(2, chain.hashes[2])
    assert by_update.path == place_in(tmp_path / "update").held_path(2)
    assert_same(by_update.tensors(), by_resync.tensors())
    assert_same(by_update.tensors(), chain.thetas[2])
    assert list(by_resync.tensors()) == list(chain.thetas[2])  # θ's order, for fragments
    # A new file: the held θ (which the workers may still be reading) is as it was.
    assert params_hash(held.path) == chain.hashes[1]
    assert fake.hits[f"/v1/jobs/{JOB}/rounds/1/update"] == 1
    assert fake.hits["/artifacts/snapshot-0"] == 1


@pytest.mark.parametrize("every", [2, 3])
async def test_updates_are_chained_and_theta_written_whole_every_few_rounds(
    chain: Chain,
    served: tuple[FakeCoordinatorFiles, str],
    federation: Federation,
    every: int,
    tmp_path: Path,
) -> None:
    """θ_1 and θ_2 from θ_0 by their updates, ``theta_file_every`` 2 or 3: each update is
    kept in its file and chained after θ_0's, until the chain would reach ``every``
    files; then θ is written whole again. Every θ is the published one, bit for bit."""
    job = place_in(tmp_path)
    held = held_theta(chain, 0, tmp_path)
    async with synchronizing(served[1], federation, theta_file_every=every) as sync:
        for round_ in (1, 2):
            synced = await sync.sync(announce(chain, round_), held, job)
            assert synced.method == "update"
            assert synced.path == job.held_path(round_)
            assert_same(synced.tensors(), chain.thetas[round_])
            assert params_hash(synced.path) == chain.hashes[round_]
            job.record_params(synced.version)
            held = HeldTheta(synced.version, synced.path)
    described = ThetaChain.load(job.held_path(2))
    params = tmp_path / "jobs" / JOB / "params"
    files = sorted(p.name for p in params.iterdir() if p.name != "current.json")
    if every == 3:  # θ_0's file and both updates
        assert (described.base, described.base_round) == (job.params_path(0), 0)
        assert [u.path for u in described.updates] == [job.update_path(0), job.update_path(1)]
        assert files == [
            "round-0.safetensors",
            "round-1.chain.json",
            "round-2.chain.json",
            "update-0.bundle",
            "update-1.bundle",
        ]
    else:  # θ_2 written whole: θ_1's chain kept (a worker group may still read it)
        assert (described.base, described.updates) == (job.params_path(2), ())
        assert files == [
            "round-0.safetensors",
            "round-1.chain.json",
            "round-2.chain.json",
            "round-2.safetensors",
            "update-0.bundle",
        ]
    assert job.load_params() == HeldTheta(ParamsVersion(2, chain.hashes[2]), job.held_path(2))


async def test_a_kept_update_changed_on_disk_is_refused_and_the_region_resyncs(
    chain: Chain,
    served: tuple[FakeCoordinatorFiles, str],
    federation: Federation,
    tmp_path: Path,
) -> None:
    """θ_1 held as θ_0's file and round 0's update; a byte of that update changes on disk.
    Reaching θ_2 reads the chain to hash it: the changed chunk is refused, and θ_2 comes
    from a resync, bit for bit."""
    job = place_in(tmp_path)
    async with synchronizing(served[1], federation, theta_file_every=3) as sync:
        first = await sync.sync(announce(chain, 1), held_theta(chain, 0, tmp_path), job)
        kept = job.update_path(0)
        stored = ThetaChain.load(first.path).updates[0]
        data = bytearray(kept.read_bytes())
        data[stored.start + stored.sizes[0] + stored.sizes[1] - 40] ^= 0x01  # chunk 0
        kept.write_bytes(bytes(data))
        second = await sync.sync(announce(chain, 2), HeldTheta(first.version, first.path), job)
    assert second.method == "resync"
    assert second.refused is not None
    assert f"update of round 0 at {kept}" in second.refused, second.refused
    assert_same(second.tensors(), chain.thetas[2])


async def test_held_theta_with_the_announced_hash_needs_no_download(
    chain: Chain,
    synchronizer: Synchronizer,
    served: tuple[FakeCoordinatorFiles, str],
    tmp_path: Path,
) -> None:
    held = held_theta(chain, 1, tmp_path)
    synced = await synchronizer.sync(announce(chain, 1), held, place_in(tmp_path))
    assert synced.method == "held"
    assert synced.path == held.path
    assert served[0].hits == {}


async def test_resync_stops_at_the_announced_round(
    chain: Chain, synchronizer: Synchronizer, tmp_path: Path
) -> None:
    synced = await synchronizer.sync(announce(chain, 1), None, place_in(tmp_path))
    assert synced.version == ParamsVersion(1, chain.hashes[1])
    assert_same(synced.tensors(), chain.thetas[1])


def flip_last_frame_byte(bundle: bytes) -> bytes:
    data = bytearray(bundle)
    data[-40] ^= 0x01  # inside the trailer frame's body
    return bytes(data)


def resign_by(signer: Principal) -> Callable[[Chain], bytes]:
    def make(chain: Chain) -> bytes:
        update = chain.manifests[1]
        bundle, _ = artifact_bundle(
            signer,
            ArtifactKind.GLOBAL_UPDATE,
            1,
            {n: chain.thetas[2][n] - chain.thetas[1][n] for n in chain.thetas[1]},
            base_hash=update.base_hash,
            parameters_hash=update.parameters_hash,
        )
        return bundle

    return make


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (lambda chain, fed: flip_last_frame_byte(chain.updates[1]), "sha256"),
        (lambda chain, fed: resign_by(fed.region("us-east"))(chain), "not by a coordinator"),
        (lambda chain, fed: chain.updates[0], "is for global_update tiny/0"),
        (
            lambda chain, fed: chain.updates[1].replace(b'"round":1', b'"round":7', 1),
            "signature does not match",
        ),
    ],
    ids=["flipped-byte", "signed-by-a-region", "replayed-old-update", "edited-manifest"],
)
async def test_tampered_update_is_refused_and_triggers_a_resync(
    chain: Chain,
    federation: Federation,
    synchronizer: Synchronizer,
    served: tuple[FakeCoordinatorFiles, str],
    tamper: Callable[[Chain, Federation], bytes],
    reason: str,
    tmp_path: Path,
) -> None:
    fake = served[0]
    fake.files[f"/v1/jobs/{JOB}/rounds/1/update"] = tamper(chain, federation)
    announcement = announce(chain, 2)
    held = held_theta(chain, 1, tmp_path)
    synced = await synchronizer.sync(announcement, held, place_in(tmp_path))
    assert synced.method == "resync"
    assert synced.refused is not None
    assert reason in synced.refused
    assert_same(synced.tensors(), chain.thetas[2])
    assert fake.hits["/artifacts/snapshot-0"] == 1


async def test_update_whose_digest_differs_from_the_announcement_is_refused(
    chain: Chain, synchronizer: Synchronizer, tmp_path: Path
) -> None:
    synced = await synchronizer.sync(
        announce(chain, 2, update_digest="ab" * 32),
        held_theta(chain, 1, tmp_path),
        place_in(tmp_path),
    )
    assert synced.method == "resync"
    assert synced.refused is not None
    assert "manifest digest" in synced.refused


async def test_resync_that_cannot_reach_the_announced_hash_fails(
    chain: Chain, synchronizer: Synchronizer, tmp_path: Path
) -> None:
    with pytest.raises(ResyncFailed, match="announced"):
        await synchronizer.sync(announce(chain, 2, base_hash="0" * 64), None, place_in(tmp_path))


async def test_resync_with_a_tampered_snapshot_fails(
    chain: Chain,
    synchronizer: Synchronizer,
    served: tuple[FakeCoordinatorFiles, str],
    tmp_path: Path,
) -> None:
    served[0].files["/artifacts/snapshot-0"] = flip_last_frame_byte(chain.snapshot)
    with pytest.raises(ResyncFailed, match="sha256"):
        await synchronizer.sync(announce(chain, 1), None, place_in(tmp_path))
    kept = await asyncio.to_thread(lambda: sorted(p.name for p in tmp_path.rglob("*.*")))
    assert kept == []  # nothing of it was kept: not θ_0, nor the download


def test_verify_artifact_refuses_an_untrusted_federation(tmp_path: Path, chain: Chain) -> None:
    other = make_federation(tmp_path / "other", name="otherfed")
    with pytest.raises(ArtifactRejected, match="signer certificate refused"):
        verify_artifact(
            chain.updates[0],
            other.bundle(),
            kind=ArtifactKind.GLOBAL_UPDATE,
            job=JOB,
            round_=0,
            now=NOW,
        )


@pytest.mark.parametrize("window", [1, 3])
async def test_a_resync_fetches_the_chain_window_at_a_time_and_applies_it_in_order(
    chain: Chain,
    served: tuple[FakeCoordinatorFiles, str],
    federation: Federation,
    window: int,
    tmp_path: Path,
) -> None:
    fake, url = served
    fake.delay_s = 0.05
    async with synchronizing(url, federation, download_window=window) as sync:
        synced = await sync.sync(announce(chain, 2), None, place_in(tmp_path))
    assert synced.method == "resync"
    assert synced.version == ParamsVersion(2, chain.hashes[2])
    assert_same(synced.tensors(), chain.thetas[2])
    # The snapshot and both updates: one at a time, or all three at once.
    assert fake.most_in_flight == window
    assert [fake.hits[p] for p in ("/artifacts/snapshot-0", "/artifacts/update-0")] == [1, 1]
