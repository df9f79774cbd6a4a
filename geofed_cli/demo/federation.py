"""The demo's ephemeral federation PKI: one CA and a credential per principal, in the work dir."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from geofed.pki import create_ca, issue, save_ca, save_credential
from geofed.pki.store import CERT, KEY, TRUST_BUNDLE
from geofed.types import Identity, Role


@dataclass(frozen=True, slots=True)
class Credential:
    """Where one principal's certificate and key were written."""

    identity: Identity
    directory: Path

    @property
    def cert(self) -> Path:
        return self.directory / CERT

    @property
    def key(self) -> Path:
        return self.directory / KEY


@dataclass(frozen=True, slots=True)
class DemoFederation:
    """The demo's CA, trust bundle and credentials."""

    name: str
    ca_dir: Path
    trust_bundle: Path
    coordinator: Credential
    operator: Credential
    regions: dict[str, Credential]


def create_demo_federation(root: Path, name: str, regions: Sequence[str]) -> DemoFederation:
    """Create a CA under ``root/ca`` and issue the coordinator, an operator and each region."""
    ca = create_ca(name)
    save_ca(ca, root / "ca", force=True)

    def credential(role: Role, principal: str, *, loopback: bool = False) -> Credential:
        identity = Identity(federation=name, role=role, name=principal)
        issued = issue(
            ca,
            identity,
            dns_names=("localhost",) if loopback else (),
            ip_addresses=(ipaddress.ip_address("127.0.0.1"),) if loopback else (),
        )
        directory = root / (principal if role is Role.REGION else role.value)
        save_credential(issued, directory, force=True)
        return Credential(identity, directory)

    return DemoFederation(
        name=name,
        ca_dir=root / "ca",
        trust_bundle=root / "ca" / TRUST_BUNDLE,
        coordinator=credential(Role.COORDINATOR, "main", loopback=True),
        operator=credential(Role.OPERATOR, "demo"),
        regions={region: credential(Role.REGION, region) for region in regions},
    )
