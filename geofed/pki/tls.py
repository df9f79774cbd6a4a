"""TLS contexts built from a trust bundle, and the identity of a TLS peer.

Both sides require a certificate from the other (mutual TLS, TLS 1.2 or newer) and trust
only the bundle's authorities, never the system store. OpenSSL checks the chain and the
validity window during the handshake; grants, revocation and the federation are checked
right after it by :func:`peer_identity`, because Python's ``ssl`` offers no verify
callback. Contexts are built once, at start-up; revocations added to a bundle later are
honoured by :func:`peer_identity` without rebuilding them.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from cryptography import x509

from geofed.pki.errors import BadCertificate, NoPeerCertificate
from geofed.pki.trust import TrustBundle
from geofed.pki.verify import verify_certificate
from geofed.types import Identity

Clock = Callable[[], datetime]


def utc_now() -> datetime:
    """The default clock of the TLS checks."""
    return datetime.now(UTC)


def server_ssl_context(bundle: TrustBundle, cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """A server context that requires a client certificate from one of the bundle's CAs."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _configure(context, bundle, cert_file, key_file)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_ssl_context(bundle: TrustBundle, cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """A client context that presents our certificate and checks the server's hostname."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    _configure(context, bundle, cert_file, key_file)
    context.check_hostname = True
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def _configure(
    context: ssl.SSLContext, bundle: TrustBundle, cert_file: Path, key_file: Path
) -> None:
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # Strict RFC 5280 checks (Python 3.13's default) catch malformed certificates early.
    context.verify_flags |= ssl.VERIFY_X509_STRICT
    context.load_verify_locations(cadata=bundle.ca_pem().decode("ascii"))
    context.load_cert_chain(certfile=cert_file, keyfile=key_file)


def peer_certificate(peer: ssl.SSLObject | ssl.SSLSocket | bytes | None) -> x509.Certificate:
    """The peer's leaf certificate from an SSL object, socket, or DER bytes."""
    if peer is None:
        raise NoPeerCertificate("connection is not TLS, so it carries no identity")
    der = peer if isinstance(peer, bytes) else peer.getpeercert(binary_form=True)
    if not der:
        raise NoPeerCertificate("TLS peer presented no certificate")
    try:
        return x509.load_der_x509_certificate(der)
    except ValueError as err:
        raise BadCertificate(f"peer certificate does not parse: {err}") from None


def peer_identity(
    peer: ssl.SSLObject | ssl.SSLSocket | bytes | None,
    bundle: TrustBundle,
    *,
    now: datetime | None = None,
) -> Identity:
    """Verify a TLS peer's certificate against ``bundle``; return its identity.

    Raises a :class:`~geofed.pki.errors.CertificateRefused` subclass when refused.
    """
    return verify_certificate(peer_certificate(peer), bundle, now=now or utc_now())
