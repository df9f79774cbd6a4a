"""One rank of a region's worker group: the process.

Run by a launcher as ``python -m regional_agent.worker.rank --workdir DIR --backend B ...``
under torch's elastic launcher, which sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` and ``TORCHELASTIC_RESTART_COUNT``.

The process joins the group (head node first: :func:`head_first_ranks`), sends its output
to its rank log, reports itself in ``ranks/``, and serves rounds
(:class:`~regional_agent.worker.runner.RoundRunner`) until a stop: the stop file,
SIGTERM/SIGINT/SIGHUP (:class:`StopSignals`), or its launcher gone.

Exit codes: 0 stopped on request, 1 failed (the traceback is in the rank's log), 2 bad
arguments.

"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from types import FrameType

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore
from torch.distributed.rendezvous import rendezvous

from geofed.process_exit import exit_without_teardown
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.messages import RankStatus
from regional_agent.handoff.settings import (
    LAUNCH_ID_ENV,
    WorkerSettings,
    head_first_ranks,
    is_head_node,
)
from regional_agent.worker.runner import RoundRunner

log = logging.getLogger("regional_agent.worker.rank")


class StopSignals:
    """Turns termination signals and the loss of the launcher into a stop wish."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._parent = os.getppid()

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        del frame
        self.signal = signum

    def reason(self) -> str | None:
        if self.signal is not None:
            return f"received {signal.Signals(self.signal).name}"
        if os.getppid() != self._parent:
            return "the launcher exited"
        return None


def _join(backend: str, head: bool, timeout: timedelta, device: torch.device) -> tuple[int, int]:
    """Join the process group with the head node's ranks first; return (rank, world size).

    Every rank publishes whether it is on the head node in the launcher's store
    (``MASTER_ADDR``/``MASTER_PORT``, the ``env://`` rendezvous), then all take their
    renumbered rank in a process group over that same store.
    """
    # A store of this attempt's own (the launcher disables sharing the rendezvous
    # store), so no key of an earlier attempt is read.
    store, launcher_rank, world_size = next(rendezvous("env://", timeout=timeout))
    store.set(f"geofed/head/{launcher_rank}", "1" if head else "0")
    keys = [f"geofed/head/{r}" for r in range(world_size)]
    store.wait(keys, timeout)
    heads = [store.get(key) == b"1" for key in keys]
    rank = head_first_ranks(heads)[launcher_rank]
    dist.init_process_group(
        backend,
        store=PrefixStore("geofed/pg", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    return rank, world_size


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise SystemExit(f"worker: {name} is not set; run under torch.distributed.run")
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"worker: {name}={raw!r} is not an integer") from None


def _redirect_output(path: os.PathLike[str] | str) -> None:
    """Send this process's stdout and stderr (C++ messages included) to its rank log."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _device(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _warm_up() -> None:
    """Pay one-time lazy imports now, at start-up, rather than in the first round.

    Building the first optimizer imports torch._dynamo, which takes seconds.
    """
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])


def _report_ready(handoff: HandoffDir, status: RankStatus) -> None:
    """Every rank records its own status; rank 0 also writes every rank's into the
    hand-off directory, where the agent counts them, stamped with its launch (a collective)."""
    handoff.write_rank_status(status)
    statuses: list[RankStatus | None] = [None] * status.world_size
    dist.all_gather_object(statuses, status)
    if status.rank != 0:
        return
    for other in statuses:
        if other is not None and other.rank != 0:
            handoff.write_rank_status(replace(other, launch_id=status.launch_id))


def main(argv: Sequence[str] | None = None) -> int:
    """Run one rank until a stop is requested; return the process exit code."""
    settings = WorkerSettings.from_argv(argv)
    _env_int("RANK")  # fail early outside the elastic launcher
    local_rank = _env_int("LOCAL_RANK")
    restart_count = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    launch_id = os.environ.get(LAUNCH_ID_ENV, "")
    torch.set_num_threads(settings.num_threads)
    device = _device(settings.backend, local_rank)
    timeout = timedelta(seconds=settings.collective_timeout_s)
    # The rank is known only once joined; until then output goes to the launcher's log.
    rank, world_size = _join(settings.backend, is_head_node(os.environ), timeout, device)
    # On the head node this is the hand-off directory; on the others a node-local
    # directory of the same path, for this rank's log and status only.
    handoff = HandoffDir(settings.workdir)
    handoff.log_dir.mkdir(parents=True, exist_ok=True)
    _redirect_output(handoff.rank_log_path(rank))
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    log.info(
        "worker pid %d rank %d/%d launch %s restart %d",
        os.getpid(),
        rank,
        world_size,
        launch_id,
        restart_count,
    )
    stop = StopSignals()
    stop.install()
    status = RankStatus(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        pid=os.getpid(),
        launch_id=launch_id,
        restart_count=restart_count,
        backend=settings.backend,
        device=str(device),
        state="starting",
    )
    handoff.write_rank_status(status)
    _warm_up()
    _report_ready(handoff, replace(status, state="ready"))
    try:
        RoundRunner(handoff, settings, device, stop.reason).serve()
    except Exception:
        log.exception("worker failed")
        return 1
    # Every rank reaches the teardown before any leaves: FSDP's groups abort the
    # process when torn down under a peer that is still using them.
    dist.barrier()
    dist.destroy_process_group()
    log.info("worker stopped cleanly")
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
