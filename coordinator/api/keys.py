"""Typed keys of the coordinator's aiohttp application state."""

from __future__ import annotations

from typing import Final

from aiohttp import web
from prometheus_client import CollectorRegistry

from coordinator.costs.watch import CostWatch
from coordinator.intake.uploads import UploadService
from coordinator.jobs.manager import JobManager
from coordinator.runtime import Runtime
from coordinator.services import Services

__all__ = ["COSTS", "JOBS", "REGISTRY", "RUNTIME", "SERVICES", "UPLOADS"]

RUNTIME: Final = web.AppKey("geofed_runtime", Runtime)
REGISTRY: Final = web.AppKey("geofed_registry", CollectorRegistry)
SERVICES: Final = web.AppKey("geofed_services", Services)
JOBS: Final = web.AppKey("geofed_jobs", JobManager)
UPLOADS: Final = web.AppKey("geofed_uploads", UploadService)
COSTS: Final = web.AppKey("geofed_costs", CostWatch)
