"""Fuzzing the parsers that read untrusted bytes: each raises its own error or succeeds.

Bundle framing, codec streams (with and without the manifest's digests), stream headers,
commit bodies, MQTT topics, audit entries fetched from a coordinator, and job specs and
policy files nested or grown past their bounds. Signed manifests
and control-plane messages have their own fuzz tests (``test_manifest_fuzz``,
``test_control_messages``).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.api.bodies import commit_metrics
from coordinator.errors import ApiError
from coordinator.jobs.spec import JobSpecError, parse_job_spec
from coordinator.state.audit import AuditEntry, InvalidAuditEntry
from geofed.artifact_bundle import (
    HEADER_SIZE,
    BundleError,
    manifest_length,
    pack_bundle,
    split_bundle,
)
from geofed.codec import DecodeError, StreamDecoder, decode, encode_stream
from geofed.codec.wire import PREFIX, TAG_SIZE, parse_header_body
from geofed.codec_params import CodecParams
from geofed.control import TopicError, TopicKind, Topics
from geofed.located_yaml import MAX_DEPTH
from policies.errors import PolicyLoadError
from policies.loading import parse_policy
from tests.support import fuzz

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TENSORS = {
    "w": torch.linspace(-1, 1, 96).reshape(8, 12),
    "b": torch.arange(10, dtype=torch.float32),
}
STREAMS = {
    scheme: encode_stream(TENSORS, CodecParams(scheme=scheme, block_size=16), chunk_elements=32)
    for scheme in ("fp32", "int8", "int4")
}
MAX_DECODED = 4 * sum(t.numel() for t in TENSORS.values())

json_values = fuzz.json_values()
edits = fuzz.byte_edits(min_size=1)


# -- artifact bundles --------------------------------------------------------------------


@FUZZ
@given(data=st.binary(max_size=64))
def test_fuzz_bundle_framing_random_bytes(data: bytes) -> None:
    try:
        manifest, stream = split_bundle(data)
    except BundleError:
        return
    assert data == pack_bundle(manifest, [stream])
    assert manifest_length(data[:HEADER_SIZE]) == len(manifest)


@FUZZ
@given(changes=edits, cut=st.none() | st.integers(min_value=0), tail=st.binary(max_size=8))
def test_fuzz_bundle_framing_of_a_mutated_bundle(
    changes: list[tuple[int, int]], cut: int | None, tail: bytes
) -> None:
    data = fuzz.mutated(pack_bundle(b'{"m": 1}', [b"frame-a", b"frame-b"]), changes, cut, tail)
    try:
        manifest, stream = split_bundle(data)
    except BundleError:
        return
    assert HEADER_SIZE + len(manifest) + len(stream) == len(data)


# -- codec streams -----------------------------------------------------------------------


def _decode_or_refuse(data: bytes, *, with_digests: str | None) -> dict[str, torch.Tensor] | None:
    """Decode ``data`` bounded as a receiver does; None if it is refused as a DecodeError."""
    expected = STREAMS[with_digests] if with_digests else None
    try:
        return decode(
            data,
            expected_header_digest=expected.header_digest if expected else None,
            expected_digests=expected.digests if expected else None,
            max_decoded_bytes=MAX_DECODED,
        )
    except DecodeError:
        return None


@FUZZ
@given(data=st.binary(max_size=512))
def test_fuzz_stream_decoder_random_bytes(data: bytes) -> None:
    assert _decode_or_refuse(data, with_digests=None) is None


@FUZZ
@given(
    scheme=st.sampled_from(sorted(STREAMS)),
    changes=edits,
    cut=st.none() | st.integers(min_value=0),
    tail=st.binary(max_size=16),
    checked=st.booleans(),
)
def test_fuzz_stream_decoder_mutated_streams(
    scheme: str, changes: list[tuple[int, int]], cut: int | None, tail: bytes, checked: bool
) -> None:
    """Changed streams are refused; with the manifest's digests nothing but the original
    stream decodes, and without them whatever decodes is bounded and finite."""
    original = STREAMS[scheme].to_bytes()
    data = fuzz.mutated(original, changes, cut, tail)
    decoded = _decode_or_refuse(data, with_digests=scheme if checked else None)
    if decoded is None:
        return
    if checked:
        assert data == original
    assert sum(4 * t.numel() for t in decoded.values()) <= MAX_DECODED
    assert all(bool(torch.isfinite(t.float()).all()) for t in decoded.values())


@FUZZ
@given(data=st.binary(max_size=256), parts=st.lists(st.integers(1, 64), max_size=8))
def test_fuzz_stream_decoder_fed_in_pieces(data: bytes, parts: list[int]) -> None:
    """Random bytes fed piece by piece end in a DecodeError, never another exception."""
    with pytest.raises(DecodeError):
        _feed(StreamDecoder(max_decoded_bytes=MAX_DECODED), data, parts)


def _feed(decoder: StreamDecoder, data: bytes, parts: list[int]) -> None:
    position = 0
    for size in [*parts, len(data)]:
        for _ in decoder.feed(data[position : position + size]):
            pass
        position += size
    decoder.finish()


@FUZZ
@given(value=json_values, raw=st.binary(max_size=64), use_raw=st.booleans())
def test_fuzz_stream_header_body(value: Any, raw: bytes, use_raw: bool) -> None:
    body = raw if use_raw else json.dumps(value).encode()
    try:
        config, chunk_elements, specs = parse_header_body(body, "header")
    except DecodeError:
        return
    assert all(all(size >= 0 for size in spec.shape) for spec in specs)
    assert config.block_size >= 1
    assert chunk_elements % config.block_size == 0


@FUZZ
@given(choice=st.integers(min_value=0), value=json_values)
def test_fuzz_stream_header_of_a_valid_stream(choice: int, value: Any) -> None:
    """One field of a valid header replaced: refused, or still a sane configuration."""
    document = json.loads(STREAMS["int8"].header[PREFIX.size : -TAG_SIZE])
    paths = fuzz.json_paths(document)[1:]
    fuzz.edit_at(document, paths[choice % len(paths)], "set", value)
    try:
        config, chunk_elements, specs = parse_header_body(json.dumps(document).encode(), "header")
    except DecodeError:
        return
    assert config.block_size >= 1
    assert chunk_elements % config.block_size == 0
    assert all(all(size >= 0 for size in spec.shape) for spec in specs)


# -- commit bodies -----------------------------------------------------------------------

metric_documents = st.one_of(
    json_values,
    st.fixed_dictionaries({"metrics": json_values}),
    st.fixed_dictionaries(
        {"metrics": st.dictionaries(st.text(max_size=80), st.floats() | st.integers(), max_size=70)}
    ),
)


@FUZZ
@given(document=metric_documents, raw=st.binary(max_size=64), use_raw=st.booleans())
def test_fuzz_commit_metrics(document: Any, raw: bytes, use_raw: bool) -> None:
    body = raw if use_raw else json.dumps(document).encode()
    error: ApiError | None = None
    try:
        parsed = commit_metrics(body)
    except ApiError as exc:
        error = exc
    if error is not None:
        assert (error.status, error.code) == (400, "bad_request")
        return
    assert len(parsed) <= 64
    assert all(len(name) <= 64 and math.isfinite(value) for name, value in parsed.items())


# -- MQTT topics -------------------------------------------------------------------------

TOPICS = Topics("acme")
topic_levels = st.sampled_from(
    ["geofed", "acme", "other", "regions", "jobs", "events", "status", "commands", "round"]
) | st.text(max_size=8)


@FUZZ
@given(
    levels=st.lists(topic_levels, max_size=6),
    text=st.text(max_size=64),
    use_text=st.booleans(),
)
def test_fuzz_topics(levels: list[str], text: str, use_text: bool) -> None:
    """A topic parses only if it is exactly what the builder makes of its kind and name."""
    topic = text if use_text else "/".join(levels)
    try:
        parsed = TOPICS.parse(topic)
    except TopicError:
        return
    rebuilt = {
        TopicKind.EVENTS: lambda: TOPICS.events(),
        TopicKind.REGION_STATUS: lambda: TOPICS.region_status(parsed.region),
        TopicKind.REGION_COMMANDS: lambda: TOPICS.region_commands(parsed.region),
        TopicKind.JOB_ROUND: lambda: TOPICS.job_round(parsed.job),
    }[parsed.kind]()
    assert rebuilt == topic


# -- audit entries as GET /v1/audit returns them ----------------------------------------


def _entry() -> dict[str, Any]:
    return {
        "seq": 1,
        "time": "2030-01-01T00:00:00.000000Z",
        "actor": "spiffe://acme/region/eu-west",
        "action": "delta.reject",
        "verdict": "deny",
        "job": "tiny",
        "round": 0,
        "region": "eu-west",
        "details": {"code": "corrupt_chunk"},
        "prev_hash": "0" * 64,
        "hash": hashlib.sha256(b"x").hexdigest(),
    }


@FUZZ
@given(key=st.sampled_from(sorted(_entry())) | st.text(max_size=8), value=json_values)
def test_fuzz_audit_entries(key: str, value: Any) -> None:
    data = {**_entry(), key: value}
    try:
        entry = AuditEntry.from_dict(data)
    except InvalidAuditEntry:
        return
    assert entry.to_dict()["hash"] == data["hash"]


# -- job specs and policy files: nesting and size -----------------------------------------

_OPEN_CLOSE = st.sampled_from([("[", "]"), ("{a: ", "}"), ('{"a": ', "}")])
_SPEC_HEAD = "job: j\ntask: {spec: geofed.examples.charlm:CharLMTask}\nrounds: "
_POLICY_HEAD = "region: eu-west\njurisdiction: EU\nexports: "


def _nested(depth: int, brackets: tuple[str, str], block: bool) -> str:
    if block:
        return "\n" + "".join("  " * (level + 1) + "- \n" for level in range(depth))
    opening, closing = brackets
    return opening * depth + "1" + closing * depth + "\n"


def _problems(parse: Callable[[], object]) -> list[str]:
    """What a job-spec or policy parse refused, as ``file:line: key: message`` lines."""
    try:
        parse()
    except JobSpecError as exc:
        return list(exc.problems)
    except PolicyLoadError as exc:
        return [str(problem) for problem in exc.problems]
    return []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    depth=st.integers(min_value=1, max_value=200_000),
    brackets=_OPEN_CLOSE,
    block=st.booleans(),
    json_body=st.booleans(),
)
def test_fuzz_job_spec_and_policy_nesting_is_refused_with_a_line(
    depth: int, brackets: tuple[str, str], block: bool, json_body: bool
) -> None:
    block = block and depth < 500  # an indented level costs two bytes a line
    body = _nested(depth, brackets, block)
    spec = '{"job": "j", "rounds": ' + body + "}" if json_body else _SPEC_HEAD + body
    problems = _problems(lambda: parse_job_spec(spec, "job.yaml"))
    assert all(re.match(r"job\.yaml:\d+: ", problem) for problem in problems)
    if depth > MAX_DEPTH:
        assert any(word in problems[0] for word in ("nest", "Expecting", "larger than")), problems
    problems = _problems(lambda: parse_policy(_POLICY_HEAD + body, "eu-west.yaml"))
    assert all(re.match(r"eu-west\.yaml:\d+: ", problem) for problem in problems)
    if depth > MAX_DEPTH:
        assert problems


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    items=st.integers(min_value=0, max_value=60_000),
    flow=st.booleans(),
    alias=st.booleans(),
)
def test_fuzz_job_spec_and_policy_size_is_bounded(items: int, flow: bool, alias: bool) -> None:
    if alias:  # each level doubles what the aliases expand to
        body = "&a0 [x]\n" + "".join(
            f"l{i}: &a{i + 1} [*a{i}, *a{i}]\n" for i in range(min(items, 40))
        )
        extra = "bomb: " + body
    elif flow:
        extra = "flat: [" + ", ".join("1" for _ in range(items)) + "]\n"
    else:
        extra = "flat:\n" + "".join(f"  k{i}: {i}\n" for i in range(items))
    spec = _problems(lambda: parse_job_spec(_SPEC_HEAD + "1\n" + extra, "job.yaml"))
    policy = _problems(lambda: parse_policy(_POLICY_HEAD + "{}\n" + extra, "eu-west.yaml"))
    # Unknown keys at the least; never anything but a located refusal.
    assert spec
    assert policy
    assert all(re.match(r"job\.yaml:\d+: ", problem) for problem in spec)
    assert all(re.match(r"eu-west\.yaml:\d+: ", problem) for problem in policy)
