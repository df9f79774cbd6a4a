"""``GET /ui``: the status page's aiohttp handler (thin: gather facts, render, answer).

Readers only (operators and observers), as for ``/metrics``; a region is refused. The
regions and jobs are exactly what ``GET /v1/regions`` and ``GET /v1/jobs`` answer, so the
page never disagrees with the JSON API. The audit log is read incrementally: each
request reads at most :data:`PAGES_PER_REQUEST` pages of new entries (in the store's
thread) and folds and renders off the event loop, so a long log costs a bounded amount
per request and the first views of a huge one simply catch up over a few refreshes.
``?part=main`` answers only the live part, which the page's script fetches again.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any, Final

from aiohttp import web

from coordinator.api import admin as api_admin
from coordinator.api.auth import READERS, require_role
from coordinator.api.keys import JOBS, RUNTIME, SERVICES
from coordinator.api.ui.history import AuditDigest
from coordinator.api.ui.page import CONTENT_SECURITY_POLICY, PageFacts, render_main, render_page
from coordinator.state.async_store import AsyncStore
from coordinator.state.audit import MAX_PAGE
from geofed.api_paths import ApiPaths

__all__ = ["PAGES_PER_REQUEST", "AuditFollower", "install", "status_page"]

#: Audit pages (of :data:`~coordinator.state.audit.MAX_PAGE` entries) one request reads at most.
PAGES_PER_REQUEST: Final = 20

_HEADERS: Final = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


class AuditFollower:
    """The audit log folded so far (:class:`AuditDigest`), read on by each page view."""

    def __init__(self) -> None:
        self.digest = AuditDigest()
        self.lock = asyncio.Lock()

    async def catch_up(self, db: AsyncStore, pages: int = PAGES_PER_REQUEST) -> int:
        """Read and fold up to ``pages`` pages of new entries; the log's newest seq.

        Call it holding :attr:`lock` (the fold runs in a thread and must not overlap a
        render of the same digest).
        """
        head, _ = await db.audit_head()
        for _ in range(pages):
            if self.digest.seq >= head:
                break
            entries = await db.audit_entries(self.digest.seq, MAX_PAGE, None)
            if not entries:
                break
            await asyncio.to_thread(self.digest.fold, entries)
        return head


FOLLOWER: Final = web.AppKey("geofed_ui_audit", AuditFollower)


def install(app: web.Application) -> None:
    """Serve the status page on ``app`` (call before the app starts)."""
    app[FOLLOWER] = AuditFollower()
    app.router.add_get(ApiPaths.UI, status_page)


async def status_page(request: web.Request) -> web.Response:
    identity = require_role(request, *READERS)
    part = request.query.get("part")
    refresh = api_admin.int_query(request.query.get("refresh", "5"), "refresh", 1, 600)
    regions = await _json_of(api_admin.regions, request)
    jobs = await _json_of(api_admin.list_jobs, request)
    services = request.app[SERVICES]
    region_list: list[dict[str, Any]] = regions["regions"]
    for entry in region_list:
        view = services.control.regions.get(entry["region"])
        if view is not None:
            entry.setdefault("agent_version", view.status.agent_version)
    engines = list(request.app[JOBS].engines())
    fp32 = {engine.job: engine.ctx.fp32_bytes for engine in engines}
    # A streaming round's delta is its fragment: each round has its own size.
    round_fp32 = {
        engine.job: engine.ctx.round_fp32_bytes
        for engine in engines
        if engine.ctx.spec.overlap == "streaming"
    }
    costs = await api_admin.current_costs(request.app)
    follower = request.app[FOLLOWER]
    async with follower.lock:
        head = await follower.catch_up(services.db)
        facts = PageFacts(
            federation=request.app[RUNTIME].config.federation,
            viewer=str(identity),
            now=time.time(),
            regions=region_list,
            jobs=jobs["jobs"],
            digest=follower.digest,
            audit_head=head,
            fp32_bytes=fp32,
            round_fp32_bytes=round_fp32,
            refresh_s=refresh,
            costs=dict(costs.latest),
            currency=costs.currency,
        )
        render = render_main if part == "main" else render_page
        body = await asyncio.to_thread(render, facts)
    return web.Response(
        text=body, content_type="text/html", charset="utf-8", headers=dict(_HEADERS)
    )


async def _json_of(handler: Callable[[web.Request], Any], request: web.Request) -> dict[str, Any]:
    """The JSON body the API's own handler answers this request (same checks, same fields)."""
    response: web.Response = await handler(request)
    data: dict[str, Any] = json.loads(response.text or "{}")
    return data
