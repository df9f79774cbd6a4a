"""Which team an operator belongs to, and which jobs it may manage. Pure.

An operator's team is part of its certificate's name: ``operator/<team>--<person>``
(``geofed ca issue --role operator --name vision--alice``); the first ``--`` separates
them, so a team name never contains ``--``. An operator whose name has no ``--``
(every certificate issued before teams) belongs to the team ``default``. The
coordinator config's ``admins`` lists operator names that manage every team's jobs.

* A job's team defaults to its submitter's team; only an admin may submit a job of
  another team.
* Pause, resume and cancel apply to jobs of the caller's own team (admins: all);
  ``preempt`` is for admins only.
* An export goes only to a destination the coordinator config's ``export_destinations``
  grants the operator's team (admins: any); the residency policies then decide it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Final

from geofed.types import Identity, Role

__all__ = [
    "ADMIN_ONLY",
    "DEFAULT_TEAM",
    "TEAM_SEPARATOR",
    "destination_refusal",
    "is_admin",
    "management_refusal",
    "operator_team",
    "priority_refusal",
    "submission_refusal",
]

TEAM_SEPARATOR: Final = "--"
#: The team of an operator whose name carries none, and of a job that names none.
DEFAULT_TEAM: Final = "default"
#: Job actions only an admin may take.
ADMIN_ONLY: Final = frozenset({"preempt"})


def operator_team(identity: Identity) -> str:
    """The team of an operator: the part of its name before ``--``, else ``default``."""
    team, separator, person = identity.name.partition(TEAM_SEPARATOR)
    return team if separator and team and person else DEFAULT_TEAM


def is_admin(identity: Identity, admins: Collection[str]) -> bool:
    """Whether ``identity`` is an operator listed in the coordinator's ``admins``."""
    return identity.role is Role.OPERATOR and identity.name in admins


def submission_refusal(identity: Identity, team: str, admins: Collection[str]) -> str | None:
    """Why ``identity`` may not submit a job of ``team``, or None when it may."""
    if is_admin(identity, admins):
        return None
    own = operator_team(identity)
    if team == own:
        return None
    return (
        f"{identity} belongs to team {own} and may submit only its jobs, not team {team}'s "
        "(leave team out to submit for your own team; an admin may submit for any team)"
    )


def priority_refusal(
    identity: Identity,
    team: str,
    priority: str,
    allowed: Collection[str] | None,
    admins: Collection[str],
) -> str | None:
    """Why ``identity`` may not submit a job of ``team`` in class ``priority``, or None:
    a team's jobs use the classes the scheduling config grants it (``allowed``; None:
    every class); an admin may use any."""
    if allowed is None or priority in allowed or is_admin(identity, admins):
        return None
    return (
        f"team {team} may not submit jobs of priority {priority} (its classes: "
        f"{', '.join(sorted(allowed)) or 'none'}; the scheduling config's teams.{team}."
        "priorities)"
    )


def management_refusal(
    identity: Identity, action: str, job: str, team: str, admins: Collection[str]
) -> str | None:
    """Why ``identity`` may not ``action`` job ``job`` of ``team``, or None when it may.
    ``action`` is an audit action's verb (``pause``, ``regions``, ...)."""
    if is_admin(identity, admins):
        return None
    doing = _PHRASES.get(action, f"{action} job {job}").format(job=job)
    if action in ADMIN_ONLY:
        return f"{identity} may not {doing}: only an admin may"
    own = operator_team(identity)
    if team == own:
        return None
    return (
        f"{identity} belongs to team {own} and may not {doing} of team {team}; "
        f"operators of team {team} or an admin may"
    )


#: How a refusal says the actions whose verb is not a sentence's verb.
_PHRASES: Final = {
    "regions": "change the regions of job {job}",
    "export": "take away the model of job {job}",
}


def destination_refusal(
    identity: Identity,
    destination: str,
    granted: Mapping[str, Collection[str]],
    admins: Collection[str],
) -> str | None:
    """Why ``identity`` may not export a model to ``destination`` (``storage:NAME`` or
    ``jurisdiction:CODE``, as written), or None when it may.

    Where a model lands is not the operator's to declare: its team's destinations are
    those the coordinator config grants it (``granted``: team -> destinations); an admin
    may name any. The residency policies decide an allowed destination afterwards.
    """
    if is_admin(identity, admins):
        return None
    team = operator_team(identity)
    allowed = granted.get(team, ())
    if destination in allowed:
        return None
    some = ", ".join(sorted(allowed)) if allowed else "none"
    return (
        f"team {team} may not export to {destination} (its destinations: {some}; the "
        f"coordinator config's export_destinations.{team}, which an admin sets)"
    )
