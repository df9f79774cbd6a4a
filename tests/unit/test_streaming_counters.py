"""What a region counts for the downloads it applies under ``overlap: streaming``: an
update names one fragment of θ and stands for that fragment's float32 size, not the
whole model's; a snapshot stays all of θ.

The coordinator serves signed artifacts through a client that answers from memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import cast

import pytest
import torch
from prometheus_client import CollectorRegistry

from geofed.api_paths import ApiPaths
from geofed.artifact_bundle import pack_bundle
from geofed.codec import EncodedStream, decode, encode_stream
from geofed.codec_params import CodecParams
from geofed.control import RoundAnnouncement
from geofed.deltas import apply_partial_update
from geofed.fragments import fragment_plan
from geofed.manifest import ArtifactProvenance, build_manifest, sign_manifest
from geofed.params import parameters_vector_hash
from geofed.types import ArtifactKind
from regional_agent.metrics import AgentMetrics
from regional_agent.state import AgentState, HeldTheta, JobDirectory, ParamsVersion
from regional_agent.transfer.coordinator_client import Answer, CoordinatorClient
from regional_agent.transfer.sync import Synchronizer
from tests.support.agent_schedule import REGION, announce
from tests.support.pki import Federation, Principal, make_federation

JOB = "llm"
Params = dict[str, torch.Tensor]
# Four tensors of distinct sizes; F = 2 splits them {w1, b2} / {w2, b1}.
THETA: Params = {
    "w1": torch.linspace(-1, 1, 96).reshape(8, 12),
    "b1": torch.linspace(0, 1, 8),
    "w2": torch.linspace(1, -1, 90).reshape(9, 10),
    "b2": torch.linspace(-0.5, 0.5, 4),
}
UPDATE_URL = f"/v1/jobs/{JOB}/rounds/0/update"
FRAGMENT = fragment_plan({n: tuple(t.shape) for n, t in THETA.items()}, 2).names(0)


def fp32_size(names: Iterable[str]) -> int:
    return 4 * sum(THETA[name].numel() for name in names)


def signed_bundle(
    signer: Principal,
    kind: ArtifactKind,
    stream: EncodedStream,
    parameters_hash: str,
    base_hash: str | None = None,
) -> tuple[bytes, str]:
    """A round-0 artifact of ``stream`` as the coordinator publishes it, and its manifest
    digest."""
    manifest = build_manifest(
        kind=kind,
        job=JOB,
        round=0,
        producer=signer.identity,
        stream=stream,
        provenance=(ArtifactProvenance(region=REGION, jurisdiction="EU", datasets=()),),
        created_at=datetime.now(UTC),
        base_round=0 if kind is ArtifactKind.GLOBAL_UPDATE else None,
        base_hash=base_hash,
        parameters_hash=parameters_hash,
    )
    credential = signer.credential
    signed = sign_manifest(manifest, credential.private_key, credential.certificate).to_bytes()
    return pack_bundle(signed, list(stream.frames())), hashlib.sha256(signed).hexdigest()


@dataclass
class Chain:
    """θ_0 (an fp32 snapshot), the int8 update of round 0 naming only its fragment, θ_1."""

    snapshot: bytes
    update: bytes
    update_digest: str
    hashes: tuple[str, str]


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Federation:
    return make_federation(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def chain(federation: Federation) -> Chain:
    coordinator = federation.coordinator()
    base = parameters_vector_hash(THETA)
    whole = encode_stream(THETA, CodecParams(scheme="fp32"))
    snapshot, _ = signed_bundle(coordinator, ArtifactKind.GLOBAL_CHECKPOINT, whole, base)
    intended = {name: torch.full_like(THETA[name], 0.01) for name in FRAGMENT}
    stream = encode_stream(intended, CodecParams(scheme="int8"))
    following = parameters_vector_hash(apply_partial_update(THETA, decode(stream.frames())))
    update, digest = signed_bundle(
        coordinator, ArtifactKind.GLOBAL_UPDATE, stream, following, base_hash=base
    )
    return Chain(snapshot, update, digest, (base, following))


class ServedFiles:
    """The coordinator's download endpoints as the client answers them: path -> bytes."""

    def __init__(self, chain: Chain) -> None:
        self.files = {"/snapshot-0": chain.snapshot, UPDATE_URL: chain.update}
        self.latest = {
            "job": JOB,
            "round": 1,
            "parameters_hash": chain.hashes[1],
            "snapshot": {"round": 0, "url": "/snapshot-0"},
            "updates": [{"round": 0, "url": UPDATE_URL}],
        }

    async def request(self, method: str, path: str, **_: object) -> Answer:
        assert (method, path) == ("GET", ApiPaths.latest_checkpoint(JOB))
        return Answer(200, {}, json.dumps(self.latest).encode())

    async def download_to(
        self,
        path: str,
        target: Path,
        *,
        what: str | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ) -> int:
        data = self.files[path]
        if on_bytes is not None:
            on_bytes(len(data))
        await asyncio.to_thread(target.write_bytes, data)
        return len(data)


@pytest.fixture
def synchronizer(chain: Chain, federation: Federation) -> tuple[Synchronizer, CollectorRegistry]:
    registry = CollectorRegistry()
    client = cast(CoordinatorClient, ServedFiles(chain))
    metrics = AgentMetrics(registry, REGION)
    return Synchronizer(client, federation.bundle(), metrics=metrics), registry


def fp32_downloaded(registry: CollectorRegistry, scheme: str) -> float | None:
    return registry.get_sample_value(
        "geofed_agent_fp32_equivalent_bytes_total",
        {"region": REGION, "direction": "download", "scheme": scheme},
    )


def round_1(chain: Chain) -> RoundAnnouncement:
    return announce(JOB, 1, base_hash=chain.hashes[1], update_digest=chain.update_digest)


def job_directory(root: Path) -> JobDirectory:
    job = AgentState(root).job(JOB)
    job.prepare_params()
    return job


async def test_an_applied_partial_update_counts_only_its_fragment(
    chain: Chain, synchronizer: tuple[Synchronizer, CollectorRegistry], tmp_path: Path
) -> None:
    sync, registry = synchronizer
    job = job_directory(tmp_path)
    version = ParamsVersion(0, chain.hashes[0])
    held = HeldTheta(version, job.save_params(version, THETA))
    assert fp32_size(FRAGMENT) < fp32_size(THETA)
    synced = await sync.sync(round_1(chain), held, job)
    assert synced.method == "update"
    assert fp32_downloaded(registry, "int8") == fp32_size(FRAGMENT)


async def test_a_resync_counts_the_whole_snapshot_and_the_updates_fragment(
    chain: Chain, synchronizer: tuple[Synchronizer, CollectorRegistry], tmp_path: Path
) -> None:
    sync, registry = synchronizer
    synced = await sync.sync(round_1(chain), None, job_directory(tmp_path))
    assert synced.method == "resync"
    assert fp32_downloaded(registry, "fp32") == fp32_size(THETA)
    assert fp32_downloaded(registry, "int8") == fp32_size(FRAGMENT)
