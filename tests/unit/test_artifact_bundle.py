"""Artifact bundle framing."""

import pytest

from geofed.artifact_bundle import BundleError, pack_bundle, split_bundle


def test_round_trip() -> None:
    manifest = b'{"manifest": 1}'
    frames = [b"a" * 10, b"", b"bc"]
    assert split_bundle(pack_bundle(manifest, frames)) == (manifest, b"a" * 10 + b"bc")


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"GFA", "truncated"),
        (b"XXXX\x00\x00\x00\x01m", "magic"),
        (b"GFA1\x00\x00\x00\x09abc", "inside the manifest"),
        (b"GFA1\xff\xff\xff\xff", "exceeds"),
    ],
)
def test_refuses_bad_bundles(data: bytes, needle: str) -> None:
    with pytest.raises(BundleError, match=needle):
        split_bundle(data)
