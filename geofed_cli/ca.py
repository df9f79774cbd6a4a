"""``geofed ca``: run a federation member's certificate authority.

- ``geofed ca init --federation NAME --out DIR`` creates a root CA and a default trust bundle.
- ``geofed ca issue --ca DIR --role ROLE --name NAME --out DIR`` issues a key and certificate.
- ``geofed ca revoke --bundle FILE --cert FILE [--ca DIR --crl FILE]`` adds a certificate's
  serial to a bundle; with ``--ca`` and ``--crl``, writes that CA's CRL of the bundle's
  revoked serials too (the broker's ``crlfile``).
- ``geofed ca crl --ca DIR --bundle FILE --out FILE`` writes the CA's CRL of the bundle's
  revoked serials (before the first revocation, and again before it expires).

Exit codes: 0 done, 1 refused (one ``error: ...`` line on stderr), 2 usage error.
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from geofed.pki import (
    CertificateAuthority,
    CredentialStoreError,
    PKIError,
    add_revoked_serials,
    create_ca,
    format_serial,
    issue,
    load_ca,
    parse_serial,
    read_certificate,
    save_ca,
    save_credential,
)
from geofed.pki.authority import DEFAULT_CA_VALIDITY, DEFAULT_LEAF_VALIDITY, IPAddress
from geofed.pki.crl import DEFAULT_CRL_VALIDITY, revocation_list, write_crl
from geofed.pki.trust import read_trust_bundle_file
from geofed.types import Identity, InvalidName, Role, validate_name

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2

COORDINATOR_DEFAULT_DNS = ("localhost",)
COORDINATOR_DEFAULT_IPS = (ipaddress.ip_address("127.0.0.1"),)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``ca init``, ``ca issue``, ``ca revoke`` and ``ca crl`` to the ``geofed`` parser."""
    parser = subparsers.add_parser("ca", help="run a federation certificate authority")
    commands = parser.add_subparsers(dest="ca_command", metavar="ACTION", required=True)

    init = commands.add_parser("init", help="create a root CA and a default trust bundle")
    init.add_argument("--federation", required=True, type=_name("federation"))
    init.add_argument(
        "--name", type=_name("authority name"), help="authority name (default: the federation)"
    )
    init.add_argument("--out", required=True, type=Path, help="CA directory to create")
    init.add_argument("--days", type=_days, default=DEFAULT_CA_VALIDITY.days)
    init.add_argument("--force", action="store_true", help="replace an existing CA")
    init.set_defaults(handler=_init)

    iss = commands.add_parser("issue", help="issue a key and certificate for a principal")
    iss.add_argument("--ca", required=True, type=Path, help="CA directory")
    iss.add_argument("--role", required=True, choices=[role.value for role in Role])
    iss.add_argument("--name", required=True, type=_name("principal name"))
    iss.add_argument("--out", required=True, type=Path, help="credential directory to create")
    iss.add_argument(
        "--dns", action="append", default=[], type=_dns, help="SAN DNS name (repeatable)"
    )
    iss.add_argument(
        "--ip", action="append", default=[], type=_ip, help="SAN IP address (repeatable)"
    )
    iss.add_argument("--days", type=_days, default=DEFAULT_LEAF_VALIDITY.days)
    iss.add_argument("--force", action="store_true", help="replace an existing credential")
    iss.set_defaults(handler=_issue)

    rev = commands.add_parser("revoke", help="add a certificate's serial to a trust bundle")
    rev.add_argument("--bundle", required=True, type=Path, help="trust bundle YAML file")
    rev.add_argument("--cert", required=True, type=Path, help="PEM certificate to revoke")
    rev.add_argument("--ca", type=Path, help="CA directory that signs the CRL (with --crl)")
    rev.add_argument("--crl", type=Path, help="write the CA's CRL here too (the broker's crlfile)")
    rev.add_argument("--days", type=_days, default=DEFAULT_CRL_VALIDITY.days, help="CRL validity")
    rev.set_defaults(handler=_revoke)

    crl = commands.add_parser("crl", help="write a CA's CRL of a trust bundle's revoked serials")
    crl.add_argument("--ca", required=True, type=Path, help="CA directory")
    crl.add_argument("--bundle", required=True, type=Path, help="trust bundle YAML file")
    crl.add_argument("--out", required=True, type=Path, help="CRL file to write (PEM)")
    crl.add_argument("--days", type=_days, default=DEFAULT_CRL_VALIDITY.days, help="CRL validity")
    crl.set_defaults(handler=_crl)


def _init(args: argparse.Namespace) -> int:
    ca = create_ca(args.federation, args.name, valid_for=timedelta(days=args.days))
    try:
        save_ca(ca, args.out, force=args.force)
    except CredentialStoreError as err:
        return _refused(f"{err} (--force replaces them)")
    serial = format_serial(ca.certificate.serial_number)
    print(f"created CA {ca.name!r} of federation {ca.federation!r} in {args.out} (serial {serial})")
    return EXIT_OK


def _issue(args: argparse.Namespace) -> int:
    try:
        ca = load_ca(args.ca)
        identity = Identity(federation=ca.federation, role=Role(args.role), name=args.name)
    except (PKIError, InvalidName) as err:
        return _refused(str(err))
    dns: list[str] = args.dns
    ips: list[IPAddress] = args.ip
    if identity.role is Role.COORDINATOR and not dns and not ips:
        dns, ips = list(COORDINATOR_DEFAULT_DNS), list(COORDINATOR_DEFAULT_IPS)
    credential = issue(
        ca, identity, dns_names=dns, ip_addresses=ips, valid_for=timedelta(days=args.days)
    )
    try:
        save_credential(credential, args.out, force=args.force)
    except CredentialStoreError as err:
        return _refused(f"{err} (--force replaces them)")
    serial = format_serial(credential.certificate.serial_number)
    print(f"issued {identity} in {args.out} (serial {serial})")
    return EXIT_OK


def _revoke(args: argparse.Namespace) -> int:
    if (args.ca is None) != (args.crl is None):
        print("error: --ca and --crl go together", file=sys.stderr)
        return EXIT_USAGE
    try:
        ca = load_ca(args.ca) if args.ca is not None else None
        serial = read_certificate(args.cert).serial_number
        added = add_revoked_serials(args.bundle, [serial])
    except (PKIError, OSError) as err:
        return _refused(str(err))
    state = "revoked" if added else "already revoked"
    print(f"serial {format_serial(serial)} {state} in {args.bundle}")
    if ca is None:
        return EXIT_OK
    return _write_crl(ca, args.bundle, args.crl, args.days)


def _crl(args: argparse.Namespace) -> int:
    try:
        ca = load_ca(args.ca)
    except (PKIError, OSError) as err:
        return _refused(str(err))
    return _write_crl(ca, args.bundle, args.out, args.days)


def _write_crl(ca: CertificateAuthority, bundle: Path, out: Path, days: int) -> int:
    try:
        serials = [parse_serial(s) for s in read_trust_bundle_file(bundle).revoked_serials]
        crl = revocation_list(ca, serials, valid_for=timedelta(days=days))
        write_crl([crl], out)
    except (PKIError, OSError) as err:
        return _refused(str(err))
    print(
        f"wrote the CRL of CA {ca.name!r} to {out}: {len(set(serials))} revoked serial(s), "
        f"valid until {crl.next_update_utc:%Y-%m-%d}; reload the broker (SIGHUP) to apply it"
    )
    return EXIT_OK


def _refused(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_REFUSED


def _name(what: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        try:
            return validate_name(what, value)
        except InvalidName as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = what
    return parse


def _days(value: str) -> int:
    try:
        days = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of days: {value!r}") from None
    if days < 1:
        raise argparse.ArgumentTypeError(f"days must be at least 1, got {days}")
    return days


def _dns(value: str) -> str:
    labels = value.split(".")
    if not value or not all(
        label and len(label) <= 63 and label.replace("-", "").isalnum() and label.isascii()
        for label in labels
    ):
        raise argparse.ArgumentTypeError(f"not a DNS name: {value!r}")
    return value.lower()


def _ip(value: str) -> IPAddress:
    try:
        return ipaddress.ip_address(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an IP address: {value!r}") from None
