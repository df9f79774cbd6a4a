"""The region's retained status on ``regions/<region>/status``, kept fresh.

:class:`StatusReporter` holds what the agent is doing (state, job, round, the hash of
the θ it trained from, train loss, worker restarts, a detail line) and publishes it,
retained with QoS 1, whenever it changes and every ``interval_s`` besides (so
``sent_at`` and the restart count stay current). The broker's Last Will and the goodbye
on a clean stop carry ``offline`` (:meth:`StatusReporter.offline`). Publishing never
blocks the caller: :meth:`update` only records and wakes the publishing task.

Listeners (:meth:`StatusReporter.add_listener`) hear every change at once, in the
caller's task: the daemon turns them into systemd ``STATUS=`` lines (:func:`describe`).

Every live status carries the region's capacity (:func:`probe_capacity`: the visible
accelerators from ``torch.cuda``, and the worker group's ranks as CPU worker slots),
probed once, off the event loop, before the first publication; and the node's hardware
as last read (``hardware``: the agent's :func:`regional_agent.telemetry.node.summarize`),
read again before a publication when it is older than a few seconds.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import geofed
from geofed.control import (
    Capacity,
    ControlClient,
    ControlError,
    HardwareSummary,
    Publication,
    RegionStatus,
    Topics,
    encode,
)
from geofed.control.messages import RegionState
from geofed.timeouts import wait_event

log = logging.getLogger(__name__)

AGENT_VERSION = f"geofed-agent/{geofed.__version__}"
_FIELDS = frozenset({"state", "job", "round", "params_hash", "train_loss", "detail", "refused"})

Listener = Callable[[RegionStatus], None]


class StatusReporter:
    """Publishes the region's status (see the module docstring)."""

    def __init__(
        self,
        control: ControlClient,
        topics: Topics,
        region: str,
        *,
        interval_s: float,
        timeout_s: float,
        restarts: Callable[[], int] = lambda: 0,
        capacity: Callable[[], Capacity | None] = lambda: None,
        hardware: Callable[[], Awaitable[HardwareSummary | None]] | None = None,
    ) -> None:
        self._control = control
        self._topic = topics.region_status(region)
        self._region = region
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._restarts = restarts
        self._fields: dict[str, Any] = {"state": "online", "detail": "starting"}
        self._changed = asyncio.Event()
        self._changed.set()
        self._listeners: list[Listener] = []
        self._restarts_seen = 0
        self._probe = capacity
        self._capacity: Capacity | None = None
        self._probed = False
        self._read_hardware = hardware
        self._hardware: HardwareSummary | None = None
        #: The last status the broker acknowledged (tests and logs read it).
        self.published: RegionStatus | None = None
        # This run of the agent, and how many statuses it published: the coordinator
        # orders them by that count, whatever this host's clock says.
        self._boot = uuid.uuid4().hex
        self._seq = 0

    @property
    def topic(self) -> str:
        return self._topic

    @property
    def state(self) -> RegionState:
        state: RegionState = self._fields["state"]
        return state

    def current(self, worker_restarts: int = 0) -> RegionStatus:
        return RegionStatus(
            region=self._region,
            agent_version=AGENT_VERSION,
            worker_restarts=worker_restarts,
            capacity=self._capacity,
            hardware=self._hardware,
            boot=self._boot,
            seq=max(self._seq, 1),
            **self._fields,
        )

    def update(self, state: RegionState, **fields: Any) -> None:
        """Record a new status; fields not given keep their values, ``detail`` and
        ``refused`` reset."""
        unknown = set(fields) - _FIELDS
        if unknown:
            raise ValueError(f"unknown status fields {sorted(unknown)}")
        detail = fields.pop("detail", "")
        fields["refused"] = bool(fields.get("refused", False))
        loss = fields.get("train_loss")
        if loss is not None and not math.isfinite(loss):
            # JSON has no NaN; a diverged loss is said in words.
            fields["train_loss"] = None
            detail = f"{detail} (train loss {loss})".strip()
        new = {**self._fields, **fields, "state": state, "detail": detail[:4096]}
        if new != self._fields:
            self._fields = new
            log.info("status %s %s", state, detail, extra={"status": dict(new)})
            self._changed.set()
            self._tell_listeners()

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(status)`` now and after every change (it must not block)."""
        self._listeners.append(listener)
        self._call(listener, self.current(self._restarts_seen))

    def _tell_listeners(self) -> None:
        status = self.current(self._restarts_seen)
        for listener in self._listeners:
            self._call(listener, status)

    @staticmethod
    def _call(listener: Listener, status: RegionStatus) -> None:
        try:
            listener(status)
        except Exception:  # a listener's failure must not fail the agent's state change
            log.exception("status listener %r failed", listener)

    def offline(self, detail: str = "") -> Publication:
        """The ``offline`` status, for the goodbye."""
        return offline_status(self._topic, self._region, detail)

    async def publish_now(self) -> None:
        """Publish the current status once (raises ``ControlError`` if not acknowledged)."""
        if not self._probed:
            try:
                self._capacity = await asyncio.to_thread(self._probe)
            except Exception:  # an unreadable device leaves the capacity unknown, not the agent
                log.exception("cannot read this region's capacity; reporting none")
            self._probed = True
        if self._read_hardware is not None:
            try:
                self._hardware = await self._read_hardware() or self._hardware
            except Exception:  # the node unread leaves its last figures, not the status
                log.exception("cannot read this node's hardware for the status")
        restarts = await asyncio.to_thread(self._restarts)
        self._restarts_seen = restarts
        self._seq += 1
        status = self.current(restarts)
        await self._control.publish(
            self._topic, encode(status), retain=True, timeout_s=self._timeout_s
        )
        self.published = status

    async def run(self) -> None:
        """Publish on every change and every ``interval_s``, until cancelled."""
        while True:
            await wait_event(self._changed, self._interval_s)
            self._changed.clear()
            try:
                await self.publish_now()
            except ControlError as exc:
                log.warning("status not published: %s", exc)

    def mark_stale(self) -> None:
        """Publish again soon (after a reconnect: a Last Will may have replaced ours)."""
        self._changed.set()


def describe(status: RegionStatus) -> str:
    """One line for humans: ``training job llm round 3: 50 steps``."""
    line: str = status.state
    if status.job is not None:
        line += f" job {status.job}"
        if status.round is not None:
            line += f" round {status.round}"
    if status.detail:
        line += f": {status.detail}"
    return line


def offline_status(topic: str, region: str, detail: str = "") -> Publication:
    """The retained ``offline`` status of ``region``: the Last Will and the goodbye."""
    status = RegionStatus(
        region=region, state="offline", agent_version=AGENT_VERSION, detail=detail
    )
    return Publication(topic, encode(status), retain=True)


def probe_capacity(workers: int | str, backend: str = "auto") -> Capacity:
    """This host's capacity: visible CUDA devices (kind, count, memory) and worker slots.

    ``workers`` is the agent's ``workers.count``: a number of ranks, or ``auto`` (one per
    visible GPU on nccl, 2 on gloo, as the launcher resolves it). Blocking (imports torch,
    reads the devices): call it off the event loop.
    """
    import torch  # heavy: imported only where the agent first reports its capacity

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    kind: str | None = None
    memory = 0.0
    if gpus:
        props = torch.cuda.get_device_properties(0)
        kind = str(props.name)
        memory = round(props.total_memory / 2**30, 1)
    return Capacity(
        gpus=gpus,
        gpu_kind=kind,
        gpu_memory_gib=memory,
        cpu_slots=worker_slots(workers, backend, gpus),
    )


def worker_slots(workers: int | str, backend: str, gpus: int) -> int:
    """The ranks of the worker group: ``workers.count``, with ``auto`` resolved."""
    if isinstance(workers, int):
        return workers
    nccl = backend == "nccl" or (backend == "auto" and gpus > 0)
    return gpus if nccl and gpus > 0 else 2
