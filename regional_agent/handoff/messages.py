"""The messages of the agent↔worker contract: what each hand-off file carries.

Instructions, summaries, markers, regional checkpoint records, progress and rank status
are pydantic dataclasses (strict, no unknown field), each field of a declared type with
its own check, and the rules between fields in ``__post_init__``; constructing one with a
bad value, or parsing a file that holds one, raises :class:`InvalidHandoffData`, which
names every problem. A round's result (:class:`RoundResult`) holds tensors and never
travels as JSON: it stays a plain dataclass. Where the files live and how they are
written is :mod:`regional_agent.handoff.directory`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar, cast, dataclass_transform, get_args

import torch
from pydantic import BeforeValidator, ConfigDict, InstanceOf, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass

from geofed.codec import DEFAULT_CHUNK_ELEMENTS, CodecError
from geofed.codec.layout import check_chunk_elements
from geofed.codec_params import CodecParams
from geofed.data.location import DatasetLocation
from geofed.training_config import Parallelism, TrainingConfig
from geofed.types import validate_name
from regional_agent.handoff.errors import InvalidHandoffData
from regional_agent.handoff.training_stats import TrainingStats

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from regional_agent.handoff.delta_stream import DeltaStream

FORMAT_VERSION = 1
_T = TypeVar("_T")
_RECORD_FORMAT = 2


def require_int(what: str, value: object, minimum: int) -> int:
    """``value`` if it is an integer of at least ``minimum``, else :class:`InvalidHandoffData`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidHandoffData(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def _require_str(what: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidHandoffData(f"{what} must be a non-empty string, got {value!r}")
    return value


def _require_float(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidHandoffData(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _require_bool(what: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidHandoffData(f"{what} must be a bool, got {value!r}")
    return value


def _require_string(what: str, value: object) -> str:
    if not isinstance(value, str):
        raise InvalidHandoffData(f"{what} must be a string")
    return value


def _require_absolute(what: str, value: object) -> str:
    path = _require_str(what, value)
    if not Path(path).is_absolute():
        raise InvalidHandoffData(f"{what} must be an absolute path, got {path!r}")
    return path


def _require_metrics(what: str, value: object) -> Mapping[str, float]:
    if not isinstance(value, Mapping):
        raise InvalidHandoffData(f"{what} must be a mapping, got {value!r}")
    for name, number in value.items():
        _require_str(f"{what} key", name)
        _require_float(f"{what}[{name!r}]", number)
    return value


def _require_names(what: str, value: object) -> tuple[str, ...]:
    """A non-empty tuple of distinct tensor names."""
    if not isinstance(value, tuple) or not value:
        raise InvalidHandoffData(f"{what} must be a non-empty tuple of names, got {value!r}")
    for name in value:
        _require_str(f"{what} entry", name)
    if len(set(value)) != len(value):
        repeated = sorted({name for name in value if value.count(name) > 1})
        raise InvalidHandoffData(f"{what} repeats {repeated}")
    return value


def _require_instance(kind: type[Any], described: str) -> Callable[[str, object], object]:
    def check(what: str, value: object) -> object:
        if not isinstance(value, kind):
            raise InvalidHandoffData(f"{what} must be {described}, got {value!r}")
        return value

    return check


def _name(what: str) -> Callable[[str, object], str]:
    def check(_field: str, value: object) -> str:
        try:
            return validate_name(what, cast(str, value))
        except ValueError as exc:
            raise InvalidHandoffData(str(exc)) from None

    return check


def _natural(what: str, value: object) -> int:
    return require_int(what, value, 0)


def _positive(what: str, value: object) -> int:
    return require_int(what, value, 1)


def _optional(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    return lambda what, value: None if value is None else check(what, value)


def _in_request(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    return lambda what, value: check(f"delta.{what}", value)


def _checked(check: Callable[[str, Any], Any]) -> BeforeValidator:
    """A field's own check, by its name, with the message the protocol has always given."""
    return BeforeValidator(lambda value, info: check(str(info.field_name), value))


# The fields' types: pydantic validates them (strictly), each with its own message.
JobName = Annotated[str, _checked(_name("job"))]
RegionName = Annotated[str, _checked(_name("region"))]
Natural = Annotated[int, _checked(_natural)]
Positive = Annotated[int, _checked(_positive)]
Text = Annotated[str, _checked(_require_str)]
AnyText = Annotated[str, _checked(_require_string)]
Finite = Annotated[float, _checked(_require_float)]
Flag = Annotated[bool, _checked(_require_bool)]
AbsolutePath = Annotated[str, _checked(_require_absolute)]
OptionalFinite = Annotated[float | None, _checked(_optional(_require_float))]

_STRICT = ConfigDict(strict=True, extra="forbid", arbitrary_types_allowed=True)
_M = TypeVar("_M")


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def _message(cls: type[_M]) -> type[_M]:
    """``cls`` as a frozen pydantic dataclass (strict, no unknown fields) whose
    construction raises :class:`InvalidHandoffData` naming each problem."""
    made: Any = pydantic_dataclass(cls, frozen=True, slots=True, config=_STRICT)
    validate = made.__init__
    names = [each.name for each in dataclasses.fields(made)]

    @functools.wraps(validate)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            validate(self, *args, **kwargs)
        except ValidationError as exc:
            raise InvalidHandoffData(_problems(exc, names)) from None

    made.__init__ = init
    return cast(type[_M], made)


def _problems(exc: ValidationError, names: list[str]) -> str:
    """A validation error as the protocol words it: each field's check names its field;
    pydantic's own errors are prefixed with where they are."""
    parts = []
    for error in exc.errors(include_url=False):
        cause = error.get("ctx", {}).get("error")
        if error["type"] == "value_error" and cause is not None:
            parts.append(str(cause))
            continue
        where = [
            names[p] if i == 0 and isinstance(p, int) and p < len(names) else str(p)
            for i, p in enumerate(error["loc"])
        ]
        parts.append(f"{'.'.join(where)}: {error['msg']}" if where else error["msg"])
    return "; ".join(parts)


def _names_from_json(what: str, value: object) -> tuple[str, ...] | None:
    """Names as a JSON file records them (a list), or None."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidHandoffData(f"{what} must be a list of names, got {value!r}")
    return _require_names(what, tuple(value))


def _flat_json(record: DataclassInstance) -> bytes:
    """A flat record's file content: the format, then its fields."""
    return json.dumps({"format": FORMAT_VERSION, **asdict(record)}, sort_keys=True).encode()


def _parse_flat(make: Callable[..., _T], names: tuple[str, ...], raw: bytes, source: str) -> _T:
    """A record :func:`_flat_json` wrote, every field present; errors name ``source``."""
    try:
        data = _fields(source, json.loads(raw), names)
        return make(**{name: data[name] for name in names})
    except (ValueError, TypeError) as exc:
        raise InvalidHandoffData(f"{source}: {exc}") from None


def _fields(
    cls_name: str, data: object, names: tuple[str, ...], optional: frozenset[str] = frozenset()
) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise InvalidHandoffData(f"{cls_name} must be a JSON object, got {type(data).__name__}")
    if data.get("format", FORMAT_VERSION) != FORMAT_VERSION:
        raise InvalidHandoffData(f"{cls_name}: format {data['format']!r} is not {FORMAT_VERSION}")
    missing = [name for name in names if name not in data and name not in optional]
    unknown = sorted(set(data) - set(names) - {"format"})
    if missing or unknown:
        raise InvalidHandoffData(f"{cls_name}: missing fields {missing}, unknown fields {unknown}")
    return data


@_message
class DeltaRequest:
    """Rank 0 hands over the round's delta quantized, instead of the trained parameters.

    Δ = θ_round - θ_local plus the error-feedback residual stored at ``feedback`` (the
    agent's residual after its last accepted delta; no file: none) is quantized with
    ``codec`` in chunks of ``chunk_elements`` where rank 0 holds the parameters (its
    accelerator, when it has one); the residual this leaves is written to the round's
    residual file, which the agent keeps only if the coordinator accepts the delta.

    ``names``: the tensors the delta holds, in this order (``overlap: streaming``: the
    round's fragment, :mod:`geofed.fragments`); None: every federated tensor. The residual
    of the other tensors is carried unchanged into the round's residual file.
    """

    codec: Annotated[
        InstanceOf[CodecParams],
        _checked(_in_request(_require_instance(CodecParams, "CodecParams"))),
    ]
    feedback: Annotated[str, _checked(_in_request(_require_absolute))]
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
    names: Annotated[tuple[str, ...] | None, _checked(_in_request(_optional(_require_names)))] = (
        None
    )

    def __post_init__(self) -> None:
        try:
            check_chunk_elements(self.chunk_elements, self.codec.block_size)
        except CodecError as exc:
            raise InvalidHandoffData(f"delta.chunk_elements: {exc}") from None

    @staticmethod
    def parse(data: object) -> DeltaRequest:
        """The request as an instruction file records it (:func:`dataclasses.asdict`)."""
        required = {"codec", "feedback", "chunk_elements"}
        # names: written by agents that know it; a request without it names every tensor.
        if not isinstance(data, Mapping) or not required <= set(data) <= required | {"names"}:
            raise InvalidHandoffData(
                f"delta must hold codec, feedback and chunk_elements (names optional), got {data!r}"
            )
        try:
            codec = _CODEC.validate_python(data["codec"])
        except ValidationError as exc:
            raise InvalidHandoffData(f"delta.codec: {exc.errors(include_url=False)}") from None
        names = _names_from_json("delta.names", data.get("names"))
        return DeltaRequest(codec, data["feedback"], data["chunk_elements"], names)


_CODEC: TypeAdapter[CodecParams] = TypeAdapter(CodecParams)


_FINGERPRINT_RE = re.compile(r"[0-9a-f]{64}")


def _require_fingerprint(what: str, value: object) -> str:
    if not isinstance(value, str) or not _FINGERPRINT_RE.fullmatch(value):
        raise InvalidHandoffData(f"{what} must be 64 hex digits, got {value!r}")
    return value


def _require_plain_json(what: str, value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidHandoffData(f"{what} must be a mapping, got {value!r}")
    try:
        json.dumps(dict(value), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidHandoffData(f"{what} must be plain JSON: {exc}") from None
    return value


def _require_overlap(what: str, value: object) -> str:
    if value not in ("none", "delayed", "streaming"):
        raise InvalidHandoffData(f"{what} must be none, delayed or streaming, got {value!r}")
    return value


def _require_start(what: str, value: object) -> str:
    if value not in ("local", "eager"):
        raise InvalidHandoffData(f"{what} must be local or eager, got {value!r}")
    return value


def _require_locations(what: str, value: object) -> Mapping[str, DatasetLocation]:
    if not isinstance(value, Mapping):
        raise InvalidHandoffData(f"{what} must be a mapping, got {value!r}")
    for name, location in value.items():
        _name("dataset")(what, name)
        if not isinstance(location, DatasetLocation):
            raise InvalidHandoffData(f"dataset {name}'s location is {location!r}")
    return value


def _require_dataset_names(what: str, value: object) -> tuple[str, ...]:
    """A tuple (maybe empty) of distinct dataset names."""
    if not isinstance(value, tuple):
        raise InvalidHandoffData(f"{what} must be a tuple of dataset names, got {value!r}")
    for name in value:
        _name("dataset")(what, name)
    if len(set(value)) != len(value):
        raise InvalidHandoffData(f"{what} repeats a dataset: {list(value)}")
    return value


@_message
class RoundInstruction:
    """Train ``inner_steps`` steps of round ``round`` of ``job`` from ``base_params``.

    ``base_params`` is the path of the global parameters' θ file
    (:mod:`geofed.theta_file`; a ``torch.save``-d fp32 state dict is read too); ``task``
    and ``task_options`` name the task as :func:`geofed.task.load_task`
    takes them. ``training`` is the job's training section; ``total_steps`` is the job's
    inner steps in all (rounds x H), which the learning-rate schedule decays over (see
    :mod:`geofed.lr_schedule`): unknown (None) only under a constant schedule.
    ``evaluate_base``: evaluate ``base_params`` with the task before training from them
    (:func:`geofed.evaluation_config.region_evaluates` decided it).

    ``overlap`` is the job's overlap mode. ``base_pending`` marks a delayed round
    (:mod:`regional_agent.handoff.overlap`): the workers start from the parameters they hold at
    the end of round ``round - 1``; θ_round is not there yet, and ``base_params`` is where
    the agent will put it, announcing it with the round's base-ready marker
    (:meth:`HandoffDir.write_base_ready`). ``start`` ``eager`` (``overlap_start: eager``):
    a delayed round starts instead from the estimate S the agent writes, announced by the
    round's start marker (:meth:`HandoffDir.write_start`), which the workers wait for.

    ``delta``: rank 0 hands over the quantized delta (:class:`DeltaRequest`) rather than
    the trained parameters (None). ``base_hash``: the hash of θ at ``base_params``, as the
    agent verified it (None: not given); the workers report it when they made θ from the
    θ they held and its update instead of reading it
    (:mod:`regional_agent.worker.base_update`).

    ``datasets``: where the region keeps the datasets the round reads, by name;
    ``datasets_without_files``: those it reads that the agent config names without files
    (a task with data of its own needs none; one that reads files refuses them);
    ``task_fingerprint``: the task's fingerprint as the coordinator read it (the workers
    refuse the round when theirs differs; None: not compared).

    ``overlap`` ``streaming`` rounds are delayed rounds that synchronize one fragment of
    the model (:mod:`geofed.fragments`): the delta request names the round's fragment
    (always given: such a round never hands over its parameters), and a speculative
    round's ``fold`` names the tensors θ_round changed (the previous round's fragment):
    only those are folded in, every other tensor keeps its local progress.
    """

    job: JobName
    round: Natural
    base_params: AbsolutePath
    inner_steps: Positive
    task: Text
    task_options: Annotated[Mapping[str, Any], _checked(_require_plain_json)]
    seed: Natural
    region: RegionName
    region_index: Natural
    num_regions: Positive
    training: Annotated[
        InstanceOf[TrainingConfig], _checked(_require_instance(TrainingConfig, "a TrainingConfig"))
    ] = field(default_factory=TrainingConfig)
    total_steps: Annotated[int | None, _checked(_optional(_positive))] = None
    evaluate_base: Flag = False
    overlap: Annotated[str, _checked(_require_overlap)] = "none"
    base_pending: Flag = False
    start: Annotated[str, _checked(_require_start)] = "local"
    delta: Annotated[
        InstanceOf[DeltaRequest] | None,
        _checked(_optional(_require_instance(DeltaRequest, "a DeltaRequest"))),
    ] = None
    fold: Annotated[tuple[str, ...] | None, _checked(_optional(_require_names))] = None
    datasets: Annotated[Mapping[str, InstanceOf[DatasetLocation]], _checked(_require_locations)] = (
        field(default_factory=dict)
    )
    task_fingerprint: Annotated[str | None, _checked(_optional(_require_fingerprint))] = None
    base_hash: Annotated[str | None, _checked(_optional(_require_str))] = None
    datasets_without_files: Annotated[tuple[str, ...], _checked(_require_dataset_names)] = ()

    def __post_init__(self) -> None:
        if self.region_index >= self.num_regions:
            raise InvalidHandoffData(
                f"region_index {self.region_index} is not below num_regions {self.num_regions}"
            )
        if self.base_pending and self.overlap == "none":
            raise InvalidHandoffData(
                "base_pending is for rounds of an overlap: delayed or streaming job"
            )
        if self.start == "eager" and not self.base_pending:
            raise InvalidHandoffData("start eager is for a delayed round (base_pending)")
        if self.overlap == "streaming" and (self.delta is None or self.delta.names is None):
            raise InvalidHandoffData(
                "an overlap: streaming round hands over the delta of its fragment: "
                "it needs a delta request naming the fragment's tensors"
            )
        if self.fold is not None and (self.overlap != "streaming" or not self.base_pending):
            raise InvalidHandoffData(
                "fold is for the speculative rounds (base_pending) of an overlap: streaming job"
            )
        if self.total_steps is None and self.training.lr_schedule.kind != "constant":
            raise InvalidHandoffData(
                f"a {self.training.lr_schedule.kind} schedule needs total_steps"
            )

    def to_json(self) -> bytes:
        """Serialize as the instruction file's content."""
        body = {
            "format": FORMAT_VERSION,
            **asdict(self),
            "task_options": dict(self.task_options),
            "training": self.training.record(),
            "datasets": {name: loc.model_dump() for name, loc in self.datasets.items()},
        }
        return json.dumps(body, sort_keys=True, allow_nan=False).encode()

    @classmethod
    def from_json(cls, raw: bytes, source: str = "instruction") -> RoundInstruction:
        """Parse an instruction file's content; :class:`InvalidHandoffData` names ``source``."""
        try:
            data = _fields(f"{source}", json.loads(raw), _INSTRUCTION_FIELDS, _INSTRUCTION_OPTIONAL)
            fields = {name: data[name] for name in _INSTRUCTION_FIELDS if name in data}
            if "training" in fields:
                fields["training"] = _training(fields["training"])
            if fields.get("delta") is not None:
                fields["delta"] = DeltaRequest.parse(fields["delta"])
            if "fold" in fields:
                fields["fold"] = _names_from_json("fold", fields["fold"])
            if "datasets" in fields:
                fields["datasets"] = _locations(fields["datasets"])
            if "datasets_without_files" in fields:
                fields["datasets_without_files"] = _dataset_names(fields["datasets_without_files"])
            return cls(**fields)
        except (ValueError, TypeError) as exc:
            raise InvalidHandoffData(f"{source}: {exc}") from None


def _training(data: object) -> TrainingConfig:
    try:
        return TrainingConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            ".".join(["training", *map(str, error["loc"])]) + f": {error['msg']}"
            for error in exc.errors(include_url=False)
        )
        raise InvalidHandoffData(problems) from None


def _dataset_names(data: object) -> tuple[str, ...]:
    if not isinstance(data, list):
        raise InvalidHandoffData(f"datasets_without_files must be a list, got {data!r}")
    return tuple(data)


def _locations(data: object) -> dict[str, DatasetLocation]:
    if not isinstance(data, Mapping):
        raise InvalidHandoffData(f"datasets must be a mapping, got {data!r}")
    try:
        return {str(name): DatasetLocation.model_validate(loc) for name, loc in data.items()}
    except ValidationError as exc:
        raise InvalidHandoffData(f"datasets: {exc}") from None


_INSTRUCTION_FIELDS = tuple(RoundInstruction.__dataclass_fields__)
# Written by every agent that knows them; an instruction without them trains as before.
_INSTRUCTION_OPTIONAL = frozenset(
    {
        "training",
        "total_steps",
        "evaluate_base",
        "overlap",
        "base_pending",
        "start",
        "delta",
        "fold",
        "datasets",
        "task_fingerprint",
        "datasets_without_files",
    }
)


@_message
class RoundSummary:
    """What a finished round produced, besides the parameters (the done marker's content).

    ``tokens`` counts the whole region (all ranks); ``mean_loss`` averages every rank's
    every micro-batch; ``steps`` counts optimizer steps, and ``cursor`` is the data step
    (micro-batch) index the next round starts at. ``params_hash`` names what the result
    holds: the trained parameters' :func:`geofed.params.parameters_vector_hash`, or the
    quantized delta's payload hash (:func:`regional_agent.worker.device_delta.payloads_hash`).
    """

    job: JobName
    round: Natural
    steps: Natural
    tokens: Natural
    mean_loss: Finite
    cursor: Natural
    base_params_hash: Text
    params_hash: Text
    world_size: Positive
    train_seconds: Finite
    #: The task's held-out metrics of the base parameters θ_round, when the round
    #: evaluated them before training (``RoundInstruction.evaluate_base``).
    base_eval: Annotated[Mapping[str, float] | None, _checked(_optional(_require_metrics))] = None
    #: What the workers measured while training (step time, throughput, memory...).
    stats: Annotated[
        InstanceOf[TrainingStats] | None,
        _checked(_optional(_require_instance(TrainingStats, "TrainingStats"))),
    ] = None
    #: When rank 0's inner loop started and finished (unix seconds): the round's
    #: training interval on the wall clock, for compute utilization.
    train_started_at: OptionalFinite = None
    train_finished_at: OptionalFinite = None
    #: A delayed round (``overlap: delayed``): how long the workers waited for θ_round
    #: after their last step, and the step before which it was folded in (``steps``
    #: when it came only after the last one).
    base_wait_seconds: OptionalFinite = None
    base_folded_at_step: Annotated[int | None, _checked(_optional(_natural))] = None

    def to_json(self) -> bytes:
        return _flat_json(self)

    @classmethod
    def from_json(cls, raw: bytes, source: str = "done marker") -> RoundSummary:
        try:
            data = _fields(source, json.loads(raw), _SUMMARY_FIELDS, _SUMMARY_OPTIONAL)
            fields = {name: data[name] for name in _SUMMARY_FIELDS if name in data}
            if fields.get("stats") is not None:
                fields["stats"] = TrainingStats.from_mapping(fields["stats"])
            return cls(**fields)
        except (ValueError, TypeError) as exc:
            raise InvalidHandoffData(f"{source}: {exc}") from None


_SUMMARY_FIELDS = tuple(RoundSummary.__dataclass_fields__)
# Written by workers that evaluated the round's base parameters (base_eval), and by
# workers that measure their training (stats) and its wall-clock interval.
_SUMMARY_OPTIONAL = frozenset(
    {
        "base_eval",
        "stats",
        "train_started_at",
        "train_finished_at",
        "base_wait_seconds",
        "base_folded_at_step",
    }
)


@_message
class BaseReady:
    """θ of a delayed round is ready: the file, its hash, and whether to evaluate it."""

    job: JobName
    round: Natural
    base_params: Text
    base_hash: Text
    evaluate_base: Flag = False

    def to_json(self) -> bytes:
        return _flat_json(self)

    @classmethod
    def from_json(cls, raw: bytes, source: str = "base-ready marker") -> BaseReady:
        return _parse_flat(cls, _BASE_READY_FIELDS, raw, source)


_BASE_READY_FIELDS = tuple(BaseReady.__dataclass_fields__)


@_message
class StartReady:
    """Where an eager delayed round starts: S's file and hash, or (both empty) the
    workers' own parameters, when the agent had no estimate; ``reason`` says why."""

    job: JobName
    round: Natural
    start_params: AnyText = ""
    start_hash: AnyText = ""
    reason: AnyText = ""

    def __post_init__(self) -> None:
        if bool(self.start_params) != bool(self.start_hash):
            raise InvalidHandoffData("start_params and start_hash go together")

    def to_json(self) -> bytes:
        return _flat_json(self)

    @classmethod
    def from_json(cls, raw: bytes, source: str = "start marker") -> StartReady:
        return _parse_flat(cls, _START_READY_FIELDS, raw, source)


_START_READY_FIELDS = tuple(StartReady.__dataclass_fields__)


@dataclass(frozen=True, slots=True)
class RoundResult:
    """A completed round: its summary and rank 0's locally trained fp32 state, or (an
    instruction with a :class:`DeltaRequest`) the quantized delta's stream file and its
    residual file (``params`` then empty)."""

    summary: RoundSummary
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    delta: DeltaStream | None = None
    residual: Path | None = None


def _require_parallelism(what: str, value: object) -> Parallelism:
    if value not in get_args(Parallelism):
        raise InvalidHandoffData(f"{what} must be one of {get_args(Parallelism)}, got {value!r}")
    return cast(Parallelism, value)


@_message
class RegionalCheckpoint:
    """The region's inner training state at the end of ``last_round`` of ``job``.

    ``cursor`` is the data step (micro-batch) index the next round starts at.
    ``optimizer_round`` names the round whose inner optimizer state is saved, sharded,
    in :meth:`HandoffDir.optimizer_path` (None: none is saved yet); it may be older than
    ``last_round`` (the state is saved every few rounds), and a group resuming from it
    then trains with that older optimizer state and this cursor.

    ``optimizer_state`` is set only for a checkpoint of the format before, which held
    the whole state, as ``parallelism`` keys it: under ``ddp`` the optimizer's
    ``state_dict()``, under ``fsdp`` the shards gathered by parameter name; checkpoints
    written before FSDP existed are ``ddp``.
    """

    job: JobName
    last_round: Natural
    cursor: Natural
    world_size: Positive
    optimizer_state: dict[str, Any] | None = field(default=None, repr=False)
    parallelism: Annotated[Parallelism, _checked(_require_parallelism)] = "ddp"
    optimizer_round: Annotated[int | None, _checked(_optional(_natural))] = None

    def __post_init__(self) -> None:
        if self.optimizer_round is not None and not (0 <= self.optimizer_round <= self.last_round):
            raise InvalidHandoffData(
                f"optimizer_round {self.optimizer_round} is not a round up to last_round "
                f"{self.last_round}"
            )
        if self.optimizer_round is not None and self.optimizer_state is not None:
            raise InvalidHandoffData("a checkpoint holds a whole or a sharded optimizer state")

    def record(self) -> bytes:
        """The record's JSON (the sharded optimizer state stays in its own directory)."""
        if self.optimizer_state is not None:
            raise InvalidHandoffData("a whole optimizer state is no longer written")
        return json.dumps(
            {
                "format": _RECORD_FORMAT,
                "job": self.job,
                "last_round": self.last_round,
                "cursor": self.cursor,
                "world_size": self.world_size,
                "parallelism": self.parallelism,
                "optimizer_round": self.optimizer_round,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def from_record(cls, raw: bytes, source: str) -> RegionalCheckpoint:
        """Parse :meth:`record`'s JSON; :class:`InvalidHandoffData` names what is wrong."""
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise InvalidHandoffData(f"{source}: not JSON: {exc}") from None
        if not isinstance(body, dict) or body.get("format") != _RECORD_FORMAT:
            raise InvalidHandoffData(f"{source}: not a format-{_RECORD_FORMAT} regional checkpoint")
        try:
            optimizer_round = body["optimizer_round"]
            return cls(
                job=validate_name("job", body["job"]),
                last_round=require_int("last_round", body["last_round"], 0),
                cursor=require_int("cursor", body["cursor"], 0),
                world_size=require_int("world_size", body["world_size"], 1),
                parallelism=body["parallelism"],
                optimizer_round=None
                if optimizer_round is None
                else require_int("optimizer_round", optimizer_round, 0),
            )
        except KeyError as exc:
            raise InvalidHandoffData(f"{source}: missing {exc.args[0]}") from None
        except ValueError as exc:
            raise InvalidHandoffData(f"{source}: {exc}") from None


@_message
class RoundProgress:
    """Advisory progress of the round rank 0 is training."""

    job: JobName
    round: Natural
    steps_done: Natural
    inner_steps: Positive


def _require_rank_state(what: str, value: object) -> str:
    if value not in ("starting", "ready"):
        raise InvalidHandoffData(f"{what} must be starting or ready, got {value!r}")
    return value


@_message
class RankStatus:
    """What one worker process reports about itself; ``state`` is ``starting`` or ``ready``."""

    rank: Natural
    local_rank: Natural
    world_size: Positive
    pid: Positive
    launch_id: AnyText
    restart_count: Natural
    backend: Text
    device: Text
    state: Annotated[str, _checked(_require_rank_state)]
