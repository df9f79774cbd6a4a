"""The hand-off protocol's errors (its messages: :mod:`regional_agent.handoff.messages`)."""

from __future__ import annotations


class HandoffError(Exception):
    """Base class of hand-off protocol errors."""


class InvalidHandoffData(HandoffError, ValueError):
    """A hand-off value or file does not follow the protocol; the message says where."""
