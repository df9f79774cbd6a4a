"""torch's elastic launcher with the ranks forked from a process that has imported them.

``python -m regional_agent.launch.forking_run`` takes ``torch.distributed.run``'s own
command line (parsed by torch's parser, so every option means what it means there), with
``--module regional_agent.worker.rank`` as the script. Before it launches anything it
imports the rank's modules (torch, torch.distributed's checkpointing, torch._dynamo, which
the first optimizer imports), then runs torch's elastic agent with
:func:`regional_agent.worker.rank.main` as a function entrypoint, started with ``fork``:
every rank, and every in-place restart of the group, starts with those imports done (about
4 CPU seconds a rank on a CPU core) instead of paying them in a fresh interpreter.

Only CPU (gloo) groups are launched this way: a process must not fork once CUDA is
initialised, and NCCL groups keep ``torch.distributed.run``, whose ranks are fresh
interpreters. The launcher itself runs no torch operation before it forks (no thread
pool to inherit); each rank sets its own thread count.

A forked rank keeps the launcher's command line: tell ranks from launchers by descent
(a rank's parent is its launcher), as
:func:`regional_agent.launch.spec.is_launcher_command` cannot.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from regional_agent.launch.spec import RANK_MODULE

#: Imported before the first fork (each a few hundred ms to seconds of CPU): the rank's
#: module and everything it imports, and what the rank's first optimizer imports.
PRELOADED = (RANK_MODULE, "torch._dynamo")


def _serve(*argv: str) -> None:
    """One rank: :func:`regional_agent.worker.rank.main`, its exit code as the process's.

    A rank that stopped returns, and torch's wrapper hands its return value to the
    launcher, which ends the group once every rank has (a stop file, a signal to one rank).
    One whose launcher is gone leaves at once: the wrapper would wait for the launcher to
    read the value, forever.
    """
    rank = importlib.import_module(RANK_MODULE)
    launcher = os.getppid()
    code = rank.main(argv)
    if os.getppid() != launcher:
        # Not exit_without_teardown: the atexit handlers of a forked process are its
        # launcher's (multiprocessing's own children leave this way too).
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    if code:
        raise SystemExit(code)


def _release_returned_ranks_on_close() -> None:
    """Let a closing launcher's ranks exit as soon as they return.

    A rank forked by torch's elastic agent waits, after its function returned, for an
    event the agent sets once it has read every rank's return value; an agent closing the
    group (SIGTERM to the launcher, its parent gone) reads none, so every rank that
    stopped on the SIGTERM it was sent would wait for the SIGKILL at the end of the
    shutdown timeout. The return values travel through pipes the rank writes before it
    waits, so nothing is lost by letting them go. Set from a thread of its own: torch warns
    that setting the event can block when a rank died while waiting on it.
    """
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

    close = MultiprocessContext._close

    def _close(self: MultiprocessContext, death_sig: signal.Signals, timeout: int = 30) -> None:
        finished = getattr(self, "_worker_finished_event", None)
        if finished is not None:
            threading.Thread(target=finished.set, name="release-ranks", daemon=True).start()
        close(self, death_sig, timeout)

    MultiprocessContext._close = _close  # type: ignore[method-assign]


def main(argv: Sequence[str] | None = None) -> None:
    """Parse ``argv`` as ``torch.distributed.run`` does and launch forked ranks."""
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    args = get_args_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    if not args.module or args.training_script != RANK_MODULE:
        raise SystemExit(
            f"forking_run launches --module {RANK_MODULE} only, not {args.training_script!r}"
        )
    config, _command, _command_args = config_from_args(args)
    config.start_method = "fork"
    _release_returned_ranks_on_close()
    for name in PRELOADED:
        importlib.import_module(name)
    elastic_launch(config, _serve)(*args.training_script_args)


if __name__ == "__main__":
    main()
