"""Fuzzing the signed-manifest parser: untrusted bytes raise ManifestError or nothing."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geofed.manifest import ManifestError, SignedManifest, sign_manifest
from tests.support.pki import Federation, make_federation
from tests.unit.test_manifest import make_manifest

NOW = datetime.now(UTC)


@pytest.fixture(autouse=True, scope="module")
def _fresh_now() -> None:
    """Take NOW when the module runs, not when it is imported: the certificates are issued
    then, and a long suite may collect this module minutes before running it."""
    global NOW
    NOW = datetime.now(UTC)


FUZZ = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Federation:
    return make_federation(tmp_path_factory.mktemp("fuzz") / "fed", "acme")


@pytest.fixture(scope="module")
def wire(fed: Federation) -> bytes:
    signer = fed.region("eu-west")
    cred = signer.credential
    return sign_manifest(make_manifest(signer), cred.private_key, cred.certificate).to_bytes()


def _parse_and_verify(fed: Federation, data: bytes) -> None:
    """Only ManifestError may escape; a document that parses is also verified."""
    try:
        parsed = SignedManifest.from_bytes(data)
    except ManifestError:
        return
    try:
        parsed.verify(fed.bundle(), now=NOW)
    except ManifestError:
        return


@FUZZ
@given(data=st.binary(max_size=512))
def test_random_bytes(fed, data):
    _parse_and_verify(fed, data)


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), max_size=8))
def test_byte_edits_of_a_valid_document(fed, wire, edits):
    mutated = bytearray(wire)
    for position, value in edits:
        mutated[position % len(mutated)] = value
    _parse_and_verify(fed, bytes(mutated))


@FUZZ
@given(cut=st.integers(min_value=0), extra=st.binary(max_size=16))
def test_truncated_and_extended_documents(fed, wire, cut, extra):
    _parse_and_verify(fed, wire[: cut % (len(wire) + 1)] + extra)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            found += _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += _paths(child, (*prefix, index))
    return found


@FUZZ
@given(choice=st.data(), replacement=json_values, action=st.sampled_from(["set", "drop", "add"]))
def test_structural_mutations_of_a_valid_document(fed, wire, choice, replacement, action):
    document = json.loads(wire)
    path = choice.draw(st.sampled_from(_paths(document)[1:]))
    parent: Any = document
    for part in path[:-1]:
        parent = parent[part]
    key = path[-1]
    if action == "set":
        parent[key] = replacement
    elif action == "drop":
        del parent[key]
    elif isinstance(parent, dict):
        parent[f"{key}x"] = replacement
    else:
        parent.append(replacement)
    _parse_and_verify(fed, json.dumps(document).encode())
