"""A real Slurm cluster on this machine for tests: munged, slurmctld and two slurmd.

Two nodes (``gfnode1``, ``gfnode2``) are aliases of this host (``NodeHostname`` is its
name, ``NodeAddr`` 127.0.0.1), each slurmd on its own port (``slurmd -N``), one CPU each.
Every daemon runs in the foreground as a child of the test, with its own munge key and
socket, configuration, state and logs under the test's directory; clients find them by
``SLURM_CONF``. Needs root and Debian's ``slurm-wlm`` and ``munge``
(``scripts/install-system-deps.sh``); without them the test fails saying so.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from geofed.ports import unused_port

NODES = ("gfnode1", "gfnode2")
_BINARIES = ("munged", "slurmctld", "slurmd", "srun", "salloc", "scancel", "scontrol", "sinfo")


@dataclass(frozen=True, slots=True)
class SlurmCluster:
    root: Path
    conf: Path

    @property
    def env(self) -> dict[str, str]:
        """Client environment: this cluster's configuration."""
        return {"SLURM_CONF": str(self.conf)}

    def logs(self) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            parts.append(f"--- {path.name} ---\n{path.read_text(errors='replace')[-2000:]}")
        return "\n".join(parts)


def _free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = unused_port()
        if port not in ports:
            ports.append(port)
    return ports


def _config(root: Path, host: str, ports: list[int]) -> str:
    ctld, slurmd, *node_ports = ports
    nodes = "\n".join(
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=1 State=UNKNOWN"
        for name, port in zip(NODES, node_ports, strict=True)
    )
    return f"""\
ClusterName=geofedtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={slurmd}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/ctld
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
PlugStackConfig={root}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
ReturnToService=2
{nodes}
PartitionName=geofed Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def slurm_cluster(root: Path) -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and a slurmd per node under ``root``; stop them after."""
    missing = [name for name in _BINARIES if shutil.which(name) is None]
    if missing:
        pytest.fail(
            f"Slurm test needs {', '.join(missing)}: run scripts/install-system-deps.sh "
            "(apt-get install slurm-wlm munge)"
        )
    if os.geteuid() != 0:
        pytest.fail("the Slurm test runs slurmd, which needs root")
    for sub in ("munge", "ctld", "log", *(f"spool/{n}" for n in NODES)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "munge").chmod(0o700)
    key = root / "munge" / "key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o400)
    (root / "plugstack.conf").touch()
    conf = root / "slurm.conf"
    conf.write_text(_config(root, socket.gethostname(), _free_ports(2 + len(NODES))))
    cluster = SlurmCluster(root, conf)
    env = {**os.environ, **cluster.env}
    log = root / "log"
    with ExitStack() as stack:

        def daemon(name: str, *argv: str) -> subprocess.Popen[bytes]:
            with (log / f"{name}.out").open("wb") as out:
                proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
            stack.callback(_stop, proc)
            return proc

        m = root / "munge"
        daemon(
            "munged",
            *("munged", "--foreground", "--force", f"--socket={m}/sock"),
            *(f"--key-file={key}", f"--pid-file={m}/pid", f"--seed-file={m}/seed"),
            f"--log-file={log}/munged.log",
        )
        _wait_for(lambda: (m / "sock").exists(), 10, "munged did not start", cluster)
        daemon("slurmctld", "slurmctld", "-D", "-i", "-f", str(conf))
        for node in NODES:
            daemon(f"slurmd-{node}", "slurmd", "-D", "-N", node, "-f", str(conf))
        _wait_for(lambda: _idle_nodes(env) == len(NODES), 30, "nodes not idle", cluster)
        yield cluster


def _idle_nodes(env: dict[str, str]) -> int:
    done = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True, timeout=10
    )
    return done.stdout.split().count("idle") if done.returncode == 0 else 0


def _wait_for(
    ready: Callable[[], bool], timeout_s: float, what: str, cluster: SlurmCluster
) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(f"Slurm test cluster: {what} after {timeout_s} s\n{cluster.logs()}")
        time.sleep(0.2)
