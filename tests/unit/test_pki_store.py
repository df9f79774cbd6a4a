"""CA and credential directories: layout, key file modes, refusing to overwrite."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from geofed.fsutil import atomic_write_bytes
from geofed.pki import (
    CredentialStoreError,
    create_ca,
    issue,
    load_ca,
    load_credential,
    save_ca,
    save_credential,
)
from geofed.types import Identity, Role


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_ca_directory_round_trip_and_modes(tmp_path):
    ca = create_ca("acme", "org-a")
    directory = tmp_path / "ca"
    save_ca(ca, directory)
    assert sorted(p.name for p in directory.iterdir()) == [
        "ca.key",
        "ca.pem",
        "ca.yaml",
        "trust.yaml",
    ]
    assert _mode(directory / "ca.key") == 0o600
    assert _mode(directory) == 0o700
    loaded = load_ca(directory)
    assert loaded.federation == "acme"
    assert loaded.name == "org-a"
    assert loaded.certificate == ca.certificate
    assert loaded.private_key.private_numbers() == ca.private_key.private_numbers()


def test_credential_directory_round_trip_and_modes(tmp_path):
    ca = create_ca("acme")
    cred = issue(ca, Identity("acme", Role.REGION, "eu-west"))
    files = save_credential(cred, tmp_path / "eu-west")
    assert sorted(p.name for p in files.directory.iterdir()) == ["ca.pem", "cert.pem", "key.pem"]
    assert _mode(files.key_file) == 0o600
    loaded = load_credential(files.directory)
    assert loaded.identity == cred.identity
    assert loaded.certificate == cred.certificate
    assert loaded.issuer == ca.certificate


def test_refuses_to_overwrite_unless_forced(tmp_path):
    directory = tmp_path / "ca"
    first = create_ca("acme")
    save_ca(first, directory)
    with pytest.raises(CredentialStoreError, match=r"refusing to overwrite ca\.key"):
        save_ca(create_ca("acme"), directory)
    assert load_ca(directory).certificate == first.certificate
    second = create_ca("acme")
    save_ca(second, directory, force=True)
    assert load_ca(directory).certificate == second.certificate
    assert _mode(directory / "ca.key") == 0o600


def test_a_key_that_does_not_match_its_certificate_is_refused(tmp_path):
    ca = create_ca("acme")
    one = save_credential(issue(ca, Identity("acme", Role.REGION, "a")), tmp_path / "a")
    two = save_credential(issue(ca, Identity("acme", Role.REGION, "b")), tmp_path / "b")
    one.key_file.write_bytes(two.key_file.read_bytes())
    with pytest.raises(CredentialStoreError, match="does not match the certificate"):
        load_credential(one.directory)


@pytest.mark.parametrize("missing", ["ca.yaml", "ca.pem", "ca.key"])
def test_incomplete_ca_directory(tmp_path, missing):
    save_ca(create_ca("acme"), tmp_path / "ca")
    (tmp_path / "ca" / missing).unlink()
    with pytest.raises(CredentialStoreError, match=missing):
        load_ca(tmp_path / "ca")


def test_output_path_that_is_a_file(tmp_path):
    (tmp_path / "taken").write_text("x")
    with pytest.raises(CredentialStoreError, match="not a directory"):
        save_ca(create_ca("acme"), tmp_path / "taken")


def test_atomic_write_creates_the_file_with_its_final_mode_and_leaves_no_temp(tmp_path):
    target = tmp_path / "secret"
    atomic_write_bytes(target, b"one", private=True)
    atomic_write_bytes(target, b"two", private=True)
    assert target.read_bytes() == b"two"
    assert _mode(target) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["secret"]
