"""The production Mosquitto config (deploy/mosquitto/mosquitto.conf) run for real in tests.

Only the deployment-specific values are rewritten (paths, listener, user); everything else,
TLS, CRL and ACL settings included, is exactly what operators deploy. The ``crlfile`` holds
one CRL per CA of the federation (:func:`write_crls`), as ``geofed ca crl`` writes them.
"""

from __future__ import annotations

import getpass
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path

from geofed.pki import CertificateAuthority
from geofed.pki.crl import revocation_list, write_crl
from tests.support.mosquitto import HOST, MosquittoBroker, run_mosquitto
from tests.support.pki import Federation, Principal

REPO = Path(__file__).resolve().parents[2]
PRODUCTION_CONF = REPO / "deploy" / "mosquitto" / "mosquitto.conf"


def rewritten(path: Path, replacements: dict[str, str]) -> str:
    """``path``'s text with the value of each ``key value`` line in ``replacements`` replaced."""
    lines, seen = [], set()
    for line in path.read_text().splitlines():
        key = line.split(" ", 1)[0]
        if key in replacements:
            assert key not in seen, f"{path} sets {key} twice"
            seen.add(key)
            line = f"{key} {replacements[key]}"
        lines.append(line)
    missing = sorted(set(replacements) - seen)
    assert not missing, f"{path} no longer sets {missing}; update this test"
    return "\n".join(lines) + "\n"


def production_config(
    port: int,
    *,
    cafile: Path,
    certfile: Path,
    keyfile: Path,
    acl_file: Path,
    crlfile: Path,
    state: Path,
) -> str:
    """deploy/mosquitto/mosquitto.conf with each deployment-specific value replaced."""
    replacements = {
        # Started as root Mosquitto would switch to "mosquitto", who cannot read our keys.
        "user": getpass.getuser(),
        "listener": f"{port} {HOST}",
        "cafile": str(cafile),
        "certfile": str(certfile),
        "keyfile": str(keyfile),
        "acl_file": str(acl_file),
        "crlfile": str(crlfile),
        "persistence_location": f"{state}/",
    }
    # Debug logging shows "Denied PUBLISH" lines in the test's log.
    return rewritten(PRODUCTION_CONF, replacements) + "log_type debug\n"


def write_crls(
    authorities: Iterable[CertificateAuthority], revoked: Iterable[int], path: Path
) -> Path:
    """Write each CA's CRL of the ``revoked`` serials to ``path`` (a broker's ``crlfile``)."""
    serials = frozenset(revoked)
    write_crl([revocation_list(ca, serials) for ca in authorities], path)
    return path


@asynccontextmanager
async def production_broker(
    federation: Federation,
    principals: dict[str, Principal],
    acl_file: Path,
    workdir: Path,
    *,
    server_name: str = "broker",
    extra: str = "",
) -> AsyncIterator[MosquittoBroker]:
    """The production config on a free port; ``extra`` is appended (a bridge). Its
    ``crlfile`` is ``workdir/crl.pem``, with the bundle's revoked serials: rewrite it with
    :func:`write_crls` and send the broker SIGHUP to revoke more."""
    server = principals[server_name]
    state = workdir / "state"
    state.mkdir(parents=True, exist_ok=True)
    crlfile = write_crls(
        federation.authorities.values(), federation.bundle().revoked_serials, workdir / "crl.pem"
    )

    def config(port: int) -> str:
        return (
            production_config(
                port,
                cafile=federation.ca_file,
                certfile=server.cert_file,
                keyfile=server.key_file,
                acl_file=acl_file,
                crlfile=crlfile,
                state=state,
            )
            + extra
        )

    with run_mosquitto(
        workdir,
        cafile=federation.ca_file,
        certfile=server.cert_file,
        keyfile=server.key_file,
        config=config,
    ) as broker:
        yield broker
