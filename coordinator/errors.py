"""Errors the coordinator answers over HTTP: a status, a stable code, a specific message.

Handlers raise :class:`ApiError` (or a subclass); the app's error middleware turns it
into ``{"error": CODE, "message": TEXT, ...extra}``. Codes are those of
``docs/protocol.md``; they are also the ``code`` label of
``geofed_deltas_rejected_total``, so the set stays small and fixed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

__all__ = [
    "ApiError",
    "BadRequest",
    "Conflict",
    "Forbidden",
    "NotFound",
    "TooLarge",
    "Unavailable",
]

#: Every code the coordinator answers with.
CODES: Final = frozenset(
    {
        "bad_request",
        "malformed_manifest",
        "bad_chunk_index",
        "corrupt_chunk",
        "decode_failed",
        "non_finite",
        "shape_mismatch",
        "codec_mismatch",
        "tokens_out_of_bounds",
        "forbidden",
        "cross_site",
        "bad_signature",
        "producer_mismatch",
        "untrusted_certificate",
        "policy_denied",
        "not_found",
        "round_closed",
        "not_participant",
        "wrong_round",
        "base_mismatch",
        "code_mismatch",
        "already_accepted",
        "already_exists",
        "invalid_state",
        "incomplete",
        "too_large",
        "timeout",
        "unavailable",
        "internal",
    }
)


class ApiError(Exception):
    """An answer other than success; ``extra`` adds fields to the JSON body."""

    def __init__(
        self, status: int, code: str, message: str, extra: Mapping[str, Any] | None = None
    ) -> None:
        if code not in CODES:
            raise ValueError(f"unknown error code {code!r}")
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.extra = dict(extra or {})

    def body(self) -> dict[str, Any]:
        return {**self.extra, "error": self.code, "message": self.message}


class BadRequest(ApiError):
    def __init__(
        self, message: str, code: str = "bad_request", extra: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(400, code, message, extra)


class Forbidden(ApiError):
    def __init__(
        self, message: str, code: str = "forbidden", extra: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(403, code, message, extra)


class NotFound(ApiError):
    def __init__(self, message: str) -> None:
        super().__init__(404, "not_found", message)


class Conflict(ApiError):
    def __init__(self, message: str, code: str, extra: Mapping[str, Any] | None = None) -> None:
        super().__init__(409, code, message, extra)


class TooLarge(ApiError):
    def __init__(self, message: str) -> None:
        super().__init__(413, "too_large", message)


class Unavailable(ApiError):
    def __init__(self, message: str) -> None:
        super().__init__(503, "unavailable", message)
