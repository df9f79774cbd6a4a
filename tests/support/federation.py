"""A whole federation of real processes for integration and fault tests.

The coordinator and each regional agent run as ``python -m geofed_cli ...`` child processes
(each agent with its own local worker group), configured from the example files of
``configs/`` exactly as ``geofed demo`` does, over real HTTPS with client certificates.
The broker is either the embedded one (in the test's own event loop, so a test can stop
and restart it) or a real Mosquitto with TLS, client certificates and the generated ACL.
The test talks to the coordinator as an operator would: HTTP over mTLS.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from geofed.control.broker import EmbeddedBroker, quiet_broker_logging
from geofed.mqtt_acl import Principals, render_acl
from geofed.pki import client_ssl_context, issue, load_ca, load_trust_bundle, save_credential
from geofed.ports import unused_port
from geofed.types import Identity, Role
from geofed_cli.demo.configs import DemoConfigs, write_demo_configs
from geofed_cli.demo.federation import Credential, DemoFederation, create_demo_federation
from geofed_cli.demo.processes import Child, ChildSet
from tests.support.fork_server import shared_fork_server
from tests.support.mosquitto import run_mosquitto
from tests.support.mosquitto_production import production_config, write_crls

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "configs"
FEDERATION = "demo"
REGIONS: tuple[str, ...] = ("eu-west", "us-east", "ap-south")
#: How often the waits on a job's status ask for it (a status is cheap; a test waiting on
#: a round that closed should see it soon).
STATUS_POLL_S = 0.1

#: The example task, small enough that a round of a few steps takes a second per region.
TINY_CHARLM: dict[str, Any] = {
    "d_model": 32,
    "n_layers": 1,
    "n_heads": 2,
    "seq_len": 32,
    "batch_size": 8,
    "val_batches": 2,
}


def issue_extra(federation: DemoFederation, role: Role, name: str, out: Path) -> Credential:
    """Issue one more credential from the demo CA (a broker, an observer)."""
    ca = load_ca(federation.ca_dir)
    identity = Identity(federation=federation.name, role=role, name=name)
    credential = issue(
        ca,
        identity,
        dns_names=("localhost",),
        ip_addresses=(ipaddress.ip_address("127.0.0.1"),),
    )
    save_credential(credential, out, force=True)
    return Credential(identity, out)


@dataclass
class FederationRun:
    """A running federation: its processes, its configs, and an operator's HTTP session."""

    work: Path
    federation: DemoFederation
    configs: DemoConfigs
    children: ChildSet
    http: aiohttp.ClientSession
    base: str
    http_port: int
    mqtt_port: int
    regions: tuple[str, ...]
    observer: Credential
    _broker: EmbeddedBroker | None = None
    _named: dict[str, Child] = field(default_factory=dict)

    @property
    def job(self) -> str:
        return self.configs.job_id

    async def start_coordinator(self, *, ready: bool = True) -> None:
        """Start the coordinator; ``ready``: wait until it serves."""
        child = await self.children.start(
            "coordinator", ["coordinator", "--config", str(self.configs.coordinator)]
        )
        self._named["coordinator"] = child
        if ready:
            await self.wait_ready()

    async def start_agent(self, region: str) -> None:
        """Start a region's agent (the agents stop together, the harness does not wait)."""
        name = f"agent-{region}"
        child = await self.children.start(
            name, ["agent", "--config", str(self.configs.agents[region])], group="agents"
        )
        self._named[name] = child

    async def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Signal a child's whole process group (an agent's workers die with it)."""
        child = self._named[name]
        assert child.pid is not None
        os.killpg(child.pid, sig)
        await child.stop(20.0)

    async def restart(self, name: str) -> None:
        """Start a fresh process for a child that was killed or stopped."""
        old = self._named[name]
        self.children.children.remove(old)
        if name == "coordinator":
            await self.start_coordinator()
        else:
            await self.start_agent(name.removeprefix("agent-"))

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.children.check_alive()
            try:
                async with self.http.get(f"{self.base}/readyz") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.3)
        raise AssertionError(f"coordinator not ready within {timeout_s} s\n{self.log_tails()}")

    async def submit(self, job: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        """POST the job (the generated one by default); return (status, JSON body)."""
        body = self.configs.job.read_bytes() if job is None else yaml.safe_dump(job).encode()
        headers = {"Content-Type": "application/yaml"}
        async with self.http.post(f"{self.base}/v1/jobs", data=body, headers=headers) as resp:
            return resp.status, await resp.json()

    def job_spec(self) -> dict[str, Any]:
        data: dict[str, Any] = yaml.safe_load(self.configs.job.read_text())
        return data

    async def get(self, path: str) -> dict[str, Any]:
        async with self.http.get(f"{self.base}{path}") as response:
            assert response.status == 200, f"GET {path}: {response.status} {await response.text()}"
            data: dict[str, Any] = await response.json()
            return data

    async def status(self, job: str | None = None) -> dict[str, Any]:
        return await self.get(f"/v1/jobs/{job or self.job}")

    async def metrics_text(self) -> str:
        async with self.http.get(f"{self.base}/metrics") as response:
            assert response.status == 200
            return await response.text()

    async def wait_for(
        self,
        predicate: Callable[[dict[str, Any]], bool],
        *,
        timeout_s: float,
        what: str,
        job: str | None = None,
    ) -> dict[str, Any]:
        """Poll the job status until ``predicate`` holds; fail with the daemons' logs."""
        deadline = time.monotonic() + timeout_s
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            self.children.check_alive()
            try:
                last = await self.status(job)
            except (aiohttp.ClientError, AssertionError):
                await asyncio.sleep(STATUS_POLL_S)
                continue
            if predicate(last):
                return last
            await asyncio.sleep(STATUS_POLL_S)
        raise AssertionError(
            f"timed out after {timeout_s} s waiting for {what}; last status {last}\n"
            f"{self.log_tails()}"
        )

    async def wait_round(self, round_: int, *, timeout_s: float = 180.0) -> dict[str, Any]:
        """Wait until the job's parameters reach version ``round_`` (round_ rounds published)."""
        return await self.wait_for(
            lambda s: int(s.get("round", 0)) >= round_, timeout_s=timeout_s, what=f"θ_{round_}"
        )

    async def wait_completed(self, *, timeout_s: float = 300.0) -> dict[str, Any]:
        rounds = int(self.job_spec()["rounds"])
        return await self.wait_for(
            lambda s: (
                s.get("state") == "completed"
                and any(e["round"] == rounds for e in s.get("val_loss_history", []))
            ),
            timeout_s=timeout_s,
            what="the job to complete and its last parameters to be evaluated",
        )

    async def stop_broker(self) -> None:
        assert self._broker is not None, "only the embedded broker can be stopped by the test"
        await self._broker.stop()

    async def start_broker(self) -> None:
        assert self._broker is not None, "only the embedded broker can be started by the test"
        self._broker = EmbeddedBroker(port=self.mqtt_port)
        await self._broker.start()

    def log_tails(self, lines: int = 25) -> str:
        parts = []
        for child in self.children.children:
            parts.append(f"--- {child.name} (exit {child.returncode}) ---\n{child.log_tail(lines)}")
        return "\n".join(parts)


@asynccontextmanager
async def running_federation(
    work: Path,
    *,
    regions: Sequence[str] = REGIONS,
    rounds: int = 5,
    inner_steps: int = 5,
    task_options: dict[str, Any] | None = None,
    broker: str = "embedded",
    customize: Callable[[str, dict[str, Any]], None] | None = None,
    start_agents: bool = True,
    ready: bool = True,
    ranks: int | None = 1,
    fork: bool = True,
) -> AsyncIterator[FederationRun]:
    """Start a broker, the coordinator and (by default) every agent; stop all on exit.

    ``ranks``: each agent's worker count (one rank: the worker group is not what most
    federation tests look at, and each rank is a torch process on a 2-core machine);
    None keeps the example configs' ``auto`` (2 gloo ranks). ``customize`` runs after.
    ``ready``: yield once the coordinator serves (else at once, while it starts).
    ``fork``: fork the daemons from this process's fork server (:mod:`tests.support.fork_server`);
    False starts each as a new interpreter, as production does (what a benchmark of their
    memory and start needs).
    """
    assert broker in ("embedded", "mosquitto")
    regions = tuple(regions)
    federation = await asyncio.to_thread(create_demo_federation, work / "pki", FEDERATION, regions)
    observer = await asyncio.to_thread(
        issue_extra, federation, Role.OBSERVER, "tests", work / "pki" / "observer"
    )
    http_port = unused_port()
    async with AsyncExitStack() as stack:
        embedded: EmbeddedBroker | None = None
        if broker == "embedded":
            quiet_broker_logging()
            embedded = await stack.enter_async_context(EmbeddedBroker(port=0))
            mqtt_port = embedded.port
        else:
            server = await asyncio.to_thread(
                issue_extra, federation, Role.OBSERVER, "mqtt-broker", work / "pki" / "broker"
            )
            acl = work / "mosquitto" / "acl"
            acl.parent.mkdir(parents=True, exist_ok=True)
            acl.write_text(render_acl(Principals(FEDERATION, regions, observers=("tests",))))
            state = work / "mosquitto" / "state"
            state.mkdir(parents=True, exist_ok=True)
            cafile = federation.ca_dir / "ca.pem"
            crlfile = write_crls([load_ca(federation.ca_dir)], (), work / "mosquitto" / "crl.pem")

            def config(port: int) -> str:
                return production_config(
                    port,
                    cafile=cafile,
                    certfile=server.cert,
                    keyfile=server.key,
                    acl_file=acl,
                    crlfile=crlfile,
                    state=state,
                )

            mosquitto = stack.enter_context(
                run_mosquitto(
                    work / "mosquitto",
                    cafile=cafile,
                    certfile=server.cert,
                    keyfile=server.key,
                    config=config,
                )
            )
            mqtt_port = mosquitto.port
        configs = await asyncio.to_thread(
            write_demo_configs,
            examples=EXAMPLES,
            work=work,
            federation=federation,
            regions=regions,
            http_port=http_port,
            mqtt_port=mqtt_port,
            rounds=rounds,
            inner_steps=inner_steps,
            mqtt_tls=broker == "mosquitto",
            task_options=TINY_CHARLM if task_options is None else task_options,
            customize=_with_ranks(ranks, customize),
        )
        ssl_context = client_ssl_context(
            load_trust_bundle(federation.trust_bundle),
            federation.operator.cert,
            federation.operator.key,
        )
        http = await stack.enter_async_context(
            aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=ssl_context),
                timeout=aiohttp.ClientTimeout(total=30),
            )
        )
        children = await stack.enter_async_context(
            ChildSet(
                work / "logs",
                stop_deadline_s=30.0,
                fork_server=await shared_fork_server() if fork else None,
            )
        )
        run = FederationRun(
            work=work,
            federation=federation,
            configs=configs,
            children=children,
            http=http,
            base=f"https://localhost:{http_port}",
            http_port=http_port,
            mqtt_port=mqtt_port,
            regions=regions,
            observer=observer,
            _broker=embedded,
        )
        # The agents start while the coordinator does: they connect to the broker and
        # retry the coordinator until it serves.
        await run.start_coordinator(ready=False)
        if start_agents:
            for region in regions:
                await run.start_agent(region)
        if ready:
            await run.wait_ready()
        try:
            yield run
        except BaseException:
            print(run.log_tails(60))
            raise
        finally:
            # The test may have replaced the embedded broker; stop whichever runs now.
            if run._broker is not None and run._broker is not embedded:
                await run._broker.stop()


async def operator_cli(
    fed: FederationRun, *args: str, **env: str
) -> subprocess.CompletedProcess[str]:
    """``geofed ARGS`` as the operator runs it against ``fed``, forked from this process's
    fork server: its exit code, standard output and standard error."""
    operator = fed.federation.operator
    environment = {
        **os.environ,
        "GEOFED_URL": fed.base,
        "GEOFED_CERT": str(operator.cert),
        "GEOFED_KEY": str(operator.key),
        "GEOFED_TRUST": str(fed.federation.trust_bundle),
        **env,
    }
    outputs = fed.work / "cli"
    outputs.mkdir(exist_ok=True)
    name = f"{len(list(outputs.glob('*.out')))}-{args[0] if args else 'geofed'}"
    out, err = outputs / f"{name}.out", outputs / f"{name}.err"
    server = await shared_fork_server()
    child = await asyncio.to_thread(
        server.spawn, list(args), env=environment, cwd=REPO, log_file=out, stderr_file=err
    )
    try:
        async with asyncio.timeout(120):
            code = await child.wait()
    except TimeoutError:
        child.kill()
        raise
    return subprocess.CompletedProcess(
        ["geofed", *args], code, out.read_text(errors="replace"), err.read_text(errors="replace")
    )


def _with_ranks(
    ranks: int | None, customize: Callable[[str, dict[str, Any]], None] | None
) -> Callable[[str, dict[str, Any]], None] | None:
    """``customize``, after setting each agent's worker count to ``ranks`` (unless None)."""
    if ranks is None:
        return customize

    def configure(name: str, data: dict[str, Any]) -> None:
        if name.startswith("agent-"):
            data.setdefault("workers", {})["count"] = ranks
        if customize is not None:
            customize(name, data)

    return configure
