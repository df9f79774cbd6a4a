"""The region's credential: its signing key and certificate, and the federation's trust bundle.

Read once at start-up from the files the agent's configuration names (its ``identity``
section, :class:`AgentIdentityConfig`); the trust bundle is re-read when its file changes
(:attr:`Credentials.trust`), so revocations apply without a restart.
The certificate must name this region of this federation
(``spiffe://<federation>/region/<region>``); its key signs every delta manifest and
authenticates the agent over TLS; the trust bundle verifies the coordinator's server
certificate and the signatures of the updates and checkpoints it publishes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from pydantic import Field

from geofed.config_sections import IdentityConfig
from geofed.pki import (
    BadCertificate,
    CredentialStoreError,
    TrustBundle,
    TrustBundleError,
    certificate_identity,
    load_trust_bundle,
    read_certificate,
)
from geofed.pki.bundle_source import BundleSource, ReloadingBundle
from geofed.types import Identity


class AgentIdentityConfig(IdentityConfig):
    """The agent's ``identity`` section: the region's key and certificate, and the trust bundle."""

    trust_bundle: Path = Field(description="the federation's trust bundle file")


class CredentialsError(ValueError):
    """The identity files are unreadable or do not name this region of this federation."""


@dataclass(frozen=True)
class Credentials:
    """The region's signing key and certificate, and the federation's trust bundle."""

    identity: Identity
    certificate: x509.Certificate
    private_key: ec.EllipticCurvePrivateKey
    bundle: TrustBundle
    cert_file: Path
    key_file: Path
    #: The bundle as its file says now; None: ``bundle`` as read at start-up.
    reloading: Callable[[], TrustBundle] | None = None

    @property
    def trust(self) -> BundleSource:
        """What checks peers and artifacts: the reloading bundle, else the start-up one."""
        return self.reloading if self.reloading is not None else self.bundle


def load_credentials(files: AgentIdentityConfig, expected: Identity) -> Credentials:
    """Read the identity ``files``; the certificate must name ``expected``, this region."""
    try:
        bundle = load_trust_bundle(files.trust_bundle)
    except TrustBundleError as exc:
        raise CredentialsError(f"trust bundle: {exc}") from None
    if bundle.federation != expected.federation:
        raise CredentialsError(
            f"trust bundle {files.trust_bundle} is for federation {bundle.federation!r}, "
            f"not {expected.federation!r}"
        )
    try:
        certificate = read_certificate(files.cert)
        identity = certificate_identity(certificate)
    except (CredentialStoreError, BadCertificate) as exc:
        raise CredentialsError(f"{files.cert}: {exc}") from None
    try:
        key = serialization.load_pem_private_key(files.key.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise CredentialsError(f"{files.key}: not a readable PEM private key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != (
        certificate.public_key()
    ):
        raise CredentialsError(f"{files.key} is not the ECDSA key of {files.cert}")
    if identity != expected:
        raise CredentialsError(f"{files.cert} is {identity}, but this agent is {expected}")
    return Credentials(
        identity=expected,
        certificate=certificate,
        private_key=key,
        bundle=bundle,
        cert_file=files.cert,
        key_file=files.key,
        reloading=ReloadingBundle(files.trust_bundle, bundle),
    )
