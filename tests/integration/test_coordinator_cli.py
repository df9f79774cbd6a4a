"""``geofed job ...`` and ``geofed status`` against a real coordinator over TLS."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from geofed.control import ControlClient, RegionStatus, Topics, encode
from geofed.control.broker import EmbeddedBroker
from geofed_cli import main
from tests.support.coordinator import (
    coordinator,
    job_yaml,
    metric_value,
    request,
    write_setup,
)
from tests.support.pki import Principal

pytestmark = pytest.mark.integration


def _flags(url: str, principal: Principal, trust: Path) -> list[str]:
    return [
        "--url",
        url,
        "--cert",
        str(principal.cert_file),
        "--key",
        str(principal.key_file),
        "--trust",
        str(trust),
    ]


async def _report_status(port: int, region: str) -> None:
    client = ControlClient("127.0.0.1", port, client_id=f"agent-{region}", timeout_s=5.0)
    task = asyncio.create_task(client.run())
    status = RegionStatus(
        region=region, state="training", job="tiny", round=0, train_loss=2.5, agent_version="t"
    )
    await client.publish(Topics("acme").region_status(region), encode(status), retain=True)
    await client.close(timeout_s=5.0)
    await asyncio.wait([task])


async def _geofed(*argv: str) -> int:
    return await asyncio.to_thread(main, list(argv))


async def test_operators_manage_jobs_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with EmbeddedBroker() as broker:
        setup = write_setup(tmp_path, broker.port)
        async with coordinator(setup) as running:
            monkeypatch.setenv("GEOFED_URL", running.url)
            monkeypatch.setenv("GEOFED_CERT", str(setup.operator.cert_file))
            monkeypatch.setenv("GEOFED_KEY", str(setup.operator.key_file))
            monkeypatch.setenv("GEOFED_TRUST", str(setup.fed.bundle_file))
            spec = tmp_path / "job.yaml"

            spec.write_text(job_yaml().replace("rounds: 3", "rounds: 0"))
            assert await _geofed("job", "submit", str(spec)) == 1
            assert f"{spec}:8: rounds: Input should be" in capsys.readouterr().err

            spec.write_text(job_yaml())
            assert await _geofed("job", "submit", str(spec)) == 0
            assert "job tiny admitted: running, checkpoints in eu-ckpt" in capsys.readouterr().out

            assert await _geofed("job", "status", "tiny") == 0
            out = capsys.readouterr().out
            assert "job tiny: running, round 0/3" in out
            assert "of eu-west, us-east, quorum 2" in out

            assert await _geofed("job", "pause", "tiny") == 0
            assert capsys.readouterr().out.strip() == "job tiny: paused"
            assert await _geofed("job", "pause", "tiny") == 1
            assert "error: invalid_state (409)" in capsys.readouterr().err

            # A region's agent reports its status on MQTT; the coordinator follows it.
            await _report_status(broker.port, "eu-west")
            session = running.session(setup.observer)
            async with asyncio.timeout(10):
                while True:
                    _, body = await request(session, "GET", "/v1/regions")
                    states = {r["region"]: r["state"] for r in body["regions"]}
                    if states["eu-west"] == "training":
                        break
                    await asyncio.sleep(0.05)
            assert await metric_value(running, session, "geofed_regions_up") == 1.0

            # Flags win over the environment: as an observer, reading works, managing not.
            observer = _flags(running.url, setup.observer, setup.fed.bundle_file)
            assert await _geofed("status", *observer) == 0
            out = capsys.readouterr().out
            assert "eu-west   EU            training  tiny  0      2.5000" in out
            assert "tiny  paused  0/3" in out
            # --watch, piped: one plain snapshot per refresh, each under its time.
            watch = ("status", "--watch", "--interval", "0.05", "--count", "2")
            assert await _geofed(*watch, *observer) == 0
            out = capsys.readouterr().out
            assert out.count("--- 20") == 2
            assert out.count("tiny  paused  0/3") == 2
            assert await _geofed("status", "--watch", "--interval", "0", *observer) == 2
            assert "--interval must be > 0" in capsys.readouterr().err
            assert await _geofed("job", "resume", "tiny", *observer) == 1
            assert "error: forbidden (403)" in capsys.readouterr().err
            assert await _geofed("job", "status", "tiny", "--json", *observer) == 0
            assert '"state": "paused"' in capsys.readouterr().out

            monkeypatch.delenv("GEOFED_URL")
            assert await _geofed("job", "status", "tiny") == 2
            assert "no coordinator URL" in capsys.readouterr().err
            assert await _geofed("status", "--url", "http://example.com:80") == 2
            assert "only for the loopback demo" in capsys.readouterr().err


async def test_the_loopback_demo_is_reached_with_an_identity_header(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with EmbeddedBroker() as broker:
        setup = write_setup(tmp_path, broker.port, insecure=True)
        async with coordinator(setup) as running:
            url = f"http://127.0.0.1:{running.port}"
            observer = "spiffe://acme/observer/watch"
            assert await _geofed("status", "--url", url, "--identity", observer) == 0
            assert "REGION" in capsys.readouterr().out
            assert await _geofed("status", "--url", url) == 2
            assert "needs --identity or GEOFED_IDENTITY" in capsys.readouterr().err
            spec = tmp_path / "job.yaml"
            spec.write_text(job_yaml())
            assert (
                await _geofed("job", "submit", str(spec), "--url", url, "--identity", observer) == 1
            )
            assert "error: forbidden (403)" in capsys.readouterr().err
