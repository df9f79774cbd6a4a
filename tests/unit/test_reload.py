"""The shared logic of both daemons' reloads (SIGHUP): what changed, what is logged, when.

The daemons' reloads with real files and signals are tested in
``tests/integration/test_daemon_signals.py``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pydantic import BaseModel

from geofed.pki import Grant, TrustBundle, TrustedAuthority, create_ca
from geofed.reload import ReloadReport, apply_log_level, changed_keys, describe_bundle_reload
from geofed.reloader import Reloader
from geofed.sdnotify import Notifier

NOW = datetime(2030, 6, 1, tzinfo=UTC)


class Limits(BaseModel):
    size: int = 1
    names: tuple[str, ...] = ()


class Config(BaseModel):
    port: int = 1
    log_level: str | None = None
    limits: Limits = Limits()


def test_changed_keys_names_each_changed_leaf_and_skips_ignored_ones() -> None:
    old = Config()
    new = Config(port=2, log_level="DEBUG", limits=Limits(size=3, names=("a",)))
    assert changed_keys(old, new, ignore={"log_level"}) == [
        "limits.names",
        "limits.size",
        "port",
    ]
    assert changed_keys(old, new, ignore={"log_level", "limits"}) == ["port"]
    assert changed_keys(old, old.model_copy()) == []


def test_a_refused_report_logs_only_the_refusal(caplog: pytest.LogCaptureFixture) -> None:
    report = ReloadReport(reloaded=["policies"], refused=["a.yaml:3: bad"])
    logger = logging.getLogger("test.reload")
    with caplog.at_level(logging.INFO, logger="test.reload"):
        report.log(logger, "configuration")
    assert not report.ok
    assert [r.getMessage() for r in caplog.records] == [
        "configuration reload refused, nothing changed: a.yaml:3: bad"
    ]
    assert caplog.records[0].levelno == logging.ERROR


def test_a_report_names_what_needs_a_restart(caplog: pytest.LogCaptureFixture) -> None:
    report = ReloadReport(reloaded=["policies", "log level INFO"], needs_restart=["port changed"])
    logger = logging.getLogger("test.reload")
    with caplog.at_level(logging.INFO, logger="test.reload"):
        report.log(logger, "configuration")
    assert [r.getMessage() for r in caplog.records] == [
        "configuration reloaded: policies; log level INFO",
        "configuration reload: these changes need a restart and are not in force: port changed",
    ]


def test_apply_log_level_sets_the_root_level_and_falls_back_to_the_default() -> None:
    root = logging.getLogger()
    before = root.level
    try:
        assert apply_log_level("ERROR", logging.INFO) == "log level ERROR"
        assert root.level == logging.ERROR
        assert apply_log_level(None, logging.WARNING) == "log level WARNING"
        assert root.level == logging.WARNING
    finally:
        root.setLevel(before)


def _bundle(authorities: tuple[TrustedAuthority, ...], revoked: set[int]) -> TrustBundle:
    return TrustBundle("acme", authorities, frozenset(revoked))


def test_bundle_reload_applies_revocations_and_defers_new_authorities() -> None:
    grants = (Grant.parse("region/*"),)
    a = TrustedAuthority("a", create_ca("acme", "a", now=NOW).certificate, grants)
    b = TrustedAuthority("b", create_ca("acme", "b", now=NOW).certificate, grants)
    old = _bundle((a,), {1, 2})
    applied, later = describe_bundle_reload(old, _bundle((a,), {2, 3, 4}))
    assert applied == "trust bundle (3 revoked serials, 2 added, 1 removed)"
    assert later is None
    _, later = describe_bundle_reload(old, _bundle((a, b), {1, 2}))
    assert later is not None
    assert "until a restart" in later


async def test_reloader_runs_one_reload_at_a_time_and_reads_again_after_a_late_signal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    started = threading.Event()
    release = threading.Event()
    prepared: list[int] = []

    def prepare() -> int:
        started.set()
        release.wait(10)
        prepared.append(len(prepared))
        return prepared[-1]

    def apply(n: int) -> ReloadReport:
        return ReloadReport(reloaded=[f"read {n}"])

    reloader = Reloader(prepare, apply, Notifier(None), "configuration")
    with caplog.at_level(logging.INFO, logger="geofed.reloader"):
        reloader.request()
        await asyncio.to_thread(started.wait, 10)
        reloader.request()  # during the first: one more, after it
        reloader.request()  # and no third
        release.set()
        await reloader.wait()
    assert prepared == [0, 1]
    reloaded = [r.getMessage() for r in caplog.records if "reloaded:" in r.getMessage()]
    assert reloaded == ["configuration reloaded: read 0", "configuration reloaded: read 1"]


async def test_a_failing_reload_is_logged_and_the_next_one_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[str] = []

    def prepare() -> str:
        calls.append("prepare")
        if len(calls) == 1:
            raise RuntimeError("disk on fire")
        return "ok"

    reloader = Reloader(prepare, lambda _: ReloadReport(), Notifier(None), "configuration")
    with caplog.at_level(logging.INFO, logger="geofed.reloader"):
        reloader.request()
        await reloader.wait()
        reloader.request()
        await reloader.wait()
    messages = [r.getMessage() for r in caplog.records]
    assert "configuration reload failed; nothing changed" in messages
    assert "configuration reloaded: nothing" in messages


@pytest.mark.parametrize("unit", ["geofed-coordinator.service", "geofed-agent@.service"])
def test_the_shipped_units_reload_with_sighup(unit: str) -> None:
    text = (Path(__file__).resolve().parents[2] / "deploy" / "systemd" / unit).read_text()
    assert "\nExecReload=/bin/kill -HUP $MAINPID\n" in text
