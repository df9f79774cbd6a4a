"""Time spent in DDP's gradient all-reduce, measured by a communication hook.

:class:`CommTimer` wraps DDP's default hook (``allreduce_hook``, which divides each
bucket by the world size and sums it across ranks, as DDP does without a hook: the
gradients are unchanged) and notes when each bucket's all-reduce starts and when its
result is ready. Buckets overlap, so the time reported is the union of those intervals:
the wall time during which at least one all-reduce was in flight.

On the CPU (gloo) the times are the host clock's, taken when the hook runs and when the
all-reduce's future completes. On CUDA (NCCL) the future completes as soon as the work
is queued, so the times are CUDA events instead: the start recorded on the stream that
produced the bucket, the end on the stream the reduced bucket is ready on, read once at
the end of the round.

FSDP2 offers no such hook around its reduce-scatters, so its communication time is not
measured (reported as None rather than estimated).
"""

# Without postponed annotations: DDP checks the hook's annotations as real objects.

import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket  # dist.GradBucket, as mypy sees it
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from regional_agent.handoff.utilization import union_seconds

__all__ = ["CommTimer"]


class CommTimer:
    """The all-reduce time of one DDP model, per round (:meth:`start`, :meth:`seconds`)."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._lock = threading.Lock()
        self._intervals: list[tuple[Any, Any]] = []
        self._origin: Any = None

    def attach(self, ddp: DistributedDataParallel) -> None:
        """Register as ``ddp``'s communication hook (before its first forward)."""
        ddp.register_comm_hook(ddp.process_group, self.hook)

    def start(self) -> None:
        """Forget what was measured so far: a new round begins."""
        with self._lock:
            self._intervals = []
            self._origin = self._now()

    def seconds(self) -> float:
        """The wall seconds with an all-reduce in flight since :meth:`start`.

        On CUDA this waits for the device to finish the work queued so far.
        """
        with self._lock:
            intervals, origin = list(self._intervals), self._origin
        if self._cuda:
            torch.cuda.synchronize()
            intervals = [
                (origin.elapsed_time(a) / 1000.0, origin.elapsed_time(b) / 1000.0)
                for a, b in intervals
            ]
        return union_seconds(intervals)

    def hook(
        self, state: dist.ProcessGroup, bucket: GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        """DDP's default all-reduce of ``bucket``, timed."""
        started = self._now()
        reduced = allreduce_hook(state, bucket)

        def finished(future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            ended = self._now()
            with self._lock:
                self._intervals.append((started, ended))
            return future.value()

        return reduced.then(finished)

    def _now(self) -> Any:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            return event
        return time.perf_counter()
