"""Hostile delta uploads against a running coordinator (real TLS, SQLite, Mosquitto).

One table holds every hostile case: flipped bytes, a tampered manifest, an inflated token
claim, a replayed delta, another region's or a revoked certificate, wrong shapes, NaN/Inf,
oversize bodies, decompression bombs and garbage. Each must get its 4xx and error code, one
``delta.reject`` audit entry and one ``geofed_deltas_rejected_total`` increment with that
code, and leave the job's parameters, checkpoint and delivered list as they were. An
honest upload of the same round succeeds afterwards.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
import zstandard
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from geofed.artifact_bundle import pack_bundle
from geofed.codec import EncodedStream
from geofed.codec.wire import (
    CHUNK_FIELDS,
    PREFIX,
    TAG_SIZE,
    Compression,
    FrameKind,
    TrailerFields,
    chunk_fields,
    header_body,
    parse_chunk_fields,
    parse_header_body,
    parse_trailer_body,
    seal,
    trailer_body,
)
from geofed.manifest import Manifest, ManifestTensor, SignedManifest, chunk_records, sign_manifest
from tests.support.coordinator import (
    JOB,
    FakeRegion,
    Running,
    audit_after,
    coordinator,
    job_yaml,
    mosquitto_setup,
    request,
    wait_collecting,
)
from tests.support.pki import Principal

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REJECTED = "geofed_deltas_rejected_total"
Answer = tuple[int, dict[str, Any]]


# -- a coordinator on Mosquitto, and what the tests read from it ----------------------


async def rejected_counts(observer: aiohttp.ClientSession) -> dict[str, float]:
    """``geofed_deltas_rejected_total`` by code, as scraped from /metrics."""
    async with observer.get("/metrics") as response:
        assert response.status == 200
        text = await response.text()
    counts: dict[str, float] = {}
    prefix = REJECTED + '{code="'
    for line in text.splitlines():
        if line.startswith(prefix):
            code, _, value = line[len(prefix) :].partition('"} ')
            counts[code] = float(value)
    return counts


async def audit_head(observer: aiohttp.ClientSession) -> int:
    status, body = await request(observer, "GET", "/v1/audit?limit=1")
    assert status == 200, body
    head: int = body["head"]["seq"]
    return head


async def global_state(
    observer: aiohttp.ClientSession, region: FakeRegion, *, job: str = JOB
) -> dict[str, Any]:
    """What must not change: parameters, round, delivered deltas and the latest checkpoint."""
    status, body = await request(observer, "GET", f"/v1/jobs/{job}")
    assert status == 200, body
    status, latest = await request(region.session, "GET", f"/v1/jobs/{job}/checkpoints/latest")
    assert status == 200, latest
    current = body["current"]
    return {
        "round": body["round"],
        "params_hash": body["params_hash"],
        "phase": current["phase"],
        "attempt": current["attempt"],
        "delivered": current["delivered"],
        "latest": latest,
    }


# -- building hostile artifacts --------------------------------------------------------


def resign(principal: Principal, manifest: bytes, **changes: Any) -> bytes:
    """``manifest`` with ``changes`` applied, signed again by ``principal``."""
    parsed = SignedManifest.from_bytes(manifest).manifest
    updated = Manifest.model_validate({**parsed.model_dump(), **changes})
    credential = principal.credential
    return sign_manifest(updated, credential.private_key, credential.certificate).to_bytes()


def signed_by_another(principal: Principal, manifest: bytes) -> bytes:
    """The same manifest with a valid signature by ``principal``, who is not its producer."""
    parsed = SignedManifest.from_bytes(manifest).manifest
    credential = principal.credential
    signature = credential.private_key.sign(parsed.canonical_bytes(), ec.ECDSA(hashes.SHA256()))
    return SignedManifest(parsed, signature, credential.certificate).to_bytes()


def for_frames(principal: Principal, manifest: bytes, frames: list[bytes]) -> bytes:
    """``manifest`` re-signed so that it describes exactly ``frames`` (a forged stream)."""
    return resign(
        principal,
        manifest,
        chunks=[record.model_dump() for record in chunk_records(frames)],
        total_size=sum(len(frame) for frame in frames),
    )


def zstd_of(frame: bytes) -> bytes:
    """The zstd frame inside a chunk frame."""
    return frame[PREFIX.size + CHUNK_FIELDS.size : -TAG_SIZE]


def rechained(header: bytes, chunks: list[bytes], stream: EncodedStream) -> list[bytes]:
    """Frames ``header``, ``chunks`` and a trailer whose digests and sizes fit them."""
    chained = hashlib.sha256(hashlib.sha256(header).digest())
    for frame in chunks:
        chained.update(hashlib.sha256(frame).digest())
    old = parse_trailer_body(stream.trailer[PREFIX.size : -TAG_SIZE])
    size = len(header) + sum(len(frame) for frame in chunks)
    fields = TrailerFields(old.chunk_count, old.total_elements, size, chained.digest())
    return [header, *chunks, seal(FrameKind.TRAILER, [trailer_body(fields)]).data]


def with_chunk_payload(stream: EncodedStream, index: int, zstd_frame: bytes) -> list[bytes]:
    """The stream's frames with chunk ``index`` carrying ``zstd_frame``, sealed and chained
    as a well-behaved encoder would: only the payload itself is hostile."""
    chunks = []
    for chunk in stream.chunks:
        frame = chunk.data
        if chunk.index == index:
            # The hostile payload is a zstd frame, whatever the original chunk stored.
            fields = chunk_fields(
                replace(parse_chunk_fields(frame[PREFIX.size :]), compression=Compression.ZSTD)
            )
            frame = seal(FrameKind.CHUNK, [fields, zstd_frame]).data
        chunks.append(frame)
    return rechained(stream.header, chunks, stream)


def with_scale(stream: EncodedStream, value: float) -> list[bytes]:
    """Chunk 0 with its first block scale set to ``value`` (a bfloat16: NaN or Inf here).

    The encoder refuses non-finite deltas, so a region that sends one forged it.
    """
    frame = stream.chunks[0].data
    stored = parse_chunk_fields(frame[PREFIX.size :]).compression == Compression.NONE
    body = zstd_of(frame)
    payload = bytearray(body if stored else zstandard.ZstdDecompressor().decompress(body))
    payload[0:2] = struct.pack("<f", value)[2:4]  # bfloat16: the high half of a float32
    compressor = zstandard.ZstdCompressor(level=3, write_content_size=True)
    return with_chunk_payload(stream, 0, compressor.compress(bytes(payload)))


def zstd_bomb(stream: EncodedStream) -> list[bytes]:
    """Chunk 0's payload replaced by a zstd frame of megabytes of zeros in a few bytes."""
    frame = stream.chunks[0].data
    limit = len(zstd_of(frame)) + 64  # what a frame of this chunk may weigh
    size = 1 << 24
    compressor = zstandard.ZstdCompressor(level=19, write_content_size=True)
    bomb = compressor.compress(bytes(size))
    while len(bomb) > limit:
        size //= 2
        bomb = compressor.compress(bytes(size))
    assert size >= 1 << 20, f"a {len(bomb)}-byte bomb expands only to {size} bytes"
    return with_chunk_payload(stream, 0, bomb)


def huge_header(stream: EncodedStream) -> list[bytes]:
    """A stream header declaring a billion-element tensor (a size bomb before any chunk)."""
    body = stream.header[PREFIX.size : -TAG_SIZE]
    codec, chunk_elements, specs = parse_header_body(body, "header")
    specs[0] = type(specs[0])(specs[0].name, specs[0].dtype, (1 << 15, 1 << 15))
    header = seal(FrameKind.HEADER, [header_body(codec, chunk_elements, specs)]).data
    return rechained(header, [chunk.data for chunk in stream.chunks], stream)


def odd_header(stream: EncodedStream) -> list[bytes]:
    """A stream header whose first tensor's dtype is a JSON list instead of a name."""
    document = json.loads(stream.header[PREFIX.size : -TAG_SIZE])
    document["tensors"][0][1] = ["float32"]
    body = json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
    header = seal(FrameKind.HEADER, [body]).data
    return rechained(header, [chunk.data for chunk in stream.chunks], stream)


def flipped(frames: list[bytes], index: int) -> list[bytes]:
    out = list(frames)
    frame = bytearray(out[index])
    frame[len(frame) // 2] ^= 0x01
    out[index] = bytes(frame)
    return out


# -- the table ---------------------------------------------------------------------------


@dataclass
class Scene:
    """What the hostile cases act on: the open round, its base, the regions, a replay."""

    running: Running
    observer: aiohttp.ClientSession
    round: int
    base: str
    eu: FakeRegion
    us: FakeRegion
    replay: tuple[bytes, EncodedStream]
    revoked_eu: Principal
    rogue_eu: Principal
    seed: int = 100

    def fresh(self) -> tuple[bytes, EncodedStream]:
        """A new, honest delta of eu-west for the open round (a hostile case alters it)."""
        self.seed += 1
        return self.eu.delta(JOB, self.round, self.base, seed=self.seed)

    @property
    def url(self) -> str:
        return self.eu.path(JOB, self.round)

    async def put(
        self, suffix: str, data: bytes, session: aiohttp.ClientSession | None = None
    ) -> Answer:
        return await request(session or self.eu.session, "PUT", self.url + suffix, data=data)

    async def bundle(self, manifest: bytes, frames: list[bytes]) -> Answer:
        return await self.put("", pack_bundle(manifest, frames))


async def flipped_chunk_three_step(s: Scene) -> Answer:
    manifest, stream = s.fresh()
    status, body = await s.put("/manifest", manifest)
    assert (status, body["state"]) == (200, "open"), body
    frames = flipped(list(stream.frames()), 1)
    return await s.put("/chunks/1", frames[1])


async def flipped_chunk_single_shot(s: Scene) -> Answer:
    manifest, stream = s.fresh()
    return await s.bundle(manifest, flipped(list(stream.frames()), 2))


async def tampered_manifest(s: Scene) -> Answer:
    manifest, stream = s.fresh()
    tampered = manifest.replace(b'"tokens":100', b'"tokens":100000')
    assert tampered != manifest
    return await s.bundle(tampered, list(stream.frames()))


async def inflated_token_claim(s: Scene) -> Answer:
    manifest, stream = s.fresh()
    return await s.bundle(resign(s.eu.principal, manifest, tokens=10**15), list(stream.frames()))


async def replay_at_next_round(s: Scene) -> Answer:
    manifest, stream = s.replay
    return await s.bundle(manifest, list(stream.frames()))


async def replay_at_its_round(s: Scene) -> Answer:
    manifest, stream = s.replay
    return await s.eu.single_shot(JOB, s.round - 1, manifest, stream)


async def replay_relabelled(s: Scene) -> Answer:
    manifest, stream = s.replay
    relabelled = resign(s.eu.principal, manifest, round=s.round, base_round=s.round)
    return await s.bundle(relabelled, list(stream.frames()))


async def another_regions_certificate(s: Scene) -> Answer:
    manifest, stream = s.fresh()
    return await request(s.us.session, "PUT", s.url, data=pack_bundle(manifest, stream.frames()))


async def another_regions_signature(s: Scene) -> Answer:
    manifest, stream = s.fresh()
    forged = signed_by_another(s.us.principal, manifest)
    return await s.bundle(forged, list(stream.frames()))


async def revoked_certificate(s: Scene) -> Answer:
    manifest, stream = s.fresh()
    session = s.running.session(s.revoked_eu)
    return await s.put("", pack_bundle(manifest, stream.frames()), session)


async def revoked_signing_certificate(s: Scene) -> Answer:
    manifest, stream = s.fresh()
    return await s.bundle(resign(s.revoked_eu, manifest), list(stream.frames()))


async def untrusted_signing_certificate(s: Scene) -> Answer:
    manifest, stream = s.fresh()
    return await s.bundle(resign(s.rogue_eu, manifest), list(stream.frames()))


async def wrong_shapes_declared(s: Scene) -> Answer:
    manifest, stream = s.fresh()
    specs = list(SignedManifest.from_bytes(manifest).manifest.tensors)
    specs[0] = ManifestTensor(name=specs[0].name, dtype=specs[0].dtype, shape=(3, 3))
    return await s.bundle(
        resign(s.eu.principal, manifest, tensors=[spec.model_dump() for spec in specs]),
        list(stream.frames()),
    )


async def wrong_shapes_in_stream(s: Scene) -> Answer:
    manifest, _ = s.fresh()
    tensors = {
        spec.name: torch.full((math.prod(spec.shape),), 0.01)
        for spec in SignedManifest.from_bytes(manifest).manifest.tensors
    }
    _, flat = s.eu.delta(JOB, s.round, s.base, seed=0, tensors=tensors)
    frames = list(flat.frames())
    return await s.bundle(for_frames(s.eu.principal, manifest, frames), frames)


async def nan_values(s: Scene) -> Answer:
    manifest, stream = s.fresh()
    frames = with_scale(stream, float("nan"))
    return await s.bundle(for_frames(s.eu.principal, manifest, frames), frames)


async def inf_values(s: Scene) -> Answer:
    manifest, stream = s.fresh()
    frames = with_scale(stream, float("inf"))
    return await s.bundle(for_frames(s.eu.principal, manifest, frames), frames)


async def oversize_manifest_body(s: Scene) -> Answer:
    manifest, _ = s.fresh()
    return await s.put("/manifest", manifest + b" " * (96 * 1024))


async def oversize_declared(s: Scene) -> Answer:
    manifest, stream = s.fresh()
    records = [record.model_dump() for record in chunk_records(stream.frames())]
    records[-1]["size"] = 2 * 1024 * 1024  # a signed promise of a 2 MiB stream
    total = sum(record["size"] for record in records)
    big = resign(s.eu.principal, manifest, chunks=records, total_size=total)
    return await s.bundle(big, list(stream.frames()))


async def oversize_chunk_body(s: Scene) -> Answer:
    manifest, stream = s.fresh()
    status, body = await s.put("/manifest", manifest)
    assert (status, body["state"]) == (200, "open"), body
    return await s.put("/chunks/1", stream.chunks[0].data + bytes(256 * 1024))


async def bundle_longer_than_declared(s: Scene) -> Answer:
    manifest, stream = s.fresh()
    return await s.put("", pack_bundle(manifest, stream.frames()) + bytes(256 * 1024))


async def decompression_bomb(s: Scene) -> Answer:
    manifest, stream = s.fresh()
    frames = zstd_bomb(stream)
    return await s.bundle(for_frames(s.eu.principal, manifest, frames), frames)


async def size_bomb_header(s: Scene) -> Answer:
    manifest, stream = s.fresh()
    frames = huge_header(stream)
    return await s.bundle(for_frames(s.eu.principal, manifest, frames), frames)


async def odd_stream_header(s: Scene) -> Answer:
    manifest, stream = s.fresh()
    frames = odd_header(stream)
    return await s.bundle(for_frames(s.eu.principal, manifest, frames), frames)


async def garbage_manifest(s: Scene) -> Answer:
    return await s.put("/manifest", bytes(range(256)) * 8)


async def garbage_bundle(s: Scene) -> Answer:
    return await s.put("", b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8)


async def garbage_chunk(s: Scene) -> Answer:
    manifest, stream = s.fresh()
    status, body = await s.put("/manifest", manifest)
    assert (status, body["state"]) == (200, "open"), body
    size = len(stream.chunks[0].data)  # frame 1: frame 0 is the stream header
    return await s.put("/chunks/1", (hashlib.sha256(b"garbage").digest() * size)[:size])


async def truncated_bundle(s: Scene) -> Answer:
    manifest, stream = s.fresh()
    data = pack_bundle(manifest, stream.frames())
    return await s.put("", data[: len(data) - 10])


@dataclass(frozen=True)
class Hostile:
    """A hostile upload and what the coordinator must answer.

    ``counted`` is the code of the audit entry and the counter when it differs from the
    answer's: a certificate the TLS layer refuses is answered with the PKI's reason
    (``revoked``) and counted under the protocol's ``untrusted_certificate``.
    """

    case: str
    send: Callable[[Scene], Awaitable[Answer]]
    status: int
    code: str
    counted: str | None = None
    url_round: int = 0  # relative to the open round


TABLE = [
    Hostile(
        "flipped byte in a chunk (three steps)", flipped_chunk_three_step, 400, "corrupt_chunk"
    ),
    Hostile(
        "flipped byte in a chunk (single shot)", flipped_chunk_single_shot, 400, "corrupt_chunk"
    ),
    Hostile("tampered manifest", tampered_manifest, 403, "bad_signature"),
    Hostile(
        "validly signed claim of 10**15 tokens", inflated_token_claim, 400, "tokens_out_of_bounds"
    ),
    Hostile("delta of round r replayed in round r+1", replay_at_next_round, 409, "wrong_round"),
    Hostile(
        "delta of round r replayed in round r",
        replay_at_its_round,
        409,
        "round_closed",
        url_round=-1,
    ),
    Hostile("delta of round r re-signed for round r+1", replay_relabelled, 409, "base_mismatch"),
    Hostile("another region's certificate", another_regions_certificate, 403, "forbidden"),
    Hostile(
        "signed with another region's key", another_regions_signature, 403, "producer_mismatch"
    ),
    Hostile(
        "revoked certificate", revoked_certificate, 403, "revoked", counted="untrusted_certificate"
    ),
    Hostile(
        "signed by a revoked certificate", revoked_signing_certificate, 403, "untrusted_certificate"
    ),
    Hostile(
        "signed by an untrusted CA", untrusted_signing_certificate, 403, "untrusted_certificate"
    ),
    Hostile("wrong shapes in the manifest", wrong_shapes_declared, 400, "shape_mismatch"),
    Hostile("wrong shapes in the stream", wrong_shapes_in_stream, 400, "shape_mismatch"),
    Hostile("NaN values", nan_values, 400, "non_finite"),
    Hostile("Inf values", inf_values, 400, "non_finite"),
    Hostile("oversize manifest body", oversize_manifest_body, 413, "too_large"),
    Hostile("declared size over the limit", oversize_declared, 413, "too_large"),
    Hostile("oversize chunk body", oversize_chunk_body, 400, "corrupt_chunk"),
    Hostile("bundle longer than its manifest", bundle_longer_than_declared, 400, "bad_request"),
    Hostile("decompression bomb in a chunk", decompression_bomb, 400, "decode_failed"),
    Hostile("stream header declaring 2**30 elements", size_bomb_header, 400, "decode_failed"),
    Hostile("stream header with a list for a dtype", odd_stream_header, 400, "decode_failed"),
    Hostile("garbage bytes as a manifest", garbage_manifest, 400, "malformed_manifest"),
    Hostile("garbage bytes as a bundle", garbage_bundle, 400, "bad_request"),
    Hostile("garbage bytes as a chunk", garbage_chunk, 400, "corrupt_chunk"),
    Hostile("truncated bundle", truncated_bundle, 400, "bad_request"),
]


async def open_scene(running: Running) -> Scene:
    """A job whose round 0 took honest deltas of both regions; round 1 collecting."""
    setup = running.setup
    observer = running.session(setup.observer)
    operator = running.session(setup.operator)
    status, body = await request(operator, "POST", "/v1/jobs", data=job_yaml(deadline=60))
    assert status == 201, body
    base = (await wait_collecting(observer, 0))["params_hash"]
    eu, us = running.region("eu-west"), running.region("us-east")
    replay = eu.delta(JOB, 0, base, seed=1)
    assert (await eu.single_shot(JOB, 0, *replay))[1]["state"] == "accepted"
    assert (await us.single_shot(JOB, 0, *us.delta(JOB, 0, base, seed=2)))[0] == 200
    opened = await wait_collecting(observer, 1)
    revoked = setup.fed.region("eu-west")  # a second certificate of eu-west, revoked
    setup.fed.revoke(revoked)
    setup.fed.add_untrusted_authority("rogue")
    return Scene(
        running=running,
        observer=observer,
        round=1,
        base=opened["params_hash"],
        eu=eu,
        us=us,
        replay=replay,
        revoked_eu=revoked,
        rogue_eu=setup.fed.region("eu-west", authority="rogue"),
    )


async def check(scene: Scene, hostile: Hostile, before: dict[str, Any]) -> list[str]:
    """Send one hostile upload; what differs from the expected refusal, if anything."""
    observer = scene.observer
    counted = hostile.counted or hostile.code
    counts, seq = await rejected_counts(observer), await audit_head(observer)
    status, body = await hostile.send(scene)
    found = []
    if (status, body.get("error")) != (hostile.status, hostile.code):
        found.append(f"answered {status} {body}")
    after = await rejected_counts(observer)
    increments = {code: n - counts.get(code, 0.0) for code, n in after.items()}
    increments = {code: n for code, n in increments.items() if n}
    if increments != {counted: 1.0}:
        found.append(f"counter increments {increments}")
    rejects = [
        (entry["region"], entry["round"], entry["details"].get("code"))
        for entry in await audit_after(observer, seq)
        if entry["action"] == "delta.reject"
    ]
    if rejects != [("eu-west", scene.round + hostile.url_round, counted)]:
        found.append(f"audit delta.reject entries {rejects}")
    state = await global_state(observer, scene.us)
    if state != before:
        found.append(f"global state changed from {before} to {state}")
    return found


async def test_every_hostile_upload_is_refused_counted_audited_and_changes_nothing(
    tmp_path: Path,
) -> None:
    with mosquitto_setup(tmp_path) as setup:
        async with coordinator(setup) as running:
            scene = await open_scene(running)
            eu, us = scene.eu, scene.us
            before = await global_state(scene.observer, us)
            assert before["delivered"] == []
            problems = []
            for hostile in TABLE:
                found = await check(scene, hostile, before)
                if found:
                    problems.append(f"{hostile.case}: " + "; ".join(found))
            assert not problems, "\n".join(problems)

            # The hostile uploads did not poison the round: its honest deltas are accepted.
            manifest, stream = eu.delta(JOB, 1, scene.base, seed=11)
            status, body = await eu.three_step(JOB, 1, manifest, stream)
            assert (status, body["state"]) == (200, "accepted"), body
            digest = SignedManifest.from_bytes(manifest).manifest.digest()
            assert body["receipt"]["manifest_digest"] == digest
            status, body = await us.single_shot(JOB, 1, *us.delta(JOB, 1, scene.base, seed=12))
            assert (status, body["state"]) == (200, "accepted"), body
            reopened = await wait_collecting(scene.observer, 2)
            _, params_hash, version = await us.download_params(JOB)
            assert (version, params_hash) == (2, reopened["params_hash"])
            status, body = await request(scene.observer, "GET", "/v1/audit?verify=1&limit=1")
            assert body["verify"]["ok"], body["verify"]
