"""The demo's restart rules: the shipped systemd units' Restart=on-failure, back-off, limit."""

from __future__ import annotations

import signal

import pytest

from geofed_cli.demo.supervisor import RestartPolicy, describe_exit

POLICY = RestartPolicy(initial_delay_s=1.0, max_delay_s=8.0, burst=5, interval_s=900.0)


@pytest.mark.parametrize(
    ("code", "restart"),
    [
        (-signal.SIGKILL, True),  # kill -9, the OOM killer
        (-signal.SIGSEGV, True),
        (1, True),  # runtime failure
        (0, False),  # a clean stop
        (2, False),  # configuration error: RestartPreventExitStatus=2
        (-signal.SIGTERM, False),  # systemd counts these signals as clean
        (-signal.SIGINT, False),
        (-signal.SIGHUP, False),
        (-signal.SIGPIPE, False),
    ],
)
def test_which_exits_are_restarted(code: int, restart: bool) -> None:
    decision = POLICY.decide(code, [], now=0.0)
    assert decision.restart is restart
    assert decision.reason.startswith(describe_exit(code))


def test_the_delay_doubles_up_to_its_cap_and_the_burst_limit_gives_up() -> None:
    restarts: list[float] = []
    delays = []
    now = 0.0
    for _ in range(5):
        decision = POLICY.decide(-signal.SIGKILL, restarts, now)
        assert decision.restart, decision.reason
        delays.append(decision.delay_s)
        now += decision.delay_s
        restarts.append(now)
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0]
    decision = POLICY.decide(-signal.SIGKILL, restarts, now)
    assert not decision.restart
    assert "restarted 5 times within 900 s already: giving up" in decision.reason


def test_restarts_older_than_the_interval_no_longer_count() -> None:
    decision = POLICY.decide(1, [0.0, 1.0, 2.0, 3.0, 4.0], now=1000.0)
    assert (decision.restart, decision.delay_s) == (True, 1.0)
    assert "restart 1 of at most 5" in decision.reason


def test_describe_exit() -> None:
    assert describe_exit(1) == "exited with status 1"
    assert describe_exit(-9) == "was killed by SIGKILL"
