"""Certificate revocation lists, for the MQTT broker.

Mosquitto cannot read a trust bundle's ``revoked_serials``; it checks each client
certificate against the CRLs in its ``crlfile``. With a ``crlfile`` set, OpenSSL refuses
every certificate whose issuing CA has no CRL there, so each CA of the broker's ``cafile``
publishes one (an empty one before its first revocation) and the broker's ``crlfile`` is
their concatenation. :func:`revocation_list` is one CA's CRL of the given serials;
:func:`write_crl` writes it. A CRL past its ``next_update`` fails every check, so it is
written again before then (``geofed ca crl``).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from geofed.fsutil import atomic_write_bytes
from geofed.pki.authority import CertificateAuthority

__all__ = ["DEFAULT_CRL_VALIDITY", "revocation_list", "write_crl"]

DEFAULT_CRL_VALIDITY = timedelta(days=365)
# As for certificates: a broker whose clock is a little behind still accepts a fresh CRL.
_BACKDATE = timedelta(minutes=5)


def revocation_list(
    ca: CertificateAuthority,
    serials: Iterable[int],
    *,
    now: datetime | None = None,
    valid_for: timedelta = DEFAULT_CRL_VALIDITY,
) -> x509.CertificateRevocationList:
    """``ca``'s CRL revoking ``serials`` (serials of other CAs revoke nothing here)."""
    if valid_for <= timedelta(0):
        raise ValueError(f"a CRL must be valid for some time, got {valid_for}")
    issued = now or datetime.now(UTC)
    start = issued - _BACKDATE
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca.certificate.subject)
        .last_update(start)
        .next_update(issued + valid_for)
        # Increasing with every CRL written, as RFC 5280 asks.
        .add_extension(x509.CRLNumber(int(issued.timestamp() * 1000)), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.private_key.public_key()),
            critical=False,
        )
    )
    for serial in sorted(set(serials)):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(start).build()
        )
    return builder.sign(ca.private_key, hashes.SHA256())


def write_crl(crls: Iterable[x509.CertificateRevocationList], path: Path) -> None:
    """Atomically write ``crls`` to ``path``, PEM, one after another (a broker's ``crlfile``)."""
    data = b"".join(crl.public_bytes(serialization.Encoding.PEM) for crl in crls)
    atomic_write_bytes(path, data, mode=0o644)
