"""``GET /v1/usage``: what each job and team used and cost over a period (readers).

Query: ``since`` and ``until`` in epoch seconds (default: the 30 days up to now), ``job``
to report one job. The answer is :meth:`coordinator.costs.report.UsageReport.to_json`,
from the coordinator's :class:`~coordinator.costs.watch.CostWatch` (the audit log is
folded once, as it grows, not read again for each report).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Final

from aiohttp import web

from coordinator.api.auth import READERS, require_role
from coordinator.api.keys import COSTS
from coordinator.costs.showback import Period
from coordinator.errors import BadRequest
from geofed.api_paths import ApiPaths
from geofed.types import InvalidName, validate_name

__all__ = ["DEFAULT_DAYS", "period_query", "routes"]

routes = web.RouteTableDef()

#: The period a report covers when the query names no ``since``.
DEFAULT_DAYS: Final = 30


@routes.get(ApiPaths.USAGE)
async def usage(request: web.Request) -> web.Response:
    require_role(request, *READERS)
    period = period_query(request.query, time.time())
    job = request.query.get("job")
    if job is not None:
        try:
            validate_name("job", job)
        except InvalidName as exc:
            raise BadRequest(str(exc)) from None
    report = await request.app[COSTS].report(period, job)
    return web.json_response(report.to_json())


def period_query(query: Mapping[str, str], now: float) -> Period:
    """The period ``since``..``until`` a query names (epoch seconds), else 400. It ends
    now at the latest: what has not happened yet is not reported (nor billed)."""
    until = min(_seconds(query, "until", now), now)
    since = _seconds(query, "since", until - DEFAULT_DAYS * 86400)
    if since >= until:
        raise BadRequest(f"since ({since:g}) must be before until ({until:g}, now at the latest)")
    return Period(since, until)


def _seconds(query: Mapping[str, str], name: str, default: float) -> float:
    text = query.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise BadRequest(f"query parameter {name} must be epoch seconds, got {text!r}") from None
    if not math.isfinite(value) or not 0 <= value < 1e11:
        raise BadRequest(f"query parameter {name} must be epoch seconds, got {text!r}")
    return value
