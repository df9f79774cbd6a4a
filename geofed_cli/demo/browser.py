"""The demo operator's credential for a browser: a PKCS#12 file and its passphrase.

The status page (``/ui``) is served like every endpoint: HTTPS with a client
certificate. A browser takes a client certificate as a PKCS#12 file, so the demo writes
its operator's key and certificate (with the demo CA) as one, encrypted with a random
passphrase written beside it (0600): browsers and macOS refuse a PKCS#12 without one.
The legacy SHA-1/3DES encryption is the one every browser and key store imports.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.serialization import PrivateFormat, pkcs12

from geofed.fsutil import atomic_write_bytes
from geofed.pki import load_credential

__all__ = ["BrowserCredential", "write_browser_credential"]


@dataclass(frozen=True, slots=True)
class BrowserCredential:
    """Where the PKCS#12 file and its passphrase were written, and the passphrase."""

    p12: Path
    passphrase_file: Path
    passphrase: str


def write_browser_credential(credential_dir: Path, name: str = "browser") -> BrowserCredential:
    """Write ``<name>.p12`` (key, certificate, issuing CA) into ``credential_dir``."""
    issued = load_credential(credential_dir)
    passphrase = secrets.token_urlsafe(12)
    encryption = (
        PrivateFormat.PKCS12.encryption_builder()
        .kdf_rounds(50_000)
        .key_cert_algorithm(pkcs12.PBES.PBESv1SHA1And3KeyTripleDESCBC)
        .hmac_hash(hashes.SHA1())  # noqa: S303 - what every key store still reads
        .build(passphrase.encode())
    )
    data = pkcs12.serialize_key_and_certificates(
        str(issued.identity).encode(),
        issued.private_key,
        issued.certificate,
        [issued.issuer],
        encryption,
    )
    p12 = credential_dir / f"{name}.p12"
    passphrase_file = credential_dir / f"{name}.p12.passphrase"
    atomic_write_bytes(p12, data, private=True)
    atomic_write_bytes(passphrase_file, passphrase.encode() + b"\n", private=True)
    return BrowserCredential(p12, passphrase_file, passphrase)
