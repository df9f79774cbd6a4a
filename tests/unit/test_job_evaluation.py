"""What the job keeps of its evaluations: the pointers' format and the newest loss."""

from __future__ import annotations

import pytest

from coordinator.job_evaluation import (
    format_history,
    format_val_loss,
    newest,
    parse_history,
    parse_val_loss,
)


@pytest.mark.parametrize(("version", "loss"), [(0, 5.25), (12, 0.1 + 0.2), (3, 1e-300)])
def test_the_loss_pointer_keeps_the_loss_exactly(version: int, loss: float) -> None:
    text = format_val_loss(version, loss)
    assert text.startswith(f"{version}:")
    assert parse_val_loss(text) == (version, loss)


def test_the_loss_pointer_format() -> None:
    assert format_val_loss(7, 2.5) == "7:2.5"
    assert parse_val_loss("7:2.5") == (7, 2.5)


def test_the_history_pointer_is_json_in_version_order() -> None:
    history = {10: 1.25, 2: 3.0, 0: 4.5}
    text = format_history(history)
    assert text == '{"0": 4.5, "2": 3.0, "10": 1.25}'
    assert parse_history(text) == history


def test_the_newest_parameters_loss_is_shown() -> None:
    assert newest(None, 0, 4.5) == (0, 4.5)
    assert newest((0, 4.5), 1, 3.0) == (1, 3.0)
    assert newest((1, 3.0), 1, 2.9) == (1, 2.9)  # the same version evaluated again


def test_an_older_evaluation_finishing_late_changes_nothing() -> None:
    assert newest((5, 2.0), 4, 2.5) is None
