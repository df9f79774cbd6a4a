"""The coordinator's HTTP API paths, spelt in one place for the server and its clients.

The upper-case names are route patterns in aiohttp's syntax (``{job}`` matches one path
segment), which the coordinator registers its handlers under; the methods format the
concrete path a client requests. Everything versioned lives under ``/v1``:

- ``jobs``, ``jobs/<job>``, ``jobs/<job>/<pause|resume|cancel|preempt>``  jobs (operators)
- ``regions``, ``queue``, ``audit``                                federation views
- ``jobs/<job>/rounds/<round>/deltas/<region>[/manifest|/chunks/<i>|/commit]``
                                                                   delta uploads
- ``jobs/<job>/rounds/<round>/update``                             a published update
- ``jobs/<job>/checkpoints/latest``                                where to resync from
- ``jobs/<job>/artifacts/<sha256>``                                any stored artifact
- ``jobs/<job>/exports``, ``jobs/<job>/exports/<id>/artifacts/<sha256>``
                                                                   a model export (operators)
- ``jobs/<job>/lineage``                                           what made each version

The unversioned ``/healthz``, ``/readyz`` and ``/metrics`` are for the operations tools,
``/ui`` the status page for a browser.
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
    #: The status page (HTML, for a browser holding a reader's certificate).
    UI: ClassVar[str] = "/ui"

    JOBS: ClassVar[str] = _V1 + "/jobs"
    JOB: ClassVar[str] = _V1 + "/jobs/{job}"
    JOB_ACTION: ClassVar[str] = _V1 + "/jobs/{job}/{action:" + "|".join(JOB_ACTIONS) + "}"
    #: Stop a capacity-scheduled job at its next round boundary and requeue it (admins).
    JOB_PREEMPT: ClassVar[str] = _V1 + "/jobs/{job}/preempt"
    #: Add a region to a job or remove one, from its next round boundary (operators).
    JOB_REGIONS: ClassVar[str] = _V1 + "/jobs/{job}/regions"
    REGIONS: ClassVar[str] = _V1 + "/regions"
    QUEUE: ClassVar[str] = _V1 + "/queue"
    AUDIT: ClassVar[str] = _V1 + "/audit"
    #: What each job and team used and cost over a period (readers).
    USAGE: ClassVar[str] = _V1 + "/usage"

    DELTA: ClassVar[str] = _DELTA
    DELTA_MANIFEST: ClassVar[str] = _DELTA + "/manifest"
    DELTA_CHUNK: ClassVar[str] = _DELTA + "/chunks/{index}"
    DELTA_COMMIT: ClassVar[str] = _DELTA + "/commit"

    UPDATE: ClassVar[str] = _V1 + "/jobs/{job}/rounds/{round}/update"
    LATEST_CHECKPOINT: ClassVar[str] = _V1 + "/jobs/{job}/checkpoints/latest"
    ARTIFACT: ClassVar[str] = _V1 + "/jobs/{job}/artifacts/{digest}"
    EXPORTS: ClassVar[str] = _V1 + "/jobs/{job}/exports"
    EXPORT_ARTIFACT: ClassVar[str] = _V1 + "/jobs/{job}/exports/{export}/artifacts/{digest}"
    LINEAGE: ClassVar[str] = _V1 + "/jobs/{job}/lineage"

    @staticmethod
    def job(job: str) -> str:
        return f"{_V1}/jobs/{job}"

    @staticmethod
    def job_action(job: str, action: str) -> str:
        """``pause``, ``resume`` or ``cancel`` of ``job`` (the server refuses any other)."""
        return f"{_V1}/jobs/{job}/{action}"

    @staticmethod
    def job_regions(job: str) -> str:
        return f"{_V1}/jobs/{job}/regions"

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

    @staticmethod
    def exports(job: str) -> str:
        """Where an operator asks to export ``job``'s model (POST)."""
        return f"{_V1}/jobs/{job}/exports"

    @staticmethod
    def export_artifact(job: str, export: str, digest: str) -> str:
        """An artifact of the chain that export ``export`` of ``job`` was granted."""
        return f"{_V1}/jobs/{job}/exports/{export}/artifacts/{digest}"

    @staticmethod
    def lineage(job: str) -> str:
        return f"{_V1}/jobs/{job}/lineage"
