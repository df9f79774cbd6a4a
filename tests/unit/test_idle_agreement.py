"""When an idle worker group's ranks meet: rank 0 polls alone between meetings."""

from __future__ import annotations

from regional_agent.worker.idle_agreement import IDLE_AGREE_S, IdleAgreement


def test_rank_zero_polls_alone_between_meetings_unless_it_has_work_or_a_stop() -> None:
    now = [100.0]
    rank0 = IdleAgreement(0, clock=lambda: now[0])
    assert not rank0.wait_alone(False, False)  # never met: meet at once
    rank0.agreed()
    now[0] += IDLE_AGREE_S / 2
    assert rank0.wait_alone(False, False)
    assert not rank0.wait_alone(True, False)  # work to share
    assert not rank0.wait_alone(False, True)  # a stop to share
    now[0] += IDLE_AGREE_S / 2
    assert not rank0.wait_alone(False, False)  # time to meet


def test_the_other_ranks_always_wait_in_the_meeting() -> None:
    other = IdleAgreement(1, clock=lambda: 0.0)
    other.agreed()
    assert not other.wait_alone(False, False)
