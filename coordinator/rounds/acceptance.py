"""The protocol's answers about a delta's acceptability: its 409s, and a delta sent again.

:func:`coordinator.rounds.state.judge_delta` states when a delta is acceptable; the round
engine and the upload path answer its refusals with :func:`refusal` (a late delta that a
job merges, while no round collects, gets 503: it is sent again). A region whose delta
the round already holds gets that delta's receipt again when it sends the same manifest
(an upload retried after a lost answer) and ``409 already_accepted`` when it sends another
one (:func:`accepted_again`).
"""

from __future__ import annotations

from typing import Final

from coordinator.errors import ApiError, Conflict, Unavailable
from coordinator.rounds.state import DeltaVerdict, DeltaVerdictCode
from coordinator.state.store import Receipt

__all__ = ["accepted_again", "refusal"]

#: The protocol's code (``docs/protocol.md``) of each refusal.
_CONFLICT_CODES: Final = {
    DeltaVerdictCode.LATE: "round_closed",
    DeltaVerdictCode.NOT_PARTICIPANT: "not_participant",
    DeltaVerdictCode.WRONG_ROUND: "wrong_round",
}


def refusal(verdict: DeltaVerdict) -> ApiError:
    """The 409 that answers a refused delta, or the 503 that asks for a late one to be
    sent again once a round collects; ``verdict`` must not be an acceptance."""
    if verdict.code is DeltaVerdictCode.NOT_YET:
        return Unavailable(verdict.reason)
    code = _CONFLICT_CODES.get(verdict.code)
    if code is None:
        raise ValueError(f"a {verdict.code} delta is not refused")
    return Conflict(verdict.reason, code)


def accepted_again(
    existing: Receipt | None, manifest_digest: str, *, job: str, round: int, region: str
) -> Receipt:
    """The receipt that answers a delta sent again; ``409 already_accepted`` for another one."""
    if existing is not None and existing.manifest_digest == manifest_digest:
        return existing
    raise Conflict(
        f"{region} already has a different delta accepted for round {round} of job {job}",
        "already_accepted",
    )
