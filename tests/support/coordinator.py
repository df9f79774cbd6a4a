"""Shared set-up of the coordinator integration tests (no tests of its own).

A throwaway federation (``tests.support.pki``), the repository's region policies, an
embedded MQTT broker (or a real Mosquitto: :func:`mosquitto_setup`), and a coordinator app
on an ephemeral loopback port with real TLS and a real SQLite state directory.
:class:`FakeRegion` is the outer edge: test code acting as a regional agent, built
directly on the codec, manifest and PKI libraries.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Generic, Self, TypeVar

import aiohttp
import torch
from aiohttp import web
from prometheus_client import CollectorRegistry

from coordinator.api.app import create_app
from coordinator.api.server import CoordinatorRunner
from coordinator.config import CoordinatorConfig, load_config
from coordinator.runtime import load_runtime
from geofed.artifact_bundle import pack_bundle, split_bundle
from geofed.codec import EncodedStream, decode, encode_stream
from geofed.codec_params import CodecParams
from geofed.control import Command, ControlClient, Event, RegionStatus, RoundAnnouncement, Topics
from geofed.control import decode as decode_message
from geofed.lineage import Software
from geofed.manifest import (
    ArtifactProvenance,
    SignedManifest,
    build_manifest,
    sign_manifest,
)
from geofed.params import parameters_vector_hash, state_to_fp32
from geofed.pki import TrustBundle, load_trust_bundle
from geofed.pki.httpauth import VerifiedConnector
from geofed.types import ArtifactKind, Role
from tests.support.mosquitto import run_mosquitto
from tests.support.pki import Federation, Principal, make_federation
from tests.support.tiny_task import TinyOptions, TinyTask

FEDERATION = "acme"
POLICIES = Path(__file__).resolve().parents[2] / "configs" / "policies"
JURISDICTIONS = {"eu-west": "EU", "us-east": "US", "ap-south": "IN"}
DATASETS = {
    "eu-west": ["eu-parliament-proceedings"],
    "us-east": ["us-public-domain-books"],
    "ap-south": ["in-indic-wikipedia"],
}
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=20)

#: The job id :func:`job_yaml` writes unless told another.
JOB = "tiny"
_JOB_YAML = """\
job: {job}
task:
  spec: {task}
  options: {{hidden: 8}}
regions:
  eu-west: [eu-parliament-proceedings]
  us-east: [us-public-domain-books]
{extra}rounds: {rounds}
inner_steps: 2
codec: {{scheme: int8, block_size: 32}}
snapshot_every: 2
deadline: {{initial_s: {deadline}, min_s: {deadline}, max_s: 60}}
checkpoint_storage: [us-ckpt, eu-ckpt]
"""


def job_yaml(
    job: str = JOB,
    *,
    rounds: int = 3,
    deadline: float = 30,
    extra: str = "",
    task: str = "tests.support.tiny_task:TinyTask",
) -> str:
    return _JOB_YAML.format(job=job, rounds=rounds, deadline=deadline, extra=extra, task=task)


class EvaluatedTinyTask(TinyTask):
    """The tiny task with a held-out loss, so the coordinator has something to evaluate."""

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        gen = torch.Generator().manual_seed(1234)
        inputs = torch.randn(16, self.options.in_dim, generator=gen)
        with torch.no_grad():
            loss = torch.nn.functional.mse_loss(model(inputs), inputs @ self._teacher)
        return {"val_loss": float(loss)}


def model_state() -> dict[str, torch.Tensor]:
    """θ_0 of the job above (TinyTask, hidden 8, seed 0)."""
    return state_to_fp32(TinyTask(TinyOptions(hidden=8)).build_model(seed=0))


@dataclass
class Setup:
    """A federation, its principals and a configuration file for one coordinator."""

    root: Path
    fed: Federation
    coordinator: Principal
    operator: Principal
    observer: Principal
    regions: dict[str, Principal]
    broker_port: int
    config_path: Path
    trust_file: Path
    insecure: bool = False

    def config(self) -> CoordinatorConfig:
        return load_config(self.config_path)

    def bundle(self) -> TrustBundle:
        return load_trust_bundle(self.trust_file)


def write_setup(
    root: Path,
    broker_port: int,
    *,
    insecure: bool = False,
    mqtt_tls: bool = False,
    fed: Federation | None = None,
    timeouts: str = "{connect_s: 1, heartbeat_s: 0.5, request_s: 2, upload_s: 5, "
    "download_s: 5, round_deadline_s: 20}",
) -> Setup:
    fed = fed or make_federation(root / "fed", FEDERATION)
    coordinator = fed.coordinator()
    regions = {name: fed.region(name) for name in ("eu-west", "us-east", "ap-south")}
    tls = "insecure_loopback: true" if insecure else "tls: {}"
    text = f"""\
federation: {FEDERATION}
jurisdiction: EU
listen: {{host: 127.0.0.1, port: 0}}
{tls}
trust_bundle: {fed.bundle_file}
identity: {{cert: {coordinator.cert_file}, key: {coordinator.key_file}}}
mqtt: {{host: 127.0.0.1, port: {broker_port}, tls: {"true" if mqtt_tls else "false"}}}
state_dir: state
policies_dir: {POLICIES}
storage:
  - {{name: eu-ckpt, jurisdiction: EU, path: ckpt/eu}}
  - {{name: us-ckpt, jurisdiction: US, path: ckpt/us}}
timeouts: {timeouts}
limits: {{max_upload_bytes: 1048576, max_manifest_bytes: 65536, max_chunk_bytes: 65536}}
task_modules: [tests.support.*]
"""
    path = root / "coordinator.yaml"
    path.write_text(text)
    return Setup(
        root,
        fed,
        coordinator,
        fed.operator(),
        fed.observer(),
        regions,
        broker_port,
        path,
        fed.bundle_file,
        insecure,
    )


@dataclass
class Running:
    """A coordinator app served on a loopback port."""

    runner: web.AppRunner
    port: int
    registry: CollectorRegistry
    setup: Setup
    sessions: list[aiohttp.ClientSession] = field(default_factory=list)

    @property
    def url(self) -> str:
        scheme = "http" if self.setup.insecure else "https"
        return f"{scheme}://localhost:{self.port}"

    def region(self, name: str) -> FakeRegion:
        principal = self.setup.regions[name]
        return FakeRegion(principal, self.session(principal), self.setup.bundle)

    def session(self, principal: Principal) -> aiohttp.ClientSession:
        """A client session presenting ``principal`` (certificate, or header if insecure)."""
        bundle = self.setup.bundle
        if self.setup.insecure:
            session = aiohttp.ClientSession(
                base_url=self.url,
                timeout=HTTP_TIMEOUT,
                headers={"X-Geofed-Identity": principal.identity.uri},
            )
        else:
            connector = VerifiedConnector(
                bundle, principal.client_context(bundle()), expect=Role.COORDINATOR
            )
            session = aiohttp.ClientSession(
                base_url=self.url, connector=connector, timeout=HTTP_TIMEOUT
            )
        self.sessions.append(session)
        return session


@asynccontextmanager
async def coordinator(setup: Setup) -> AsyncIterator[Running]:
    """Serve a coordinator for ``setup`` until the block ends (then clean it up)."""
    runtime = load_runtime(setup.config())
    registry = CollectorRegistry()
    app = create_app(runtime, registry=registry)
    runner = CoordinatorRunner(app)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    site = web.SockSite(runner, sock, ssl_context=runtime.server_ssl())
    running = Running(runner, port, registry, setup)
    try:
        await site.start()
        yield running
    finally:
        for session in running.sessions:
            await session.close()
        await runner.cleanup()


M = TypeVar("M", RoundAnnouncement, RegionStatus, Command, Event)


class Subscribed(Generic[M]):
    """Collects the control messages of one type published on ``topic`` (in ``queue``),
    as a watcher on the broker at ``port``."""

    def __init__(self, port: int, topic: str, kind: type[M], client_id: str) -> None:
        self.client = ControlClient("127.0.0.1", port, client_id=client_id, timeout_s=5.0)
        self.queue: asyncio.Queue[M] = asyncio.Queue()
        self._topic = topic
        self._kind: type[M] = kind
        self._task: asyncio.Task[None] | None = None

    async def _on_message(self, topic: str, payload: bytes) -> None:
        await self.queue.put(decode_message(payload, self._kind))

    async def __aenter__(self) -> Self:
        await self.client.subscribe(self._topic, self._on_message)
        self._task = asyncio.create_task(self.client.run())
        await self.client.wait_connected(5.0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close(timeout_s=5.0)
        if self._task is not None:
            await asyncio.wait([self._task])


class Announcements(Subscribed[RoundAnnouncement]):
    """Collects the round announcements the coordinator publishes on MQTT."""

    def __init__(self, port: int) -> None:
        topic = Topics(FEDERATION).all_job_rounds()
        super().__init__(port, topic, RoundAnnouncement, "test-watcher")

    async def until(
        self, round: int, state: str, timeout_s: float = 20.0, job: str | None = None
    ) -> RoundAnnouncement:
        """The next announcement of ``round`` in ``state`` (of ``job``, if given)."""
        async with asyncio.timeout(timeout_s):
            while True:
                message = await self.queue.get()
                if (message.round, message.state) == (round, state) and job in (None, message.job):
                    return message


class FakeRegion:
    """Test code acting as a region's agent (the outer edge of these tests)."""

    def __init__(
        self,
        principal: Principal,
        session: aiohttp.ClientSession,
        bundle: Callable[[], TrustBundle],
    ) -> None:
        self.principal = principal
        self.name = principal.identity.name
        self.session = session
        self._bundle = bundle

    def delta(
        self,
        job: str,
        round: int,
        base_hash: str,
        *,
        seed: int,
        tokens: int = 100,
        codec: CodecParams | None = None,
        chunk_elements: int = 64,
        tensors: dict[str, torch.Tensor] | None = None,
        base_eval: dict[str, float] | None = None,
        software: Software | None = None,
    ) -> tuple[bytes, EncodedStream]:
        """A signed manifest and the encoded stream of a small random delta (``base_eval``:
        the region's metrics of the base parameters, as a region that evaluated sends;
        ``software``: what trained it, for the round's lineage)."""
        codec = codec or CodecParams(scheme="int8", block_size=32)
        if tensors is None:
            gen = torch.Generator().manual_seed(seed)
            tensors = {
                name: 0.01 * torch.randn(t.shape, generator=gen)
                for name, t in model_state().items()
            }
        stream = encode_stream(tensors, codec, chunk_elements=chunk_elements)
        manifest = build_manifest(
            kind=ArtifactKind.MODEL_DELTA,
            job=job,
            round=round,
            producer=self.principal.identity,
            stream=stream,
            provenance=(
                ArtifactProvenance(
                    region=self.name,
                    jurisdiction=JURISDICTIONS[self.name],
                    datasets=tuple(DATASETS[self.name]),
                ),
            ),
            created_at=datetime.now(UTC),
            base_round=round,
            base_hash=base_hash,
            tokens=tokens,
            base_eval=base_eval,
            software=software,
        )
        credential = self.principal.credential
        signed = sign_manifest(manifest, credential.private_key, credential.certificate)
        return signed.to_bytes(), stream

    def path(self, job: str, round: int, region: str | None = None) -> str:
        return f"/v1/jobs/{job}/rounds/{round}/deltas/{region or self.name}"

    async def three_step(
        self, job: str, round: int, manifest: bytes, stream: EncodedStream, *, loss: float = 1.5
    ) -> tuple[int, dict[str, Any]]:
        path = self.path(job, round)
        status, body = await request(self.session, "PUT", path + "/manifest", data=manifest)
        if status != 200 or body["state"] == "accepted":
            return status, body
        for index, frame in enumerate(stream.frames()):
            if index in body["received"]:
                continue
            status, answer = await request(
                self.session, "PUT", f"{path}/chunks/{index}", data=frame
            )
            if status != 200:
                return status, answer
        return await request(
            self.session, "POST", path + "/commit", json={"metrics": {"train_loss": loss}}
        )

    async def single_shot(
        self, job: str, round: int, manifest: bytes, stream: EncodedStream
    ) -> tuple[int, dict[str, Any]]:
        return await request(
            self.session, "PUT", self.path(job, round), data=pack_bundle(manifest, stream.frames())
        )

    async def download_params(self, job: str) -> tuple[dict[str, torch.Tensor], str, int]:
        """Resync as a joiner: snapshot + update chain, every signature and hash checked."""
        status, latest = await request(self.session, "GET", f"/v1/jobs/{job}/checkpoints/latest")
        assert status == 200, latest
        params = await self._artifact(latest["snapshot"]["url"], ArtifactKind.GLOBAL_CHECKPOINT)
        for update in latest["updates"]:
            delta = await self._artifact(update["url"], ArtifactKind.GLOBAL_UPDATE)
            params = {name: params[name] + delta[name] for name in params}
        assert parameters_vector_hash(params) == latest["parameters_hash"]
        return params, latest["parameters_hash"], latest["round"]

    async def download_update(self, job: str, round: int) -> tuple[dict[str, torch.Tensor], str]:
        """The update of ``round`` and the hash of the parameters it leads to."""
        async with self.session.get(f"/v1/jobs/{job}/rounds/{round}/update") as response:
            assert response.status == 200, await response.text()
            data = await response.read()
        manifest_bytes, stream = split_bundle(data)
        signed = SignedManifest.from_bytes(manifest_bytes)
        producer = signed.verify(self._bundle(), now=datetime.now(UTC))
        assert producer.role is Role.COORDINATOR
        digests = [record.sha256 for record in signed.manifest.chunks]
        update = decode(stream, expected_header_digest=digests[0], expected_digests=digests[1:-1])
        assert signed.manifest.parameters_hash is not None
        return update, signed.manifest.parameters_hash

    async def _artifact(self, url: str, kind: ArtifactKind) -> dict[str, torch.Tensor]:
        async with self.session.get(url) as response:
            assert response.status == 200, await response.text()
            data = await response.read()
        manifest_bytes, stream = split_bundle(data)
        signed = SignedManifest.from_bytes(manifest_bytes)
        assert signed.verify(self._bundle(), now=datetime.now(UTC)).role is Role.COORDINATOR
        assert signed.manifest.kind is kind
        return decode(stream)


async def request(
    session: aiohttp.ClientSession, method: str, path: str, **kwargs: Any
) -> tuple[int, dict[str, Any]]:
    """One request and its JSON answer. A ``str`` body (a job spec) goes as YAML: aiohttp
    would label it ``text/plain``, which the coordinator refuses as a page's form post."""
    if isinstance(kwargs.get("data"), str):
        kwargs["data"] = kwargs["data"].encode("utf-8")
        kwargs["headers"] = {"Content-Type": "application/yaml", **kwargs.get("headers", {})}
    async with session.request(method, path, **kwargs) as response:
        body = await response.json(content_type=None)
        return response.status, body


async def metric_value(running: Running, session: aiohttp.ClientSession, line_prefix: str) -> float:
    async with session.get("/metrics") as response:
        assert response.status == 200
        text = await response.text()
    for line in text.splitlines():
        if line.startswith(line_prefix + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# -- a coordinator on Mosquitto, and what the tests read from it ---------------------------


@contextmanager
def mosquitto_setup(root: Path, **options: Any) -> Iterator[Setup]:
    """A federation and a coordinator configuration on a running Mosquitto (mTLS)."""
    fed = make_federation(root / "fed", FEDERATION)
    server = fed.coordinator("broker")
    with run_mosquitto(
        root / "mqtt", cafile=fed.ca_file, certfile=server.cert_file, keyfile=server.key_file
    ) as broker:
        yield write_setup(root, broker.port, mqtt_tls=True, fed=fed, **options)


async def wait_collecting(
    observer: aiohttp.ClientSession, round: int, *, job: str = JOB, timeout_s: float = 30.0
) -> dict[str, Any]:
    """The job's status once ``round`` collects deltas (polled over HTTP)."""
    body: dict[str, Any] = {}
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                status, body = await request(observer, "GET", f"/v1/jobs/{job}")
                current = body.get("current") or {}
                if (
                    status == 200
                    and body["round"] == round
                    and current.get("round") == round
                    and current.get("phase") == "collecting"
                ):
                    return body
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"round {round} of {job} did not open: {body}") from None


async def audit_after(
    observer: aiohttp.ClientSession, seq: int, *, job: str = JOB
) -> list[dict[str, Any]]:
    """Audit entries of ``job`` after ``seq``."""
    status, body = await request(observer, "GET", f"/v1/audit?after={seq}&limit=1000&job={job}")
    assert status == 200, body
    entries: list[dict[str, Any]] = body["entries"]
    return entries
