"""Throwaway federations for tests: CAs, a trust bundle and credentials under one directory.

    fed = make_federation(tmp_path, authorities={"org-a": ["*/*"]})
    coordinator = fed.coordinator()          # localhost / 127.0.0.1 SANs, for TLS servers
    region = fed.region("eu-west")
    server_ctx = coordinator.server_context(fed.bundle())
    client_ctx = region.client_context(fed.bundle())

Layout under ``root``: ``<authority>/`` CA directories as ``geofed ca init`` writes them,
``trust.yaml`` (the federation's bundle), ``cafile.pem`` (every trusted CA, for a broker's
``cafile``), ``credentials/<authority>-<role>-<name>[-N]/`` as ``geofed ca issue`` writes
them, and ``untrusted/<authority>/`` for CAs the bundle does not list.
Everything goes through the real library, so certificates are exactly production's.
"""

from __future__ import annotations

import ipaddress
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from geofed.pki import (
    CertificateAuthority,
    CredentialFiles,
    Grant,
    IssuedCredential,
    TrustBundle,
    TrustBundleFile,
    add_revoked_serials,
    client_ssl_context,
    create_ca,
    issue,
    load_trust_bundle,
    save_ca,
    save_credential,
    server_ssl_context,
    write_trust_bundle_file,
)
from geofed.pki.authority import IPAddress
from geofed.types import Identity, Role

LOOPBACK_DNS = ("localhost",)
LOOPBACK_IPS: tuple[IPAddress, ...] = (ipaddress.ip_address("127.0.0.1"),)


@dataclass(frozen=True)
class Principal:
    """An issued identity whose key and certificate are on disk."""

    identity: Identity
    authority: str
    credential: IssuedCredential
    files: CredentialFiles

    @property
    def cert_file(self) -> Path:
        return self.files.cert_file

    @property
    def key_file(self) -> Path:
        return self.files.key_file

    @property
    def serial(self) -> int:
        return self.credential.certificate.serial_number

    def server_context(self, bundle: TrustBundle) -> ssl.SSLContext:
        return server_ssl_context(bundle, self.cert_file, self.key_file)

    def client_context(self, bundle: TrustBundle) -> ssl.SSLContext:
        return client_ssl_context(bundle, self.cert_file, self.key_file)


@dataclass
class Federation:
    """A federation's CAs, trust bundle file and issued principals, in ``root``."""

    name: str
    root: Path
    authorities: dict[str, CertificateAuthority]
    grants: dict[str, tuple[str, ...]]
    untrusted: dict[str, CertificateAuthority] = field(default_factory=dict)

    @property
    def bundle_file(self) -> Path:
        return self.root / "trust.yaml"

    @property
    def ca_file(self) -> Path:
        return self.root / "cafile.pem"

    def bundle(self) -> TrustBundle:
        """The trust bundle as loaded from its file now (revocations included)."""
        return load_trust_bundle(self.bundle_file)

    def issue(
        self,
        role: Role | str,
        name: str,
        *,
        authority: str | None = None,
        dns_names: Sequence[str] = (),
        ip_addresses: Sequence[IPAddress] = (),
        not_before: datetime | None = None,
        not_after: datetime | None = None,
    ) -> Principal:
        """Issue ``role/name``. ``authority`` defaults to the first whose grants allow it;
        name one explicitly (trusted or untrusted) to mint a certificate it should not."""
        identity = Identity(federation=self.name, role=Role(role), name=name)
        org = authority or self._granting(identity)
        ca = self.authorities.get(org) or self.untrusted[org]
        credential = issue(
            ca,
            identity,
            dns_names=dns_names,
            ip_addresses=ip_addresses,
            not_before=not_before,
            not_after=not_after,
        )
        base = self.root / "credentials" / f"{org}-{identity.role.value}-{name}"
        directory, n = base, 1
        while directory.exists():
            n += 1
            directory = base.with_name(f"{base.name}-{n}")
        files = save_credential(credential, directory)
        return Principal(identity=identity, authority=org, credential=credential, files=files)

    def coordinator(
        self,
        name: str = "main",
        *,
        authority: str | None = None,
        not_before: datetime | None = None,
        not_after: datetime | None = None,
    ) -> Principal:
        """A coordinator with loopback SANs, so TLS clients can verify ``localhost``."""
        return self.issue(
            Role.COORDINATOR,
            name,
            authority=authority,
            dns_names=LOOPBACK_DNS,
            ip_addresses=LOOPBACK_IPS,
            not_before=not_before,
            not_after=not_after,
        )

    def region(
        self,
        name: str,
        *,
        authority: str | None = None,
        not_before: datetime | None = None,
        not_after: datetime | None = None,
    ) -> Principal:
        return self.issue(
            Role.REGION, name, authority=authority, not_before=not_before, not_after=not_after
        )

    def operator(self, name: str = "ops", *, authority: str | None = None) -> Principal:
        return self.issue(Role.OPERATOR, name, authority=authority)

    def observer(self, name: str = "watch", *, authority: str | None = None) -> Principal:
        return self.issue(Role.OBSERVER, name, authority=authority)

    def add_untrusted_authority(self, name: str) -> CertificateAuthority:
        """A CA of this federation's name that the bundle does not list."""
        ca = create_ca(self.name, name)
        save_ca(ca, self.root / "untrusted" / name)
        self.untrusted[name] = ca
        return ca

    def revoke(self, *principals: Principal) -> None:
        """Add the principals' serials to the bundle file."""
        add_revoked_serials(self.bundle_file, [p.serial for p in principals])

    def _granting(self, identity: Identity) -> str:
        for org, grants in self.grants.items():
            if any(Grant.parse(g).allows(identity) for g in grants):
                return org
        raise ValueError(f"no authority of {self.name!r} may issue {identity.path}")


def make_federation(
    root: Path,
    name: str = "testfed",
    *,
    authorities: Mapping[str, Sequence[str]] | None = None,
) -> Federation:
    """Create CAs (authority name -> grants; default one CA granted ``*/*``) and a bundle."""
    grants = {org: tuple(g) for org, g in (authorities or {"org": ["*/*"]}).items()}
    root.mkdir(parents=True, exist_ok=True)
    cas = {}
    for org in grants:
        cas[org] = create_ca(name, org)
        save_ca(cas[org], root / org)
    spec = TrustBundleFile.model_validate(
        {
            "federation": name,
            "authorities": [
                {"name": org, "certificate": f"{org}/ca.pem", "grants": list(g)}
                for org, g in grants.items()
            ],
            "revoked_serials": [],
        }
    )
    write_trust_bundle_file(root / "trust.yaml", spec)
    federation = Federation(name=name, root=root, authorities=cas, grants=grants)
    federation.ca_file.write_bytes(federation.bundle().ca_pem())
    return federation
