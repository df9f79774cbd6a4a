"""The coordinator's HTTP API paths, spelt in one place for the server and its clients.

The upper-case names are route patterns in aiohttp's syntax (``{job}`` matches one path
segment), which the coordinator registers its handlers under; the methods format the
concrete path a client requests. Everything versioned lives under ``/v1``:

- ``jobs``, ``jobs/<job>``, ``jobs/<job>/<pause|resume|cancel>``   jobs (operators)
- ``regions``, ``audit``                                           federation views
- ``jobs/<job>/rounds/<round>/deltas/<region>[/manifest|/chunks/<i>|/commit]``
                                                                   delta uploads
- ``jobs/<job>/rounds/<round>/update``                             a published update
- ``jobs/<job>/checkpoints/latest``                                where to resync from
- ``jobs/<job>/artifacts/<sha256>``                                any stored artifact

The unversioned ``/healthz``, ``/readyz`` and ``/metrics`` are for the operations tools.
"""

from __future__ import annotations

from typing import ClassVar, Final

__all__ = ["JOB_ACTIONS", "ApiPaths"]

#: What an operator may do to a job through ``POST /v1/jobs/<job>/<action>``.
JOB_ACTIONS: Final = ("pause", "resume", "cancel")

_V1 = "/v1"
_DELTA = _V1 + "/jobs/{job}/rounds/{round}/deltas/{region}"


class ApiPaths:
    """Route patterns (class constants) and client paths (static methods) of the API."""

    HEALTHZ: ClassVar[str] = "/healthz"
    READYZ: ClassVar[str] = "/readyz"
    METRICS: ClassVar[str] = "/metrics"

    JOBS: ClassVar[str] = _V1 + "/jobs"
    JOB: ClassVar[str] = _V1 + "/jobs/{job}"
    JOB_ACTION: ClassVar[str] = _V1 + "/jobs/{job}/{action:" + "|".join(JOB_ACTIONS) + "}"
    REGIONS: ClassVar[str] = _V1 + "/regions"
    AUDIT: ClassVar[str] = _V1 + "/audit"

    DELTA: ClassVar[str] = _DELTA
    DELTA_MANIFEST: ClassVar[str] = _DELTA + "/manifest"
    DELTA_CHUNK: ClassVar[str] = _DELTA + "/chunks/{index}"
    DELTA_COMMIT: ClassVar[str] = _DELTA + "/commit"

    UPDATE: ClassVar[str] = _V1 + "/jobs/{job}/rounds/{round}/update"
    LATEST_CHECKPOINT: ClassVar[str] = _V1 + "/jobs/{job}/checkpoints/latest"
    ARTIFACT: ClassVar[str] = _V1 + "/jobs/{job}/artifacts/{digest}"

    @staticmethod
    def job(job: str) -> str:
        return f"{_V1}/jobs/{job}"

    @staticmethod
    def job_action(job: str, action: str) -> str:
        """``pause``, ``resume`` or ``cancel`` of ``job`` (the server refuses any other)."""
        return f"{_V1}/jobs/{job}/{action}"

    @staticmethod
    def delta(job: str, round_: int, region: str) -> str:
        """The delta of ``region`` for ``round_``: the single-shot upload, and the base of
        the three steps below."""
        return f"{_V1}/jobs/{job}/rounds/{round_}/deltas/{region}"

    @staticmethod
    def delta_manifest(job: str, round_: int, region: str) -> str:
        return ApiPaths.delta(job, round_, region) + "/manifest"

    @staticmethod
    def delta_chunk(job: str, round_: int, region: str, index: int) -> str:
        return ApiPaths.delta(job, round_, region) + f"/chunks/{index}"

    @staticmethod
    def delta_commit(job: str, round_: int, region: str) -> str:
        return ApiPaths.delta(job, round_, region) + "/commit"

    @staticmethod
    def update(job: str, round_: int) -> str:
        """The global update published at the end of ``round_``."""
        return f"{_V1}/jobs/{job}/rounds/{round_}/update"

    @staticmethod
    def latest_checkpoint(job: str) -> str:
        return f"{_V1}/jobs/{job}/checkpoints/latest"

    @staticmethod
    def artifact(job: str, digest: str) -> str:
        """A stored artifact of ``job`` by the SHA-256 of its payload."""
        return f"{_V1}/jobs/{job}/artifacts/{digest}"
