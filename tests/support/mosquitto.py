"""A real Mosquitto broker for integration tests: mutual TLS on a free loopback port.

    with run_mosquitto(tmp_path / "mqtt", cafile=fed.ca_file, certfile=server.cert_file,
                       keyfile=server.key_file, acl=ACL_TEXT) as broker:
        ...  # broker.host, broker.port, broker.log_text()

The generated config mirrors production's: a TLS listener with ``require_certificate
true`` and ``use_identity_as_username true`` (the certificate CN becomes the username),
``cafile`` = the federation's CAs, and an optional ACL file. The broker's log is printed
on teardown, which pytest shows for failing tests only.
"""

from __future__ import annotations

import getpass
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from geofed.ports import unused_port

MOSQUITTO = Path("/usr/sbin/mosquitto")
HOST = "127.0.0.1"


class MosquittoError(RuntimeError):
    """Mosquitto is missing, or did not start or stop as expected."""


@dataclass(frozen=True)
class MosquittoBroker:
    """A running broker: where it listens and where its files are."""

    host: str
    port: int
    config_file: Path
    log_file: Path
    cafile: Path
    acl_file: Path | None
    pid: int

    def log_text(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""


def mosquitto_config(
    *,
    port: int,
    cafile: Path,
    certfile: Path,
    keyfile: Path,
    acl_file: Path | None = None,
    host: str = HOST,
) -> str:
    """The text of a mosquitto.conf for one mutual-TLS listener."""
    lines = [
        # Running as root, Mosquitto would switch to user "mosquitto", who cannot read
        # the test's keys; stay the user we are.
        f"user {getpass.getuser()}",
        "persistence false",
        "log_dest stderr",
        "log_type all",
        "connection_messages true",
        "per_listener_settings false",
        "allow_anonymous false",
        f"listener {port} {host}",
        f"cafile {cafile}",
        f"certfile {certfile}",
        f"keyfile {keyfile}",
        "require_certificate true",
        "use_identity_as_username true",
    ]
    if acl_file is not None:
        lines.append(f"acl_file {acl_file}")
    return "\n".join(lines) + "\n"


def _accepting(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _start(
    workdir: Path, port: int, config: str, timeout_s: float
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    config_file = workdir / f"mosquitto-{port}.conf"
    log_file = workdir / f"mosquitto-{port}.log"
    config_file.write_text(config)
    with log_file.open("wb") as log:
        process = subprocess.Popen(
            [str(MOSQUITTO), "-c", str(config_file)], stdout=log, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return process, config_file, log_file
        if _accepting(HOST, port):
            return process, config_file, log_file
        time.sleep(0.05)
    process.kill()
    process.wait(timeout=5)
    raise MosquittoError(
        f"mosquitto did not accept connections on port {port} within {timeout_s} s; log:\n"
        + log_file.read_text(errors="replace")
    )


def _stop(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=timeout_s)


@contextmanager
def run_mosquitto(
    workdir: Path,
    *,
    cafile: Path,
    certfile: Path,
    keyfile: Path,
    acl: str | None = None,
    config: Callable[[int], str] | None = None,
    startup_timeout_s: float = 10.0,
) -> Iterator[MosquittoBroker]:
    """Start Mosquitto with a mutual-TLS listener; stop it and print its log on exit.

    ``acl`` is the text of an ACL file (without one, every authenticated client may
    use every topic). ``config``, given the chosen port, returns a whole mosquitto.conf
    to use instead of :func:`mosquitto_config` (for a production config rewritten to
    test paths; it must listen on ``HOST`` and names its own ACL file, so ``acl`` must
    be None). Retries on a fresh port if another process took the chosen one.
    """
    if config is not None and acl is not None:
        raise ValueError("pass the ACL inside config's text, not as acl")
    if not MOSQUITTO.exists():
        raise MosquittoError(
            f"{MOSQUITTO} not found; install mosquitto: apt-get install -y mosquitto"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    acl_file = None
    if acl is not None:
        acl_file = workdir / "acl"
        acl_file.write_text(acl)
    for _ in range(3):
        port = unused_port()
        if config is not None:
            text = config(port)
        else:
            text = mosquitto_config(
                port=port, cafile=cafile, certfile=certfile, keyfile=keyfile, acl_file=acl_file
            )
        process, config_file, log_file = _start(workdir, port, text, startup_timeout_s)
        if process.poll() is None:
            break
        log_text = log_file.read_text(errors="replace")
        if "Address already in use" not in log_text:
            raise MosquittoError(f"mosquitto exited with {process.returncode}; log:\n{log_text}")
    else:
        raise MosquittoError("mosquitto found no free port in 3 attempts")
    broker = MosquittoBroker(
        host=HOST,
        port=port,
        config_file=config_file,
        log_file=log_file,
        cafile=cafile,
        acl_file=acl_file,
        pid=process.pid,
    )
    try:
        yield broker
    finally:
        _stop(process, timeout_s=10.0)
        # Captured by pytest and shown only when the test fails.
        print(f"--- mosquitto log ({log_file}) ---\n{broker.log_text()}")
