"""Requests a web page could have made a browser send: refused on every mutating endpoint.

An operator who imports their client certificate into a browser (to view ``/ui``) lends
it to every site they visit: the browser attaches it to any request a page sends to the
coordinator, and a page can send a form or a ``fetch`` without asking the server first
as long as it uses a method and a body type the CORS rules call simple. None of the
coordinator's own clients (the CLI, the agents, ``/ui``, which only reads) ever sends such
a request, so for every method but ``GET``, ``HEAD`` and ``OPTIONS``,
:func:`cross_site_refusal` refuses, with its reason:

- ``Sec-Fetch-Site`` other than ``same-origin`` or ``none`` (the browser says another site,
  or a sibling subdomain, made the request);
- an ``Origin`` other than the coordinator's own (scheme, host and port the request came
  to; ``null``, an opaque origin, included);
- a body of a type a page may send without a preflight: ``application/x-www-form-urlencoded``,
  ``multipart/form-data`` or ``text/plain``. The API takes JSON (``application/json``), job
  specs as YAML or JSON (``application/yaml``, ``application/json``) and streams as
  ``application/octet-stream``.

Pure: the caller answers 403 and audits the refusal.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final
from urllib.parse import urlsplit

__all__ = ["SAFE_METHODS", "SIMPLE_BODY_TYPES", "cross_site_refusal"]

#: Methods that change nothing, never checked.
SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})
#: Body types a page may send to another site without the browser asking it first.
SIMPLE_BODY_TYPES: Final = frozenset(
    {"application/x-www-form-urlencoded", "multipart/form-data", "text/plain"}
)
_SAME_SITE_FETCHES: Final = frozenset({"same-origin", "none"})
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}


def _origin(scheme: str, host: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of ``scheme://host``, the port made explicit; None if malformed."""
    try:
        parts = urlsplit(f"{scheme}://{host}")
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname or parts.scheme not in _DEFAULT_PORTS:
        return None
    return parts.scheme, parts.hostname.lower(), port or _DEFAULT_PORTS[parts.scheme]


def cross_site_refusal(
    method: str, headers: Mapping[str, str], scheme: str, host: str
) -> str | None:
    """Why a ``method`` request with ``headers``, received over ``scheme`` for ``host``
    (the ``Host`` it named), may have been sent by another site's page; None: it may not.
    ``headers`` must look names up case-insensitively (as aiohttp's do)."""
    if method.upper() in SAFE_METHODS:
        return None
    fetch_site = headers.get("Sec-Fetch-Site")
    if fetch_site is not None and fetch_site.strip().lower() not in _SAME_SITE_FETCHES:
        return f"a cross-site request (Sec-Fetch-Site: {fetch_site.strip()[:40]})"
    origin = headers.get("Origin")
    if origin is not None:
        own = _origin(scheme, host)
        parts = urlsplit(origin.strip()) if origin.strip() != "null" else None
        theirs = None if parts is None else _origin(parts.scheme, parts.netloc)
        if own is None or theirs is None or theirs != own:
            return f"a request from another origin (Origin: {origin.strip()[:100]})"
    content_type = headers.get("Content-Type")
    if content_type is not None:
        media = content_type.split(";", 1)[0].strip().lower()
        if media in SIMPLE_BODY_TYPES:
            return (
                f"a body of type {media}, which any web page may send; send "
                "application/json, application/yaml or application/octet-stream"
            )
    return None
