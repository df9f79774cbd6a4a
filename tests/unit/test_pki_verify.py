"""verify_certificate: the one decision every TLS peer and manifest signer goes through."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.serialization import Encoding

from geofed.pki import (
    BadCertificate,
    Expired,
    Grant,
    NoPeerCertificate,
    NotYetValid,
    OutsideGrant,
    Revoked,
    TrustBundle,
    TrustedAuthority,
    UnknownAuthority,
    WrongFederation,
    create_ca,
    generate_key,
    issue,
    peer_identity,
    verify_certificate,
)
from geofed.pki.authority import CertificateAuthority
from geofed.types import Identity, Role

NOW = datetime(2030, 6, 1, tzinfo=UTC)


def _bundle(*authorities: tuple[CertificateAuthority, list[str]], revoked=()) -> TrustBundle:
    return TrustBundle(
        federation="acme",
        authorities=tuple(
            TrustedAuthority(
                name=ca.name,
                certificate=ca.certificate,
                grants=tuple(Grant.parse(g) for g in grants),
            )
            for ca, grants in authorities
        ),
        revoked_serials=frozenset(revoked),
    )


@pytest.fixture(scope="module")
def org_a() -> CertificateAuthority:
    return create_ca("acme", "org-a", now=NOW)


@pytest.fixture(scope="module")
def org_b() -> CertificateAuthority:
    return create_ca("acme", "org-b", now=NOW)


def _cert(ca: CertificateAuthority, role: Role, name: str, **kw) -> x509.Certificate:
    return issue(ca, Identity(ca.federation, role, name), now=NOW, **kw).certificate


def test_accepts_a_valid_certificate_and_returns_its_identity(org_a):
    cert = _cert(org_a, Role.REGION, "eu-west")
    identity = verify_certificate(cert, _bundle((org_a, ["*/*"])), now=NOW)
    assert identity == Identity("acme", Role.REGION, "eu-west")


def test_two_authorities_with_disjoint_grants(org_a, org_b):
    bundle = _bundle((org_a, ["coordinator/*", "region/eu-*"]), (org_b, ["region/us-*"]))
    assert verify_certificate(_cert(org_a, Role.REGION, "eu-west"), bundle, now=NOW).name == (
        "eu-west"
    )
    assert verify_certificate(_cert(org_b, Role.REGION, "us-east"), bundle, now=NOW).name == (
        "us-east"
    )
    with pytest.raises(OutsideGrant, match="'org-b' may issue only region/us-\\*; not region/eu"):
        verify_certificate(_cert(org_b, Role.REGION, "eu-west"), bundle, now=NOW)
    with pytest.raises(OutsideGrant):
        verify_certificate(_cert(org_a, Role.REGION, "us-east"), bundle, now=NOW)
    with pytest.raises(OutsideGrant):
        verify_certificate(_cert(org_b, Role.COORDINATOR, "main"), bundle, now=NOW)


def test_unknown_authority_even_with_the_same_subject_name(org_a):
    impostor = create_ca("acme", "org-a", now=NOW)  # same subject, different key
    assert impostor.certificate.subject == org_a.certificate.subject
    with pytest.raises(UnknownAuthority, match="not an authority this bundle trusts"):
        verify_certificate(
            _cert(impostor, Role.REGION, "eu-west"), _bundle((org_a, ["*/*"])), now=NOW
        )


def test_wrong_federation(org_a):
    other = create_ca("other", now=NOW)
    cert = issue(other, Identity("other", Role.REGION, "eu-west"), now=NOW).certificate
    with pytest.raises(WrongFederation, match="'other'"):
        verify_certificate(cert, _bundle((org_a, ["*/*"])), now=NOW)


def test_revoked_leaf_and_revoked_authority(org_a):
    cert = _cert(org_a, Role.REGION, "eu-west")
    with pytest.raises(Revoked, match=format(cert.serial_number, "x")):
        verify_certificate(cert, _bundle((org_a, ["*/*"]), revoked=[cert.serial_number]), now=NOW)
    ca_serial = org_a.certificate.serial_number
    with pytest.raises(Revoked, match="authority 'org-a'"):
        verify_certificate(cert, _bundle((org_a, ["*/*"]), revoked=[ca_serial]), now=NOW)


def test_validity_window(org_a):
    bundle = _bundle((org_a, ["*/*"]))
    expired = _cert(
        org_a,
        Role.REGION,
        "r1",
        not_before=NOW - timedelta(days=2),
        not_after=NOW - timedelta(days=1),
    )
    with pytest.raises(Expired, match="expired at"):
        verify_certificate(expired, bundle, now=NOW)
    future = _cert(org_a, Role.REGION, "r1", not_before=NOW + timedelta(days=1))
    with pytest.raises(NotYetValid):
        verify_certificate(future, bundle, now=NOW)
    # A leaf that outlives its CA is refused once the CA has expired.
    fresh = _cert(org_a, Role.REGION, "r1", not_after=NOW + timedelta(days=4000))
    with pytest.raises(Expired, match="authority 'org-a'"):
        verify_certificate(fresh, bundle, now=NOW + timedelta(days=3651))


def test_a_ca_certificate_is_not_a_principal(org_a):
    with pytest.raises(BadCertificate):
        verify_certificate(org_a.certificate, _bundle((org_a, ["*/*"])), now=NOW)


def _hand_made(ca: CertificateAuthority, sans: list[x509.GeneralName]) -> x509.Certificate:
    key = generate_key()
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - timedelta(days=1))
        .not_valid_after(NOW + timedelta(days=1))
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=True)
    return builder.sign(ca.private_key, hashes.SHA256())


@pytest.mark.parametrize(
    ("sans", "message"),
    [
        ([], "no subjectAltName"),
        ([x509.DNSName("example.org")], "exactly one SPIFFE URI, has 0"),
        (
            [
                x509.UniformResourceIdentifier("spiffe://acme/region/a"),
                x509.UniformResourceIdentifier("spiffe://acme/region/b"),
            ],
            "exactly one SPIFFE URI, has 2",
        ),
        ([x509.UniformResourceIdentifier("spiffe://acme/admin/root")], "unknown role"),
        ([x509.UniformResourceIdentifier("spiffe://acme/region/a")], "no basicConstraints"),
    ],
)
def test_certificates_without_a_usable_identity_are_bad(org_a, sans, message):
    with pytest.raises(BadCertificate, match=message):
        verify_certificate(_hand_made(org_a, sans), _bundle((org_a, ["*/*"])), now=NOW)


def test_naive_time_is_refused(org_a):
    with pytest.raises(ValueError, match="timezone-aware"):
        verify_certificate(
            _cert(org_a, Role.REGION, "r1"), _bundle((org_a, ["*/*"])), now=datetime(2030, 1, 1)
        )


def test_peer_identity_from_der_bytes_and_missing_peers(org_a):
    bundle = _bundle((org_a, ["*/*"]))
    der = _cert(org_a, Role.OPERATOR, "alice").public_bytes(Encoding.DER)
    assert peer_identity(der, bundle, now=NOW).uri == "spiffe://acme/operator/alice"
    with pytest.raises(NoPeerCertificate):
        peer_identity(None, bundle, now=NOW)
    with pytest.raises(NoPeerCertificate):
        peer_identity(b"", bundle, now=NOW)
    with pytest.raises(BadCertificate):
        peer_identity(b"\x30\x03garbage", bundle, now=NOW)


def test_every_refusal_has_a_distinct_code():
    classes = [
        BadCertificate,
        Expired,
        NoPeerCertificate,
        NotYetValid,
        OutsideGrant,
        Revoked,
        UnknownAuthority,
        WrongFederation,
    ]
    assert len({cls.code for cls in classes}) == len(classes)
