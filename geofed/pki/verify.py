"""Certificate verification against a trust bundle, in pure Python.

:func:`verify_certificate` is the single decision every path uses: TLS peers (after the
handshake, since Python's ``ssl`` has no verify callback) and manifest signers (which do
not come over TLS at all). It checks, in this order, that the certificate:

1. carries exactly one ``spiffe://<federation>/<role>/<name>`` SAN URI, is not a CA,
   and its key may sign (``keyUsage`` includes ``digitalSignature``);
2. names a principal of the bundle's federation;
3. is signed by an authority of the bundle (leaves are issued directly by a root);
4. is not revoked, and neither is its authority;
5. is inside its validity window, and so is its authority;
6. names an identity its authority's grants cover.

The first failed check raises its :class:`~geofed.pki.errors.CertificateRefused` subclass.
"""

from __future__ import annotations

from datetime import datetime
from typing import TypeVar

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm

from geofed.pki.errors import (
    BadCertificate,
    Expired,
    NotYetValid,
    OutsideGrant,
    Revoked,
    UnknownAuthority,
    WrongFederation,
)
from geofed.pki.trust import TrustBundle, TrustedAuthority, format_serial
from geofed.types import Identity, InvalidName

_E = TypeVar("_E", bound=x509.ExtensionType)

# Lazily parsed extensions raise these on malformed DER.
_EXTENSION_ERRORS = (ValueError, x509.DuplicateExtension, x509.UnsupportedGeneralNameType)


def certificate_identity(cert: x509.Certificate) -> Identity:
    """The identity named by the certificate's SPIFFE SAN URI (nothing is verified)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        raise BadCertificate("certificate has no subjectAltName, so no SPIFFE identity") from None
    except _EXTENSION_ERRORS as err:
        raise BadCertificate(f"certificate extensions are malformed: {err}") from None
    spiffe = [uri for uri in uris if uri.startswith("spiffe://")]
    if len(spiffe) != 1:
        raise BadCertificate(f"certificate must carry exactly one SPIFFE URI, has {len(spiffe)}")
    try:
        return Identity.parse(spiffe[0])
    except InvalidName as err:
        raise BadCertificate(str(err)) from None


def verify_certificate(cert: x509.Certificate, bundle: TrustBundle, *, now: datetime) -> Identity:
    """Verify ``cert`` as a federation identity at time ``now`` (timezone-aware)."""
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    try:
        return _verify(cert, bundle, now)
    except (ValueError, TypeError) as err:
        # cryptography parses certificate fields lazily: a mangled field surfaces here.
        raise BadCertificate(f"certificate is malformed: {err}") from None


def _verify(cert: x509.Certificate, bundle: TrustBundle, now: datetime) -> Identity:
    identity = certificate_identity(cert)
    _check_usage(cert, identity)
    if identity.federation != bundle.federation:
        raise WrongFederation(
            f"{identity} belongs to federation {identity.federation!r}, "
            f"this bundle trusts {bundle.federation!r}"
        )
    authority = _issuing_authority(cert, bundle, identity)
    subjects = ((str(identity), cert), (f"authority {authority.name!r}", authority.certificate))
    for subject, checked in subjects:
        if bundle.is_revoked(checked.serial_number):
            raise Revoked(f"{subject}: serial {format_serial(checked.serial_number)} is revoked")
        if now < checked.not_valid_before_utc:
            raise NotYetValid(
                f"{subject}: certificate is valid from {checked.not_valid_before_utc.isoformat()}"
            )
        if now > checked.not_valid_after_utc:
            raise Expired(
                f"{subject}: certificate expired at {checked.not_valid_after_utc.isoformat()}"
            )
    if not authority.allows(identity):
        granted = ", ".join(str(grant) for grant in authority.grants)
        raise OutsideGrant(
            f"authority {authority.name!r} may issue only {granted}; not {identity.path}"
        )
    return identity


def _check_usage(cert: x509.Certificate, identity: Identity) -> None:
    constraints = _extension(cert, x509.BasicConstraints, identity, "basicConstraints")
    usage = _extension(cert, x509.KeyUsage, identity, "keyUsage")
    if constraints.ca:
        raise BadCertificate(f"{identity}: a CA certificate cannot be a principal")
    if not usage.digital_signature:
        raise BadCertificate(f"{identity}: key usage does not include digitalSignature")


def _extension(cert: x509.Certificate, kind: type[_E], identity: Identity, name: str) -> _E:
    try:
        return cert.extensions.get_extension_for_class(kind).value
    except x509.ExtensionNotFound:
        raise BadCertificate(f"{identity}: certificate has no {name} extension") from None
    except _EXTENSION_ERRORS as err:
        raise BadCertificate(f"certificate extensions are malformed: {err}") from None


def _issuing_authority(
    cert: x509.Certificate, bundle: TrustBundle, identity: Identity
) -> TrustedAuthority:
    for authority in bundle.authorities:
        try:
            cert.verify_directly_issued_by(authority.certificate)
        except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm):
            continue
        return authority
    raise UnknownAuthority(
        f"{identity}: issuer {_issuer_text(cert)!r} is not an authority this "
        f"bundle trusts, or its signature does not verify"
    )


def _issuer_text(cert: x509.Certificate) -> str:
    # The issuer name is parsed lazily; a mangled one must not turn a refusal into a crash.
    try:
        return cert.issuer.rfc4514_string()
    except ValueError:
        return "<unparseable issuer name>"
