"""What every policy decision returns: allow or deny, the rule that decided, and why."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RuleRef:
    """A stable rule id (``eu-west:exports.global_checkpoint[1]``) and where it is written.

    ``origin`` is ``file:line``, or ``-`` for built-in rules with no place in a file.
    """

    rule_id: str
    origin: str = "-"

    def __str__(self) -> str:
        return f"{self.rule_id} ({self.origin})"


@dataclass(frozen=True, slots=True)
class Verdict:
    """The answer of one rule (or one built-in) that was consulted."""

    allowed: bool
    rule: RuleRef
    reason: str

    def __str__(self) -> str:
        return f"{'allow' if self.allowed else 'deny'} {self.rule}: {self.reason}"


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome for one subject (a transfer, a dataset placement, ...).

    ``rule`` and ``reason`` are those of the first denying verdict, or of the first
    verdict when all allow; ``verdicts`` lists every rule consulted, in order.
    """

    subject: str
    allowed: bool
    rule: RuleRef
    reason: str
    verdicts: tuple[Verdict, ...]

    @classmethod
    def of(cls, subject: str, verdicts: Iterable[Verdict]) -> Decision:
        """Combine verdicts: allowed only when there is at least one and all allow."""
        found = tuple(verdicts)
        if not found:
            default = Verdict(
                False,
                RuleRef("federation:default-deny"),
                f"no policy governs {subject}; default is deny",
            )
            return cls(subject, False, default.rule, default.reason, (default,))
        denied = [verdict for verdict in found if not verdict.allowed]
        if denied:
            first = denied[0]
            return cls(subject, False, first.rule, first.reason, found)
        first = found[0]
        reason = first.reason
        if len(found) > 1:
            reason = f"all {len(found)} rules consulted allow it; first: {first.reason}"
        return cls(subject, True, first.rule, reason, found)

    @property
    def verb(self) -> str:
        return "allow" if self.allowed else "deny"

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready form for audit records and API responses."""
        return {
            "subject": self.subject,
            "allowed": self.allowed,
            "rule": self.rule.rule_id,
            "origin": self.rule.origin,
            "reason": self.reason,
            "verdicts": [
                {
                    "allowed": v.allowed,
                    "rule": v.rule.rule_id,
                    "origin": v.rule.origin,
                    "reason": v.reason,
                }
                for v in self.verdicts
            ],
        }

    def __str__(self) -> str:
        return f"{self.verb} {self.subject}: {self.reason} [{self.rule}]"
