"""CA and credential directories on disk.

A CA directory (``geofed ca init``)::

    ca.key      the CA's private key, PKCS#8 PEM, mode 0600
    ca.pem      the CA's self-signed certificate
    ca.yaml     metadata: federation, authority name, serial, SHA-256 fingerprint, expiry
    trust.yaml  a default trust bundle trusting only this CA, for every identity

A credential directory (``geofed ca issue``)::

    key.pem     the principal's private key, PKCS#8 PEM, mode 0600
    cert.pem    its certificate
    ca.pem      the certificate of the CA that issued it

Nothing is overwritten unless ``force`` is set. Every file is written atomically, keys
with mode 0600 from creation (see :mod:`geofed.fsutil`); the CA directory is created
0700. Keys are stored unencrypted: daemons read them unattended at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from pydantic import BaseModel, ConfigDict, ValidationError

from geofed.fsutil import PUBLIC_MODE, atomic_write_bytes
from geofed.pki.authority import CertificateAuthority, IssuedCredential
from geofed.pki.errors import BadCertificate, CredentialStoreError
from geofed.pki.trust import TrustBundleFile, format_serial, write_trust_bundle_file
from geofed.pki.verify import certificate_identity

CA_KEY = "ca.key"
CA_CERT = "ca.pem"
CA_META = "ca.yaml"
TRUST_BUNDLE = "trust.yaml"
KEY = "key.pem"
CERT = "cert.pem"
ISSUER = "ca.pem"


class CAMetadata(BaseModel):
    """Contents of ``ca.yaml``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    federation: str
    name: str
    serial: str
    fingerprint_sha256: str
    not_after: datetime


@dataclass(frozen=True)
class CredentialFiles:
    """Paths of a credential directory, as TLS contexts and broker configs want them."""

    directory: Path

    @property
    def cert_file(self) -> Path:
        return self.directory / CERT

    @property
    def key_file(self) -> Path:
        return self.directory / KEY

    @property
    def issuer_file(self) -> Path:
        return self.directory / ISSUER


def save_ca(ca: CertificateAuthority, directory: Path, *, force: bool = False) -> None:
    """Write ``ca`` and a default trust bundle trusting it into ``directory``."""
    _prepare(directory, (CA_KEY, CA_CERT, CA_META, TRUST_BUNDLE), force=force, mode=0o700)
    cert = ca.certificate
    meta = CAMetadata(
        federation=ca.federation,
        name=ca.name,
        serial=format_serial(cert.serial_number),
        fingerprint_sha256=cert.fingerprint(hashes.SHA256()).hex(),
        not_after=cert.not_valid_after_utc,
    )
    atomic_write_bytes(directory / CA_KEY, _key_pem(ca.private_key), private=True)
    atomic_write_bytes(directory / CA_CERT, _cert_pem(cert), mode=PUBLIC_MODE)
    bundle = TrustBundleFile.model_validate(
        {
            "federation": ca.federation,
            "authorities": [{"name": ca.name, "certificate": CA_CERT, "grants": ["*/*"]}],
            "revoked_serials": [],
        }
    )
    write_trust_bundle_file(directory / TRUST_BUNDLE, bundle)
    # Metadata last: a CA directory is complete once ca.yaml exists.
    text = yaml.safe_dump(meta.model_dump(mode="json"), sort_keys=False)
    atomic_write_bytes(directory / CA_META, text.encode("utf-8"), mode=PUBLIC_MODE)


def load_ca(directory: Path) -> CertificateAuthority:
    """Read a CA directory written by :func:`save_ca`."""
    meta_path = directory / CA_META
    try:
        meta = CAMetadata.model_validate(yaml.safe_load(meta_path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ValidationError) as err:
        raise CredentialStoreError(f"{meta_path}: not a readable CA metadata file: {err}") from None
    cert = _read_cert(directory / CA_CERT)
    key = _read_key(directory / CA_KEY, cert)
    return CertificateAuthority(
        federation=meta.federation, name=meta.name, certificate=cert, private_key=key
    )


def save_credential(
    credential: IssuedCredential, directory: Path, *, force: bool = False
) -> CredentialFiles:
    """Write an issued credential into ``directory``."""
    _prepare(directory, (KEY, CERT, ISSUER), force=force, mode=0o755)
    files = CredentialFiles(directory)
    atomic_write_bytes(files.key_file, _key_pem(credential.private_key), private=True)
    atomic_write_bytes(files.issuer_file, _cert_pem(credential.issuer), mode=PUBLIC_MODE)
    atomic_write_bytes(files.cert_file, _cert_pem(credential.certificate), mode=PUBLIC_MODE)
    return files


def load_credential(directory: Path) -> IssuedCredential:
    """Read a credential directory written by :func:`save_credential`."""
    files = CredentialFiles(directory)
    cert = _read_cert(files.cert_file)
    issuer = _read_cert(files.issuer_file)
    key = _read_key(files.key_file, cert)
    try:
        identity = certificate_identity(cert)
    except BadCertificate as err:
        raise CredentialStoreError(f"{files.cert_file}: {err}") from None
    return IssuedCredential(identity=identity, certificate=cert, private_key=key, issuer=issuer)


def read_certificate(path: Path) -> x509.Certificate:
    """Read one PEM certificate, raising :class:`CredentialStoreError` on any failure."""
    return _read_cert(path)


def _prepare(directory: Path, names: tuple[str, ...], *, force: bool, mode: int) -> None:
    if directory.exists() and not directory.is_dir():
        raise CredentialStoreError(f"{directory} exists and is not a directory")
    existing = [name for name in names if (directory / name).exists()]
    if existing and not force:
        raise CredentialStoreError(f"refusing to overwrite {', '.join(existing)} in {directory}")
    try:
        directory.mkdir(mode=mode, parents=True, exist_ok=True)
    except OSError as err:
        raise CredentialStoreError(f"cannot create {directory}: {err}") from None


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _read_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError) as err:
        raise CredentialStoreError(f"{path}: not a readable PEM certificate: {err}") from None


def _read_key(path: Path, cert: x509.Certificate) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as err:
        raise CredentialStoreError(f"{path}: not a readable PEM private key: {err}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
        raise CredentialStoreError(f"{path}: expected an ECDSA P-256 key")
    if key.public_key() != cert.public_key():
        raise CredentialStoreError(f"{path}: key does not match the certificate beside it")
    return key
