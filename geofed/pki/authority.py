"""Certificate authorities and the certificates they issue, in memory.

A federation member organization runs one root CA (ECDSA P-256, SHA-256). It issues leaf
certificates directly (no intermediates: the CA's ``pathLenConstraint`` is 0), one per
principal, each usable as a TLS server and client certificate and for signing manifests.

Leaf certificate contents:

- SAN URI ``spiffe://<federation>/<role>/<name>``, the identity every check relies on.
- Subject ``O=<federation>, OU=<role>, CN=<role>.<name>``. The CN is what a broker with
  ``use_identity_as_username`` sees as the MQTT username (see :func:`mqtt_username`). It
  keeps the role so an observer named ``eu-west`` can never pass for region ``eu-west``,
  and uses a dot, not a slash, so it fills exactly one topic level; names cannot contain
  dots, so the split is unambiguous. Broker ACLs therefore list principals by username
  (``user region.eu-west``) rather than ``%u`` patterns over ``regions/<region>/``.
- SAN DNS/IP entries when given (coordinators: ``localhost`` and ``127.0.0.1`` by default
  in ``geofed ca issue``) so TLS clients verify hostnames.
- ``keyUsage=digitalSignature`` and ``extendedKeyUsage=serverAuth,clientAuth``.

Storage on disk is :mod:`geofed.pki.store`'s job; this module does no I/O.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from geofed.types import Identity, validate_name

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

DEFAULT_CA_VALIDITY = timedelta(days=3650)
DEFAULT_LEAF_VALIDITY = timedelta(days=365)
# Tolerates clocks a little behind the issuer's without making fresh certificates unusable.
_BACKDATE = timedelta(minutes=5)


@dataclass(frozen=True)
class CertificateAuthority:
    """A root CA of one member organization of a federation."""

    federation: str
    name: str
    certificate: x509.Certificate
    private_key: ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class IssuedCredential:
    """A principal's key and certificate, with the certificate of the CA that issued it."""

    identity: Identity
    certificate: x509.Certificate
    private_key: ec.EllipticCurvePrivateKey
    issuer: x509.Certificate


def generate_key() -> ec.EllipticCurvePrivateKey:
    """A fresh ECDSA P-256 private key."""
    return ec.generate_private_key(ec.SECP256R1())


def mqtt_username(identity: Identity) -> str:
    """The certificate CN, which a broker with ``use_identity_as_username`` uses: ``role.name``."""
    return f"{identity.role.value}.{identity.name}"


def create_ca(
    federation: str,
    name: str | None = None,
    *,
    now: datetime | None = None,
    valid_for: timedelta = DEFAULT_CA_VALIDITY,
) -> CertificateAuthority:
    """A self-signed root CA for ``federation``; ``name`` (the organization) defaults to it."""
    validate_name("federation", federation)
    org = validate_name("authority name", name if name is not None else federation)
    start = (now or datetime.now(UTC)) - _BACKDATE
    key = generate_key()
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, federation),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, org),
            x509.NameAttribute(NameOID.COMMON_NAME, f"{org} CA"),
        ]
    )
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + valid_for)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    return CertificateAuthority(federation=federation, name=org, certificate=cert, private_key=key)


def issue(
    ca: CertificateAuthority,
    identity: Identity,
    *,
    dns_names: Sequence[str] = (),
    ip_addresses: Sequence[IPAddress] = (),
    now: datetime | None = None,
    valid_for: timedelta = DEFAULT_LEAF_VALIDITY,
    not_before: datetime | None = None,
    not_after: datetime | None = None,
) -> IssuedCredential:
    """Issue a key and certificate for ``identity``.

    ``not_before``/``not_after`` override the window computed from ``now`` and
    ``valid_for``; tests use them to mint expired or future certificates.
    """
    if identity.federation != ca.federation:
        raise ValueError(
            f"CA {ca.name!r} belongs to federation {ca.federation!r}, not {identity.federation!r}"
        )
    start = not_before or (now or datetime.now(UTC)) - _BACKDATE
    end = not_after or start + valid_for
    if end <= start:
        raise ValueError(f"certificate would end ({end}) before it starts ({start})")
    key = generate_key()
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity.uri)]
    names += [x509.DNSName(dns) for dns in dns_names]
    names += [x509.IPAddress(ip) for ip in ip_addresses]
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, identity.federation),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, identity.role.value),
            x509.NameAttribute(NameOID.COMMON_NAME, mqtt_username(identity)),
        ]
    )
    ca_public = ca.private_key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        # RFC 5280 wants a SAN marked critical only when the subject is empty; ours is not.
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_public), critical=False
        )
        .sign(ca.private_key, hashes.SHA256())
    )
    return IssuedCredential(
        identity=identity, certificate=cert, private_key=key, issuer=ca.certificate
    )
