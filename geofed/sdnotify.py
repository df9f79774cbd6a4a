"""The systemd notify protocol, for daemons run as ``Type=notify`` services.

systemd passes ``$NOTIFY_SOCKET`` (a unix datagram socket: a path, or an abstract name
written ``@name``) and, with ``WatchdogSec=``, ``$WATCHDOG_USEC`` and ``$WATCHDOG_PID``.
A daemon reports its state with newline-separated ``KEY=value`` assignments in one
datagram each::

    notifier = Notifier.from_env(os.environ)      # a no-op outside systemd
    ...                                           # bind sockets, open state
    notifier.ready("serving on :8443")
    interval = watchdog_interval(os.environ)
    if interval is not None:
        tg.create_task(run_watchdog(notifier, interval, alive=lambda: engine.healthy))
    ...
    notifier.stopping()

Sending never raises into the daemon: the socket is non-blocking, and a full queue
(EAGAIN) or a vanished socket (ENOENT, ECONNREFUSED) is logged once per kind of error and
reported by a False return. Only malformed variables are errors, raised at start-up by
:meth:`Notifier.from_env` and :func:`watchdog_interval` as :class:`NotifyEnvironmentError`.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType

__all__ = [
    "Notifier",
    "NotifyEnvironmentError",
    "run_watchdog",
    "watchdog_interval",
    "without_notify_env",
]

log = logging.getLogger(__name__)

NOTIFY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
# sockaddr_un.sun_path is 108 bytes on Linux, the terminating NUL included for paths.
_SUN_PATH_MAX = 108
# systemd reads at most PIPE_BUF bytes of one notification; keep STATUS= well below it.
MAX_STATUS_CHARS = 1024


class NotifyEnvironmentError(ValueError):
    """``$NOTIFY_SOCKET``, ``$WATCHDOG_USEC`` or ``$WATCHDOG_PID`` holds an unusable value."""


def _address(value: str) -> str:
    """The ``sendto`` address for a ``$NOTIFY_SOCKET`` value (``@name`` is abstract)."""
    if value.startswith("@"):
        address = "\0" + value[1:]
        limit = _SUN_PATH_MAX
    elif value.startswith("/"):
        address = value
        limit = _SUN_PATH_MAX - 1
    else:
        raise NotifyEnvironmentError(
            f"NOTIFY_SOCKET={value!r}: expected an absolute socket path or @abstract-name"
        )
    if len(address.encode("utf-8", errors="surrogateescape")) > limit:
        raise NotifyEnvironmentError(
            f"NOTIFY_SOCKET={value!r}: longer than the {limit} bytes a unix socket name allows"
        )
    return address


def _one_line(text: str) -> str:
    # A newline would start another assignment (``STATUS=x\nREADY=1``); flatten it.
    flat = " ".join(text.split())
    if len(flat) > MAX_STATUS_CHARS:
        flat = flat[: MAX_STATUS_CHARS - 3] + "..."
    return flat


class Notifier:
    """Sends state notifications to the service manager; a no-op without a socket.

    Build it with :meth:`from_env`. Each method returns True when the datagram was
    handed to the socket, False when there is no socket or sending failed.
    """

    def __init__(self, socket_value: str | None) -> None:
        """``socket_value`` is a ``$NOTIFY_SOCKET`` value, or None (or "") for a no-op."""
        self._address = _address(socket_value) if socket_value else None
        self._socket_value = socket_value or None
        self._sock: socket.socket | None = None
        self._reported: set[int] = set()

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Notifier:
        """A notifier for ``environ["NOTIFY_SOCKET"]``; a no-op when it is unset or empty."""
        return cls(environ.get("NOTIFY_SOCKET"))

    @property
    def enabled(self) -> bool:
        """Whether a service manager is listening (``$NOTIFY_SOCKET`` was set)."""
        return self._address is not None

    def ready(self, status: str | None = None) -> bool:
        """Start-up finished: systemd marks the unit active (``READY=1``)."""
        return self.notify("READY=1", *self._status_field(status))

    def status(self, text: str) -> bool:
        """A one-line status shown by ``systemctl status`` (newlines become spaces)."""
        return self.notify(f"STATUS={_one_line(text)}")

    def stopping(self, status: str | None = None) -> bool:
        """Shutdown began (``STOPPING=1``): the unit shows as deactivating meanwhile."""
        return self.notify("STOPPING=1", *self._status_field(status))

    def reloading(self, status: str | None = None) -> bool:
        """A configuration reload began (``RELOADING=1``); send :meth:`ready` when done."""
        # systemd >= 253 (Type=notify-reload) wants the CLOCK_MONOTONIC time of the reload.
        stamp = f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}"
        return self.notify("RELOADING=1", stamp, *self._status_field(status))

    def watchdog(self) -> bool:
        """Keep-alive ping (``WATCHDOG=1``); see :func:`run_watchdog`."""
        return self.notify("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for ``seconds`` more before the current start or stop timeout fires."""
        if not seconds > 0:
            raise ValueError(f"extend_timeout needs a positive duration, got {seconds!r}")
        return self.notify(f"EXTEND_TIMEOUT_USEC={round(seconds * 1_000_000)}")

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=value`` assignments in one datagram; never raises on send errors."""
        for assignment in assignments:
            if "\n" in assignment or "=" not in assignment:
                raise ValueError(f"not a single KEY=value assignment: {assignment!r}")
        if self._address is None:
            return False
        payload = "\n".join(assignments).encode("utf-8", errors="replace")
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                sock.setblocking(False)
                self._sock = sock
            self._sock.sendto(payload, self._address)
        except OSError as exc:
            self._report(exc)
            return False
        return True

    def close(self) -> None:
        """Close the socket; later notifications open a new one."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Notifier:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _status_field(self, status: str | None) -> tuple[str, ...]:
        return () if status is None else (f"STATUS={_one_line(status)}",)

    def _report(self, exc: OSError) -> None:
        # Once per kind of failure: a watchdog ping every few seconds must not flood logs.
        code = exc.errno if exc.errno is not None else -1
        if code in self._reported:
            return
        self._reported.add(code)
        name = errno.errorcode.get(code, str(code))
        log.warning(
            "cannot notify the service manager at %s (%s: %s); further %s errors not logged",
            self._socket_value,
            name,
            exc.strerror or exc,
            name,
        )


def watchdog_interval(environ: Mapping[str, str], pid: int | None = None) -> float | None:
    """The watchdog timeout in seconds that systemd expects pings within, or None.

    None when ``$WATCHDOG_USEC`` is unset or empty, or when ``$WATCHDOG_PID`` names
    another process than ``pid`` (default: this one), as happens in a child that
    inherited the environment. Ping every half of it (:func:`run_watchdog` does).
    """
    raw = environ.get("WATCHDOG_USEC", "")
    if not raw:
        return None
    owner = environ.get("WATCHDOG_PID", "")
    if owner:
        try:
            owner_pid = int(owner)
        except ValueError:
            raise NotifyEnvironmentError(f"WATCHDOG_PID={owner!r} is not a process id") from None
        if owner_pid != (os.getpid() if pid is None else pid):
            return None
    try:
        usec = int(raw)
    except ValueError:
        raise NotifyEnvironmentError(f"WATCHDOG_USEC={raw!r} is not an integer") from None
    if usec <= 0:
        raise NotifyEnvironmentError(f"WATCHDOG_USEC={raw!r} must be positive")
    return usec / 1_000_000


def without_notify_env(environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``environ`` for child processes, without the notify and watchdog variables.

    With ``NotifyAccess=main`` systemd ignores children anyway; dropping the variables
    keeps a child (a worker group) from trying, and from mistaking itself for the daemon.
    """
    return {key: value for key, value in environ.items() if key not in NOTIFY_ENV}


async def run_watchdog(
    notifier: Notifier,
    interval_s: float,
    *,
    alive: Callable[[], bool] = lambda: True,
    clock: Callable[[], float] | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Ping ``WATCHDOG=1`` every ``interval_s / 2`` from the event loop, until cancelled.

    The pings are scheduled on the loop itself, so a loop blocked by a stuck call stops
    them and systemd restarts the daemon (``WatchdogSignal=``, then ``Restart=``). A tick
    where ``alive()`` is false (or raises) sends nothing, for the same effect when the
    daemon knows it is wedged although its loop still turns.

    ``clock`` (seconds; default: the running loop's clock) and ``sleep`` (default
    :func:`asyncio.sleep`) are the schedule's time source and wait, so that the schedule
    can run on simulated time.
    """
    if not interval_s > 0:
        raise ValueError(f"watchdog interval must be positive, got {interval_s!r}")
    period = interval_s / 2
    now_s = clock if clock is not None else asyncio.get_running_loop().time
    healthy = True
    next_at = now_s()
    while True:
        ok, error = _check(alive)
        if ok:
            notifier.watchdog()
            if not healthy:
                log.warning("daemon alive again; watchdog pings resumed")
        elif healthy:
            log.error("daemon reports itself not alive; withholding watchdog pings", exc_info=error)
        healthy = ok
        next_at += period
        now = now_s()
        if next_at < now:
            # The loop stalled past a tick: carry on from now rather than burst to catch up.
            next_at = now + period
        await sleep(next_at - now)


def _check(alive: Callable[[], bool]) -> tuple[bool, Exception | None]:
    try:
        return bool(alive()), None
    except Exception as exc:  # a broken health check means "not alive", not a dead task
        return False, exc
