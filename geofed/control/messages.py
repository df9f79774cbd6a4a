"""Control-plane message schemas and their wire form.

Every message is a strict pydantic model (unknown keys refused, no silent coercion)
carrying a ``type`` discriminator, a ``message_id`` (UUID) and a ``sent_at`` timestamp
(timezone-aware, normalised to UTC). The wire form is UTF-8 JSON; :func:`decode` turns
any payload that is not a valid message of the expected type into a
:class:`~geofed.control.errors.MessageError` and never raises anything else.

QoS 1 delivers at least once, and a retained message comes again after every
resubscription, so receivers drop repeats with a :class:`Deduplicator` keyed by
``message_id``.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, Self, TypeVar
from uuid import UUID, uuid4

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    model_serializer,
    model_validator,
)

from geofed.codec_params import CodecParams
from geofed.control.errors import MessageError
from geofed.evaluation_config import EvaluationConfig
from geofed.outer_step_config import OuterOptimizerConfig
from geofed.training_config import TrainingConfig
from geofed.types import validate_name

#: Payloads above this are refused before parsing; control messages are small.
MAX_PAYLOAD_BYTES = 256 * 1024
#: Defaults are for senders; a received message must carry its own envelope, else
#: de-duplication and ordering would run on values made up at the receiver.
_ENVELOPE = frozenset({"type", "message_id", "sent_at"})


def _utc_now() -> datetime:
    return datetime.now(UTC)


_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


def _traceparent_or_none(value: object) -> object:
    """A W3C ``traceparent``, or None for anything else: a trace that cannot be read
    costs the round's spans their parent, never the round."""
    return value if isinstance(value, str) and _TRACEPARENT.fullmatch(value) else None


def _as_tuple(value: Any) -> Any:
    # Strict mode wants a tuple in Python; callers naturally pass lists.
    return tuple(value) if isinstance(value, list) else value


RegionName = Annotated[str, AfterValidator(lambda v: validate_name("region", v))]
JobName = Annotated[str, AfterValidator(lambda v: validate_name("job", v))]
DatasetName = Annotated[str, AfterValidator(lambda v: validate_name("dataset", v))]
UtcDatetime = Annotated[AwareDatetime, AfterValidator(lambda v: v.astimezone(UTC))]
Sha256Hex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Text = Annotated[str, StringConstraints(max_length=4096)]
RoundNumber = Annotated[int, Field(ge=0, lt=2**63)]

Overlap = Literal["none", "delayed", "streaming"]
#: The overlap modes a job may ask for.
OVERLAP_MODES: tuple[str, ...] = ("none", "delayed", "streaming")
#: Where a delayed round starts: the region's own parameters, or the eager estimate.
OverlapStart = Literal["local", "eager"]

AnnouncedPhase = Literal["open", "closed", "done", "cancelled", "paused"]
"""``open``: regions train; ``closed``: no more deltas, aggregating; ``done``: the job
finished; ``cancelled``: the job was cancelled; ``paused``: regions hold until resumed."""

RegionState = Literal[
    "online", "offline", "training", "uploading", "syncing", "paused", "draining", "error"
]
CommandAction = Literal["pause", "resume", "cancel", "resync", "drain", "checkpoint"]


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)

    message_id: UUID = Field(default_factory=uuid4)
    sent_at: UtcDatetime = Field(default_factory=_utc_now)


class RoundAnnouncement(_Message):
    """Round ``round`` of ``job`` (retained on ``jobs/<job>/round``).

    Regions start from the parameters of ``base_round`` whose hash is ``base_hash``,
    reached by applying the update at ``update_url`` (manifest digest
    ``update_digest``); neither exists for round 0. ``training`` says how regions train
    and ``total_rounds`` how many rounds the job has, so a learning-rate schedule can run
    over the whole job; announcements that lack them train with the defaults, and a
    schedule that decays needs ``total_rounds``. ``evaluation`` says which regions
    evaluate the base parameters before training
    (:func:`geofed.evaluation_config.region_evaluates`); without it, the default.
    ``overlap`` is the job's overlap mode: under ``delayed`` a region starts the next
    round from its own parameters as soon as it has trained this one, and folds the
    next θ in when it comes (the protocol between regions and coordinator is the same).
    ``overlap_start`` ``eager`` makes it start instead from an estimate of the next θ
    (:mod:`geofed.eager_start`), for which it needs the job's ``outer_optimizer``;
    announcements that lack them start from the region's own parameters. ``streaming``
    overlaps as ``delayed`` does and round r synchronizes only fragment ``r mod
    fragments`` of the model (:mod:`geofed.fragments`): the delta and the update of the
    round name only that fragment's tensors.
    """

    type: Literal["round_announcement"] = "round_announcement"
    job: JobName
    round: RoundNumber
    base_round: RoundNumber
    base_hash: Sha256Hex
    update_url: Annotated[str, StringConstraints(min_length=1, max_length=2048)] | None = None
    update_digest: Sha256Hex | None = None
    participants: Annotated[tuple[RegionName, ...], BeforeValidator(_as_tuple)]
    min_regions: int = Field(ge=1)
    deadline: UtcDatetime
    deadline_s: float = Field(gt=0)
    inner_steps: int = Field(ge=1)
    codec: CodecParams
    task: Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")]
    task_options: dict[str, JsonValue] = Field(default_factory=dict)
    seed: int = Field(ge=0, lt=2**63)
    state: AnnouncedPhase
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    total_rounds: int | None = Field(default=None, ge=1, lt=2**63)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    overlap: Overlap = "none"
    overlap_start: OverlapStart = "local"
    #: F, the number of fragments a ``streaming`` job's model is split into; None otherwise.
    fragments: int | None = Field(default=None, ge=1, le=1024)
    #: The job's outer optimizer config; sent with ``overlap_start: eager`` only.
    outer_optimizer: OuterOptimizerConfig | None = None
    #: The job's regions, as its spec lists them: a region's data shard is its place among
    #: them (:meth:`data_shard`), whoever takes part in a round. Empty from coordinators
    #: that predate it; the participants then stand in.
    regions: Annotated[tuple[RegionName, ...], BeforeValidator(_as_tuple)] = ()
    #: The job's shard assignment: region -> its data shard slot, fixed while the region
    #: stays in the job (regions join and leave elastic jobs), out of ``shards`` slots.
    #: Empty (and ``shards`` None) from coordinators that predate it: a region's place
    #: among ``regions`` then stands in.
    assignment: dict[RegionName, Annotated[int, Field(ge=0, lt=2**31)]] = Field(
        default_factory=dict
    )
    shards: int | None = Field(default=None, ge=1, lt=2**31)
    #: The datasets each of the job's regions trains on (its spec, and the regions that
    #: joined it). Empty from coordinators that predate it: a region then reads every
    #: dataset its agent gives files for.
    datasets: dict[RegionName, tuple[DatasetName, ...]] = Field(default_factory=dict)
    #: The task's fingerprint as the coordinator read it (:meth:`geofed.task.Task.fingerprint`):
    #: a region whose workers read another refuses to train. None: the task reads no files.
    task_fingerprint: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    #: The W3C ``traceparent`` of the coordinator's span of this round, when it traces
    #: rounds (:mod:`geofed.tracing`): the regions' spans of the round go under it. Left
    #: out when None.
    trace: Annotated[str | None, BeforeValidator(_traceparent_or_none)] = None
    #: How many rounds behind a late delta the coordinator still merges into the round
    #: open when it comes (the job's ``aggregation.late: merge``); 0: it refuses late
    #: deltas (``round_closed``), as coordinators that predate it do.
    max_staleness: int = Field(default=0, ge=0, le=1024)

    @model_validator(mode="after")
    def _fragments_with_streaming(self) -> RoundAnnouncement:
        if (self.overlap == "streaming") != (self.fragments is not None):
            raise ValueError(
                f"fragments ({self.fragments}) is for overlap streaming only and streaming "
                f"needs it (overlap is {self.overlap!r})"
            )
        return self

    @model_serializer(mode="wrap")
    def _without_absent_fragments(
        self, handler: SerializerFunctionWrapHandler, info: SerializationInfo
    ) -> dict[str, Any]:
        # Left out unless set, so agents that predate these keys read every other
        # announcement (a job not streaming, rounds not traced, late deltas refused).
        data: dict[str, Any] = handler(self)
        if data.get("max_staleness") == 0:
            del data["max_staleness"]
        if data.get("fragments", 0) is None:
            del data["fragments"]
        if data.get("trace", "") is None:
            del data["trace"]
        return data

    def data_shard(self, region: str) -> tuple[int, int]:
        """``region``'s data shard: its slot in the job's assignment, and the slot count.

        Fixed by the job's assignment, so a region left out of a round (quarantined, a
        straggler), or another region joining or leaving the job, changes no other
        region's data. Without an assignment: its index among the job's regions.
        """
        if self.assignment and self.shards is not None:
            if region not in self.assignment:
                raise ValueError(
                    f"region {region!r} is not one of the job's regions {sorted(self.assignment)}"
                )
            return self.assignment[region], self.shards
        regions = sorted(self.regions or self.participants)
        if region not in regions:
            raise ValueError(f"region {region!r} is not one of the job's regions {regions}")
        return regions.index(region), len(regions)

    def _consistent_assignment(self) -> None:
        if (not self.assignment) != (self.shards is None):
            raise ValueError("assignment and shards go together")
        if not self.assignment or self.shards is None:
            return
        slots = list(self.assignment.values())
        if len(set(slots)) != len(slots):
            raise ValueError(f"assignment gives two regions one shard: {self.assignment}")
        if max(slots) >= self.shards:
            raise ValueError(f"assignment {self.assignment} names a shard beyond {self.shards}")
        if self.regions and set(self.assignment) != set(self.regions):
            raise ValueError("assignment and regions name different regions")
        if not set(self.participants) <= set(self.assignment):
            strangers = sorted(set(self.participants) - set(self.assignment))
            raise ValueError(f"participants {strangers} have no shard in the assignment")

    @property
    def total_steps(self) -> int | None:
        """The job's inner steps in all (rounds x H), if the job's length was announced."""
        return None if self.total_rounds is None else self.total_rounds * self.inner_steps

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.base_round > self.round:
            raise ValueError(f"base_round {self.base_round} is after round {self.round}")
        if (self.update_url is None) != (self.update_digest is None):
            raise ValueError("update_url and update_digest go together")
        if self.round == 0 and self.update_url is not None:
            raise ValueError("round 0 starts from the initial parameters; it has no update")
        if not self.participants:
            raise ValueError("participants must name at least one region")
        if len(set(self.participants)) != len(self.participants):
            raise ValueError("participants lists a region twice")
        if len(set(self.regions)) != len(self.regions):
            raise ValueError("regions lists a region twice")
        if self.regions and not set(self.participants) <= set(self.regions):
            strangers = sorted(set(self.participants) - set(self.regions))
            raise ValueError(f"participants {strangers} are not among the job's regions")
        if self.min_regions > len(self.participants):
            raise ValueError(
                f"min_regions {self.min_regions} exceeds {len(self.participants)} participants"
            )
        self._consistent_assignment()
        if self.total_rounds is None and self.training.lr_schedule.kind != "constant":
            raise ValueError(f"a {self.training.lr_schedule.kind} schedule needs total_rounds")
        return self


class Capacity(BaseModel):
    """What a region offers jobs (:attr:`RegionStatus.capacity`).

    ``gpus`` accelerators of one ``gpu_kind`` (the device name), each with
    ``gpu_memory_gib``; ``cpu_slots`` worker slots (the ranks of the agent's worker group,
    ``workers.count``). A CPU-only region has ``gpus`` 0.
    """

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)

    gpus: int = Field(default=0, ge=0, le=1_000_000)
    gpu_kind: Annotated[str, StringConstraints(min_length=1, max_length=128)] | None = None
    gpu_memory_gib: float = Field(default=0.0, ge=0, le=1e9)
    cpu_slots: int = Field(default=0, ge=0, le=1_000_000)


class HardwareSummary(BaseModel):
    """The agent's node as the agent last read it (:attr:`RegionStatus.hardware`).

    ``gpus`` read through NVML (None: no NVML on the node), their mean utilization, the
    hottest one's temperature, their uncorrectable ECC errors over their lives (summed),
    how many the hardware or heat slows down now, the critical XID errors they raised
    since the agent started; from the node's hardware history (kept across restarts), the
    uncorrectable ECC errors new since the agent first saw each GPU and the critical XID
    errors of the last day; the node's available memory and the free space of the agent's
    state disk. A figure no device reported is None (also the history's, from an agent
    that keeps none).
    """

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)

    host: Annotated[str, StringConstraints(min_length=1, max_length=255)]
    gpus: int | None = Field(default=None, ge=0, le=1_000_000)
    gpu_utilization: float | None = Field(default=None, ge=0, le=1)
    max_temperature_c: float | None = Field(default=None, ge=-273, le=1000)
    ecc_uncorrected: int | None = Field(default=None, ge=0, lt=2**63)
    slowed_gpus: int | None = Field(default=None, ge=0, le=1_000_000)
    xid_errors: int | None = Field(default=None, ge=0, lt=2**63)
    ecc_uncorrected_new: int | None = Field(default=None, ge=0, lt=2**63)
    xid_errors_recent: int | None = Field(default=None, ge=0, lt=2**63)
    memory_available_bytes: int | None = Field(default=None, ge=0, lt=2**63)
    state_disk_free_bytes: int | None = Field(default=None, ge=0, lt=2**63)

    def describe(self) -> str:
        """One line for humans: ``gpu-node-1: 8 GPUs 92% busy, hottest 71 °C, ...``."""
        parts = []
        if self.gpus is None:
            parts.append("no GPU read")
        else:
            gpus = f"{self.gpus} GPU{'' if self.gpus == 1 else 's'}"
            if self.gpu_utilization is not None:
                gpus += f" {self.gpu_utilization:.0%} busy"
            parts.append(gpus)
            if self.max_temperature_c is not None:
                parts.append(f"hottest {self.max_temperature_c:.0f} °C")
            if self.slowed_gpus:
                parts.append(f"{self.slowed_gpus} slowed down")
            if self.ecc_uncorrected:
                ecc = f"{self.ecc_uncorrected} uncorrectable ECC errors"
                if self.ecc_uncorrected_new:
                    ecc += f" ({self.ecc_uncorrected_new} new)"
                parts.append(ecc)
            if self.xid_errors:
                parts.append(f"{self.xid_errors} XID errors")
            if self.xid_errors_recent:
                parts.append(f"{self.xid_errors_recent} XID errors in the last day")
        if self.memory_available_bytes is not None:
            parts.append(f"{self.memory_available_bytes / 2**30:.1f} GiB memory free")
        if self.state_disk_free_bytes is not None:
            parts.append(f"{self.state_disk_free_bytes / 2**30:.1f} GiB disk free")
        return f"{self.host}: {', '.join(parts)}"


class RegionStatus(_Message):
    """What a region's agent is doing (retained on ``regions/<region>/status``).

    The Last Will carries ``state="offline"``; its ``sent_at`` is when the will was
    registered (each connection registers a fresh one), not when the broker published
    it, so it is older than the statuses it outlived: receivers take an ``offline``
    status whatever its ``sent_at``, and only a later live status replaces it. A
    diverged loss is reported as ``state="error"`` with a ``detail``, since JSON has no
    NaN.
    """

    type: Literal["region_status"] = "region_status"
    region: RegionName
    state: RegionState
    job: JobName | None = None
    round: RoundNumber | None = None
    params_hash: Sha256Hex | None = None
    train_loss: float | None = None
    worker_restarts: int = Field(default=0, ge=0)
    agent_version: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    detail: Text = ""
    #: What the region offers jobs; None from agents that predate it (and in a Last Will):
    #: the coordinator then treats the region's capacity as unknown, i.e. unlimited.
    capacity: Capacity | None = None
    #: Which run of the agent sent it (random per start) and its place among that run's
    #: statuses: receivers order one run's statuses by ``seq``, never by the sender's
    #: clock. None in a Last Will and from agents that predate them.
    #: The agent itself refused the round ``job``/``round`` names (its own residency
    #: policy, or a dataset it does not train on); ``detail`` says why. The coordinator
    #: records each such refusal in its audit log.
    refused: bool = False
    boot: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")] | None = None
    seq: int | None = Field(default=None, ge=1, lt=2**63)
    #: The agent's node (GPUs, memory, disk) as last read; None from agents that predate
    #: it, before the first reading, and in a Last Will.
    hardware: HardwareSummary | None = None


class Command(_Message):
    """An instruction from the coordinator to one region (``regions/<region>/commands``).

    ``command_id`` names the operator request the command carries out, so an agent's
    acknowledgement (an :class:`Event`) and a retransmission refer to the same request.
    """

    type: Literal["command"] = "command"
    action: CommandAction
    job: JobName | None = None
    reason: Text = ""
    command_id: UUID = Field(default_factory=uuid4)
    #: ``checkpoint`` only: the round from which the region is to save its regional
    #: checkpoint (at the end of the first round it finishes from it on). Left out
    #: otherwise, so agents that predate it read every other command.
    round: RoundNumber | None = None

    @model_validator(mode="after")
    def _job_when_needed(self) -> Self:
        if self.job is None and self.action != "drain":
            raise ValueError(f"a {self.action} command must name its job")
        if (self.action == "checkpoint") != (self.round is not None):
            raise ValueError("a checkpoint command, and only one, names its round")
        return self

    @model_serializer(mode="wrap")
    def _without_absent_round(
        self, handler: SerializerFunctionWrapHandler, info: SerializationInfo
    ) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("round", 0) is None:
            del data["round"]
        return data


class Event(_Message):
    """Something that happened, for operators and dashboards (``events``)."""

    type: Literal["event"] = "event"
    kind: Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_.-]{0,63}$")]
    job: JobName | None = None
    round: RoundNumber | None = None
    region: RegionName | None = None
    detail: Text = ""


ControlMessage = Annotated[
    RoundAnnouncement | RegionStatus | Command | Event, Field(discriminator="type")
]
_ANY_MESSAGE: TypeAdapter[ControlMessage] = TypeAdapter(ControlMessage)
M = TypeVar("M", RoundAnnouncement, RegionStatus, Command, Event)


def encode(message: RoundAnnouncement | RegionStatus | Command | Event) -> bytes:
    """Return the wire form (UTF-8 JSON) of a message."""
    return message.model_dump_json().encode("utf-8")


def _explain(error: ValidationError) -> str:
    items = error.errors(include_url=False)
    for item in items:
        # A message of another type fails on every field; the type alone says why.
        if item["loc"] == ("type",) and item["type"] == "literal_error":
            expected = item.get("ctx", {}).get("expected", "another type")
            return f"type is {item['input']!r:.64}, expected {expected}"
    parts = []
    for item in items[:5]:
        where = ".".join(str(loc) for loc in item["loc"]) or "message"
        parts.append(f"{where}: {item['msg']}")
    more = len(items) - len(parts)
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def _check_size(payload: bytes | bytearray) -> None:
    if not isinstance(payload, bytes | bytearray):
        raise MessageError(f"payload must be bytes, got {type(payload).__name__}")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise MessageError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")


def _check_envelope(message: _Message, what: str) -> None:
    missing = sorted(_ENVELOPE - message.model_fields_set)
    if missing:
        raise MessageError(f"not a valid {what}: message lacks {', '.join(missing)}")


def decode(payload: bytes | bytearray, expected: type[M]) -> M:
    """Parse a payload as a message of type ``expected``; :class:`MessageError` otherwise."""
    _check_size(payload)
    try:
        message = expected.model_validate_json(payload)
    except ValidationError as exc:
        raise MessageError(f"not a valid {expected.__name__}: {_explain(exc)}") from None
    _check_envelope(message, expected.__name__)
    return message


def decode_any(payload: bytes | bytearray) -> RoundAnnouncement | RegionStatus | Command | Event:
    """Parse a payload as whichever message its ``type`` names; :class:`MessageError` otherwise."""
    _check_size(payload)
    try:
        message = _ANY_MESSAGE.validate_json(payload)
    except ValidationError as exc:
        raise MessageError(f"not a valid control message: {_explain(exc)}") from None
    _check_envelope(message, "control message")
    return message


class Deduplicator:
    """Remembers the last ``capacity`` message ids and tells repeats apart.

    Bounded so a long-running daemon's memory stays flat; an id evicted long ago is
    accepted again, which only matters for replays older than ``capacity`` messages.
    """

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._seen: OrderedDict[UUID, None] = OrderedDict()

    def first_time(self, message_id: UUID) -> bool:
        """Record ``message_id``; True the first time it is seen, False for a repeat."""
        if message_id in self._seen:
            self._seen.move_to_end(message_id)
            return False
        self._seen[message_id] = None
        if len(self._seen) > self._capacity:
            self._seen.popitem(last=False)
        return True

    def __len__(self) -> int:
        return len(self._seen)

    def __contains__(self, message_id: object) -> bool:
        return message_id in self._seen
