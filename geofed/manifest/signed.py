"""Signed manifests: sign with a producer's key, verify against the trust bundle.

Wire form (UTF-8 JSON, keys sorted)::

    {"certificate": "<PEM of the producer>", "manifest": {...}, "signature": "<base64>"}

The signature is ECDSA P-256 with SHA-256 (DER, base64) over
:meth:`~geofed.manifest.model.Manifest.canonical_bytes`. Verification trusts nothing of
the transport: the enclosed certificate must pass
:func:`~geofed.pki.verify.verify_certificate` against the bundle, its identity must be the
manifest's producer, and the signature must verify with its key. Parsing untrusted bytes
raises only :class:`~geofed.manifest.errors.ManifestError` subclasses.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding
from pydantic import BaseModel, ConfigDict, StrictStr, ValidationError

from geofed.canonical_json import canonical_json
from geofed.manifest.errors import (
    BadSignature,
    MalformedManifest,
    ProducerMismatch,
    UntrustedSigner,
)
from geofed.manifest.model import Manifest
from geofed.pki.errors import CertificateRefused
from geofed.pki.trust import TrustBundle
from geofed.pki.verify import certificate_identity, verify_certificate
from geofed.types import Identity

MAX_SIGNED_MANIFEST_BYTES: Final = 16 * 1024 * 1024
# A DER ECDSA P-256 signature is at most 72 bytes; leave room for larger curves.
_MAX_SIGNATURE_BYTES: Final = 1024
_SIGNATURE_ALGORITHM: Final = ec.ECDSA(hashes.SHA256())


class _Envelope(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    manifest: Manifest
    signature: StrictStr
    certificate: StrictStr


@dataclass(frozen=True)
class SignedManifest:
    """A manifest, its producer's signature and the producer's certificate."""

    manifest: Manifest
    signature: bytes
    certificate: x509.Certificate

    def to_bytes(self) -> bytes:
        """The wire form."""
        return canonical_json(
            {
                "manifest": self.manifest.to_json_dict(),
                "signature": base64.b64encode(self.signature).decode("ascii"),
                "certificate": self.certificate.public_bytes(Encoding.PEM).decode("ascii"),
            }
        )

    @classmethod
    def from_bytes(
        cls, data: bytes, *, max_size: int = MAX_SIGNED_MANIFEST_BYTES
    ) -> SignedManifest:
        """Parse the wire form; the result is not yet verified (see :meth:`verify`)."""
        return _parse(data, max_size)

    def verify(self, bundle: TrustBundle, *, now: datetime) -> Identity:
        """Verify signer, producer and signature at time ``now``; return the producer."""
        try:
            identity = verify_certificate(self.certificate, bundle, now=now)
        except CertificateRefused as err:
            raise UntrustedSigner(f"signer certificate refused: {err}", reason=err.code) from None
        _check_signature(self.certificate, self.signature, self.manifest.canonical_bytes())
        if identity.uri != self.manifest.producer:
            raise ProducerMismatch(
                f"manifest names producer {self.manifest.producer} but {identity} signed it"
            )
        return identity


def sign_manifest(
    manifest: Manifest, private_key: ec.EllipticCurvePrivateKey, certificate: x509.Certificate
) -> SignedManifest:
    """Sign ``manifest`` as the holder of ``certificate``, who must be its producer."""
    if private_key.public_key() != certificate.public_key():
        raise ValueError("the private key does not belong to the certificate")
    signer = certificate_identity(certificate)
    if signer.uri != manifest.producer:
        raise ProducerMismatch(
            f"manifest names producer {manifest.producer}; this certificate is {signer}"
        )
    signature = private_key.sign(manifest.canonical_bytes(), _SIGNATURE_ALGORITHM)
    return SignedManifest(manifest=manifest, signature=signature, certificate=certificate)


def _check_signature(cert: x509.Certificate, signature: bytes, payload: bytes) -> None:
    try:
        key = cert.public_key()
    except (ValueError, UnsupportedAlgorithm) as err:
        raise BadSignature(f"signer key is unusable: {err}") from None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise BadSignature(f"signer key is {type(key).__name__}, not ECDSA")
    try:
        key.verify(signature, payload, _SIGNATURE_ALGORITHM)
    except InvalidSignature:
        raise BadSignature("signature does not match the manifest and signer key") from None


def _parse(data: bytes, max_size: int) -> SignedManifest:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MalformedManifest(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_size:
        raise MalformedManifest(f"signed manifest of {len(data)} bytes exceeds {max_size}")
    try:
        text = bytes(data).decode("utf-8")
        # A first pass with the standard parser refuses duplicate keys and NaN/Infinity,
        # which pydantic's parser would silently accept.
        json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except (ValueError, RecursionError) as err:
        raise MalformedManifest(f"not valid JSON: {err}") from None
    try:
        envelope = _Envelope.model_validate_json(text)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "document"
        raise MalformedManifest(f"{where}: {first['msg']}") from None
    try:
        signature = base64.b64decode(envelope.signature, validate=True)
    except (binascii.Error, ValueError) as err:
        raise MalformedManifest(f"signature is not base64: {err}") from None
    if not 0 < len(signature) <= _MAX_SIGNATURE_BYTES:
        raise MalformedManifest(f"signature of {len(signature)} bytes")
    try:
        certs = x509.load_pem_x509_certificates(envelope.certificate.encode("ascii"))
    except ValueError as err:
        raise MalformedManifest(f"certificate is not PEM: {err}") from None
    if len(certs) != 1:
        raise MalformedManifest(f"expected one certificate, found {len(certs)}")
    # cryptography still loads these (with a deprecation warning); RFC 5280 forbids them.
    if certs[0].serial_number <= 0:
        raise MalformedManifest("certificate serial number is not positive (RFC 5280)")
    return SignedManifest(manifest=envelope.manifest, signature=signature, certificate=certs[0])


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result: dict[str, object] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")
