"""`geofed ca init|issue|revoke`, run in-process through the real CLI entry point."""

from __future__ import annotations

import ipaddress
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509

from geofed.pki import load_credential, load_trust_bundle, verify_certificate
from geofed.types import Role
from geofed_cli import main


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _sans(cert_file: Path) -> x509.SubjectAlternativeName:
    cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


@pytest.fixture
def ca_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "ca"
    assert main(["ca", "init", "--federation", "acme", "--out", str(directory)]) == 0
    return directory


def test_init_writes_a_ca_with_a_private_key_and_default_bundle(tmp_path, capsys):
    ca_dir = tmp_path / "new"
    assert main(["ca", "init", "--federation", "acme", "--out", str(ca_dir)]) == 0
    assert _mode(ca_dir / "ca.key") == 0o600
    assert _mode(ca_dir) == 0o700
    bundle = load_trust_bundle(ca_dir / "trust.yaml")
    assert bundle.federation == "acme"
    assert [a.name for a in bundle.authorities] == ["acme"]
    assert "created CA 'acme'" in capsys.readouterr().out


def test_issue_each_role_with_key_mode_0600(ca_dir, tmp_path):
    bundle = load_trust_bundle(ca_dir / "trust.yaml")
    for role in Role:
        out = tmp_path / role.value
        argv = ["ca", "issue", "--ca", str(ca_dir), "--role", role.value, "--name", "n1"]
        assert main([*argv, "--out", str(out)]) == 0
        assert _mode(out / "key.pem") == 0o600
        cred = load_credential(out)
        assert cred.identity.uri == f"spiffe://acme/{role.value}/n1"
        assert verify_certificate(cred.certificate, bundle, now=_now()) == cred.identity


def test_coordinator_gets_loopback_sans_by_default_and_explicit_ones_replace_them(ca_dir, tmp_path):
    base = ["ca", "issue", "--ca", str(ca_dir), "--role", "coordinator", "--name", "main"]
    assert main([*base, "--out", str(tmp_path / "c1")]) == 0
    sans = _sans(tmp_path / "c1" / "cert.pem")
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    argv = [*base, "--out", str(tmp_path / "c2"), "--dns", "coord.example.org", "--ip", "::1"]
    assert main([*argv, "--dns", "coord"]) == 0
    sans = _sans(tmp_path / "c2" / "cert.pem")
    assert sans.get_values_for_type(x509.DNSName) == ["coord.example.org", "coord"]
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("::1")]
    region = ["ca", "issue", "--ca", str(ca_dir), "--role", "region", "--name", "eu-west"]
    assert main([*region, "--out", str(tmp_path / "r")]) == 0
    assert _sans(tmp_path / "r" / "cert.pem").get_values_for_type(x509.DNSName) == []


def test_existing_keys_are_refused_without_force(ca_dir, tmp_path, capsys):
    out = tmp_path / "r"
    argv = [
        "ca",
        "issue",
        "--ca",
        str(ca_dir),
        "--role",
        "region",
        "--name",
        "r",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    before = (out / "key.pem").read_bytes()
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: refusing to overwrite key.pem")
    assert err.count("\n") == 1
    assert (out / "key.pem").read_bytes() == before
    assert main([*argv, "--force"]) == 0
    assert (out / "key.pem").read_bytes() != before
    assert _mode(out / "key.pem") == 0o600
    assert main(["ca", "init", "--federation", "acme", "--out", str(ca_dir)]) == 1


def test_issue_from_a_directory_that_is_no_ca(tmp_path, capsys):
    argv = ["ca", "issue", "--ca", str(tmp_path / "nope"), "--role", "region", "--name", "r"]
    assert main([*argv, "--out", str(tmp_path / "r")]) == 1
    assert capsys.readouterr().err.startswith("error: ")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["ca", "init", "--federation", "Acme", "--out", "x"],
        ["ca", "init", "--out", "x"],
        ["ca", "issue", "--ca", "c", "--role", "admin", "--name", "n", "--out", "x"],
        ["ca", "issue", "--ca", "c", "--role", "region", "--name", "eu_west", "--out", "x"],
        ["ca", "issue", "--ca", "c", "--role", "region", "--name", "n", "--out", "x", "--ip", "1"],
        [
            "ca",
            "issue",
            "--ca",
            "c",
            "--role",
            "region",
            "--name",
            "n",
            "--out",
            "x",
            "--dns",
            "a b",
        ],
        [
            "ca",
            "issue",
            "--ca",
            "c",
            "--role",
            "region",
            "--name",
            "n",
            "--out",
            "x",
            "--days",
            "0",
        ],
        ["ca"],
    ],
)
def test_usage_errors_exit_2(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    assert list(tmp_path.iterdir()) == []


def test_revoke_appends_the_serial_once(ca_dir, tmp_path, capsys):
    out = tmp_path / "r"
    argv = ["ca", "issue", "--ca", str(ca_dir), "--role", "region", "--name", "r"]
    assert main([*argv, "--out", str(out)]) == 0
    bundle_file = ca_dir / "trust.yaml"
    revoke = ["ca", "revoke", "--bundle", str(bundle_file), "--cert", str(out / "cert.pem")]
    assert main(revoke) == 0
    assert main(revoke) == 0
    assert "already revoked" in capsys.readouterr().out
    serial = load_credential(out).certificate.serial_number
    assert load_trust_bundle(bundle_file).revoked_serials == {serial}


def test_revoke_with_a_missing_certificate_is_refused(ca_dir, tmp_path, capsys):
    bundle_file = ca_dir / "trust.yaml"
    before = bundle_file.read_text()
    argv = ["ca", "revoke", "--bundle", str(bundle_file), "--cert", str(tmp_path / "none.pem")]
    assert main(argv) == 1
    assert "none.pem" in capsys.readouterr().err
    assert bundle_file.read_text() == before


def _now() -> datetime:
    return datetime.now(UTC)


def _crl(path: Path) -> x509.CertificateRevocationList:
    return x509.load_pem_x509_crl(path.read_bytes())


def test_crl_before_any_revocation_is_empty_and_signed_by_the_ca(ca_dir, tmp_path, capsys):
    crl_file = tmp_path / "crl.pem"
    argv = ["ca", "crl", "--ca", str(ca_dir), "--bundle", str(ca_dir / "trust.yaml")]
    assert main([*argv, "--out", str(crl_file), "--days", "30"]) == 0
    assert "0 revoked serial(s)" in capsys.readouterr().out
    crl = _crl(crl_file)
    ca_cert = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
    assert crl.issuer == ca_cert.subject
    assert crl.is_signature_valid(ca_cert.public_key())  # type: ignore[arg-type]
    assert len(crl) == 0
    assert crl.next_update_utc is not None
    assert timedelta(days=29) < crl.next_update_utc - _now() <= timedelta(days=30)
    assert _mode(crl_file) == 0o644


def test_revoke_with_a_crl_writes_every_revoked_serial(ca_dir, tmp_path):
    bundle_file, crl_file = ca_dir / "trust.yaml", tmp_path / "crl.pem"
    serials = []
    for name in ("old-a", "old-b"):
        out = tmp_path / name
        argv = ["ca", "issue", "--ca", str(ca_dir), "--role", "region", "--name", name]
        assert main([*argv, "--out", str(out)]) == 0
        revoke = ["ca", "revoke", "--bundle", str(bundle_file), "--cert", str(out / "cert.pem")]
        assert main([*revoke, "--ca", str(ca_dir), "--crl", str(crl_file)]) == 0
        serials.append(load_credential(out).certificate.serial_number)
    crl = _crl(crl_file)
    assert {entry.serial_number for entry in crl} == set(serials)
    assert crl.get_revoked_certificate_by_serial_number(serials[0]) is not None


def test_revoke_with_a_crl_but_no_ca_is_a_usage_error(ca_dir, tmp_path, capsys):
    bundle_file = ca_dir / "trust.yaml"
    before = bundle_file.read_text()
    argv = ["ca", "revoke", "--bundle", str(bundle_file), "--cert", str(ca_dir / "ca.pem")]
    assert main([*argv, "--crl", str(tmp_path / "crl.pem")]) == 2
    assert "--ca and --crl go together" in capsys.readouterr().err
    assert bundle_file.read_text() == before
