"""The job spec: what an operator submits (``geofed job submit FILE``, ``POST /v1/jobs``).

YAML or JSON, unknown keys are errors, and every error names the file (or the request),
the line and the key. The spec is stored as submitted, in its validated JSON form.

.. code-block:: yaml

    job: charlm-demo                   # job id (a DNS-label-like name)
    task:
      spec: geofed.examples.charlm:CharLMTask     # importable package.module:Class
      options: {d_model: 96, n_layers: 2}          # validated by the task's Options
    regions:                           # region -> datasets it trains on
      eu-west: [eu-parliament-proceedings]
      us-east: [us-public-domain-books]
    min_regions: 2                     # quorum once the deadline passes (default: all)
    max_regions: 3                     # regions it may grow to (default: those listed)
    rounds: 20                         # outer rounds to run
    inner_steps: 50                    # H: local steps per round
    seed: 0                            # θ_0 and every region's data order
    codec: {scheme: int8, block_size: 128, zstd_level: 1}        # geofed.codec_params
    outer_optimizer: {kind: nesterov, lr: 0.3, momentum: 0.8, momentum_warmup_rounds: 4}
    snapshot_every: 5                  # K: full snapshot every K rounds; or auto: Young/Daly
                                       # within snapshot_min_rounds..snapshot_max_rounds
                                       # (default 1..100; coordinator.publication.snapshot_policy)
    working_state_every: 10            # the coordinator saves θ, momentum and residual with
                                       # each snapshot and every n rounds; a restart replays
                                       # the rounds since from their kept deltas (default 10)
    retention: {keep_snapshots: 3, keep_every: 10}   # default: keep the whole chain
    deadline: {initial_s: 1800, min_s: 600, max_s: 14400}       # adaptive bounds
    checkpoint_storage: [eu-ckpt, us-ckpt]                      # candidates, in preference
    init_from: {job: llm-base, round: 40}   # optional θ_0: a version of another job, or
                                       # {path: FILE} an export under import_dirs; verified,
                                       # and its provenance joins the job's (admission)
    training:                          # how regions train (geofed.training_config)
      parallelism: ddp                 # or fsdp
      precision: fp32                  # or bf16
      lr_schedule: {kind: warmup_cosine, warmup_steps: 100, min_lr_ratio: 0.1}
    evaluation:                        # where θ is evaluated (geofed.evaluation_config)
      where: region                    # region | region:NAME | regions | coordinator | none
      every: 1                         # rounds between evaluations
    aggregation:                       # how deltas combine (coordinator.aggregation.config)
      rule: mean                       # mean | trimmed_mean | median
      norm_check: off                  # off | clip | refuse, against max_norm_ratio x median
      max_tokens_per_round: 1000000    # default: inner_steps x 2^24
      late: drop                       # drop | merge a delta that missed its round
    overlap: none                      # none | delayed: start round r+1 before θ_{r+1} comes;
                                       # streaming: delayed, syncing one fragment per round
    overlap_start: local               # delayed only: local | eager (start from an estimate)
    fragments: 4                       # streaming only: F (default 4; geofed.fragments)
    priority: research                 # a class of the coordinator's scheduling config
    team: vision                       # whose job it is (quotas, fair share); default: default
    needs: {cpu_slots: 2}              # in each region: gpus, gpu_kind, min_gpu_memory_gib,
                                       # cpu_slots; default: none (not capacity-scheduled)
    region_needs: {us-east: {gpus: 4, gpu_kind: NVIDIA H100 80GB HBM3}}   # per region
    budget: 500                        # optional: what it may cost (price table currency)

A job that states ``needs`` starts only when ``min_regions`` of its regions have that
much free at once (:mod:`coordinator.jobs.capacity`); until then it is ``queued``. A job
without ``needs`` is not capacity-scheduled: it starts at once, as jobs always did, and
shares its regions' workers with the other jobs there.
"""

from __future__ import annotations

import json
from typing import Annotated, Final, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from coordinator.aggregation.config import AggregationConfig
from coordinator.aggregation.outer_optimizer import OuterOptimizerConfig
from coordinator.rounds.deadline import DeadlineConfig
from coordinator.scheduling.teams import DEFAULT_TEAM
from coordinator.storage.retention import RetentionConfig
from geofed.codec_params import CodecParams
from geofed.control.messages import OVERLAP_MODES, Overlap, OverlapStart
from geofed.evaluation_config import EvaluationConfig
from geofed.located_yaml import MAX_DEPTH, LineMap, LocatedDocument
from geofed.task import TaskSpecError, parse_task_spec
from geofed.training_config import TrainingConfig
from geofed.types import validate_name
from policies.errors import PolicyLoadError, Problem
from policies.validation import validate_document
from policies.yaml_loader import load_located

__all__ = [
    "DEFAULT_TEAM",
    "MAX_SPEC_NODES",
    "JobSpec",
    "JobSpecError",
    "NeedSpec",
    "TaskSpec",
    "parse_job_spec",
]

#: A job spec is tens of nodes, its task options at most hundreds; the bound keeps a
#: hostile body's parse short.
MAX_SPEC_NODES = 10_000
#: Streaming's F when the spec does not say, and the most it may say.
DEFAULT_FRAGMENTS = 4
MAX_FRAGMENTS = 64


class JobSpecError(ValueError):
    """A job spec is malformed; ``problems`` lists every ``file:line: key: message``."""

    def __init__(self, problems: list[str]) -> None:
        if not problems:
            raise ValueError("JobSpecError needs at least one problem")
        self.problems = tuple(problems)
        more = len(problems) - 1
        super().__init__(problems[0] + (f" (and {more} more)" if more else ""))


def _job(value: str) -> str:
    return validate_name("job", value)


def _region(value: str) -> str:
    return validate_name("region", value)


def _dataset(value: str) -> str:
    return validate_name("dataset", value)


def _storage(value: str) -> str:
    return validate_name("storage location", value)


def _priority(value: str) -> str:
    return validate_name("priority class", value)


def _team(value: str) -> str:
    return validate_name("team", value)


JobId = Annotated[str, AfterValidator(_job)]
PriorityName = Annotated[str, AfterValidator(_priority)]
TeamName = Annotated[str, AfterValidator(_team)]
RegionName = Annotated[str, AfterValidator(_region)]
DatasetName = Annotated[str, AfterValidator(_dataset)]
StorageName = Annotated[str, AfterValidator(_storage)]


#: The most rounds, and inner steps per round, a job may ask for: far beyond any run,
#: well inside what the state store's integers and an exact float step count hold.
MAX_ROUNDS: Final = 10_000_000
MAX_INNER_STEPS: Final = 10_000_000


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TaskSpec(_Section):
    """The task every region trains and the coordinator evaluates."""

    spec: str = Field(description="import path 'package.module:ClassName' of a geofed Task")
    options: dict[str, JsonValue] = Field(
        default_factory=dict, description="checked against the task's Options when submitted"
    )

    @field_validator("spec")
    @classmethod
    def _importable_shape(cls, value: str) -> str:
        try:
            parse_task_spec(value)
        except TaskSpecError as exc:
            raise ValueError(str(exc)) from None
        return value


class InitFrom(_Section):
    """Where θ_0 comes from instead of the task's ``build_model`` (``init_from``)."""

    job: JobId | None = Field(default=None, description="a job of this coordinator")
    round: int | None = Field(
        default=None, ge=0, lt=2**31, description="with job: its version θ_round; default newest"
    )
    path: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="a geofed export (file, or --format hf directory) under the coordinator's "
        "import_dirs",
    )
    params_hash: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="the parameters hash θ_0 must have; the coordinator records it",
    )
    provenance: dict[RegionName, tuple[DatasetName, ...]] | None = Field(
        default=None,
        description="what the source derives from: recorded by the coordinator at submission",
    )
    location: StorageName | None = Field(
        default=None,
        description="with job: where its checkpoints are; recorded by the coordinator",
    )

    @model_validator(mode="after")
    def _one_source(self) -> InitFrom:
        if (self.job is None) == (self.path is None):
            raise ValueError("init_from names either a job (job, round) or a path")
        if self.round is not None and self.job is None:
            raise ValueError("init_from.round goes with init_from.job")
        return self


class NeedSpec(_Section):
    """What a job needs in one region: GPUs (of a kind, with memory) and/or worker slots."""

    gpus: int = Field(default=0, ge=0, le=1_000_000, description="accelerators")
    gpu_kind: str | None = Field(
        default=None, min_length=1, max_length=128, description="the device name; any if unset"
    )
    min_gpu_memory_gib: float = Field(default=0.0, ge=0, le=1e9, allow_inf_nan=False)
    cpu_slots: int = Field(
        default=0, ge=0, le=1_000_000, description="CPU worker slots (an agent's workers.count)"
    )

    @model_validator(mode="after")
    def _asks_for_something(self) -> NeedSpec:
        if self.gpus == 0 and self.cpu_slots == 0:
            raise ValueError("a need asks for at least one GPU (gpus) or CPU worker slot")
        if self.gpus == 0 and (self.gpu_kind is not None or self.min_gpu_memory_gib > 0):
            raise ValueError("gpu_kind and min_gpu_memory_gib apply only with gpus >= 1")
        return self


class JobSpec(_Section):
    """A whole job (see the module docstring)."""

    job: JobId
    task: TaskSpec
    regions: dict[RegionName, tuple[DatasetName, ...]] = Field(
        min_length=1, description="region -> datasets it trains on"
    )
    min_regions: int | None = Field(
        default=None, ge=1, le=10_000, description="quorum at the deadline; default: every region"
    )
    max_regions: int | None = Field(
        default=None,
        ge=1,
        le=10_000,
        description="the most regions the job may run on once regions join it (its number "
        "of data shards, fixed at submission); default: the regions listed",
    )
    rounds: int = Field(ge=1, le=MAX_ROUNDS, description="outer rounds")
    inner_steps: int = Field(ge=1, le=MAX_INNER_STEPS, description="local steps per round (H)")
    seed: int = Field(default=0, ge=0, lt=2**63)
    codec: CodecParams = Field(
        default_factory=CodecParams,
        description="how regions encode their deltas and the coordinator its updates "
        "(stochastic_rounding is for regions' deltas; the update rounds to nearest)",
    )
    outer_optimizer: OuterOptimizerConfig = Field(default_factory=OuterOptimizerConfig)
    snapshot_every: int | Literal["auto"] = Field(
        default=10,
        description="K: a full snapshot every K rounds; auto: the Young/Daly interval from "
        "the measured snapshot cost and the regions' observed failures "
        "(coordinator.publication.snapshot_policy), within "
        "snapshot_min_rounds..snapshot_max_rounds",
    )
    snapshot_min_rounds: int = Field(
        default=1,
        ge=1,
        le=MAX_ROUNDS,
        description="with snapshot_every: auto, the shortest interval in rounds",
    )
    snapshot_max_rounds: int = Field(
        default=100,
        ge=1,
        le=MAX_ROUNDS,
        description="with snapshot_every: auto, the longest interval in rounds",
    )
    working_state_every: int = Field(
        default=10,
        ge=1,
        le=MAX_ROUNDS,
        description="the coordinator saves its working state (θ, outer optimizer state, "
        "residual) every n rounds, with every snapshot and at the last round; a restart "
        "replays the rounds since the last save from their kept deltas "
        "(coordinator.storage.replay); 1: every round",
    )
    retention: RetentionConfig | None = Field(
        default=None,
        description="how much of the checkpoint chain to keep (coordinator.storage.retention); "
        "default: all of it",
    )
    deadline: DeadlineConfig = Field(default_factory=DeadlineConfig)
    max_round_attempts: int = Field(
        default=3,
        ge=1,
        le=1000,
        description="tries of a round that fails below quorum before the job fails",
    )
    checkpoint_storage: tuple[StorageName, ...] = Field(
        min_length=1, description="candidate storage locations, in order of preference"
    )
    init_from: InitFrom | None = Field(
        default=None,
        description="θ_0 from a version of another job or an exported model, verified; the "
        "job inherits what that derives from (default: the task's build_model)",
    )
    training: TrainingConfig = Field(
        default_factory=TrainingConfig,
        description="how every region's worker group trains; recorded in each delta's manifest",
    )
    evaluation: EvaluationConfig = Field(
        default_factory=EvaluationConfig,
        description="where the global parameters are evaluated: by default a region, on its "
        "own accelerator, before it trains from them",
    )
    aggregation: AggregationConfig = Field(
        default_factory=AggregationConfig,
        description="how a round's deltas are combined, and what one region may weigh in it",
    )
    code_mismatch: Literal["warn", "refuse"] = Field(
        default="warn",
        description="a region whose task code fingerprint differs from the coordinator's "
        "(geofed.lineage): warned about at its first delta, or each of its deltas refused",
    )
    overlap: Overlap = Field(
        default="none",
        description="none: regions wait for θ_r before round r; delayed: a region starts "
        "round r+1 from its own parameters once it sent round r's delta, and folds θ_{r+1} "
        "in when it comes (the one-step delayed outer update); streaming: as delayed, and "
        "round r synchronizes only fragment r mod F of the model (Streaming DiLoCo)",
    )
    overlap_start: OverlapStart = Field(
        default="local",
        description="overlap delayed only: where round r+1 starts before θ_{r+1} comes; "
        "local: the region's own parameters; eager: θ_r stepped by the outer optimizer on "
        "an estimate of round r's mean delta (geofed.eager_start)",
    )
    fragments: int | None = Field(
        default=None,
        ge=2,
        le=MAX_FRAGMENTS,
        description="overlap streaming only: F, the fragments the model is split into; "
        "round r synchronizes fragment r mod F, so each tensor is synchronized every F "
        f"rounds (geofed.fragments); default {DEFAULT_FRAGMENTS}",
    )

    priority: PriorityName | None = Field(
        default=None,
        description="a priority class of the coordinator's scheduling config; default: its "
        "default_priority",
    )
    team: TeamName | None = Field(default=None, description="the owning team; default: default")
    needs: NeedSpec | None = Field(
        default=None,
        description="what the job needs in each of its regions; default: none stated, and "
        "the job is not capacity-scheduled (it starts at once and shares its regions)",
    )
    region_needs: dict[RegionName, NeedSpec] = Field(
        default_factory=dict, description="region -> its own need, instead of needs"
    )
    budget: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="what the job may cost, in the coordinator's price table's currency: "
        "the queue, the submission's answer and the job's status show its estimate against "
        "it (coordinator.costs.estimate); default: none",
    )

    @field_validator("overlap", mode="before")
    @classmethod
    def _known_overlap(cls, value: object) -> object:
        if value not in OVERLAP_MODES:
            raise ValueError(f"overlap must be one of {', '.join(OVERLAP_MODES)}; got {value!r}")
        return value

    @field_validator("snapshot_every", mode="before")
    @classmethod
    def _interval_or_auto(cls, value: object) -> object:
        if value == "auto":
            return value
        if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_ROUNDS:
            return value
        raise ValueError(
            f"snapshot_every must be a whole number in 1..{MAX_ROUNDS} or auto; got {value!r}"
        )

    @field_validator("snapshot_max_rounds")
    @classmethod
    def _bounds_ordered(cls, value: int, info: ValidationInfo) -> int:
        low = info.data.get("snapshot_min_rounds")
        if isinstance(low, int) and value < low:
            raise ValueError(f"snapshot_max_rounds ({value}) is below snapshot_min_rounds ({low})")
        return value

    @field_validator("regions")
    @classmethod
    def _datasets_given(cls, value: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        for region, datasets in value.items():
            if not datasets:
                raise ValueError(f"region {region} is assigned no datasets")
            if len(set(datasets)) != len(datasets):
                raise ValueError(f"region {region} lists a dataset twice")
        return value

    @field_validator("checkpoint_storage")
    @classmethod
    def _unique_storage(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(value)) != len(value):
            raise ValueError(f"checkpoint_storage repeats a name: {list(value)}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _streaming_fragments_default(cls, data: object) -> object:
        # An explicit null means the default too: a streaming job always has its F.
        streaming = isinstance(data, dict) and data.get("overlap") == "streaming"
        if streaming and isinstance(data, dict) and data.get("fragments") is None:
            return {**data, "fragments": DEFAULT_FRAGMENTS}
        return data

    @model_validator(mode="after")
    def _fragments_need_streaming(self) -> JobSpec:
        if self.overlap != "streaming" and self.fragments is not None:
            raise ValueError(f"fragments needs overlap streaming (overlap is {self.overlap!r})")
        return self

    @model_validator(mode="after")
    def _merge_needs_whole_rounds(self) -> JobSpec:
        if self.aggregation.late == "merge" and self.overlap == "streaming":
            raise ValueError(
                "aggregation.late merge needs overlap none or delayed: under streaming a late "
                "delta holds another fragment than the round that would take it"
            )
        return self

    @model_validator(mode="after")
    def _start_needs_delayed(self) -> JobSpec:
        if self.overlap_start != "local" and self.overlap != "delayed":
            raise ValueError(
                f"overlap_start {self.overlap_start!r} needs overlap delayed "
                f"(overlap is {self.overlap!r})"
            )
        return self

    @model_validator(mode="after")
    def _quorum(self) -> JobSpec:
        if self.min_regions is not None and self.min_regions > len(self.regions):
            raise ValueError(
                f"min_regions ({self.min_regions}) exceeds the {len(self.regions)} regions"
            )
        return self

    @model_validator(mode="after")
    def _room_to_grow(self) -> JobSpec:
        if self.max_regions is None:
            return self
        if self.max_regions < len(self.regions):
            raise ValueError(
                f"max_regions ({self.max_regions}) is below the {len(self.regions)} regions listed"
            )
        if self.min_regions is not None and self.max_regions < self.min_regions:
            raise ValueError(
                f"max_regions ({self.max_regions}) is below min_regions ({self.min_regions})"
            )
        return self

    @model_validator(mode="after")
    def _needs_of_its_regions(self) -> JobSpec:
        strangers = sorted(set(self.region_needs) - set(self.regions))
        if strangers:
            raise ValueError(
                f"region_needs names {strangers}, which are not among the job's regions "
                f"{sorted(self.regions)}"
            )
        if self.region_needs and self.needs is None:
            raise ValueError("region_needs refines needs: state needs (for the other regions)")
        return self

    @model_validator(mode="after")
    def _warmup_within_the_job(self) -> JobSpec:
        schedule = self.training.lr_schedule
        if schedule.kind == "warmup_cosine" and schedule.warmup_steps > self.total_steps:
            raise ValueError(
                f"training.lr_schedule.warmup_steps ({schedule.warmup_steps}) exceeds the job's "
                f"{self.total_steps} inner steps (rounds x inner_steps)"
            )
        return self

    @model_validator(mode="after")
    def _evaluating_region_in_the_job(self) -> JobSpec:
        named = self.evaluation.region
        if named is not None and named not in self.regions:
            raise ValueError(
                f"evaluation.where names region {named}, which is not one of the job's regions "
                f"{sorted(self.regions)}"
            )
        return self

    @property
    def quorum(self) -> int:
        return self.min_regions if self.min_regions is not None else len(self.regions)

    @property
    def region_slots(self) -> int:
        """The job's data shards: ``max_regions``, else the regions listed (elastic jobs)."""
        return self.max_regions if self.max_regions is not None else len(self.regions)

    @property
    def total_steps(self) -> int:
        """Each region's inner steps over the whole job: what the LR schedule runs over."""
        return self.rounds * self.inner_steps

    @property
    def fixed_snapshot_every(self) -> int | None:
        """K when snapshots are taken every K rounds; None with ``snapshot_every: auto``."""
        return None if self.snapshot_every == "auto" else self.snapshot_every

    @property
    def team_name(self) -> str:
        return self.team if self.team is not None else DEFAULT_TEAM

    def need_in(self, region: str) -> NeedSpec | None:
        """What the job needs in ``region``; None: it states no needs."""
        return self.region_needs.get(region, self.needs)

    @property
    def region_names(self) -> tuple[str, ...]:
        return tuple(sorted(self.regions))

    def to_json(self) -> dict[str, JsonValue]:
        data: dict[str, JsonValue] = self.model_dump(mode="json")
        if data.get("budget", 0) is None:
            # Left out unless stated: the spec of every job before it reads (and hashes,
            # in its lineage) as it did.
            del data["budget"]
        return data


def parse_job_spec(text: str, file: str) -> JobSpec:
    """Parse a YAML or JSON job spec; raise :class:`JobSpecError` naming file, line and key."""
    try:
        document = load_located(text, file, max_nodes=MAX_SPEC_NODES)
    except PolicyLoadError as yaml_error:
        document = _as_json(text, file, yaml_error)
    try:
        spec = validate_document(JobSpec, document, file)
    except PolicyLoadError as exc:
        raise JobSpecError([str(problem) for problem in exc.problems]) from None
    recorded = [
        key
        for key in ("provenance", "location")
        if spec.init_from is not None and getattr(spec.init_from, key) is not None
    ]
    if recorded:
        line = document.lines.line_of(("init_from", recorded[0]))
        raise JobSpecError(
            [f"{file}:{line}: init_from.{recorded[0]}: recorded by the coordinator, not submitted"]
        )
    return spec


def parse_stored_spec(data: object) -> JobSpec:
    """Rebuild a spec from its stored JSON form (it validated when it was submitted)."""
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise JobSpecError([f"stored job spec: {exc}"]) from None


def _as_json(text: str, file: str, yaml_error: PolicyLoadError) -> LocatedDocument:
    """JSON that YAML cannot read (tabs): parse it as JSON; keys then have no line."""
    if not text.lstrip().startswith("{"):
        raise JobSpecError([str(p) for p in yaml_error.problems]) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        problem = Problem(file, exc.lineno, "(syntax)", exc.msg)
        raise JobSpecError([str(problem)]) from None
    except RecursionError:
        data = None  # nested far too deep: refused below like any deep document
    if data is None or _depth(data) > MAX_DEPTH:
        problem = Problem(file, 1, "(syntax)", f"nested deeper than {MAX_DEPTH} levels")
        raise JobSpecError([str(problem)]) from None
    return LocatedDocument(data, LineMap({}))


def _depth(data: object) -> int:
    """How deeply ``data`` nests lists and objects, found without recursion."""
    deepest = 0
    pending: list[tuple[object, int]] = [(data, 1)]
    while pending:
        item, depth = pending.pop()
        deepest = max(deepest, depth)
        if depth > MAX_DEPTH:
            break
        if isinstance(item, dict):
            pending.extend((value, depth + 1) for value in item.values())
        elif isinstance(item, list):
            pending.extend((value, depth + 1) for value in item)
    return deepest
