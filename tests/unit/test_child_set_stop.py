"""The order in which a ChildSet stops its children (pure: nothing is started): the last
started first, a group's children (the regions' agents) together, where the group's last
started one would stop."""

from __future__ import annotations

from pathlib import Path

from geofed_cli.demo.processes import Child, stop_waves


def _children(*named: tuple[str, str | None]) -> list[Child]:
    return [Child(name, [], Path(f"{name}.log"), {}, group) for name, group in named]


def _names(waves: list[list[Child]]) -> list[list[str]]:
    return [[child.name for child in wave] for wave in waves]


def test_a_group_stops_together_and_before_what_was_started_earlier() -> None:
    children = _children(
        ("coordinator", None), ("agent-a", "agents"), ("agent-b", "agents"), ("proxy", None)
    )
    assert _names(stop_waves(children)) == [["proxy"], ["agent-b", "agent-a"], ["coordinator"]]


def test_a_group_stops_where_its_last_started_child_stands() -> None:
    children = _children(("agent-a", "agents"), ("coordinator", None), ("agent-b", "agents"))
    assert _names(stop_waves(children)) == [["agent-b", "agent-a"], ["coordinator"]]


def test_children_of_no_group_stop_one_after_another_the_last_started_first() -> None:
    children = _children(("first", None), ("second", None))
    assert _names(stop_waves(children)) == [["second"], ["first"]]
