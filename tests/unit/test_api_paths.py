"""API paths: each client path is matched by the route pattern the server registers."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from geofed.api_paths import JOB_ACTIONS, ApiPaths


async def _ok(request: web.Request) -> web.Response:
    return web.Response()


async def _matches(pattern: str, path: str) -> dict[str, str] | None:
    """The match info aiohttp's router gives ``path`` under ``pattern`` (None: no match)."""
    app = web.Application()
    app.router.add_route("GET", pattern, _ok)
    match = await app.router.resolve(make_mocked_request("GET", path, app=app))
    if match.http_exception is not None:
        return None
    return dict(match)


@pytest.mark.parametrize(
    ("pattern", "path", "info"),
    [
        (ApiPaths.JOBS, "/v1/jobs", {}),
        (ApiPaths.JOB, ApiPaths.job("llm"), {"job": "llm"}),
        (
            ApiPaths.JOB_ACTION,
            ApiPaths.job_action("llm", "pause"),
            {"job": "llm", "action": "pause"},
        ),
        (ApiPaths.JOB_PREEMPT, ApiPaths.job_action("llm", "preempt"), {"job": "llm"}),
        (ApiPaths.REGIONS, "/v1/regions", {}),
        (ApiPaths.AUDIT, "/v1/audit", {}),
        (
            ApiPaths.DELTA,
            ApiPaths.delta("llm", 3, "eu-west"),
            {"job": "llm", "round": "3", "region": "eu-west"},
        ),
        (
            ApiPaths.DELTA_MANIFEST,
            ApiPaths.delta_manifest("llm", 3, "eu-west"),
            {"job": "llm", "round": "3", "region": "eu-west"},
        ),
        (
            ApiPaths.DELTA_CHUNK,
            ApiPaths.delta_chunk("llm", 3, "eu-west", 7),
            {"job": "llm", "round": "3", "region": "eu-west", "index": "7"},
        ),
        (
            ApiPaths.DELTA_COMMIT,
            ApiPaths.delta_commit("llm", 3, "eu-west"),
            {"job": "llm", "round": "3", "region": "eu-west"},
        ),
        (ApiPaths.UPDATE, ApiPaths.update("llm", 2), {"job": "llm", "round": "2"}),
        (ApiPaths.LATEST_CHECKPOINT, ApiPaths.latest_checkpoint("llm"), {"job": "llm"}),
        (
            ApiPaths.ARTIFACT,
            ApiPaths.artifact("llm", "ab" * 32),
            {"job": "llm", "digest": "ab" * 32},
        ),
        (ApiPaths.EXPORTS, ApiPaths.exports("llm"), {"job": "llm"}),
        (
            ApiPaths.EXPORT_ARTIFACT,
            ApiPaths.export_artifact("llm", "f00d", "ab" * 32),
            {"job": "llm", "export": "f00d", "digest": "ab" * 32},
        ),
        (ApiPaths.LINEAGE, ApiPaths.lineage("llm"), {"job": "llm"}),
    ],
)
async def test_the_route_matches_the_client_path(
    pattern: str, path: str, info: dict[str, str]
) -> None:
    assert path.startswith("/v1/")
    assert await _matches(pattern, path) == info


def test_the_concrete_paths() -> None:
    assert (
        ApiPaths.delta_chunk("llm", 3, "eu-west", 7)
        == "/v1/jobs/llm/rounds/3/deltas/eu-west/chunks/7"
    )
    assert ApiPaths.update("llm", 2) == "/v1/jobs/llm/rounds/2/update"
    assert ApiPaths.latest_checkpoint("llm") == "/v1/jobs/llm/checkpoints/latest"


async def test_only_the_job_actions_match_the_action_route() -> None:
    for action in JOB_ACTIONS:
        assert await _matches(ApiPaths.JOB_ACTION, ApiPaths.job_action("llm", action))
    assert await _matches(ApiPaths.JOB_ACTION, ApiPaths.job_action("llm", "delete")) is None


async def test_the_delta_steps_are_distinct_routes() -> None:
    steps = {ApiPaths.DELTA, ApiPaths.DELTA_MANIFEST, ApiPaths.DELTA_CHUNK, ApiPaths.DELTA_COMMIT}
    assert len(steps) == 4
    assert await _matches(ApiPaths.DELTA, ApiPaths.delta_manifest("llm", 3, "eu-west")) is None
