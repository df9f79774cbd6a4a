"""``geofed mqtt``: broker-side files for the control plane.

- ``geofed mqtt acl --policies PATH --federation NAME [--coordinator NAME]...
  [--observer NAME]... [--out FILE]`` writes the Mosquitto ACL (:mod:`geofed.mqtt_acl`)
  for every region that has a policy file, to FILE (atomically) or to stdout.
- ``geofed mqtt cafile --bundle FILE [--out FILE]`` writes the trust bundle's CA
  certificates as one PEM file, the broker's ``cafile``.

Exit codes: 0 written, 1 refused (policy load errors or unusable names, one line each on
stderr; nothing is written), 2 usage error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from geofed.fsutil import atomic_write_bytes
from geofed.mqtt_acl import AclError, Principals, render_acl
from geofed.pki import PKIError, load_trust_bundle
from policies import PolicyLoadError, load_policies

EXIT_OK = 0
EXIT_REFUSED = 1


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``mqtt acl`` to the ``geofed`` parser."""
    parser = subparsers.add_parser("mqtt", help="generate broker files for the control plane")
    commands = parser.add_subparsers(dest="mqtt_command", metavar="ACTION", required=True)

    acl = commands.add_parser(
        "acl",
        help="write the Mosquitto ACL for a federation's regions",
        description="Write a Mosquitto acl_file that keeps each region to its own topics. "
        "Regions are those with a policy file; usernames are certificate CNs "
        "(region.NAME, coordinator.NAME, observer.NAME).",
    )
    acl.add_argument(
        "--policies",
        required=True,
        action="append",
        metavar="PATH",
        help="region policy file or directory of them (repeatable)",
    )
    acl.add_argument("--federation", required=True, metavar="NAME", help="federation name")
    acl.add_argument(
        "--coordinator",
        action="append",
        metavar="NAME",
        help="coordinator name (repeatable; default: main)",
    )
    acl.add_argument(
        "--observer",
        action="append",
        default=[],
        metavar="NAME",
        help="read-only principal, e.g. grafana (repeatable)",
    )
    acl.add_argument(
        "--out", type=Path, metavar="FILE", help="file to replace atomically (default: stdout)"
    )
    acl.set_defaults(handler=_acl)

    cafile = commands.add_parser(
        "cafile",
        help="write the trust bundle's CA certificates as the broker's cafile",
        description="Write every CA certificate of the trust bundle, concatenated, for "
        "Mosquitto's cafile. The broker cannot enforce the bundle's grants; it learns of "
        "revocations from each CA's CRL (geofed ca crl) in its crlfile.",
    )
    cafile.add_argument("--bundle", required=True, type=Path, help="trust bundle YAML file")
    cafile.add_argument(
        "--out", type=Path, metavar="FILE", help="file to replace atomically (default: stdout)"
    )
    cafile.set_defaults(handler=_cafile)


def _acl(args: argparse.Namespace) -> int:
    try:
        policies = load_policies(args.policies)
    except PolicyLoadError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return EXIT_REFUSED
    try:
        principals = Principals(
            federation=args.federation,
            regions=tuple(policies),
            coordinators=tuple(args.coordinator or ["main"]),
            observers=tuple(args.observer),
        )
        text = render_acl(principals, source=" ".join(args.policies))
    except AclError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    summary = (
        f"{len(principals.regions)} regions, {len(principals.coordinators)} coordinator(s), "
        f"{len(principals.observers)} observer(s)"
    )
    return _emit(args.out, text.encode("utf-8"), summary)


def _cafile(args: argparse.Namespace) -> int:
    try:
        bundle = load_trust_bundle(args.bundle)
    except PKIError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    if len(bundle.authorities) > 1:
        print(
            f"warning: the broker will accept a certificate from any of these "
            f"{len(bundle.authorities)} CAs for any name; it cannot check their grants",
            file=sys.stderr,
        )
    names = ", ".join(authority.name for authority in bundle.authorities)
    return _emit(args.out, bundle.ca_pem(), f"CA certificates of {names}")


def _emit(out: Path | None, data: bytes, summary: str) -> int:
    if out is None:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return EXIT_OK
    try:
        # Mosquitto reads its ACL after dropping to its own user (and again on SIGHUP), and
        # neither file holds a secret: leave them readable (0666 narrowed by the umask).
        atomic_write_bytes(out, data)
    except OSError as exc:
        print(f"error: cannot write {out}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_REFUSED
    print(f"wrote {out}: {summary}", file=sys.stderr)
    return EXIT_OK
