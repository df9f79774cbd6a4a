"""Contents of CA and leaf certificates as issued by geofed.pki.authority."""

from __future__ import annotations

import ipaddress
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from geofed.pki import create_ca, issue, mqtt_username
from geofed.types import Identity, InvalidName, Role

NOW = datetime(2030, 1, 1, tzinfo=UTC)


def _ext(cert: x509.Certificate, kind: type[x509.ExtensionType]) -> x509.Extension[Any]:
    return cert.extensions.get_extension_for_class(kind)


def test_ca_is_a_p256_root_that_issues_only_leaves():
    ca = create_ca("acme", "org-a", now=NOW)
    cert = ca.certificate
    constraints = _ext(cert, x509.BasicConstraints)
    assert constraints.critical
    assert constraints.value.ca
    assert constraints.value.path_length == 0
    assert _ext(cert, x509.KeyUsage).value.key_cert_sign
    assert cert.issuer == cert.subject
    cert.verify_directly_issued_by(cert)
    assert isinstance(ca.private_key.curve, ec.SECP256R1)
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "acme"
    assert cert.not_valid_after_utc - cert.not_valid_before_utc == timedelta(days=3650)


def test_ca_name_defaults_to_federation_and_is_validated():
    assert create_ca("acme").name == "acme"
    with pytest.raises(InvalidName):
        create_ca("acme", "Org A")
    with pytest.raises(InvalidName):
        create_ca("ACME")


def test_leaf_carries_identity_usages_and_sans():
    ca = create_ca("acme", now=NOW)
    who = Identity("acme", Role.COORDINATOR, "main")
    cred = issue(
        ca, who, dns_names=["localhost"], ip_addresses=[ipaddress.ip_address("127.0.0.1")], now=NOW
    )
    cert = cred.certificate
    cert.verify_directly_issued_by(ca.certificate)
    san = _ext(cert, x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
        "spiffe://acme/coordinator/main"
    ]
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    eku = _ext(cert, x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    usage = _ext(cert, x509.KeyUsage).value
    assert usage.digital_signature
    assert not usage.key_cert_sign
    assert not _ext(cert, x509.BasicConstraints).value.ca
    assert isinstance(cred.private_key.curve, ec.SECP256R1)
    assert cred.private_key.public_key() == cert.public_key()
    assert cred.issuer == ca.certificate
    assert cert.not_valid_before_utc < NOW < cert.not_valid_after_utc


def test_common_name_is_a_single_topic_level_that_keeps_the_role():
    region = Identity("acme", Role.REGION, "eu-west")
    observer = Identity("acme", Role.OBSERVER, "eu-west")
    assert mqtt_username(region) == "region.eu-west"
    assert mqtt_username(region) != mqtt_username(observer)
    cert = issue(create_ca("acme"), region).certificate
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    assert cn == "region.eu-west"
    assert "/" not in cn


def test_explicit_window_allows_expired_certificates():
    ca = create_ca("acme", now=NOW)
    start, end = NOW - timedelta(days=10), NOW - timedelta(days=1)
    cert = issue(
        ca, Identity("acme", Role.REGION, "r1"), not_before=start, not_after=end
    ).certificate
    assert cert.not_valid_before_utc == start
    assert cert.not_valid_after_utc == end


def test_issue_refuses_another_federation_and_empty_windows():
    ca = create_ca("acme", now=NOW)
    with pytest.raises(ValueError, match="federation 'acme'"):
        issue(ca, Identity("other", Role.REGION, "r1"))
    with pytest.raises(ValueError, match="before it starts"):
        issue(ca, Identity("acme", Role.REGION, "r1"), not_before=NOW, not_after=NOW)


def test_serials_are_unique():
    ca = create_ca("acme")
    who = Identity("acme", Role.REGION, "r1")
    serials = {issue(ca, who).certificate.serial_number for _ in range(20)}
    assert len(serials) == 20
