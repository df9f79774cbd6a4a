"""Operator teams: who belongs to which team, and which jobs each may manage."""

from __future__ import annotations

import pytest

from coordinator.config import ConfigError
from coordinator.scheduling.config import parse_scheduling_config
from coordinator.scheduling.teams import (
    destination_refusal,
    management_refusal,
    operator_team,
    priority_refusal,
    submission_refusal,
)
from geofed.types import Identity, Role

ADMINS = ("lead",)


def _op(name: str, role: Role = Role.OPERATOR) -> Identity:
    return Identity("acme", role, name)


@pytest.mark.parametrize(
    ("name", "team"),
    [
        ("vision--alice", "vision"),
        ("ml-infra--bob", "ml-infra"),
        ("a--b--c", "a"),  # the first -- separates
        ("ops", "default"),  # issued before teams
        ("ops-lead", "default"),
    ],
)
def test_operator_team(name: str, team: str) -> None:
    assert operator_team(_op(name)) == team


@pytest.mark.parametrize(
    ("name", "action", "team", "refused"),
    [
        ("vision--alice", "cancel", "vision", None),
        ("vision--alice", "pause", "nlp", "belongs to team vision and may not pause job j"),
        ("ops", "resume", "default", None),
        ("ops", "cancel", "vision", "belongs to team default and may not cancel"),
        ("vision--alice", "preempt", "vision", "only an admin may"),
        ("lead", "cancel", "vision", None),
        ("lead", "preempt", "nlp", None),
        (
            "ops",
            "regions",
            "vision",
            "may not change the regions of job j of team vision; operators of team vision",
        ),
    ],
)
def test_management(name: str, action: str, team: str, refused: str | None) -> None:
    refusal = management_refusal(_op(name), action, "j", team, ADMINS)
    if refused is None:
        assert refusal is None
    else:
        assert refusal is not None
        assert refused in refusal


def test_an_admin_name_only_counts_for_an_operator() -> None:
    assert management_refusal(_op("lead", Role.OBSERVER), "cancel", "j", "x", ADMINS)


@pytest.mark.parametrize(
    ("name", "team", "allowed"),
    [
        ("vision--alice", "vision", True),
        ("vision--alice", "nlp", False),
        ("ops", "default", True),
        ("ops", "nlp", False),
        ("lead", "nlp", True),
    ],
)
def test_submission(name: str, team: str, allowed: bool) -> None:
    assert (submission_refusal(_op(name), team, ADMINS) is None) is allowed


@pytest.mark.parametrize(
    ("name", "priority", "allowed"),
    [
        ("nlp--bob", "research", True),
        ("nlp--bob", "production", False),  # a preempting class is a right, not a choice
        ("lead", "production", True),  # an admin may use any
    ],
)
def test_a_team_uses_the_priority_classes_granted_to_it(
    name: str, priority: str, allowed: bool
) -> None:
    granted = frozenset({"research", "best-effort"})
    refusal = priority_refusal(_op(name), "nlp", priority, granted, ADMINS)
    assert (refusal is None) is allowed
    if refusal is not None:
        assert refusal == (
            "team nlp may not submit jobs of priority production (its classes: best-effort, "
            "research; the scheduling config's teams.nlp.priorities)"
        )
    assert priority_refusal(_op(name), "nlp", "production", None, ADMINS) is None


def test_a_team_may_be_granted_only_known_classes() -> None:
    config = parse_scheduling_config(
        "teams:\n  nlp: {priorities: [research]}\n  vision: {}\n", "scheduling.yaml"
    )
    assert config.team_priorities("nlp") == frozenset({"research"})
    assert config.team_priorities("vision") is None
    assert config.team_priorities("unlisted") is None
    with pytest.raises(ConfigError, match=r"teams\.nlp\.priorities names urgent, not priority"):
        parse_scheduling_config("teams:\n  nlp: {priorities: [urgent]}\n", "scheduling.yaml")


def test_taking_a_model_away_follows_the_job_s_team() -> None:
    assert management_refusal(_op("vision--alice"), "export", "three", "vision", ADMINS) is None
    assert management_refusal(_op("lead"), "export", "three", "vision", ADMINS) is None
    assert management_refusal(_op("nlp--bob"), "export", "three", "vision", ADMINS) == (
        "spiffe://acme/operator/nlp--bob belongs to team nlp and may not take away the model "
        "of job three of team vision; operators of team vision or an admin may"
    )


def test_a_model_goes_only_where_the_team_is_granted_to_take_it() -> None:
    granted = {"vision": ("storage:eu-ckpt", "jurisdiction:EU")}
    alice, bob = _op("vision--alice"), _op("nlp--bob")
    assert destination_refusal(alice, "jurisdiction:EU", granted, ADMINS) is None
    assert destination_refusal(alice, "storage:eu-ckpt", granted, ADMINS) is None
    assert destination_refusal(alice, "jurisdiction:US", granted, ADMINS) == (
        "team vision may not export to jurisdiction:US (its destinations: "
        "jurisdiction:EU, storage:eu-ckpt; the coordinator config's "
        "export_destinations.vision, which an admin sets)"
    )
    assert destination_refusal(bob, "jurisdiction:EU", granted, ADMINS) == (
        "team nlp may not export to jurisdiction:EU (its destinations: none; the "
        "coordinator config's export_destinations.nlp, which an admin sets)"
    )
    assert destination_refusal(_op("lead"), "jurisdiction:US", granted, ADMINS) is None
    # An admin's name counts only for an operator; a region of that name has no rights.
    assert destination_refusal(_op("lead", Role.REGION), "jurisdiction:US", {}, ADMINS)
