"""The user Task API: what a job trains, and how a job config names it.

A job config names its task by import path (``package.module:Name``) plus an ``options``
mapping. :func:`load_task` imports the class, validates the options against the class's
pydantic ``Options`` model and constructs it. Every region's workers and the coordinator
load the same task with the same options, so everything a task produces must be a pure
function of its options and arguments: the initial model of a seed, the batch at a step
of a shard, the validation loss of a model.

Besides the required methods, a task may override optional hooks that tell the region's
workers how to train it well on accelerators: :meth:`Task.fsdp_units` (which blocks
FSDP2 shards separately), :meth:`Task.checkpoint_units` (which blocks recompute their
activations in backward), :meth:`Task.flops_per_token` (for the utilisation estimate)
and :meth:`Task.on_step` (the region's global inner step), and
:meth:`Task.init_non_federated` (lets a model with non-federated buffers be built on the
``meta`` device). ``docs/tasks.md`` walks
through a complete task.

Importing a task runs the named module's code; only operators can submit jobs, the
spec is checked for shape here, and a coordinator imports only modules its allow-list
names (:func:`task_module_refusal`) before anything is imported.
"""

from __future__ import annotations

import importlib
import inspect
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar, cast

import torch
from pydantic import BaseModel, ValidationError
from torch import nn

from geofed.data.location import DataError, DatasetLocation
from geofed.params import count_parameters
from geofed.types import validate_name

BatchT = TypeVar("BatchT")

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_SPEC_RE = re.compile(rf"^({_IDENT}(?:\.{_IDENT})*):({_IDENT}(?:\.{_IDENT})*)$")
_MODULE_PATTERN_RE = re.compile(rf"^{_IDENT}(?:\.{_IDENT})*(?:\.\*)?$")

#: Task modules every coordinator may import; its config's ``task_modules`` adds more.
DEFAULT_TASK_MODULES: tuple[str, ...] = ("geofed.examples.*", "geofed.tasks.*")


class TaskError(Exception):
    """Base class of errors raised while loading or configuring a task."""


class TaskSpecError(TaskError):
    """The task spec is malformed, cannot be imported, or does not name a Task class."""


class TaskOptionsError(TaskError):
    """The options given for a task do not validate against its ``Options`` model."""


@dataclass(frozen=True, slots=True)
class DataShard:
    """Which slice of a task's data one worker trains on.

    ``region_index`` of ``num_regions`` picks the region's data; ``rank`` of
    ``world_size`` picks the worker's part of it inside the region. ``seed`` fixes the
    data order, so the batch at a step is the same after a restart. ``datasets``: where
    the region keeps the datasets the job trains on there (the agent's ``datasets``
    config), by name; empty for a task with data of its own. ``datasets_without_files``:
    those the job trains on there that the agent config names without files (a task
    that reads files refuses them: :meth:`located`).
    """

    region: str
    region_index: int
    num_regions: int
    rank: int
    world_size: int
    seed: int
    datasets: Mapping[str, DatasetLocation] = field(default_factory=dict)
    datasets_without_files: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        validate_name("region", self.region)
        if self.num_regions < 1:
            raise ValueError(f"num_regions must be >= 1, got {self.num_regions}")
        if not 0 <= self.region_index < self.num_regions:
            raise ValueError(
                f"region_index must be in [0, {self.num_regions}), got {self.region_index}"
            )
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")

    def located(self, names: Iterable[str] | None = None) -> dict[str, DatasetLocation]:
        """Where the datasets ``names`` (None: every one the job trains on here) are, for
        a task that reads files; a :class:`~geofed.data.DataError` names those the agent
        config gives no files for, before any file is read."""
        chosen = sorted({*self.datasets, *self.datasets_without_files} if names is None else names)
        missing = [name for name in chosen if name not in self.datasets]
        if missing:
            which = f"dataset {missing[0]} has" if len(missing) == 1 else "datasets have"
            raise DataError(
                f"{which} no files in region {self.region}'s agent config "
                f"({', '.join(missing)}), and this job's task reads its data from files: add "
                f"path: and format: under datasets: {missing[0]}: in the agent config "
                f"(datasets: {{{missing[0]}: {{path: /data/..., format: parquet}}}})"
            )
        return {name: self.datasets[name] for name in chosen}


class Task(ABC, Generic[BatchT]):
    """A trainable task: model, inner optimizer, data, loss and evaluation.

    A subclass that takes options declares ``Options``, a pydantic model (forbid extra
    fields so typos fail at load), and is constructed as ``cls(options)`` with a
    validated instance; a subclass without ``Options`` is constructed as ``cls()``.

    The federated state is the model's floating-point parameters and persistent buffers
    (:func:`geofed.params.federated_state`); any other buffer (a complex RoPE table, an
    integer counter) must be rebuilt by :meth:`build_model` identically everywhere.

    The hooks that take a ``model`` are given the bare module :meth:`build_model`
    returned, on its device, before the worker wraps it for DDP or FSDP.
    """

    Options: ClassVar[type[BaseModel] | None] = None

    @abstractmethod
    def build_model(self, seed: int | None = None) -> nn.Module:
        """Return a freshly initialised model; identical parameters for an equal seed.

        ``None`` means the seed the task's options configure. Must not disturb the
        caller's global random state.
        """

    def build_optimizer(self, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        """Return the inner optimizer over ``params`` (AdamW with torch defaults here)."""
        return torch.optim.AdamW(params)

    @abstractmethod
    def batches(self, shard: DataShard, start_step: int = 0) -> Iterator[BatchT]:
        """Yield this shard's batches from ``start_step`` on, without end.

        The batch at step ``s`` depends only on ``(shard, s)``: a worker restarted at its
        data cursor ``s`` continues exactly where it stopped.
        """

    @abstractmethod
    def loss(self, model: nn.Module, batch: BatchT) -> torch.Tensor:
        """Return the scalar training loss of ``model`` (possibly DDP-wrapped) on ``batch``."""

    @abstractmethod
    def tokens(self, batch: BatchT) -> int:
        """Return how many tokens ``batch`` trains on; weights the region's delta."""

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Return held-out metrics, at least ``val_loss``; empty if the task has none.

        Deterministic and of bounded cost: a fixed validation split, a fixed number of
        batches.
        """
        del model
        return {}

    def fingerprint(self) -> str | None:
        """A digest of what the task reads besides its options (a model directory's
        files), or None when it reads nothing.

        The coordinator takes it when it loads the job and announces it; a region whose
        workers compute another refuses to train, so every side trains the same model.
        """
        return None

    def evaluate_region(self, model: nn.Module, shard: DataShard) -> dict[str, float]:
        """Return held-out metrics as a region measures them, on its own data (``shard``).

        The region's workers call this (every rank, with its own shard); the coordinator,
        which holds no region's data, calls :meth:`evaluate`. Default: :meth:`evaluate`.
        """
        del shard
        return self.evaluate(model)

    def fsdp_units(self, model: nn.Module) -> Sequence[nn.Module]:
        """Return the submodules FSDP2 shards as units of their own, before the root.

        Typically the transformer blocks: each block's parameters are gathered just for
        its forward and backward. Empty (the default): the root is the only unit.
        """
        del model
        return ()

    def init_non_federated(self, model: nn.Module) -> None:
        """Fill the tensors θ does not carry, in a model built on the ``meta`` device.

        The region's workers build the model with ``torch.device("meta")`` (no storage),
        shard it, allocate each rank's part with ``to_empty`` and load θ into it; only the
        non-federated tensors (a complex RoPE table, an integer counter) then still need
        values, and this hook computes them in place on the model's device. A model
        without such tensors needs nothing. The default raises
        :class:`NotImplementedError`: a model that has such tensors is then built whole
        on the host, as before, and the worker logs that it did.
        """
        del model
        raise NotImplementedError

    def checkpoint_units(self, model: nn.Module) -> Sequence[nn.Module]:
        """Return the submodules whose activations are recomputed in backward.

        Used when the job enables ``training.activation_checkpointing``; empty by
        default.
        """
        del model
        return ()

    def flops_per_token(self, model: nn.Module) -> float:
        """Return the training FLOPs (forward and backward) per token of ``model``.

        Feeds the model-FLOPs-utilisation estimate; the default is the usual
        ``6 * parameters``, which leaves out attention over the sequence.
        """
        return 6.0 * count_parameters(model)

    def on_step(self, step: int) -> None:
        """Hear of the region's global inner step ``step`` before it is taken.

        Called on every rank before each optimizer step; ``step`` counts from 0 over the
        whole job (it continues across rounds and worker restarts), the index the
        learning-rate schedule uses. Override for step-dependent behaviour; the default
        does nothing.
        """
        del step


def evaluates_centrally(task_class: type[Task[Any]]) -> bool:
    """Whether a task measures anything without a region's data (it defines ``evaluate``):
    a task that does not is evaluated by the regions only, and no coordinator builds its
    model to learn nothing."""
    return task_class.evaluate is not Task.evaluate


def parse_task_spec(spec: str) -> tuple[str, str]:
    """Split ``package.module:Name`` into module and attribute path, checking its shape."""
    if not isinstance(spec, str):
        raise TaskSpecError(f"task spec must be a string, got {type(spec).__name__}")
    match = _SPEC_RE.fullmatch(spec)
    if match is None:
        raise TaskSpecError(f"malformed task spec {spec!r}: expected 'package.module:ClassName'")
    return match.group(1), match.group(2)


def validate_module_pattern(pattern: str) -> str:
    """``package.module`` (that module) or ``package.*`` (the package and all below it)."""
    if not isinstance(pattern, str) or _MODULE_PATTERN_RE.fullmatch(pattern) is None:
        raise ValueError(f"task module pattern {pattern!r} must be 'package.module' or 'package.*'")
    return pattern


def task_module_refusal(spec: str, allowed: Iterable[str]) -> str | None:
    """Why the module of ``spec`` may not be imported, or None when ``allowed`` names it.

    Decided on the text alone, so a refused spec imports nothing. ``allowed`` holds
    :func:`validate_module_pattern` patterns.
    """
    module, _ = parse_task_spec(spec)
    patterns = tuple(allowed)
    for pattern in patterns:
        if pattern.endswith(".*"):
            package = pattern[:-2]
            if module == package or module.startswith(package + "."):
                return None
        elif module == pattern:
            return None
    return (
        f"task module {module!r} is not in this coordinator's task_modules "
        f"({', '.join(patterns) or 'none'})"
    )


def load_task_class(spec: str) -> type[Task[Any]]:
    """Import the Task subclass ``spec`` names, with a clear error for each way it fails."""
    module_name, attr_path = parse_task_spec(spec)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise TaskSpecError(f"task spec {spec!r}: no module named {missing!r}") from None
        raise TaskSpecError(f"task spec {spec!r}: importing {module_name!r} failed: {exc}") from exc
    except Exception as exc:
        raise TaskSpecError(
            f"task spec {spec!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    obj: object = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise TaskSpecError(
                f"task spec {spec!r}: {module_name!r} has no attribute {attr_path!r}"
            ) from None
    if not (inspect.isclass(obj) and issubclass(obj, Task)):
        raise TaskSpecError(
            f"task spec {spec!r} names {type(obj).__name__} {obj!r}, "
            "not a subclass of geofed.task.Task"
        )
    if inspect.isabstract(obj):
        missing_methods = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
        raise TaskSpecError(
            f"task spec {spec!r}: {obj.__qualname__} is abstract (missing {missing_methods})"
        )
    return obj


def load_task(spec: str, options: Mapping[str, Any] | None = None) -> Task[Any]:
    """Import the task ``spec`` names and construct it with validated ``options``."""
    cls = load_task_class(spec)
    given = {} if options is None else options
    if not isinstance(given, Mapping):
        raise TaskOptionsError(
            f"options for task {spec!r} must be a mapping, got {type(given).__name__}"
        )
    options_model = cls.Options
    if options_model is None:
        if given:
            raise TaskOptionsError(
                f"task {spec!r} takes no options, got: {', '.join(sorted(map(str, given)))}"
            )
        return cls()
    if not (inspect.isclass(options_model) and issubclass(options_model, BaseModel)):
        raise TaskSpecError(f"task {spec!r}: Options must be a pydantic BaseModel subclass")
    try:
        validated = options_model.model_validate(dict(given))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or '<options>'}: {err['msg']}" for err in exc.errors()
        )
        raise TaskOptionsError(f"invalid options for task {spec!r}: {problems}") from None
    construct = cast("Callable[[BaseModel], Task[Any]]", cls)
    return construct(validated)
