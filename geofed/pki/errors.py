"""Errors of the federation PKI.

Every refusal of a certificate is a :class:`CertificateRefused` subclass with a stable
``code``: the HTTP middleware answers ``{"error": code, "message": str(err)}`` with it,
and audit records and metrics use it as a bounded label value.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar


class PKIError(Exception):
    """Base of every error raised by :mod:`geofed.pki`."""

    code: ClassVar[str] = "pki_error"


class CertificateRefused(PKIError):
    """A certificate (or a TLS peer) is not accepted as a federation identity."""

    code: ClassVar[str] = "certificate_refused"


class NoPeerCertificate(CertificateRefused):
    """The TLS peer presented no certificate, or the transport is not TLS."""

    code: ClassVar[str] = "no_peer_certificate"


class BadCertificate(CertificateRefused):
    """The certificate cannot be parsed or lacks what a federation identity needs."""

    code: ClassVar[str] = "bad_certificate"


class UnknownAuthority(CertificateRefused):
    """No authority in the trust bundle signed the certificate."""

    code: ClassVar[str] = "unknown_authority"


class WrongFederation(CertificateRefused):
    """The certificate names a principal of another federation."""

    code: ClassVar[str] = "wrong_federation"


class OutsideGrant(CertificateRefused):
    """The issuer is trusted, but not for the identity the certificate names."""

    code: ClassVar[str] = "outside_grant"


class Revoked(CertificateRefused):
    """The certificate's (or its issuer's) serial is on the bundle's revocation list."""

    code: ClassVar[str] = "revoked"


class Expired(CertificateRefused):
    """The certificate (or its issuer) is past its ``notAfter``."""

    code: ClassVar[str] = "expired"


class NotYetValid(CertificateRefused):
    """The certificate (or its issuer) is before its ``notBefore``."""

    code: ClassVar[str] = "not_yet_valid"


class UnexpectedPeer(CertificateRefused):
    """A valid federation identity, but not the one this connection must reach."""

    code: ClassVar[str] = "unexpected_peer"


class TrustBundleError(PKIError):
    """A trust bundle file is unreadable or invalid; names file, line and key."""

    code: ClassVar[str] = "invalid_trust_bundle"

    def __init__(self, path: Path, line: int | None, key: str | None, message: str) -> None:
        self.path = path
        self.line = line
        self.key = key
        self.message = message
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {key}: {message}" if key else f"{where}: {message}")


class CredentialStoreError(PKIError):
    """A CA or credential directory is missing, incomplete, inconsistent or in the way."""

    code: ClassVar[str] = "credential_store"
