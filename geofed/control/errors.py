"""Errors of the control plane.

Everything the control plane raises derives from :class:`ControlError`; errors of the
MQTT library are converted at the boundary (``client.py``) so callers never need to
know which library carries the messages.
"""

from __future__ import annotations


class ControlError(Exception):
    """Base class of control-plane errors."""


class TopicError(ControlError, ValueError):
    """A topic or topic filter is malformed or does not belong to this federation."""


class MessageError(ControlError, ValueError):
    """A payload is not a valid control message of the expected type."""


class ControlTimeout(ControlError, TimeoutError):
    """A wait on the broker (connection, acknowledgement, shutdown) ran past its deadline."""


class NotRunning(ControlError):
    """The client is closed or was never started, so it cannot reach the broker."""


class SubscriptionRefused(ControlError):
    """The broker answered a SUBSCRIBE with a failure code (typically an ACL denial)."""


class BrokerError(ControlError):
    """The embedded broker could not start or stop."""
