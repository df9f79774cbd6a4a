"""The file protocol between a regional agent and rank 0 of its worker group.

Everything crosses as files in one work directory, so either side may restart at any
moment and pick up where the other left off::

    jobs/<job>/round-<r>.instruction.json   agent -> workers: train round r from theta_r
    jobs/<job>/round-<r>.result.pt          rank 0: local fp32 parameters, or the quantized
                                            delta (an instruction's ``delta``), + summary
    jobs/<job>/round-<r>.residual.pt        rank 0: the residual the quantized delta leaves
                                            (its tensors with the regional checkpoint,
                                            else a held file naming rank 0's copy)
    jobs/<job>/residual-held.pt             rank 0, at a park or stop: the residual it held
    jobs/<job>/round-<r>.done.json          rank 0, written last: the result exists
    jobs/<job>/round-<r>.error.json         rank 0: the instruction cannot be served
    jobs/<job>/round-<r>.progress.json      rank 0: steps done so far (advisory)
    jobs/<job>/round-<r>.base.json          agent -> workers: θ_r of a delayed round is ready
    jobs/<job>/round-<r>.cancel             agent -> workers: drop the delayed round r
    jobs/<job>/round-<r>.start.pt           agent -> workers: S, where an eager round r starts
    jobs/<job>/round-<r>.start.json         agent -> workers, written last: S is ready
    jobs/<job>/regional-checkpoint.json     rank 0, every round: the job's last round, data
                                            cursor, and which optimizer state is saved
    jobs/<job>/optimizer-round-<r>/         every rank its part (DCP): the inner optimizer
                                            state at the end of round r
    jobs/<job>/inner-checkpoint.pt          rank 0, last: a round stopped mid-way (its step,
                                            each rank's RNG states and totals)
    jobs/<job>/inner-checkpoint/            every rank its part (DCP): that round's
                                            parameters and optimizer state
    ranks/rank-<n>.json                     each rank: pid, launch id, restart count
    logs/rank-<n>.log, logs/launcher.log    worker and launcher output
    stop                                    agent -> workers: finish and exit 0

Results, checkpoints, markers and instructions are written temp + fsync + rename; a
result exists only once its done marker does. The regional checkpoint is per job, so jobs
that share the group never resume from each other's state: a small record written with
every round, and the sharded optimizer state it names, saved every few rounds
(:mod:`regional_agent.optimizer_checkpoint`). A whole-state checkpoint of the format
before (``regional-checkpoint.pt``, per job or at the root) is still read and resumed
from; one at the old single-file place is moved to its job's place by
:meth:`HandoffDir.migrate_legacy_checkpoint`. Progress and rank status files are
advisory and only renamed into place (whole, not durable). All functions here block on
disk I/O; asyncio callers run them in a thread.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, get_args

import torch
from pydantic import TypeAdapter, ValidationError

from geofed.codec import DEFAULT_CHUNK_ELEMENTS, CodecError, QuantizedTensors
from geofed.codec.layout import check_chunk_elements
from geofed.codec_params import CodecParams
from geofed.data.location import DatasetLocation
from geofed.fsutil import AtomicFile, atomic_write_bytes, replace_durably
from geofed.training_config import Parallelism, TrainingConfig
from geofed.types import validate_name
from regional_agent.training_stats import TrainingStats

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

FORMAT_VERSION = 1
_T = TypeVar("_T")
_CHECKPOINT_NAME = "regional-checkpoint.pt"
_RECORD_NAME = "regional-checkpoint.json"
_RECORD_FORMAT = 2
_INNER_CHECKPOINT_NAME = "inner-checkpoint.pt"
_OPTIMIZER_DIR_RE = re.compile(r"optimizer-round-(\d+)")
_ROUND_FILE_RE = re.compile(r"^round-(\d+)\.instruction\.json$")


class HandoffError(Exception):
    """Base class of hand-off protocol errors."""


class InvalidHandoffData(HandoffError, ValueError):
    """A hand-off value or file does not follow the protocol; the message says where."""


def _require_int(what: str, value: object, minimum: int) -> int:
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


@dataclass(frozen=True, slots=True)
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

    codec: CodecParams
    feedback: str
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
    names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.codec, CodecParams):
            raise InvalidHandoffData(f"delta.codec must be CodecParams, got {self.codec!r}")
        if self.names is not None:
            _require_names("delta.names", self.names)
        _require_str("delta.feedback", self.feedback)
        if not Path(self.feedback).is_absolute():
            raise InvalidHandoffData(
                f"delta.feedback must be an absolute path, got {self.feedback!r}"
            )
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


@dataclass(frozen=True, slots=True)
class RoundInstruction:
    """Train ``inner_steps`` steps of round ``round`` of ``job`` from ``base_params``.

    ``base_params`` is the path of a ``torch.save``-d fp32 state dict of the global
    parameters; ``task`` and ``task_options`` name the task as :func:`geofed.task.load_task`
    takes them. ``training`` is the job's training section; ``total_steps`` is the job's
    inner steps in all (rounds x H), which the learning-rate schedule decays over (see
    :mod:`geofed.lr_schedule`): unknown (None) only under a constant schedule.
    ``evaluate_base``: evaluate ``base_params`` with the task before training from them
    (:func:`geofed.evaluation_config.region_evaluates` decided it).

    ``overlap`` is the job's overlap mode. ``base_pending`` marks a delayed round
    (:mod:`regional_agent.overlap`): the workers start from the parameters they hold at
    the end of round ``round - 1``; θ_round is not there yet, and ``base_params`` is where
    the agent will put it, announcing it with the round's base-ready marker
    (:meth:`HandoffDir.write_base_ready`). ``start`` ``eager`` (``overlap_start: eager``):
    a delayed round starts instead from the estimate S the agent writes, announced by the
    round's start marker (:meth:`HandoffDir.write_start`), which the workers wait for.

    ``delta``: rank 0 hands over the quantized delta (:class:`DeltaRequest`) rather than
    the trained parameters (None).

    ``datasets``: where the region keeps the datasets the round reads, by name;
    ``task_fingerprint``: the task's fingerprint as the coordinator read it (the workers
    refuse the round when theirs differs; None: not compared).

    ``overlap`` ``streaming`` rounds are delayed rounds that synchronize one fragment of
    the model (:mod:`geofed.fragments`): the delta request names the round's fragment
    (always given: such a round never hands over its parameters), and a speculative
    round's ``fold`` names the tensors θ_round changed (the previous round's fragment):
    only those are folded in, every other tensor keeps its local progress.
    """

    job: str
    round: int
    base_params: str
    inner_steps: int
    task: str
    task_options: Mapping[str, Any]
    seed: int
    region: str
    region_index: int
    num_regions: int
    training: TrainingConfig = field(default_factory=TrainingConfig)
    total_steps: int | None = None
    evaluate_base: bool = False
    overlap: str = "none"
    base_pending: bool = False
    start: str = "local"
    delta: DeltaRequest | None = None
    fold: tuple[str, ...] | None = None
    datasets: Mapping[str, DatasetLocation] = field(default_factory=dict)
    task_fingerprint: str | None = None

    def __post_init__(self) -> None:
        try:
            validate_name("job", self.job)
            validate_name("region", self.region)
            for name in self.datasets:
                validate_name("dataset", name)
        except ValueError as exc:
            raise InvalidHandoffData(str(exc)) from None
        for name, location in self.datasets.items():
            if not isinstance(location, DatasetLocation):
                raise InvalidHandoffData(f"dataset {name}'s location is {location!r}")
        if self.task_fingerprint is not None and not _FINGERPRINT_RE.fullmatch(
            str(self.task_fingerprint)
        ):
            raise InvalidHandoffData(
                f"task_fingerprint must be 64 hex digits, got {self.task_fingerprint!r}"
            )
        _require_int("round", self.round, 0)
        _require_str("base_params", self.base_params)
        if not Path(self.base_params).is_absolute():
            raise InvalidHandoffData(
                f"base_params must be an absolute path, got {self.base_params!r}"
            )
        _require_int("inner_steps", self.inner_steps, 1)
        _require_str("task", self.task)
        if not isinstance(self.task_options, Mapping):
            raise InvalidHandoffData(f"task_options must be a mapping, got {self.task_options!r}")
        _require_int("seed", self.seed, 0)
        _require_int("num_regions", self.num_regions, 1)
        _require_int("region_index", self.region_index, 0)
        if self.region_index >= self.num_regions:
            raise InvalidHandoffData(
                f"region_index {self.region_index} is not below num_regions {self.num_regions}"
            )
        try:
            json.dumps(dict(self.task_options), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidHandoffData(f"task_options must be plain JSON: {exc}") from None
        if not isinstance(self.training, TrainingConfig):
            raise InvalidHandoffData(f"training must be a TrainingConfig, got {self.training!r}")
        if not isinstance(self.evaluate_base, bool):
            raise InvalidHandoffData(f"evaluate_base must be a bool, got {self.evaluate_base!r}")
        if self.overlap not in ("none", "delayed", "streaming"):
            raise InvalidHandoffData(
                f"overlap must be none, delayed or streaming, got {self.overlap!r}"
            )
        if not isinstance(self.base_pending, bool):
            raise InvalidHandoffData(f"base_pending must be a bool, got {self.base_pending!r}")
        if self.base_pending and self.overlap == "none":
            raise InvalidHandoffData(
                "base_pending is for rounds of an overlap: delayed or streaming job"
            )
        if self.start not in ("local", "eager"):
            raise InvalidHandoffData(f"start must be local or eager, got {self.start!r}")
        if self.start == "eager" and not self.base_pending:
            raise InvalidHandoffData("start eager is for a delayed round (base_pending)")
        if self.delta is not None and not isinstance(self.delta, DeltaRequest):
            raise InvalidHandoffData(f"delta must be a DeltaRequest, got {self.delta!r}")
        if self.overlap == "streaming" and (self.delta is None or self.delta.names is None):
            raise InvalidHandoffData(
                "an overlap: streaming round hands over the delta of its fragment: "
                "it needs a delta request naming the fragment's tensors"
            )
        if self.fold is not None:
            _require_names("fold", self.fold)
            if self.overlap != "streaming" or not self.base_pending:
                raise InvalidHandoffData(
                    "fold is for the speculative rounds (base_pending) of an overlap: streaming job"
                )
        if self.total_steps is None:
            if self.training.lr_schedule.kind != "constant":
                raise InvalidHandoffData(
                    f"a {self.training.lr_schedule.kind} schedule needs total_steps"
                )
        else:
            _require_int("total_steps", self.total_steps, 1)

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
    }
)


@dataclass(frozen=True, slots=True)
class RoundSummary:
    """What a finished round produced, besides the parameters (the done marker's content).

    ``tokens`` counts the whole region (all ranks); ``mean_loss`` averages every rank's
    every micro-batch; ``steps`` counts optimizer steps, and ``cursor`` is the data step
    (micro-batch) index the next round starts at. ``params_hash`` names what the result
    holds: the trained parameters' :func:`geofed.params.parameters_vector_hash`, or the
    quantized delta's payload hash (:func:`regional_agent.device_delta.payloads_hash`).
    """

    job: str
    round: int
    steps: int
    tokens: int
    mean_loss: float
    cursor: int
    base_params_hash: str
    params_hash: str
    world_size: int
    train_seconds: float
    #: The task's held-out metrics of the base parameters θ_round, when the round
    #: evaluated them before training (``RoundInstruction.evaluate_base``).
    base_eval: Mapping[str, float] | None = None
    #: What the workers measured while training (step time, throughput, memory...).
    stats: TrainingStats | None = None
    #: When rank 0's inner loop started and finished (unix seconds): the round's
    #: training interval on the wall clock, for compute utilization.
    train_started_at: float | None = None
    train_finished_at: float | None = None
    #: A delayed round (``overlap: delayed``): how long the workers waited for θ_round
    #: after their last step, and the step before which it was folded in (``steps``
    #: when it came only after the last one).
    base_wait_seconds: float | None = None
    base_folded_at_step: int | None = None

    def __post_init__(self) -> None:
        try:
            validate_name("job", self.job)
        except ValueError as exc:
            raise InvalidHandoffData(str(exc)) from None
        if self.stats is not None and not isinstance(self.stats, TrainingStats):
            raise InvalidHandoffData(f"stats must be TrainingStats, got {self.stats!r}")
        if self.base_eval is not None:
            _require_metrics("base_eval", self.base_eval)
        for name in ("round", "steps", "tokens", "cursor"):
            _require_int(name, getattr(self, name), 0)
        _require_int("world_size", self.world_size, 1)
        _require_float("mean_loss", self.mean_loss)
        _require_float("train_seconds", self.train_seconds)
        _require_str("base_params_hash", self.base_params_hash)
        _require_str("params_hash", self.params_hash)
        for name in ("train_started_at", "train_finished_at"):
            if getattr(self, name) is not None:
                _require_float(name, getattr(self, name))
        if self.base_wait_seconds is not None:
            _require_float("base_wait_seconds", self.base_wait_seconds)
        if self.base_folded_at_step is not None:
            _require_int("base_folded_at_step", self.base_folded_at_step, 0)

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


@dataclass(frozen=True, slots=True)
class BaseReady:
    """θ of a delayed round is ready: the file, its hash, and whether to evaluate it."""

    job: str
    round: int
    base_params: str
    base_hash: str
    evaluate_base: bool = False

    def __post_init__(self) -> None:
        try:
            validate_name("job", self.job)
        except ValueError as exc:
            raise InvalidHandoffData(str(exc)) from None
        _require_int("round", self.round, 0)
        _require_str("base_params", self.base_params)
        _require_str("base_hash", self.base_hash)
        if not isinstance(self.evaluate_base, bool):
            raise InvalidHandoffData(f"evaluate_base must be a bool, got {self.evaluate_base!r}")

    def to_json(self) -> bytes:
        return _flat_json(self)

    @classmethod
    def from_json(cls, raw: bytes, source: str = "base-ready marker") -> BaseReady:
        return _parse_flat(cls, _BASE_READY_FIELDS, raw, source)


_BASE_READY_FIELDS = tuple(BaseReady.__dataclass_fields__)


@dataclass(frozen=True, slots=True)
class StartReady:
    """Where an eager delayed round starts: S's file and hash, or (both empty) the
    workers' own parameters, when the agent had no estimate; ``reason`` says why."""

    job: str
    round: int
    start_params: str = ""
    start_hash: str = ""
    reason: str = ""

    def __post_init__(self) -> None:
        try:
            validate_name("job", self.job)
        except ValueError as exc:
            raise InvalidHandoffData(str(exc)) from None
        _require_int("round", self.round, 0)
        for name in ("start_params", "start_hash", "reason"):
            if not isinstance(getattr(self, name), str):
                raise InvalidHandoffData(f"{name} must be a string")
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
    instruction with a :class:`DeltaRequest`) the quantized delta and its residual file
    (``params`` then empty)."""

    summary: RoundSummary
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    delta: QuantizedTensors | None = None
    residual: Path | None = None


@dataclass(frozen=True, slots=True)
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

    job: str
    last_round: int
    cursor: int
    world_size: int
    optimizer_state: dict[str, Any] | None = field(default=None, repr=False)
    parallelism: Parallelism = "ddp"
    optimizer_round: int | None = None

    def __post_init__(self) -> None:
        if self.parallelism not in get_args(Parallelism):
            raise InvalidHandoffData(
                f"parallelism must be one of {get_args(Parallelism)}, got {self.parallelism!r}"
            )
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
                last_round=_require_int("last_round", body["last_round"], 0),
                cursor=_require_int("cursor", body["cursor"], 0),
                world_size=_require_int("world_size", body["world_size"], 1),
                parallelism=body["parallelism"],
                optimizer_round=None
                if optimizer_round is None
                else _require_int("optimizer_round", optimizer_round, 0),
            )
        except KeyError as exc:
            raise InvalidHandoffData(f"{source}: missing {exc.args[0]}") from None
        except ValueError as exc:
            raise InvalidHandoffData(f"{source}: {exc}") from None


@dataclass(frozen=True, slots=True)
class RoundProgress:
    """Advisory progress of the round rank 0 is training."""

    job: str
    round: int
    steps_done: int
    inner_steps: int


@dataclass(frozen=True, slots=True)
class RankStatus:
    """What one worker process reports about itself; ``state`` is ``starting`` or ``ready``."""

    rank: int
    local_rank: int
    world_size: int
    pid: int
    launch_id: str
    restart_count: int
    backend: str
    device: str
    state: str


def inner_tensors_dir(path: Path) -> Path:
    """Where the sharded tensors of the inner checkpoint file at ``path`` are saved."""
    return path.with_suffix("")


class HandoffDir:
    """The hand-off files of one worker group, rooted at ``root``."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    # -- paths -------------------------------------------------------------------------

    def job_dir(self, job: str) -> Path:
        return self.root / "jobs" / validate_name("job", job)

    def _round_path(self, job: str, round_: int, suffix: str) -> Path:
        _require_int("round", round_, 0)
        return self.job_dir(job) / f"round-{round_}.{suffix}"

    def instruction_path(self, job: str, round_: int) -> Path:
        return self._round_path(job, round_, "instruction.json")

    def result_path(self, job: str, round_: int) -> Path:
        return self._round_path(job, round_, "result.pt")

    def residual_path(self, job: str, round_: int) -> Path:
        return self._round_path(job, round_, "residual.pt")

    def held_residual_path(self, job: str) -> Path:
        """Where rank 0 writes out the residual it held when it parks ``job`` or stops."""
        return self.job_dir(job) / "residual-held.pt"

    def done_path(self, job: str, round_: int) -> Path:
        return self._round_path(job, round_, "done.json")

    def error_path(self, job: str, round_: int) -> Path:
        return self._round_path(job, round_, "error.json")

    def progress_path(self, job: str, round_: int) -> Path:
        return self._round_path(job, round_, "progress.json")

    def base_ready_path(self, job: str, round_: int) -> Path:
        return self._round_path(job, round_, "base.json")

    def cancel_path(self, job: str, round_: int) -> Path:
        return self._round_path(job, round_, "cancel")

    def start_params_path(self, job: str, round_: int) -> Path:
        return self._round_path(job, round_, "start.pt")

    def start_ready_path(self, job: str, round_: int) -> Path:
        return self._round_path(job, round_, "start.json")

    def checkpoint_path(self, job: str) -> Path:
        """``job``'s regional checkpoint record, beside its round files."""
        return self.job_dir(job) / _RECORD_NAME

    def whole_checkpoint_path(self, job: str) -> Path:
        """Where a whole-state checkpoint of the format before is kept for ``job``."""
        return self.job_dir(job) / _CHECKPOINT_NAME

    def optimizer_path(self, job: str, round_: int) -> Path:
        """The sharded inner optimizer state of ``job`` at the end of ``round_``."""
        return self.job_dir(job) / f"optimizer-round-{round_}"

    def optimizer_rounds(self, job: str) -> list[int]:
        """The rounds whose optimizer state directories ``job`` has (finished or not)."""
        job_dir = self.job_dir(job)
        if not job_dir.is_dir():
            return []
        found = (_OPTIMIZER_DIR_RE.fullmatch(entry.name) for entry in job_dir.iterdir())
        return sorted(int(m.group(1)) for m in found if m is not None)

    def inner_checkpoint_path(self, job: str) -> Path:
        """The inner state of ``job``'s round stopped mid-way (see
        :mod:`regional_agent.inner_checkpoint`)."""
        return self.job_dir(job) / _INNER_CHECKPOINT_NAME

    @property
    def legacy_checkpoint_path(self) -> Path:
        """Where groups kept the region's one checkpoint before it was per job."""
        return self.root / _CHECKPOINT_NAME

    @property
    def stop_path(self) -> Path:
        return self.root / "stop"

    @property
    def log_dir(self) -> Path:
        return self.root / "logs"

    def rank_log_path(self, rank: int) -> Path:
        return self.log_dir / f"rank-{_require_int('rank', rank, 0)}.log"

    @property
    def launcher_log_path(self) -> Path:
        return self.log_dir / "launcher.log"

    def rank_status_path(self, rank: int) -> Path:
        return self.root / "ranks" / f"rank-{_require_int('rank', rank, 0)}.json"

    # -- instructions --------------------------------------------------------------------

    def write_instruction(self, instruction: RoundInstruction) -> Path:
        """Atomically write (or rewrite) an instruction; rewriting makes it the newest."""
        path = self.instruction_path(instruction.job, instruction.round)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, instruction.to_json())
        return path

    def read_instruction(self, job: str, round_: int) -> RoundInstruction:
        path = self.instruction_path(job, round_)
        instruction = RoundInstruction.from_json(path.read_bytes(), source=str(path))
        if (instruction.job, instruction.round) != (job, round_):
            raise InvalidHandoffData(
                f"{path}: names job {instruction.job!r} round {instruction.round}, "
                f"not job {job!r} round {round_}"
            )
        return instruction

    def pending_instruction(self) -> tuple[str, int] | None:
        """Return (job, round) of the newest instruction if it is neither done nor failed.

        Newest means last written (modification time, then round number). Older
        instructions left without an outcome were superseded and are never served.
        """
        newest: tuple[int, int, str] | None = None
        jobs = self.root / "jobs"
        if not jobs.is_dir():
            return None
        for job_dir in jobs.iterdir():
            if not job_dir.is_dir():
                continue
            for entry in job_dir.iterdir():
                match = _ROUND_FILE_RE.fullmatch(entry.name)
                if match is None:
                    continue
                try:
                    mtime = entry.stat().st_mtime_ns
                except FileNotFoundError:  # pruned while scanning
                    continue
                key = (mtime, int(match.group(1)), job_dir.name)
                if newest is None or key > newest:
                    newest = key
        if newest is None:
            return None
        _, round_, job = newest
        if self.done_path(job, round_).exists() or self.error_path(job, round_).exists():
            return None
        return job, round_

    # -- delayed rounds ------------------------------------------------------------------

    def write_base_ready(self, ready: BaseReady) -> None:
        """Tell the workers of a delayed round that θ is at ``ready.base_params`` (durable)."""
        path = self.base_ready_path(ready.job, ready.round)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, ready.to_json())

    def read_base_ready(self, job: str, round_: int) -> BaseReady | None:
        path = self.base_ready_path(job, round_)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        return BaseReady.from_json(raw, str(path))

    def request_cancel(self, job: str, round_: int) -> None:
        """Ask the workers to drop the delayed round ``round_`` (see the worker)."""
        path = self.cancel_path(job, round_)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, b"cancel\n")

    def cancel_requested(self, job: str, round_: int) -> bool:
        return self.cancel_path(job, round_).exists()

    def clear_cancel(self, job: str, round_: int) -> None:
        self.cancel_path(job, round_).unlink(missing_ok=True)

    def write_start(
        self,
        job: str,
        round_: int,
        params: Mapping[str, torch.Tensor] | None,
        params_hash: str = "",
        reason: str = "",
    ) -> StartReady:
        """Hand an eager round its start S (durable), then the marker; ``params`` None:
        the workers start from their own parameters."""
        path = self.start_params_path(job, round_)
        path.parent.mkdir(parents=True, exist_ok=True)
        if params is None:
            ready = StartReady(job, round_, reason=reason)
        else:
            with AtomicFile(path) as f:
                torch.save(dict(params), f)
            ready = StartReady(job, round_, str(path), params_hash, reason)
        atomic_write_bytes(self.start_ready_path(job, round_), ready.to_json())
        return ready

    def read_start_ready(self, job: str, round_: int) -> StartReady | None:
        path = self.start_ready_path(job, round_)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        return StartReady.from_json(raw, str(path))

    # -- outcomes ------------------------------------------------------------------------

    def write_result(
        self,
        summary: RoundSummary,
        params: Mapping[str, torch.Tensor] | None = None,
        delta: QuantizedTensors | None = None,
    ) -> None:
        """Atomically write the result file (not yet visible as a result: see write_done):
        the trained ``params``, or the quantized ``delta`` (its residual file written
        before, by :func:`regional_agent.residual_file.write_residual`)."""
        if (params is None) == (delta is None):
            raise HandoffError("a result holds either the parameters or the delta")
        path = self.result_path(summary.job, summary.round)
        path.parent.mkdir(parents=True, exist_ok=True)
        body: dict[str, Any] = {"format": FORMAT_VERSION, "summary": asdict(summary)}
        if params is not None:
            body["params"] = dict(params)
        if delta is not None:
            body["delta"] = delta.to_state()
        with AtomicFile(path) as f:
            torch.save(body, f)

    def has_result_file(self, job: str, round_: int) -> bool:
        return self.result_path(job, round_).is_file()

    def read_result_file(self, job: str, round_: int) -> RoundResult:
        """Load a result file whether or not its done marker exists yet."""
        path = self.result_path(job, round_)
        try:
            body = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise InvalidHandoffData(f"{path}: unreadable result: {exc}") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT_VERSION:
            raise InvalidHandoffData(f"{path}: not a format-{FORMAT_VERSION} result file")
        summary = RoundSummary.from_json(json.dumps(body.get("summary")).encode(), str(path))
        if (summary.job, summary.round) != (job, round_):
            raise InvalidHandoffData(f"{path}: holds job {summary.job!r} round {summary.round}")
        if "delta" in body:
            try:
                delta = QuantizedTensors.from_state(body["delta"], f"{path}: delta")
            except CodecError as exc:
                raise InvalidHandoffData(str(exc)) from None
            residual = self.residual_path(job, round_)
            if not residual.is_file():
                raise InvalidHandoffData(f"{path}: its residual file {residual} is missing")
            return RoundResult(summary=summary, delta=delta, residual=residual)
        params = body.get("params")
        if not isinstance(params, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in params.items()
        ):
            raise InvalidHandoffData(f"{path}: params must map names to tensors")
        return RoundResult(summary=summary, params=params)

    def write_done(self, summary: RoundSummary) -> None:
        """Publish a result: write its marker last, after the result file is durable."""
        if not self.has_result_file(summary.job, summary.round):
            raise HandoffError(
                f"no result file for job {summary.job!r} round {summary.round}; "
                "a done marker must follow its result"
            )
        atomic_write_bytes(self.done_path(summary.job, summary.round), summary.to_json())

    def read_done(self, job: str, round_: int) -> RoundSummary | None:
        """Return the summary of a completed round, or None if it is not complete."""
        path = self.done_path(job, round_)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        return RoundSummary.from_json(raw, str(path))

    def read_completed(self, job: str, round_: int) -> RoundResult | None:
        """Return a completed round's result (done marker present), else None."""
        summary = self.read_done(job, round_)
        if summary is None:
            return None
        result = self.read_result_file(job, round_)
        if result.summary != summary:
            raise InvalidHandoffData(
                f"{self.result_path(job, round_)} does not match its done marker"
            )
        return result

    def write_error(self, job: str, round_: int, message: str) -> None:
        path = self.error_path(job, round_)
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"format": FORMAT_VERSION, "job": job, "round": round_, "message": message}
        atomic_write_bytes(path, json.dumps(body).encode())

    def read_error(self, job: str, round_: int) -> str | None:
        try:
            raw = self.error_path(job, round_).read_bytes()
        except FileNotFoundError:
            return None
        try:
            message = json.loads(raw)["message"]
        except (ValueError, KeyError, TypeError):
            return f"unreadable error marker {self.error_path(job, round_)}"
        return str(message)

    def clear_error(self, job: str, round_: int) -> None:
        self.error_path(job, round_).unlink(missing_ok=True)

    def write_progress(self, progress: RoundProgress) -> None:
        _replace_quickly(self.progress_path(progress.job, progress.round), asdict(progress))

    def read_progress(self, job: str, round_: int) -> RoundProgress | None:
        data = _read_json_or_none(self.progress_path(job, round_))
        try:
            return None if data is None else RoundProgress(**data)
        except TypeError:
            return None

    def prune_rounds(self, job: str, before_round: int) -> int:
        """Delete the files of ``job``'s rounds below ``before_round``; return how many rounds.

        The done marker goes first, so a half-pruned round reads as not completed rather
        than as a completed round with a missing result.
        """
        job_dir = self.job_dir(job)
        if not job_dir.is_dir():
            return 0
        rounds = {
            int(m.group(1))
            for entry in job_dir.iterdir()
            if (m := re.fullmatch(r"round-(\d+)\..+", entry.name)) is not None
        }
        pruned = 0
        for round_ in sorted(r for r in rounds if r < before_round):
            for suffix in (
                "done.json",
                "result.pt",
                "residual.pt",
                "error.json",
                "progress.json",
                "base.json",
                "cancel",
                "start.json",
                "start.pt",
            ):
                self._round_path(job, round_, suffix).unlink(missing_ok=True)
            self.instruction_path(job, round_).unlink(missing_ok=True)
            pruned += 1
        return pruned

    def forget_job(self, job: str) -> None:
        """Drop ``job``'s round files, its regional checkpoint (record, saved optimizer
        states, a whole-state or legacy one too) and inner checkpoint.

        File by file, never the directory: the worker scans it while idle. A worker whose
        in-memory state is past a round asked again, and that finds no regional checkpoint,
        takes this as the agent's discard and starts afresh (see the worker).
        """
        job_dir = self.job_dir(job)
        if job_dir.is_dir():
            # Instructions first: a round whose done marker went before its instruction
            # would read as pending, and an idle worker would train it again.
            for entry in job_dir.iterdir():
                if _ROUND_FILE_RE.fullmatch(entry.name) is not None:
                    entry.unlink(missing_ok=True)
        self.prune_rounds(job, sys.maxsize)
        self.inner_checkpoint_path(job).unlink(missing_ok=True)
        shutil.rmtree(inner_tensors_dir(self.inner_checkpoint_path(job)), ignore_errors=True)
        self.checkpoint_path(job).unlink(missing_ok=True)
        self.whole_checkpoint_path(job).unlink(missing_ok=True)
        self.remove_optimizer_states(job)
        legacy = self.legacy_checkpoint_path
        try:
            owner = self._load_checkpoint(legacy)
        except InvalidHandoffData:
            owner = None  # unreadable: no job can resume from it anyway
            legacy.unlink(missing_ok=True)
        if owner is not None and owner.job == job:
            legacy.unlink(missing_ok=True)

    # -- regional checkpoint -------------------------------------------------------------

    def write_checkpoint(self, checkpoint: RegionalCheckpoint) -> None:
        """Atomically replace the regional checkpoint record of ``checkpoint.job``.

        A whole-state checkpoint of the format before goes once the record is durable.
        """
        path = self.checkpoint_path(checkpoint.job)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, checkpoint.record())
        self.whole_checkpoint_path(checkpoint.job).unlink(missing_ok=True)

    def has_checkpoint(self, job: str) -> bool:
        return self.checkpoint_path(job).is_file() or self.whole_checkpoint_path(job).is_file()

    def read_checkpoint(self, job: str) -> RegionalCheckpoint | None:
        """``job``'s regional checkpoint (its record, else a whole-state one), or None."""
        path = self.checkpoint_path(job)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            path = self.whole_checkpoint_path(job)
            checkpoint = self._load_checkpoint(path)
        except OSError as exc:
            raise InvalidHandoffData(f"{path}: unreadable regional checkpoint: {exc}") from None
        else:
            checkpoint = RegionalCheckpoint.from_record(raw, str(path))
        if checkpoint is not None and checkpoint.job != job:
            raise InvalidHandoffData(f"{path}: holds the state of job {checkpoint.job!r}")
        return checkpoint

    def remove_optimizer_states(self, job: str, keep: Collection[int | None] = ()) -> None:
        """Remove ``job``'s saved optimizer states but those of the rounds in ``keep``
        (this node's files)."""
        for round_ in self.optimizer_rounds(job):
            if round_ not in keep:
                # Ranks sharing a filesystem remove the same directories: a race, no error.
                shutil.rmtree(self.optimizer_path(job, round_), ignore_errors=True)

    def read_optimizer_state(self, job: str) -> dict[str, Any] | None:
        """``job``'s saved inner optimizer state, whole, in this process (for inspection).

        None when its checkpoint names none. Holds the whole state in memory: never on a
        path that scales with the model.
        """
        checkpoint = self.read_checkpoint(job)
        if checkpoint is None:
            return None
        if checkpoint.optimizer_state is not None:
            return checkpoint.optimizer_state
        if checkpoint.optimizer_round is None:
            return None
        # Here, not at the top: torch.distributed.checkpoint costs every agent's start
        # most of a second, and only an inspection needs it.
        from regional_agent.optimizer_checkpoint import read_whole

        path = self.optimizer_path(job, checkpoint.optimizer_round)
        return read_whole(path, self.job_dir(job) / f".{path.name}.whole.tmp")

    def migrate_legacy_checkpoint(self) -> str | None:
        """Move a checkpoint at the old single-file place to its job's place, once.

        Returns the job it belonged to, or None when there was none to move. A job that
        already has its own checkpoint keeps it (written later than any legacy file), and
        the legacy file goes. An unreadable legacy file raises
        :class:`InvalidHandoffData` and stays where it is, unused, until :meth:`forget_job`
        of any job removes it. Call it while no rank reads checkpoints (rank 0, before the
        group's first collective).
        """
        legacy = self.legacy_checkpoint_path
        checkpoint = self._load_checkpoint(legacy)
        if checkpoint is None:
            return None
        if self.has_checkpoint(checkpoint.job):
            legacy.unlink(missing_ok=True)
        else:
            target = self.whole_checkpoint_path(checkpoint.job)
            target.parent.mkdir(parents=True, exist_ok=True)
            replace_durably(legacy, target)
        return checkpoint.job

    def _load_checkpoint(self, path: Path) -> RegionalCheckpoint | None:
        """A whole-state checkpoint of the format before, or None if there is none."""
        try:
            # Mapped, not read: a rank that does not load the optimizer state (FSDP ranks
            # other than 0) never pages it in.
            body = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise InvalidHandoffData(f"{path}: unreadable regional checkpoint: {exc}") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT_VERSION:
            raise InvalidHandoffData(f"{path}: not a format-{FORMAT_VERSION} regional checkpoint")
        try:
            checkpoint = RegionalCheckpoint(
                job=validate_name("job", body["job"]),
                last_round=_require_int("last_round", body["last_round"], 0),
                cursor=_require_int("cursor", body["cursor"], 0),
                world_size=_require_int("world_size", body["world_size"], 1),
                optimizer_state=body["optimizer_state"],
                parallelism=body.get("parallelism", "ddp"),
            )
        except (KeyError, ValueError) as exc:
            raise InvalidHandoffData(f"{path}: {exc}") from None
        if not isinstance(checkpoint.optimizer_state, dict):
            raise InvalidHandoffData(f"{path}: optimizer_state is not a state dict")
        return checkpoint

    # -- stop flag and rank status -------------------------------------------------------

    def request_stop(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.stop_path, b"stop\n")

    def clear_stop(self) -> None:
        self.stop_path.unlink(missing_ok=True)

    def stop_requested(self) -> bool:
        return self.stop_path.exists()

    def write_rank_status(self, status: RankStatus) -> None:
        _replace_quickly(self.rank_status_path(status.rank), asdict(status))

    def read_rank_statuses(self) -> list[RankStatus]:
        """Every rank's latest status; unreadable files are skipped (they are advisory)."""
        directory = self.root / "ranks"
        if not directory.is_dir():
            return []
        statuses: list[RankStatus] = []
        for path in sorted(directory.glob("rank-*.json")):
            data = _read_json_or_none(path)
            with contextlib.suppress(TypeError):
                if data is not None:
                    statuses.append(RankStatus(**data))
        return statuses


def _replace_quickly(path: Path, data: Mapping[str, Any]) -> None:
    """Rename a whole JSON file into place without fsync (for advisory files)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps(dict(data)).encode(), durable=False)


def _read_json_or_none(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_bytes())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None
