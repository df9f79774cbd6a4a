"""What the coordinator loads once at start-up from its configuration.

Trust bundle, its own credential (checked to be ``coordinator/<name>`` of the federation),
the region policies, the checkpoint locations (checked against the storage the policies
declare) and the working directories; also the fault-injection points of crash tests
(:mod:`coordinator.faults`, inert unless their environment variable is set). Any problem
is a :class:`ConfigError`, so the daemon exits with the configuration-error code before
it serves anything.
"""

from __future__ import annotations

import logging
import os
import ssl
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from coordinator.config import ConfigError, CoordinatorConfig
from coordinator.faults import FaultError, FaultPoints
from coordinator.rounds.round_traces import RoundTraces
from coordinator.storage.artifacts import Location, Signer
from coordinator.storage.job_blobs import JobBlobStores
from geofed.pki import (
    CertificateRefused,
    PKIError,
    TrustBundle,
    client_ssl_context,
    load_trust_bundle,
    read_certificate,
    server_ssl_context,
    verify_certificate,
)
from geofed.pki.authority import IssuedCredential
from geofed.pki.bundle_source import ReloadingBundle
from geofed.tracing import RoundTracer
from geofed.types import Role
from policies import PolicyLoadError, PolicySet, load_policies

__all__ = ["PolicyCell", "Runtime", "load_runtime", "policies_with_locations"]

log = logging.getLogger(__name__)


@dataclass
class PolicyCell:
    """The region policies in force: a reload (SIGHUP) replaces them as a whole."""

    value: PolicySet


@dataclass(frozen=True)
class Runtime:
    """Loaded, checked start-up state (see the module docstring)."""

    config: CoordinatorConfig
    bundle: TrustBundle
    credential: IssuedCredential
    signer: Signer
    policy_cell: PolicyCell
    locations: dict[str, Location]
    job_blobs: JobBlobStores
    spool_dir: Path
    tls_certificate: x509.Certificate | None
    trust: ReloadingBundle
    faults: FaultPoints = field(default_factory=FaultPoints)
    #: Each job's open round span, when the config names a trace collector.
    traces: RoundTraces = field(default_factory=lambda: RoundTraces(None))

    @property
    def policies(self) -> PolicySet:
        """The region policies in force now (read them per decision, never keep them)."""
        return self.policy_cell.value

    def server_ssl(self) -> ssl.SSLContext | None:
        """The HTTPS context, or None in insecure loopback mode."""
        if not self.config.tls_enabled:
            return None
        return server_ssl_context(self.bundle, self.config.tls_cert, self.config.tls_key)

    def mqtt_ssl(self) -> ssl.SSLContext | None:
        if not self.config.mqtt.tls:
            return None
        return client_ssl_context(self.bundle, self.config.identity.cert, self.config.identity.key)

    def certificate_expiry(self) -> dict[str, float]:
        """notAfter (Unix seconds) of the identity and the TLS server certificates."""
        expiry = {"identity": self.credential.certificate.not_valid_after_utc.timestamp()}
        if self.tls_certificate is not None:
            expiry["tls"] = self.tls_certificate.not_valid_after_utc.timestamp()
        return expiry


def load_runtime(config: CoordinatorConfig) -> Runtime:
    """Load and check everything the configuration names; :class:`ConfigError` if unusable."""
    problems: list[str] = []
    bundle = _bundle(config, problems)
    credential = _credential(config, bundle, problems)
    policies, locations = policies_with_locations(config, problems)
    if problems or bundle is None or credential is None or policies is None:
        raise ConfigError(problems or ["configuration is unusable"])
    tls_certificate = None
    if config.tls_enabled:
        try:
            server_ssl_context(bundle, config.tls_cert, config.tls_key)
            tls_certificate = read_certificate(config.tls_cert)
        except (OSError, ssl.SSLError, ValueError, PKIError) as exc:
            raise ConfigError(
                [f"tls: cannot use {config.tls_cert} / {config.tls_key}: {exc}"]
            ) from None
    try:
        config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        spool = config.state_dir / "spool"
        spool.mkdir(exist_ok=True, mode=0o700)
        job_blobs = JobBlobStores(config.state_dir)
    except OSError as exc:
        raise ConfigError([f"state_dir: cannot use {config.state_dir}: {exc}"]) from None
    ca = config.tracing.certificate_file
    if ca is not None and not ca.is_file():
        raise ConfigError([f"tracing.certificate_file: {ca} is not a readable file"])
    try:
        faults = FaultPoints.from_environ(os.environ)
    except FaultError as exc:
        raise ConfigError([str(exc)]) from None
    if faults.pause_at is not None:
        log.warning("fault injection armed: %s", faults)
    signer = Signer(credential.identity, credential.certificate, credential.private_key)
    return Runtime(
        config,
        bundle,
        credential,
        signer,
        PolicyCell(policies),
        locations,
        job_blobs,
        spool,
        tls_certificate,
        ReloadingBundle(config.trust_bundle, bundle),
        faults,
        RoundTraces(
            RoundTracer.configured(
                config.tracing, "geofed-coordinator", {"geofed.coordinator": config.name}
            )
        ),
    )


def policies_with_locations(
    config: CoordinatorConfig, problems: list[str]
) -> tuple[PolicySet | None, dict[str, Location]]:
    """The policies of ``policies_dir`` and the storage locations checked against them."""
    policies = _policies(config, problems)
    locations: dict[str, Location] = {}
    if policies is not None:
        locations = _locations(config, policies, problems)
    return policies, locations


def _bundle(config: CoordinatorConfig, problems: list[str]) -> TrustBundle | None:
    try:
        bundle = load_trust_bundle(config.trust_bundle)
    except PKIError as exc:
        problems.append(f"trust_bundle: {exc}")
        return None
    if bundle.federation != config.federation:
        problems.append(
            f"trust_bundle: {config.trust_bundle} is for federation {bundle.federation!r}, "
            f"the configuration says {config.federation!r}"
        )
    return bundle


def _credential(
    config: CoordinatorConfig, bundle: TrustBundle | None, problems: list[str]
) -> IssuedCredential | None:
    try:
        cert = read_certificate(config.identity.cert)
        key = _read_key(config.identity.key, cert)
    except (PKIError, ValueError) as exc:
        problems.append(f"identity: {exc}")
        return None
    if bundle is None:
        return None
    try:
        identity = verify_certificate(cert, bundle, now=datetime.now(UTC))
    except CertificateRefused as exc:
        problems.append(f"identity: {config.identity.cert}: refused by the trust bundle: {exc}")
        return None
    if identity.role is not Role.COORDINATOR or identity.name != config.name:
        problems.append(
            f"identity: {config.identity.cert} is {identity}, expected "
            f"spiffe://{config.federation}/coordinator/{config.name}"
        )
        return None
    return IssuedCredential(identity=identity, certificate=cert, private_key=key, issuer=cert)


def _read_key(path: Path, cert: x509.Certificate) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"{path}: not a readable PEM private key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{path}: expected an ECDSA key")  # noqa: TRY004 - a bad file
    if key.public_key() != cert.public_key():
        raise ValueError(f"{path}: key does not belong to the certificate {cert.subject}")
    return key


def _policies(config: CoordinatorConfig, problems: list[str]) -> PolicySet | None:
    try:
        policies = load_policies([config.policies_dir])
    except PolicyLoadError as exc:
        problems.extend(f"policies_dir: {problem}" for problem in exc.problems)
        return None
    for warning in policies.warnings:
        log.warning("policy %s", warning)
    return policies


def _locations(
    config: CoordinatorConfig, policies: PolicySet, problems: list[str]
) -> dict[str, Location]:
    locations: dict[str, Location] = {}
    for entry in config.storage:
        region = entry.region
        declared = policies.storage(entry.name)
        if declared is not None:
            if declared.storage.jurisdiction != entry.jurisdiction:
                where = declared.owner.origin(declared.path)
                problems.append(
                    f"storage {entry.name}: jurisdiction {entry.jurisdiction} differs from "
                    f"{declared.storage.jurisdiction} declared at {where}"
                )
                continue
            region = declared.owner.region
        try:
            locations[entry.name] = Location.open(
                entry.name, entry.jurisdiction, region, entry.path
            )
        except OSError as exc:
            problems.append(f"storage {entry.name}: cannot use {entry.path}: {exc}")
    return locations
