"""``geofed job submit|status|pause|resume|cancel|preempt|regions`` and ``geofed status``.

Every call is HTTPS with the operator's (or observer's) client certificate, and the
server must prove it is a coordinator of the federation. Where to connect and as whom
comes from flags, else from the environment:

==============  =================  ===============================================
flag            environment        meaning
==============  =================  ===============================================
``--url``       ``GEOFED_URL``     ``https://host:port`` of the coordinator
``--cert``      ``GEOFED_CERT``    client certificate (PEM)
``--key``       ``GEOFED_KEY``     its private key (PEM)
``--trust``     ``GEOFED_TRUST``   the federation's trust bundle (YAML)
``--identity``  ``GEOFED_IDENTITY``  ``http://`` loopback demo only: the SPIFFE URI sent
                                   as ``X-Geofed-Identity`` instead of a certificate
==============  =================  ===============================================

A flag always wins over the environment. ``job submit`` sends the file as it is; the
coordinator validates it and its errors are printed as ``FILE:LINE: key: message``.

Exit codes: 0 success, 1 the coordinator refused or could not be reached, 2 usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlencode

from geofed.api_paths import ApiPaths
from geofed_cli.status_view import plain_text, rich_view, status_rows

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

_ENV = {
    "url": "GEOFED_URL",
    "cert": "GEOFED_CERT",
    "key": "GEOFED_KEY",
    "trust": "GEOFED_TRUST",
    "identity": "GEOFED_IDENTITY",
}


class UsageError(Exception):
    """Missing or contradictory connection settings."""


@dataclass(frozen=True)
class Reply:
    status: int
    body: Any


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    job = subparsers.add_parser(
        "job",
        help="submit and manage jobs on a coordinator",
        description="Submit and manage jobs (operators). Exit codes: 0 success, 1 refused "
        "or unreachable, 2 usage error.",
    )
    actions = job.add_subparsers(dest="job_command", metavar="ACTION", required=True)
    submit = actions.add_parser("submit", help="submit a job spec (YAML or JSON)")
    submit.add_argument("file", metavar="FILE", type=Path, help="job spec")
    submit.add_argument(
        "--priority", metavar="CLASS", help="priority class, instead of the spec's priority"
    )
    submit.add_argument(
        "--team", metavar="TEAM", help="owning team, instead of the spec's (default: yours)"
    )
    _connection_arguments(submit)
    submit.set_defaults(handler=_submit)
    for name, text in (
        ("status", "show a job"),
        ("pause", "pause a job at its current round"),
        ("resume", "resume a paused job"),
        ("cancel", "cancel a job for good"),
        ("preempt", "stop a job at its next round boundary and requeue it (admins)"),
    ):
        action = actions.add_parser(name, help=text)
        action.add_argument("job", metavar="JOB", help="job id")
        _connection_arguments(action)
        action.set_defaults(handler=_job_status if name == "status" else _job_action, action=name)

    regions = actions.add_parser(
        "regions",
        help="add a region to a job or remove one, from its next round boundary",
        description="Grow or shrink a running job within its min_regions..max_regions. A "
        "region that joins takes a free data shard slot and starts from the job's latest "
        "parameters at the next round boundary; one that leaves finishes the round in "
        "progress.",
    )
    regions.add_argument("job", metavar="JOB", help="job id")
    change = regions.add_mutually_exclusive_group(required=True)
    change.add_argument("--add", metavar="REGION", help="the region to add")
    change.add_argument("--remove", metavar="REGION", help="the region to remove")
    regions.add_argument(
        "--datasets",
        metavar="NAME[,NAME...]",
        help="with --add: the datasets the region trains on (comma-separated)",
    )
    _connection_arguments(regions)
    regions.set_defaults(handler=_job_regions)

    status = subparsers.add_parser(
        "status",
        help="show the federation's regions and jobs",
        description="Show every region's reported state and every job of a coordinator; "
        "--watch keeps it on screen, refreshed.",
    )
    _connection_arguments(status)
    watching = status.add_argument_group("watching")
    watching.add_argument(
        "--watch",
        action="store_true",
        help="refresh until Ctrl-C: a live view on a terminal, a snapshot per refresh otherwise",
    )
    watching.add_argument(
        "--interval", type=float, default=2.0, help="seconds between refreshes (default 2)"
    )
    watching.add_argument(
        "--count", type=_positive_int, default=None, help="stop after this many refreshes"
    )
    status.set_defaults(handler=_overview)


def _whole_number(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _whole_number(text, 1)


def version_number(text: str) -> int:
    """An argparse type for a version θ_N: a whole number, 0 or more (a usage error, exit
    2, otherwise)."""
    return _whole_number(text, 0)


def _connection_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection (flags win over environment variables)")
    group.add_argument("--url", help="coordinator URL, https://host:port (GEOFED_URL)")
    group.add_argument("--cert", type=Path, help="client certificate PEM (GEOFED_CERT)")
    group.add_argument("--key", type=Path, help="client private key PEM (GEOFED_KEY)")
    group.add_argument("--trust", type=Path, help="federation trust bundle (GEOFED_TRUST)")
    group.add_argument(
        "--identity", help="http:// loopback demo only: SPIFFE URI to claim (GEOFED_IDENTITY)"
    )
    group.add_argument(
        "--timeout", type=float, default=30.0, help="seconds per request (default 30)"
    )
    parser.add_argument("--json", action="store_true", help="print the coordinator's JSON")


def _setting(args: argparse.Namespace, name: str) -> str | None:
    value = getattr(args, name)
    if value is not None:
        return str(value)
    return os.environ.get(_ENV[name]) or None


# -- handlers ---------------------------------------------------------------------------


def _submit(args: argparse.Namespace) -> int:
    try:
        text = args.file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"error: {args.file}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    overrides = {
        name: value
        for name, value in (("priority", args.priority), ("team", args.team))
        if value is not None
    }
    path = ApiPaths.JOBS + ("?" + urlencode(overrides) if overrides else "")
    reply = _call(args, "POST", path, data=text.encode("utf-8"))
    if isinstance(reply, int):
        return reply
    if reply.status != 201:
        problems = reply.body.get("problems") if isinstance(reply.body, dict) else None
        if problems:
            for problem in problems:
                located = str(problem).replace("request:", f"{args.file}:", 1)
                print(f"error: {located}", file=sys.stderr)
            return EXIT_FAILED
        return _refused(reply)
    if args.json:
        _print_json(reply.body)
    else:
        body = reply.body
        print(
            f"job {body['job']} admitted: {body['state']}, checkpoints in "
            f"{body['checkpoint_location']} ({body['decisions']} policy decisions)"
        )
    return EXIT_OK


def _job_status(args: argparse.Namespace) -> int:
    return show(args, ApiPaths.job(args.job), lambda body: _print_job(body, sys.stdout))


def _post(
    args: argparse.Namespace, path: str, data: bytes | None, say: Callable[[Any], str]
) -> int:
    """POST a job change; print the reply (JSON with ``--json``, else ``say(body)``)."""
    reply = _call(args, "POST", path, data)
    if isinstance(reply, int):
        return reply
    if reply.status not in (200, 202):
        return _refused(reply)
    if args.json:
        _print_json(reply.body)
    else:
        print(say(reply.body))
    return EXIT_OK


def _job_action(args: argparse.Namespace) -> int:
    def say(body: Any) -> str:
        preempting = body.get("preempting")
        after = f" (stops at its next round boundary: {preempting})" if preempting else ""
        return f"job {body['job']}: {body['state']}{after}"

    return _post(args, ApiPaths.job_action(args.job, args.action), None, say)


def region_change_body(add: str | None, remove: str | None, datasets: str | None) -> bytes:
    """The JSON body of ``POST /v1/jobs/{job}/regions``; UsageError if incomplete."""
    if remove is not None:
        if datasets:
            raise UsageError("--datasets goes with --add, not --remove")
        return json.dumps({"remove": remove}).encode()
    names = [name.strip() for name in (datasets or "").split(",") if name.strip()]
    if not names:
        raise UsageError(f"--add {add} needs --datasets: the datasets it trains on")
    return json.dumps({"add": add, "datasets": names}).encode()


def _job_regions(args: argparse.Namespace) -> int:
    try:
        body = region_change_body(args.add, args.remove, args.datasets)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE

    def say(reply: Any) -> str:
        when = "now" if reply.get("effective") == "now" else "from the next round"
        return f"job {reply['job']}: {reply['reason']} ({when})"

    return _post(args, ApiPaths.job_regions(args.job), body, say)


def _overview(args: argparse.Namespace) -> int:
    if args.watch:
        return _watch(args)
    snapshot = _read_overview(args)
    if isinstance(snapshot, int):
        return snapshot
    regions, jobs = snapshot
    if args.json:
        _print_json({"regions": regions, "jobs": jobs})
        return EXIT_OK
    sys.stdout.write(plain_text(status_rows(regions, jobs)))
    return EXIT_OK


def _read_overview(args: argparse.Namespace) -> tuple[list[Any], list[Any]] | int:
    """The coordinator's regions and jobs, or an exit code after printing why not."""
    regions = _call(args, "GET", ApiPaths.REGIONS)
    if isinstance(regions, int):
        return regions
    if regions.status != 200:
        return _refused(regions)
    jobs = _call(args, "GET", ApiPaths.JOBS)
    if isinstance(jobs, int):
        return jobs
    if jobs.status != 200:
        return _refused(jobs)
    return list(regions.body["regions"]), list(jobs.body["jobs"])


def _watch(args: argparse.Namespace) -> int:
    """Refresh the overview every ``--interval`` seconds until Ctrl-C (or ``--count``).

    On a terminal it is a live view; otherwise one plain snapshot per refresh, each under
    a line with its time. A refresh that fails is shown and the next one tried: the view
    outlives a coordinator restart. A usage error ends it at once (exit 2).
    """
    import time
    from datetime import UTC, datetime

    from rich.console import Console
    from rich.live import Live

    if args.interval <= 0:
        print("error: --interval must be > 0", file=sys.stderr)
        return EXIT_USAGE
    live_view = sys.stdout.isatty() and not args.json
    console = Console()
    rows = status_rows([], [])
    refreshes = 0
    with contextlib.ExitStack() as stack:
        live = stack.enter_context(Live(console=console, auto_refresh=False)) if live_view else None
        try:
            while args.count is None or refreshes < args.count:
                error = None
                errors = io.StringIO()
                with contextlib.redirect_stderr(errors):
                    snapshot = _read_overview(args)
                now = datetime.now(UTC)
                if snapshot == EXIT_USAGE:
                    sys.stderr.write(errors.getvalue())
                    return EXIT_USAGE
                if isinstance(snapshot, int):
                    error = errors.getvalue().strip() or "the coordinator refused"
                else:
                    rows = status_rows(*snapshot)
                if live is not None:
                    live.update(rich_view(rows, updated=now, error=error), refresh=True)
                else:
                    print(f"--- {now.isoformat(timespec='seconds')} ---")
                    if error is not None:
                        print(f"last refresh failed: {error}")
                    if args.json and not isinstance(snapshot, int):
                        _print_json({"regions": snapshot[0], "jobs": snapshot[1]})
                    else:
                        sys.stdout.write(plain_text(rows))
                    sys.stdout.flush()
                refreshes += 1
                if args.count is None or refreshes < args.count:
                    time.sleep(args.interval)
        except KeyboardInterrupt:
            pass
    return EXIT_OK


# -- output -----------------------------------------------------------------------------


def _print_json(body: Any) -> None:
    json.dump(body, sys.stdout, indent=2, sort_keys=True)
    print()


def _print_job(body: dict[str, Any], out: TextIO) -> None:
    loss = body.get("global_val_loss")
    loss_text = f", val_loss {loss['value']:.4f} (θ_{loss['round']})" if loss else ""
    head = f"job {body['job']}: {body['state']}, round {body['round']}/{body['rounds']}"
    print(head + loss_text, file=out)
    where = body.get("checkpoint_location")
    print(f"  checkpoints in {where}; parameters {body.get('params_hash')}", file=out)
    current = body.get("current")
    if current:
        print(
            f"  round {current['round']} {current['phase']} (attempt {current['attempt']}): "
            f"delivered {', '.join(current['delivered']) or 'none'} of "
            f"{', '.join(current['participants'])}, quorum {current['min_regions']}, "
            f"deadline {current['deadline']}",
            file=out,
        )
        if current.get("end_reason"):
            print(f"  {current['end_reason']}", file=out)
    for _, reason in sorted(body.get("quarantined", {}).items()):
        print(f"  {reason}", file=out)
    shards = body.get("shards")
    if shards:
        print(
            f"  regions (data shard of {shards['count']}): {_slots(shards['assignment'])}", file=out
        )
        if shards.get("next") != shards["assignment"]:
            print(f"  from the next round: {_slots(shards.get('next') or {})}", file=out)
    snapshot = body.get("snapshot")
    if snapshot:
        last = snapshot.get("last_round")
        print(
            f"  snapshots ({snapshot['mode']}) every {snapshot['every_rounds']} round(s), "
            f"last θ_{'-' if last is None else last}, next θ_{snapshot['next_round']}: "
            f"{snapshot['reason']}",
            file=out,
        )
        risk = snapshot.get("risk")
        if risk and risk.get("score"):
            print(f"  hardware risk {risk['score']:.2f}: {risk['reason']}", file=out)
    if body.get("priority"):
        print(f"  priority {body['priority']}, team {body.get('team') or '-'}", file=out)
    queue = body.get("queue")
    if queue:
        print(
            f"  queued since {queue['since']} (position {queue['position']}): {queue['reason']}",
            file=out,
        )
    cost = body.get("cost")
    if cost:
        print(f"  {cost_line(cost)}", file=out)
    budget = (body.get("cost_estimate") or {}).get("budget")
    if budget:
        print(f"  {budget_line(budget, body['cost_estimate'].get('currency') or '')}", file=out)
    if body.get("error"):
        print(f"  error: {body['error']}", file=out)


def cost_line(cost: dict[str, Any]) -> str:
    """``cost so far 12.30 EUR (GPU 10.00, WAN 2.10, storage 0.20), projected 49.20``."""
    currency = cost.get("currency", "")
    floor = ">= " if cost.get("unpriced") else ""
    line = (
        f"cost so far {floor}{cost['total']:,.2f} {currency} (GPU {cost['gpu']:,.2f}, "
        f"WAN {cost['wan']:,.2f}, storage {cost['storage']:,.2f})"
    )
    if cost.get("projected_total") is not None:
        line += f", projected {cost['projected_total']:,.2f} over all its rounds"
    if cost.get("unpriced"):
        line += f"; not priced: {', '.join(cost['unpriced'])}"
    return line


def budget_line(budget: dict[str, Any], currency: str) -> str:
    """``budget 500.00 USD: expected 120.00, within (<basis>)``."""
    expected = budget.get("expected")
    if expected is None:
        return f"budget {budget['amount']:,.2f} {currency}: no estimate ({budget['basis']})"
    verdict = "within" if budget.get("within") else "OVER"
    return (
        f"budget {budget['amount']:,.2f} {currency}: expected {expected:,.2f}, {verdict} "
        f"({budget['basis']})"
    )


def estimate_text(estimate: dict[str, Any] | None) -> str:
    """A queue row's ``ESTIMATE`` cell: ``120.00/500 USD``, ``120.00 USD``, or ``-``."""
    if not estimate or estimate.get("amount") is None:
        return "-"
    currency = estimate.get("currency") or ""
    budget = estimate.get("budget")
    if budget:
        return f"{estimate['amount']:,.2f}/{budget['amount']:g} {currency}"
    return f"{estimate['amount']:,.2f} {currency}"


def _slots(assignment: dict[str, int]) -> str:
    return ", ".join(f"{region} {slot}" for region, slot in sorted(assignment.items())) or "none"


def _refused(reply: Reply) -> int:
    body = reply.body if isinstance(reply.body, dict) else {}
    code = body.get("error", f"http_{reply.status}")
    message = body.get("message", str(reply.body)[:500])
    print(f"error: {code} ({reply.status}): {message}", file=sys.stderr)
    return EXIT_FAILED


# -- transport --------------------------------------------------------------------------


def show(args: argparse.Namespace, path: str, render: Callable[[Any], object]) -> int:
    """GET ``path`` and print the answer: as JSON with ``--json``, else with ``render``."""
    reply = _call(args, "GET", path)
    if isinstance(reply, int):
        return reply
    if reply.status != 200:
        return _refused(reply)
    if args.json:
        _print_json(reply.body)
    else:
        render(reply.body)
    return EXIT_OK


def _call(
    args: argparse.Namespace, method: str, path: str, data: bytes | None = None
) -> Reply | int:
    """One request; returns the reply, or an exit code after printing what went wrong."""
    try:
        return asyncio.run(_request(args, method, path, data))
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # network, TLS and identity failures: report and exit 1
        print(f"error: cannot reach the coordinator: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED


async def _request(args: argparse.Namespace, method: str, path: str, data: bytes | None) -> Reply:
    import aiohttp
    from yarl import URL

    from geofed.loopback import is_loopback
    from geofed.pki import client_ssl_context, load_trust_bundle
    from geofed.pki.httpauth import VerifiedConnector
    from geofed.timeouts import wait_for
    from geofed.types import Identity, InvalidName, Role

    url = _setting(args, "url")
    if not url:
        raise UsageError("no coordinator URL: pass --url or set GEOFED_URL")
    url = url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    headers: dict[str, str] = {}
    connector: aiohttp.BaseConnector | None = None
    if url.startswith("http://"):
        host = URL(url).host or ""
        if not is_loopback(host):
            raise UsageError(f"plain http is only for the loopback demo, not {host}; use https://")
        identity = _setting(args, "identity")
        if not identity:
            raise UsageError("an http:// coordinator needs --identity or GEOFED_IDENTITY")
        try:
            Identity.parse(identity)
        except InvalidName as exc:
            raise UsageError(str(exc)) from None
        headers["X-Geofed-Identity"] = identity
    elif url.startswith("https://"):
        cert, key, trust = (_setting(args, name) for name in ("cert", "key", "trust"))
        missing = [
            f"--{n} ({_ENV[n]})"
            for n, v in (("cert", cert), ("key", key), ("trust", trust))
            if not v
        ]
        if missing or cert is None or key is None or trust is None:
            raise UsageError(f"https needs a client certificate: missing {', '.join(missing)}")
        bundle = load_trust_bundle(Path(trust))
        context = client_ssl_context(bundle, Path(cert), Path(key))
        connector = VerifiedConnector(bundle, context, expect=Role.COORDINATOR)
    else:
        raise UsageError(
            f"coordinator URL must start with https:// (or http:// for the demo): {url}"
        )
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers
    ) as session:

        async def send() -> Reply:
            async with session.request(method, url + path, data=data) as response:
                text = await response.text()
                try:
                    body: Any = json.loads(text)
                except ValueError:
                    body = text
                return Reply(response.status, body)

        return await wait_for(send(), args.timeout, f"{method} {path}")
