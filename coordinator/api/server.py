"""The HTTP server the coordinator's app runs on: every answer JSON, even the parser's.

aiohttp answers a request its HTTP parser refuses (a malformed request line, an
oversized header, a bad ``Content-Length``) before any middleware runs, as text. The
protocol promises ``{"error": CODE, "message": TEXT}`` for every error, so the
connection handler here answers those in that form too. How long a connection may sit
without a complete request (unfinished headers included) is the app's
``keepalive_timeout`` (:func:`coordinator.api.app.create_app`).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

__all__ = ["ERROR_CODES", "CoordinatorRunner", "error_code"]

#: The protocol's code for an HTTP status aiohttp answers itself.
ERROR_CODES = {
    400: "bad_request",
    403: "forbidden",
    404: "not_found",
    405: "bad_request",
    408: "timeout",
    413: "too_large",
}


def error_code(status: int) -> str:
    """The protocol's error code of an HTTP error status."""
    return ERROR_CODES.get(status, "bad_request" if status < 500 else "internal")


class _JsonErrorHandler(RequestHandler):
    """aiohttp's connection handler, answering parser errors as protocol JSON."""

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # aiohttp's own answer logs the error and checks that nothing was sent yet.
        super().handle_error(request, status, exc, message)
        text = message if status < 500 and message else HTTPStatus(status).phrase
        response = web.json_response({"error": error_code(status), "message": text}, status=status)
        response.force_close()
        return response


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class CoordinatorRunner(web.AppRunner):
    """An :class:`aiohttp.web.AppRunner` whose connections answer parser errors as JSON."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        super().__init__(app, handle_signals=False, **kwargs)

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()
        # The server aiohttp built for the app, rebuilt with the JSON-answering handler.
        return _JsonErrorServer(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            loop=made._loop,
            **made._kwargs,
        )
