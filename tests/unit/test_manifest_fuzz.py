"""Fuzzing the signed-manifest parser: untrusted bytes raise ManifestError or nothing."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geofed.manifest import ManifestError, SignedManifest, sign_manifest
from tests.support import fuzz
from tests.support.manifests import make_manifest
from tests.support.pki import Federation, make_federation

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

json_values = fuzz.json_values(allow_nan=False, text_size=20)


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
@given(edits=fuzz.byte_edits(max_size=8))
def test_byte_edits_of_a_valid_document(fed, wire, edits):
    _parse_and_verify(fed, fuzz.mutated(wire, edits))


@FUZZ
@given(cut=st.integers(min_value=0), extra=st.binary(max_size=16))
def test_truncated_and_extended_documents(fed, wire, cut, extra):
    _parse_and_verify(fed, fuzz.mutated(wire, [], cut, extra))


@FUZZ
@given(choice=st.data(), replacement=json_values, action=st.sampled_from(fuzz.ACTIONS))
def test_structural_mutations_of_a_valid_document(fed, wire, choice, replacement, action):
    document = json.loads(wire)
    path = choice.draw(st.sampled_from(fuzz.json_paths(document)[1:]))
    fuzz.edit_at(document, path, action, replacement)
    _parse_and_verify(fed, json.dumps(document).encode())
