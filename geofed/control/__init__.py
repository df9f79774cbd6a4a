"""The MQTT control plane: topics, message schemas, a reconnecting client, a demo broker.

Announcements and commands flow from the coordinator to regions, statuses and events
the other way; bulk data never travels here (it goes over HTTPS). The embedded broker
lives in :mod:`geofed.control.broker` and is imported only by those who run it.
"""

from geofed.control.client import ControlClient, Handler, Publication
from geofed.control.errors import (
    BrokerError,
    ControlError,
    ControlTimeout,
    MessageError,
    NotRunning,
    SubscriptionRefused,
    TopicError,
)
from geofed.control.messages import (
    Capacity,
    Command,
    Deduplicator,
    Event,
    HardwareSummary,
    RegionStatus,
    RoundAnnouncement,
    decode,
    decode_any,
    encode,
)
from geofed.control.topics import ParsedTopic, TopicKind, Topics

__all__ = [
    "BrokerError",
    "Capacity",
    "Command",
    "ControlClient",
    "ControlError",
    "ControlTimeout",
    "Deduplicator",
    "Event",
    "Handler",
    "HardwareSummary",
    "MessageError",
    "NotRunning",
    "ParsedTopic",
    "Publication",
    "RegionStatus",
    "RoundAnnouncement",
    "SubscriptionRefused",
    "TopicError",
    "TopicKind",
    "Topics",
    "decode",
    "decode_any",
    "encode",
]
