"""The trust bundle a daemon holds, re-read when its file changes.

Revocations added to the file (``geofed ca revoke``) apply to the next request, scrape or
verified artifact, without a restart: the HTTP checks (:mod:`geofed.pki.httpauth`) and
the artifact checks take a :data:`BundleSource`, a bundle or a zero-argument callable
returning the current one (:func:`current`), and :class:`ReloadingBundle` is that
callable. TLS contexts keep the CA list they were built with: a new authority needs a
restart.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from geofed.pki.errors import PKIError
from geofed.pki.trust import TrustBundle, load_trust_bundle

__all__ = ["BundleSource", "ReloadingBundle", "current"]

log = logging.getLogger(__name__)

BundleSource = TrustBundle | Callable[[], TrustBundle]


def current(source: BundleSource) -> TrustBundle:
    """The bundle ``source`` holds now."""
    return source if isinstance(source, TrustBundle) else source()


class ReloadingBundle:
    """The trust bundle of ``path``, re-read whenever the file changes.

    A file that no longer loads, or that names another federation, is logged and the last
    good bundle stays in force. Each call only stats the file, so it is cheap enough to run
    per request.
    """

    def __init__(self, path: Path, bundle: TrustBundle) -> None:
        self._path = path
        self._bundle = bundle
        self._stamp = self._stat()

    def _stat(self) -> tuple[int, int] | None:
        try:
            status = self._path.stat()
        except OSError:
            return None
        return (status.st_mtime_ns, status.st_size)

    @property
    def path(self) -> Path:
        return self._path

    def replace(self, bundle: TrustBundle) -> None:
        """Hold ``bundle``, just read from the file (a reload), until the file changes again."""
        self._bundle = bundle
        self._stamp = self._stat()

    def __call__(self) -> TrustBundle:
        stamp = self._stat()
        if stamp is not None and stamp != self._stamp:
            self._stamp = stamp
            try:
                bundle = load_trust_bundle(self._path)
            except PKIError as exc:
                log.error(  # noqa: TRY400 - the error names the file, line and key
                    "trust bundle %s no longer loads; keeping the previous one: %s", self._path, exc
                )
            else:
                if bundle.federation == self._bundle.federation:
                    self._bundle = bundle
                    log.info(
                        "trust bundle %s reloaded (%d revoked serials)",
                        self._path,
                        len(bundle.revoked_serials),
                    )
                else:
                    log.error(
                        "trust bundle %s now names federation %r; ignored",
                        self._path,
                        bundle.federation,
                    )
        return self._bundle
