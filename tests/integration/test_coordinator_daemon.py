"""The daemon as operators run it: a process that stops cleanly, and the example configs."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import pytest

from geofed.control.broker import EmbeddedBroker
from geofed.pki import CredentialFiles, load_credential
from geofed.pki.httpauth import VerifiedConnector
from geofed.ports import unused_port
from geofed.types import Role
from geofed_cli import main
from tests.support.coordinator import coordinator, request, write_setup
from tests.support.pki import Principal

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


async def _healthy(url: str, connector: aiohttp.BaseConnector, timeout_s: float) -> bool:
    async with aiohttp.ClientSession(connector=connector) as session:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            try:
                async with session.get(url + "/healthz") as response:
                    if response.status == 200:
                        return True
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    return False


class Systemd:
    """The outer edge: a notify socket as systemd offers one, collecting what is sent."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.messages: list[str] = []

    def __enter__(self) -> Systemd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    async def until(self, text: str, timeout_s: float = 30.0) -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout_s):
            while not any(text in message for message in self.messages):
                data = await loop.sock_recv(self.sock, 4096)
                self.messages.append(data.decode())


async def test_the_daemon_serves_until_sigterm_and_exits_0(tmp_path: Path) -> None:
    with Systemd(tmp_path / "notify") as systemd:
        await _serve_until_sigterm(tmp_path, systemd)


async def _serve_until_sigterm(tmp_path: Path, systemd: Systemd) -> None:
    async with EmbeddedBroker() as broker:
        setup = write_setup(tmp_path, broker.port)
        port = unused_port()
        config = setup.config_path
        config.write_text(config.read_text().replace("port: 0}", f"port: {port}}}"))
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "geofed_cli",
            "coordinator",
            "--config",
            str(config),
            cwd=REPO,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env={
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                "NOTIFY_SOCKET": str(systemd.path),
                "WATCHDOG_USEC": "1000000",
            },
        )
        assert process.stderr is not None
        log = asyncio.create_task(process.stderr.read())
        try:
            bundle = setup.fed.bundle
            connector = VerifiedConnector(
                bundle, setup.observer.client_context(bundle()), expect=Role.COORDINATOR
            )
            assert await _healthy(f"https://localhost:{port}", connector, 60.0)
            await systemd.until("READY=1")
            await systemd.until("WATCHDOG=1")
            process.send_signal(signal.SIGTERM)
            await systemd.until("STOPPING=1")
            code = await asyncio.wait_for(process.wait(), 30)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        err = await log
        assert code == 0, err.decode(errors="replace")[-3000:]
        assert systemd.messages[0].startswith("READY=1\nSTATUS=serving on https://127.0.0.1:")
        assert b"coordinator stopped" in err


def test_a_bad_configuration_exits_2_naming_file_line_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "coordinator.yaml"
    text = (REPO / "configs" / "coordinator.yaml").read_text()
    config.write_text(text.replace("  upload_s: 120\n", "  upload_s: 20\n"))
    assert main(["coordinator", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    line = text.splitlines().index("timeouts:") + 1
    assert f"{config}:{line}: timeouts: inconsistent timeouts: upload_s (20) must be" in err


async def test_the_example_configs_run_as_documented(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    # The commands at the top of configs/coordinator.yaml, run from the repository root.
    commands = [
        "ca init --federation demo --out run/pki/ca",
        "ca issue --ca run/pki/ca --role coordinator --name main --out run/pki/coordinator",
        "ca issue --ca run/pki/ca --role operator --name ops --out run/pki/operator",
        "ca issue --ca run/pki/ca --role region --name eu-west --out run/pki/eu-west",
    ]
    for command in commands:
        assert main(command.split()) == 0, command
    async with EmbeddedBroker() as broker:
        setup = write_setup(tmp_path / "scratch", broker.port)
        # The example as written, but on free ports so tests can run side by side.
        example = (tmp_path / "configs" / "coordinator.yaml").read_text()
        example = example.replace("  port: 8443\n", "  port: 0\n")
        example = example.replace("  port: 1883\n", f"  port: {broker.port}\n")
        (tmp_path / "configs" / "coordinator.yaml").write_text(example)
        setup.config_path = tmp_path / "configs" / "coordinator.yaml"
        setup.trust_file = tmp_path / "run" / "pki" / "ca" / "trust.yaml"
        credential = load_credential(tmp_path / "run" / "pki" / "operator")
        operator = Principal(
            credential.identity, "demo", credential, CredentialFiles(tmp_path / "run/pki/operator")
        )
        async with coordinator(setup) as running:
            session = running.session(operator)
            async with asyncio.timeout(10):  # ready once the MQTT connection is up
                while (await request(session, "GET", "/readyz"))[0] != 200:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            job = (tmp_path / "configs" / "job-charlm.yaml").read_text()
            status, body = await request(session, "POST", "/v1/jobs", data=job)
            assert status == 201, body
            assert body["checkpoint_location"] == "eu-ckpt"
        assert (tmp_path / "run" / "coordinator" / "coordinator.db").exists()
        assert (tmp_path / "run" / "checkpoints" / "eu-ckpt" / "jobs" / "charlm-demo").is_dir()
