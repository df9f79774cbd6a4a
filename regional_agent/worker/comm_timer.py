"""Time a rank spends with its data-parallel collectives in flight.

:class:`CommTimer` notes when each collective starts and when its result is ready, and
reports the union of those intervals: the wall time during which at least one was in
flight (buckets and layers overlap). Two ways in, both leaving what the ranks compute
unchanged:

- DDP: a communication hook (:meth:`CommTimer.attach`) wrapping DDP's default
  ``allreduce_hook``, which divides each bucket by the world size and sums it across
  ranks, as DDP does without a hook;
- FSDP2: the all-gathers and reduce-scatters of every ``fully_shard`` unit
  (:meth:`CommTimer.attach_fsdp`, through FSDP2's ``set_custom_all_gather`` and
  ``set_custom_reduce_scatter``), each the same ``all_gather_single`` or
  ``reduce_scatter_single`` call into a ``torch.empty`` buffer that FSDP2 makes by
  default;
- HSDP: besides, the all-reduce between the replicas, which FSDP2 issues itself right
  after a unit's reduce-scatter and which has no entry of its own: from the end of the
  reduce-scatter (or, where a shard group is one rank and FSDP2 copies instead, from the
  allocation of its output, just before the copy) to the unit's all-reduce hook
  (``set_all_reduce_hook``), which FSDP2 calls once the all-reduce is done (on CUDA,
  queued on the all-reduce's stream after it).

On the CPU (gloo) the times are the host clock's, taken when the collective is called and
when its result is ready. On CUDA (NCCL) a collective returns once queued, so the times are
CUDA events instead: recorded on the stream the collective is issued on (DDP: the stream
that produced the bucket, then the one the reduced bucket is ready on). What is kept stays
small whatever the round's length (FSDP2 issues a few collectives per unit and
micro-batch): every :data:`COMPACT_AT` intervals noted, those that have completed (on CUDA,
whose events have) are merged into disjoint intervals in seconds, and the merged ones that
nothing in flight can overlap are added up; the rest are read at the end of the round. An
FSDP2 collective issued asynchronously on CUDA (FSDP2's
``unshard_async_op``, which geofed never sets) has no event marking its end: the round's
time is then not measured (None), rather than estimated.
"""

# Without postponed annotations: DDP checks the hook's annotations as real objects.

import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import GradBucket  # dist.GradBucket, as mypy sees it
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.nn.parallel import DistributedDataParallel

from regional_agent.handoff.utilization import merged_intervals, union_seconds

__all__ = ["COMPACT_AT", "CommTimer"]

#: Intervals noted between two merges of the completed ones.
COMPACT_AT = 256


class CommTimer:
    """The collective time of one wrapped model, per round (:meth:`start`, :meth:`seconds`)."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._lock = threading.Lock()
        self._open: dict[int, Any] = {}
        """The starts of the collectives in flight, by the order they were issued in."""
        self._issued = 0
        self._noted = 0
        self._intervals: list[tuple[Any, Any]] = []
        """Noted and not merged yet: host clock readings, or CUDA events."""
        self._merged: list[tuple[float, float]] = []
        """Completed, in seconds (from :attr:`_origin` on CUDA), disjoint, in order."""
        self._folded_s = 0.0
        """The length of the merged intervals nothing in flight or to come can overlap."""
        self._origin: Any = None
        self._unmeasured = False

    def attach(self, ddp: DistributedDataParallel) -> None:
        """Register as ``ddp``'s communication hook (before its first forward)."""
        ddp.register_comm_hook(ddp.process_group, self.hook)

    def attach_fsdp(self, modules: Iterable[nn.Module], *, replicated: bool = False) -> None:
        """Time the all-gathers and reduce-scatters of every FSDP2 module in ``modules``,
        and, ``replicated`` (HSDP), the all-reduce between the replicas."""
        for module in modules:
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(_TimedAllGather(self))
                scatter = _TimedReduceScatter(self, replicated)
                module.set_custom_reduce_scatter(scatter)
                if replicated:
                    module.set_all_reduce_hook(scatter.all_reduced)

    def start(self) -> None:
        """Forget what was measured so far: a new round begins."""
        with self._lock:
            self._open = {}
            self._intervals = []
            self._merged = []
            self._folded_s = 0.0
            self._origin = self._now()
            self._unmeasured = False

    def seconds(self) -> float | None:
        """The wall seconds with a collective in flight since :meth:`start`; None when a
        collective's end could not be marked (see the module's docstring).

        On CUDA this waits for the device to finish the work queued so far.
        """
        if self._cuda:
            torch.cuda.synchronize()
        with self._lock:
            if self._unmeasured:
                return None
            noted = [*self._merged, *(self._in_seconds(i) for i in self._intervals)]
            return self._folded_s + union_seconds(noted)

    def hook(
        self, state: dist.ProcessGroup, bucket: GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        """DDP's default all-reduce of ``bucket``, timed."""
        started, token = self._begin()
        reduced = allreduce_hook(state, bucket)

        def finished(future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            self._note(token, started, self._now())
            return future.value()

        return reduced.then(finished)

    def issue(self, collective: Callable[[], dist.Work | None]) -> dist.Work | None:
        """Call ``collective`` and note its interval: until it returns, or, when it returns
        a work in flight (an asynchronous call), until that work completes."""
        started, token = self._begin()
        work = collective()
        if work is None:
            self._note(token, started, self._now())
        elif self._cuda:
            with self._lock:
                self._open.pop(token, None)
                self._unmeasured = True
        else:
            work.get_future().then(lambda _: self._note(token, started, self._now()))
        return work

    def open_interval(self) -> tuple[Any, int]:
        """Start an interval now, for a collective no call of ours issues (HSDP's
        all-reduce): its start and token, for :meth:`close_interval` or :meth:`drop`."""
        return self._begin()

    def close_interval(self, token: int, started: Any) -> None:
        """End now the interval :meth:`open_interval` started (dropped if a round began
        in between)."""
        self._note(token, started, self._now())

    def drop(self, token: int) -> None:
        """Forget an interval that did not happen (no all-reduce came after it)."""
        with self._lock:
            self._open.pop(token, None)

    def _begin(self) -> tuple[Any, int]:
        started = self._now()
        with self._lock:
            self._issued += 1
            self._open[self._issued] = started
            return started, self._issued

    def _note(self, token: int, started: Any, ended: Any) -> None:
        with self._lock:
            if self._open.pop(token, None) is None:
                return  # issued before start(): another round's
            self._intervals.append((started, ended))
            self._noted += 1
            if self._noted % COMPACT_AT == 0:
                self._compact()

    def _compact(self) -> None:
        """Merge the completed intervals noted, and fold those that nothing in flight or
        to come can overlap into :attr:`_folded_s` (under the lock).

        A collective issued later starts after every end read now; one in flight, or
        noted but not read yet, started at its start if that has been recorded, else
        later too.
        """
        done: list[tuple[Any, Any]] = []
        pending: list[tuple[Any, Any]] = []
        for interval in self._intervals:
            (done if all(map(self._recorded, interval)) else pending).append(interval)
        self._intervals = pending
        merged = merged_intervals([*self._merged, *(self._in_seconds(i) for i in done)])
        starts = [*self._open.values(), *(start for start, _ in pending)]
        cutoff = min(
            (self._at(start) for start in starts if self._recorded(start)), default=math.inf
        )
        self._folded_s += sum(end - start for start, end in merged if end < cutoff)
        self._merged = [interval for interval in merged if interval[1] >= cutoff]

    def _recorded(self, mark: Any) -> bool:
        return not self._cuda or bool(self._origin.query() and mark.query())

    def _at(self, mark: Any) -> float:
        return float(self._origin.elapsed_time(mark) / 1000.0) if self._cuda else float(mark)

    def _in_seconds(self, interval: tuple[Any, Any]) -> tuple[float, float]:
        return self._at(interval[0]), self._at(interval[1])

    def _now(self) -> Any:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            return event
        return time.perf_counter()


class _TimedComm:
    """What FSDP2's default collectives share: a ``torch.empty`` buffer, and the timer."""

    def __init__(self, timer: CommTimer) -> None:
        self._timer = timer

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class _TimedAllGather(_TimedComm, AllGather):
    """FSDP2's default all-gather, timed."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        return self._timer.issue(
            lambda: dist.all_gather_single(
                output_tensor, input_tensor, group=group, async_op=async_op
            )
        )


class _TimedReduceScatter(_TimedComm, ReduceScatter):
    """FSDP2's default reduce-scatter, timed; ``replicated`` (HSDP): the all-reduce after
    it too, from its end (or its output's allocation) to :meth:`all_reduced`."""

    def __init__(self, timer: CommTimer, replicated: bool = False) -> None:
        super().__init__(timer)
        self._replicated = replicated
        self._reduce: tuple[Any, int] | None = None  # the all-reduce to come: start, token

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        output = super().allocate(size, dtype=dtype, device=device)
        if self._replicated:
            self._expect_reduce()  # a shard group of one rank copies, then all-reduces
        return output

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        work = self._timer.issue(
            lambda: dist.reduce_scatter_single(
                output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op
            )
        )
        if self._replicated and not async_op:
            self._expect_reduce()  # the all-reduce starts where the reduce-scatter ended
        return work

    def all_reduced(self, output: torch.Tensor) -> None:
        """FSDP2's all-reduce hook: the all-reduce between the replicas is done."""
        if self._reduce is not None:
            started, token = self._reduce
            self._reduce = None
            self._timer.close_interval(token, started)

    def _expect_reduce(self) -> None:
        if self._reduce is not None:  # one that did not come (a micro-batch without it)
            self._timer.drop(self._reduce[1])
        self._reduce = self._timer.open_interval()
