"""Run a :class:`~tests.support.wanproxy.WanProxy` as its own process, steered live over a
loopback HTTP endpoint; for fault tests whose daemons are subprocesses.

    python -m tests.support.wanproxy_cli --listen 127.0.0.1:0 --target 127.0.0.1:8443 \\
        --seed 7 --both latency_s=0.05 --up bandwidth_bps=2e6

``--up``, ``--down`` and ``--both`` take ``NAME=VALUE`` link settings (VALUE is JSON:
``bandwidth_bps=null``, ``reset_after_bytes=[100,5000]``); ``--both`` applies first.
Once both listeners are bound the process prints one JSON line,
``{"port": P, "control_port": C}``, then serves until SIGTERM or SIGINT. Exit codes:
0 after a signal, 1 if a listener cannot be bound, 2 for bad arguments.

Control API, JSON in and out, errors as ``{"error": CODE, "message": TEXT}`` with 400:

    GET  /state       {"upstream": {...}, "downstream": {...}, "blackhole": B, "stats": {...}}
    POST /links       {"both": {...}, "upstream": {...}, "downstream": {...}}, partial
    POST /partition
    POST /heal        {"reset_existing": false}

Every POST answers with the new state. Tests start a process with
:func:`wanproxy_process` and steer it with :class:`WanProxyControl`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from geofed.timeouts import wait_for
from tests.support.wanproxy import (
    Direction,
    InvalidSettings,
    LinkSettings,
    WanProxy,
    WanProxyError,
    WanStats,
)

__all__ = [
    "ControlRefused",
    "WanProxyControl",
    "WanProxyProcess",
    "control_app",
    "main",
    "parse_endpoint",
    "updated_links",
    "wanproxy_process",
]

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
LINK_GROUPS = ("both", "upstream", "downstream")
PROXY = web.AppKey("proxy", WanProxy)


class ControlRefused(WanProxyError):
    """The control endpoint refused a request; ``code`` is its error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` as a pair; raises ``ValueError`` naming what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT with a port in [0, 65535], got {text!r}")
    return host, int(port)


def updated_links(
    current: Mapping[Direction, LinkSettings], body: Mapping[str, object]
) -> dict[Direction, LinkSettings]:
    """Both directions' settings after a partial update (``both`` first, then each
    direction's own); raises :class:`InvalidSettings` before anything is applied."""
    unknown = sorted(set(body) - set(LINK_GROUPS))
    if unknown:
        raise InvalidSettings(
            f"unknown link group(s) {', '.join(unknown)}; known: {', '.join(LINK_GROUPS)}"
        )
    for group, values in body.items():
        if not isinstance(values, Mapping):
            raise InvalidSettings(f"{group} must be an object of settings, got {values!r}")
    new: dict[Direction, LinkSettings] = {}
    for direction in Direction:
        settings = current[direction]
        for group in ("both", direction.value):
            values = body.get(group)
            if isinstance(values, Mapping):
                settings = LinkSettings.from_mapping(values, settings)
        new[direction] = settings
    return new


def state_of(proxy: WanProxy) -> dict[str, object]:
    """What ``GET /state`` answers."""
    return {
        "upstream": proxy.upstream.to_mapping(),
        "downstream": proxy.downstream.to_mapping(),
        "blackhole": proxy.blackhole,
        "stats": dataclasses.asdict(proxy.stats()),
    }


def _refusal(code: str, message: str) -> web.Response:
    return web.json_response({"error": code, "message": message}, status=400)


async def _json_object(request: web.Request) -> dict[str, object]:
    text = await request.text()
    if not text.strip():
        return {}
    body = json.loads(text)
    if not isinstance(body, dict):
        raise InvalidSettings(f"the request body must be a JSON object, got {body!r}")
    return body


def _reset_existing(body: Mapping[str, object]) -> bool:
    flag = body.get("reset_existing", False)
    if not isinstance(flag, bool) or set(body) - {"reset_existing"}:
        raise InvalidSettings(f'heal takes only {{"reset_existing": bool}}, got {body!r}')
    return flag


async def _get_state(request: web.Request) -> web.Response:
    return web.json_response(state_of(request.app[PROXY]))


async def _post(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    action = request.match_info["action"]
    try:
        body = await _json_object(request)
        if action == "links":
            new = updated_links({d: proxy.link(d) for d in Direction}, body)
            for direction, settings in new.items():
                proxy.set_link(direction, settings)
        elif action == "partition":
            proxy.partition()
        else:
            proxy.heal(reset_existing=_reset_existing(body))
    except json.JSONDecodeError as exc:
        return _refusal("invalid_json", f"the request body is not JSON: {exc}")
    except InvalidSettings as exc:
        return _refusal("invalid_settings", str(exc))
    return web.json_response(state_of(proxy))


def control_app(proxy: WanProxy) -> web.Application:
    """The control endpoint's application, steering ``proxy``."""
    app = web.Application()
    app[PROXY] = proxy
    app.router.add_get("/state", _get_state)
    app.router.add_post("/{action:links|partition|heal}", _post)
    return app


async def serve(
    listen: tuple[str, int],
    target: tuple[str, int],
    control: tuple[str, int],
    *,
    seed: int,
    links: Mapping[Direction, LinkSettings],
) -> int:
    """Run the proxy and its control endpoint until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with WanProxy(
        *listen,
        *target,
        seed=seed,
        upstream=links[Direction.UPSTREAM],
        downstream=links[Direction.DOWNSTREAM],
    ) as proxy:
        runner = web.AppRunner(control_app(proxy), access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, *control).start()
            control_port = runner.addresses[0][1]
            sys.stdout.write(json.dumps({"port": proxy.port, "control_port": control_port}) + "\n")
            sys.stdout.flush()
            await stop.wait()
        finally:
            await runner.cleanup()
    return 0


def _assignments(items: Sequence[str], flag: str) -> dict[str, object]:
    values: dict[str, object] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not name:
            raise ValueError(f"{flag} takes NAME=VALUE, got {item!r}")
        try:
            values[name] = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag} {name}: the value {raw!r} is not JSON ({exc})") from None
    return values


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.wanproxy_cli", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--listen", required=True, help="HOST:PORT to accept clients on")
    parser.add_argument("--target", required=True, help="HOST:PORT to forward to")
    parser.add_argument("--control", default="127.0.0.1:0", help="HOST:PORT of the control API")
    parser.add_argument("--seed", type=int, required=True, help="seed of the reset draws")
    for flag, dest in (("--both", "both"), ("--up", "upstream"), ("--down", "downstream")):
        parser.add_argument(flag, dest=dest, action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--log-level", default="WARNING")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    options = parser.parse_args(argv)
    try:
        listen = parse_endpoint(options.listen)
        target = parse_endpoint(options.target)
        control = parse_endpoint(options.control)
        body = {g: _assignments(getattr(options, g), f"--{g}") for g in LINK_GROUPS}
        links = updated_links({d: LinkSettings() for d in Direction}, body)
    except ValueError as exc:  # InvalidSettings is a ValueError too
        parser.error(str(exc))
    logging.basicConfig(level=options.log_level.upper(), stream=sys.stderr)
    try:
        return asyncio.run(serve(listen, target, control, seed=options.seed, links=links))
    except OSError as exc:
        log.error("wanproxy: cannot listen: %s", exc)  # noqa: TRY400 (the reason is enough)
        return 1


class WanProxyControl:
    """Client of a proxy process's control endpoint."""

    def __init__(self, base_url: str, *, timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    async def state(self) -> dict[str, Any]:
        return await self._call("GET", "/state")

    async def stats(self) -> WanStats:
        return WanStats(**(await self.state())["stats"])

    async def set_links(
        self,
        *,
        both: Mapping[str, object] | None = None,
        upstream: Mapping[str, object] | None = None,
        downstream: Mapping[str, object] | None = None,
    ) -> dict[str, Any]:
        """Change the named settings only; refused as a whole if any is invalid."""
        groups = {"both": both, "upstream": upstream, "downstream": downstream}
        return await self._call("POST", "/links", {k: dict(v) for k, v in groups.items() if v})

    async def partition(self) -> dict[str, Any]:
        return await self._call("POST", "/partition")

    async def heal(self, *, reset_existing: bool = False) -> dict[str, Any]:
        return await self._call("POST", "/heal", {"reset_existing": reset_existing})

    async def _call(
        self, method: str, path: str, body: Mapping[str, object] | None = None
    ) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.request(method, self.base_url + path, json=body) as response,
        ):
            payload: dict[str, Any] = await response.json()
            if response.status != 200:
                raise ControlRefused(str(payload.get("error")), str(payload.get("message")))
            return payload


@dataclass(frozen=True)
class WanProxyProcess:
    """A proxy running in a child process."""

    port: int
    control_port: int
    pid: int

    @property
    def control(self) -> WanProxyControl:
        return WanProxyControl(f"http://127.0.0.1:{self.control_port}")


@asynccontextmanager
async def wanproxy_process(
    target_port: int,
    *,
    seed: int,
    target_host: str = "127.0.0.1",
    listen: str = "127.0.0.1:0",
    both: Mapping[str, object] | None = None,
    upstream: Mapping[str, object] | None = None,
    downstream: Mapping[str, object] | None = None,
    start_timeout_s: float = 30.0,
) -> AsyncIterator[WanProxyProcess]:
    """Start a proxy process in front of ``target_host:target_port``; SIGTERM it on exit.

    Raises :class:`WanProxyError` if it does not print its ports, or exits non-zero.
    """
    args = [sys.executable, "-m", "tests.support.wanproxy_cli", "--listen", listen]
    args += ["--target", f"{target_host}:{target_port}", "--seed", str(seed)]
    for flag, values in (("--both", both), ("--up", upstream), ("--down", downstream)):
        for name, value in (values or {}).items():
            args += [flag, f"{name}={json.dumps(value)}"]
    process = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, cwd=REPO_ROOT
    )
    try:
        assert process.stdout is not None
        line = await wait_for(process.stdout.readline(), start_timeout_s, "wanproxy start")
        if not line:
            code = await wait_for(process.wait(), start_timeout_s, "wanproxy exit")
            raise WanProxyError(f"the wanproxy process exited with {code} before listening")
        ports = json.loads(line)
        yield WanProxyProcess(ports["port"], ports["control_port"], process.pid)
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                await wait_for(process.wait(), 10.0, "wanproxy exit")
            except TimeoutError:
                process.kill()
                await process.wait()
    if process.returncode != 0:
        raise WanProxyError(f"the wanproxy process exited with {process.returncode}")


if __name__ == "__main__":
    sys.exit(main())
