"""An in-process simulation of a federation's training rounds, for the benchmarks.

The round math is the daemons' own, called, not restated: each region trains
``inner_steps`` steps from θ_r with the task's inner optimizer (whose state persists
across rounds, as in a region's worker group), then forms and encodes Δ = θ_r - θ_local
with its error feedback as the regional agent does
(:func:`regional_agent.rounds.delta.encode_delta`);
the coordinator decodes the deltas chunk by chunk and combines them by the job's
aggregation rule in canonical order (:func:`coordinator.aggregation.robust.combine`, as
:func:`coordinator.aggregation.outer_round.mean_delta` does over its spool), then takes the outer
step,
encodes θ' - θ_r plus its own residual and sets θ_{r+1} = θ_r + decode(update)
(:func:`coordinator.aggregation.outer_round.publication_step`), which a region's reconstruction must
match bit for bit.

What is not simulated: processes, networks and torch.distributed. A region with W
workers at local batch b is simulated as one model that accumulates the gradients of
its W rank shards' batches, each scaled by 1/W: the gradient DDP's all-reduce would
produce, i.e. one model at batch W·b. The synchronous baseline is the same with all
regions' rank shards in every step: data-parallel training across every region.

With ``overlap="delayed"`` a region does not wait for θ_{r+1}: having sent Δ_r it trains
round r+1 on from its own parameters y_r = θ_r + p_r, keeping the snapshot S = y_r, and
when θ_{r+1} arrives (after ``arrival_fraction`` of the round's inner steps; 1.0, the
default, is at the end of the inner phase: communication that takes a whole phase) it
applies y ← y + (θ_{r+1} - S), so that Δ_{r+1} is formed against θ_{r+1} as usual. The
inner optimizer's state and the data order carry on throughout.

Corrections of that rule can be measured (all off by default):

* ``fold_mix`` a: the fold is y ← θ_{r+1} + a·(y - S), damping the progress made on the
  stale start (a = 1 is the rule above, computed as above so it is bit for bit the same;
  a = 0 keeps none of it).
* ``fold_blend`` alpha: Streaming DiLoCo's merge instead (Douillard et al. 2025), y ← alpha·y +
  (1 - alpha)·θ_{r+1}: the region's parameters averaged with the global ones it receives.
* ``stale_weight``: a staleness-aware outer step. A round whose first f·H inner steps were
  trained from a stale start (f: ``arrival_fraction``) is f outer steps behind on average
  per step, and its mean pseudo-gradient is scaled by 1 / (1 + f) before the outer step
  (staleness-aware SGD's lr / τ with τ = 1 + f; Zhang et al. 2016): the outer learning rate
  of delayed rounds, 0.3 at f = 0, is 0.2 at f = 1/2 and 0.15 at f = 1.
* ``delayed_start``: where the region trains from until θ_{r+1} arrives. ``local`` is
  y_r (the rule above); ``global`` is θ_r, the last global parameters it has; ``eager``
  is θ_r plus an outer step on an estimate of round r's mean delta made from what a
  region has (after Kale et al. 2025, "Eager Updates for Overlapped Communication and
  Computation in DiLoCo"): its own fresh Δ_r in place of its own previous one in the
  previous round's mean, ĝ_r = ḡ_{r-1} + (Δ_r - Δ_{r-1}) / M. ḡ_{r-1} and the outer
  momentum are not sent to regions; they are recovered from the published θ_r - θ_{r-1}
  and the job's outer config by replaying the outer optimizer (:class:`OuterReplica`).
  S is then that start, and the fold is as above. The math is the regional agent's own
  (:mod:`geofed.eager_start`).

With ``overlap="streaming"`` (Streaming DiLoCo on top of the above) the model's tensors are
split into ``fragments`` F (:func:`geofed.fragments.fragment_plan`, the daemons' split) and
round r synchronizes fragment r mod F only: each region's Δ_r names that fragment's tensors
(the error-feedback residual of the others carried over unchanged), the coordinator combines
and steps only those (the momentum buffers and update residual of the others kept) and
publishes an update that names only them, so every other tensor of θ_{r+1} is θ_r's. A
region folds that fragment alone one round late, y[n] ← y[n] + (θ_{r+1}[n] - S[n]) for its
tensors n (S holds only them); the other tensors train on locally until their own round.
Each tensor is thus synchronized every F rounds; F = 1 is ``delayed``, bit for bit.

An ``attack`` makes the last region hostile: it trains honestly, then sends its delta
multiplied by :data:`ATTACK_FACTORS` (through the agent's own encoding), claiming its
honest tokens.
"""

from __future__ import annotations

import copy
import functools
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from coordinator.aggregation.config import AggregationConfig
from coordinator.aggregation.outer_optimizer import OuterOptimizer, OuterOptimizerConfig
from coordinator.aggregation.outer_round import publication_step
from coordinator.aggregation.robust import combine
from geofed.codec import EncodedStream, ErrorFeedback, decode, decode_pieces
from geofed.codec_params import CodecParams, Scheme
from geofed.deltas import apply_partial_update
from geofed.eager_start import OuterReplica
from geofed.fragments import FragmentError, FragmentPlan, fragment_plan
from geofed.params import load_federated_state, parameters_vector_hash, state_to_fp32
from geofed.task import DataShard, Task
from regional_agent.rounds.delta import EncodedDelta, encode_delta

Method = Literal["sync", "diloco"]
Attack = Literal["none", "scaled", "sign_flipped"]
Overlap = Literal["none", "delayed", "streaming"]
DelayedStart = Literal["local", "global", "eager"]

#: What a hostile region multiplies its honest delta by.
ATTACK_FACTORS: dict[Attack, float] = {"none": 1.0, "scaled": 10.0, "sign_flipped": -2.0}


class SimulationError(RuntimeError):
    """A simulated run cannot go on: bad settings, divergence or a broken invariant."""


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One simulated training run.

    ``sync`` trains ``warmup_steps + rounds * inner_steps`` synchronous steps and
    evaluates every ``inner_steps``; ``diloco`` trains ``warmup_steps`` synchronous
    steps (a warm start), then ``rounds`` rounds of ``inner_steps`` inner steps. Both
    see the same tokens.
    """

    name: str
    method: Method
    regions: int
    workers: int
    rounds: int
    inner_steps: int
    seed: int
    scheme: Scheme = "fp32"
    outer: OuterOptimizerConfig = field(default_factory=OuterOptimizerConfig)
    warmup_steps: int = 0
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    attack: Attack = "none"
    overlap: Overlap = "none"
    arrival_fraction: float = 1.0
    fold_mix: float = 1.0
    fold_blend: float | None = None
    stale_weight: bool = False
    delayed_start: DelayedStart = "local"
    fragments: int | None = None

    def __post_init__(self) -> None:
        for what in ("regions", "workers", "rounds", "inner_steps"):
            if getattr(self, what) < 1:
                raise SimulationError(f"{what} must be >= 1, got {getattr(self, what)}")
        if self.warmup_steps < 0 or self.seed < 0:
            raise SimulationError("warmup_steps and seed must be >= 0")
        if not 0.0 <= self.arrival_fraction <= 1.0:
            raise SimulationError(
                f"arrival_fraction must be in [0, 1], got {self.arrival_fraction}"
            )
        if not 0.0 <= self.fold_mix <= 1.0:
            raise SimulationError(f"fold_mix must be in [0, 1], got {self.fold_mix}")
        if self.fold_blend is not None and (
            not 0.0 <= self.fold_blend <= 1.0 or self.fold_mix != 1.0
        ):
            raise SimulationError(
                f"fold_blend must be in [0, 1] and fold_mix 1, got fold_blend "
                f"{self.fold_blend} and fold_mix {self.fold_mix}"
            )
        if (self.overlap == "streaming") != (self.fragments is not None):
            raise SimulationError(
                f"fragments is set exactly with overlap 'streaming', got overlap "
                f"{self.overlap!r} and fragments {self.fragments}"
            )
        if self.fragments is not None and self.fragments < 1:
            raise SimulationError(f"fragments must be >= 1, got {self.fragments}")
        if self.overlap == "streaming" and self.delayed_start != "local":
            raise SimulationError(
                f"delayed_start {self.delayed_start!r} is not available with overlap 'streaming'"
            )

    @property
    def arrival_step(self) -> int:
        """Inner steps of a round trained before θ_r arrives, under ``delayed``/``streaming``."""
        return round(self.arrival_fraction * self.inner_steps)

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.rounds * self.inner_steps

    @property
    def stale_scale(self) -> float:
        """What a delayed round's mean pseudo-gradient is scaled by (see ``stale_weight``)."""
        if not self.stale_weight:
            return 1.0
        return 1.0 / (1.0 + self.arrival_step / self.inner_steps)


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """Validation loss of the global parameters after ``step`` steps (``tokens`` in all)."""

    step: int
    tokens: int
    val_loss: float


@dataclass(slots=True)
class RunResult:
    """Figures of one run. Bytes are on the simulated WAN, summed over all regions."""

    spec: RunSpec
    curve: list[CurvePoint] = field(default_factory=list)
    tokens: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    fp32_bytes_up: int = 0
    fp32_bytes_down: int = 0
    # Worst encoded/fp32 size over rounds: of one delta, of the update, and of what one
    # region moves in one round (its delta up and the update down).
    max_delta_ratio: float = 0.0
    max_update_ratio: float = 0.0
    max_round_region_ratio: float = 0.0
    train_s: float = 0.0
    comm_s: float = 0.0
    eval_s: float = 0.0
    wall_s: float = 0.0
    # The global parameters at the end: the coordinator's θ (the model under ``sync``).
    params: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def final_val_loss(self) -> float:
        return self.curve[-1].val_loss


def region_name(index: int) -> str:
    return f"region-{index}"


def rank_batches(task: Task[Any], spec: RunSpec) -> list[list[Iterator[Any]]]:
    """Return each region's rank-shard batch iterators, ``[region][rank]``."""
    return [
        [
            task.batches(DataShard(region_name(r), r, spec.regions, rank, spec.workers, spec.seed))
            for rank in range(spec.workers)
        ]
        for r in range(spec.regions)
    ]


def warm_up(task: Task[Any], spec: RunSpec) -> None:
    """Read every shard and the validation split, and build a model and its optimizer once.

    So no timed run pays for the data loading, or for the modules torch imports the
    first time an optimizer is built (seconds).
    """
    for region in rank_batches(task, spec):
        for shard in region:
            next(shard)
    model = task.build_model(seed=spec.seed)
    task.build_optimizer(model.parameters())
    task.evaluate(model)


def train_steps(
    task: Task[Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    shards: Sequence[Iterator[Any]],
    steps: int,
) -> int:
    """Train ``steps`` steps, each on one batch of every shard (mean gradient); return tokens."""
    tokens = 0
    model.train()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for shard in shards:
            batch = next(shard)
            loss = task.loss(model, batch)
            if not math.isfinite(float(loss.detach())):
                raise SimulationError(f"training diverged: loss {float(loss.detach())}")
            (loss / len(shards)).backward()
            tokens += task.tokens(batch)
        optimizer.step()
    return tokens


class SimCoordinator:
    """The coordinator's side of a round, as the daemon's ``publish_round`` computes it.

    It keeps what the daemon's working state keeps between rounds (θ, the outer
    optimizer's state, the update residual); only the storing and signing are left out.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        outer: OuterOptimizerConfig,
        codec: CodecParams,
        aggregation: AggregationConfig | None = None,
    ) -> None:
        self.params = dict(params)
        self._optimizer_state = OuterOptimizer(outer).state_dict()
        self._codec = codec
        self._residual: dict[str, torch.Tensor] | None = None
        self._specs = {name: tuple(t.shape) for name, t in self.params.items()}
        self._aggregation = aggregation or AggregationConfig()

    def close_round(
        self,
        deltas: Mapping[str, tuple[int, EncodedDelta]],
        names: Sequence[str] | None = None,
        own_steps: int | None = None,
        scale: float = 1.0,
    ) -> EncodedStream:
        """Fold the encoded deltas (region -> tokens, delta) in, step, return the update.

        ``scale``: what the mean pseudo-gradient is multiplied by before the step (1: as
        the daemon steps).

        ``names``: a streaming round's fragment, stepped as the daemon steps it
        (:func:`publication_step` with ``names`` and ``own_steps``: only those tensors,
        their momentum buffers and residual move, and the update names only them); None:
        the whole model.
        """
        specs = self._specs if names is None else {name: self._specs[name] for name in names}
        sources = {
            region: (float(tokens), functools.partial(decode_pieces, delta.frames))
            for region, (tokens, delta) in deltas.items()
        }
        mean = combine(specs, sources, self._aggregation).delta
        if scale != 1.0:
            mean = {name: tensor * scale for name, tensor in mean.items()}
        publication = publication_step(
            self.params,
            mean,
            self._optimizer_state,
            self._residual,
            self._codec,
            names=names,
            own_steps=own_steps,
        )
        self.params = publication.params
        self._optimizer_state = publication.optimizer_state
        self._residual = publication.residual
        return publication.stream


def _evaluate(task: Task[Any], model: nn.Module, result: RunResult, step: int) -> None:
    started = time.perf_counter()
    val_loss = task.evaluate(model)["val_loss"]
    result.eval_s += time.perf_counter() - started
    if not math.isfinite(val_loss):
        raise SimulationError(f"{result.spec.name}: validation loss {val_loss} at step {step}")
    result.curve.append(CurvePoint(step, result.tokens, val_loss))


def _train_sync(
    task: Task[Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    shards: list[Iterator[Any]],
    steps: int,
    eval_every: int,
    result: RunResult,
    first_step: int,
) -> None:
    """Synchronous steps on every region's shards, evaluating every ``eval_every`` steps.

    Plain data-parallel torch training, no geofed round: the whole of the synchronous
    baseline, and the warm start of a DiLoCo run.
    """
    done = 0
    while done < steps:
        chunk = min(eval_every, steps - done)
        started = time.perf_counter()
        result.tokens += train_steps(task, model, optimizer, shards, chunk)
        result.train_s += time.perf_counter() - started
        done += chunk
        _evaluate(task, model, result, first_step + done)


def simulate(task: Task[Any], spec: RunSpec) -> RunResult:
    """Run ``spec`` on ``task`` in this process and return its figures."""
    started = time.perf_counter()
    torch.manual_seed(spec.seed)
    result = RunResult(spec)
    shards = rank_batches(task, spec)
    every_shard = [it for region in shards for it in region]
    model = task.build_model(seed=spec.seed)
    optimizer = task.build_optimizer(model.parameters())
    _evaluate(task, model, result, 0)
    if spec.method == "sync":
        _train_sync(
            task, model, optimizer, every_shard, spec.total_steps, spec.inner_steps, result, 0
        )
    else:
        if spec.warmup_steps:
            _train_sync(
                task, model, optimizer, every_shard, spec.warmup_steps, spec.warmup_steps, result, 0
            )
        _run_rounds(task, spec, model, optimizer, shards, result)
    result.params = state_to_fp32(model)
    result.wall_s = time.perf_counter() - started
    return result


def _run_rounds(
    task: Task[Any],
    spec: RunSpec,
    global_model: nn.Module,
    warm_optimizer: torch.optim.Optimizer,
    shards: list[list[Iterator[Any]]],
    result: RunResult,
) -> None:
    codec = CodecParams(scheme=spec.scheme)
    coordinator = SimCoordinator(state_to_fp32(global_model), spec.outer, codec, spec.aggregation)
    plan = _plan(spec, coordinator.params)
    hostile = spec.regions - 1 if spec.attack != "none" else None
    warm_state = warm_optimizer.state_dict() if spec.warmup_steps else None
    models: list[nn.Module] = []
    optimizers: list[torch.optim.Optimizer] = []
    for _ in range(spec.regions):
        model = task.build_model(seed=spec.seed)
        optimizer = task.build_optimizer(model.parameters())
        if warm_state is not None:
            # A deep copy each: loading does not copy tensors that need no cast, and the
            # regions' optimizer states must not alias.
            optimizer.load_state_dict(copy.deepcopy(warm_state))
        models.append(model)
        optimizers.append(optimizer)
    feedback = [ErrorFeedback() for _ in range(spec.regions)]
    # Under delayed/streaming, where each region started its current round (S), on the
    # tensors the late update will fold (a streaming round's fragment).
    snapshots: list[dict[str, torch.Tensor] | None] = [None] * spec.regions
    # Under delayed_start="eager": each region's last raw delta, and what every region
    # knows of the outer optimizer (the same for all, so kept once).
    last_deltas: list[dict[str, torch.Tensor] | None] = [None] * spec.regions
    replica = OuterReplica(spec.outer)
    previous_base: dict[str, torch.Tensor] | None = None
    for round_ in range(spec.rounds):
        base = coordinator.params
        if spec.delayed_start == "eager" and previous_base is not None:
            replica.observe(previous_base, base)
        previous_base = base
        names = tuple(base) if plan is None else plan.names(round_)
        deltas: dict[str, tuple[int, EncodedDelta]] = {}
        # Every region folds a late θ in every round after the first, or none does.
        scale = spec.stale_scale if snapshots[0] is not None else 1.0
        for index, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            tick = time.perf_counter()
            snapshot = snapshots[index]
            if snapshot is None:
                load_federated_state(model, base)
                tokens = train_steps(task, model, optimizer, shards[index], spec.inner_steps)
            else:
                early = spec.arrival_step
                tokens = train_steps(task, model, optimizer, shards[index], early)
                _apply_late_update(model, base, snapshot, spec.fold_mix, spec.fold_blend)
                tokens += train_steps(
                    task, model, optimizer, shards[index], spec.inner_steps - early
                )
            result.tokens += tokens
            result.train_s += time.perf_counter() - tick
            tick = time.perf_counter()
            local = state_to_fp32(model)
            if spec.overlap != "none":
                start = delayed_start(spec, base, local, last_deltas[index], replica)
                if start is not local:
                    load_federated_state(model, start)
                snapshots[index] = {name: start[name] for name in names}
                if spec.delayed_start == "eager":
                    last_deltas[index] = {name: base[name] - local[name] for name in base}
            sent = {name: base[name] for name in names}
            local = {name: local[name] for name in names}
            if index == hostile:
                factor = ATTACK_FACTORS[spec.attack]
                # Δ = θ_r - local, so this local makes the agent's encoding send factor x Δ.
                local = {name: sent[name] + factor * (local[name] - sent[name]) for name in sent}
            encoded = encode_delta(sent, local, feedback[index], codec)
            # Every delta is delivered here, so the region takes its new residual at once.
            feedback[index] = encoded.feedback
            deltas[region_name(index)] = (tokens, encoded)
            result.comm_s += time.perf_counter() - tick
        tick = time.perf_counter()
        if plan is None:
            update = coordinator.close_round(deltas, scale=scale)
        else:
            update = coordinator.close_round(deltas, names, round_ // plan.count, scale=scale)
        _check_reconstruction(base, update, coordinator.params, round_)
        result.comm_s += time.perf_counter() - tick
        _count_bytes(result, [delta for _, delta in deltas.values()], update)
        load_federated_state(global_model, coordinator.params)
        _evaluate(task, global_model, result, spec.warmup_steps + (round_ + 1) * spec.inner_steps)


def _apply_late_update(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    snapshot: Mapping[str, torch.Tensor],
    mix: float = 1.0,
    blend: float | None = None,
) -> None:
    """y ← θ + a·(y - S): move a region that trained on from S onto θ, keeping a of its
    progress since S. a = 1 is computed as y + (θ - S), the simulator's original form.
    ``blend`` alpha instead: y ← alpha·y + (1 - alpha)·θ (Streaming DiLoCo's merge).

    Only the tensors ``snapshot`` holds are folded (under streaming, the fragment of the
    round whose θ arrived); every other tensor keeps its local value.
    """
    folded = state_to_fp32(model)
    for name, start in snapshot.items():
        if blend is not None:
            folded[name] = blend * folded[name] + (1.0 - blend) * params[name]
        elif mix == 1.0:
            folded[name] = folded[name] + (params[name] - start)
        else:
            folded[name] = params[name] + mix * (folded[name] - start)
    load_federated_state(model, folded)


def _plan(spec: RunSpec, params: Mapping[str, torch.Tensor]) -> FragmentPlan | None:
    """The fragments of a streaming run, split as the daemons split the model (θ's order)."""
    if spec.fragments is None:
        return None
    try:
        return fragment_plan({name: tuple(t.shape) for name, t in params.items()}, spec.fragments)
    except FragmentError as exc:
        raise SimulationError(f"{spec.name}: {exc}") from None


def delayed_start(
    spec: RunSpec,
    base: Mapping[str, torch.Tensor],
    local: dict[str, torch.Tensor],
    last_delta: Mapping[str, torch.Tensor] | None,
    replica: OuterReplica,
) -> dict[str, torch.Tensor]:
    """Where a region that sent Δ_r = θ_r - ``local`` trains from until θ_{r+1} arrives.

    In round 0, before any outer step was seen, ḡ_{r-1} and Δ_{r-1} count as 0.
    """
    if spec.delayed_start == "local":
        return local
    if spec.delayed_start == "global":
        return dict(base)
    return replica.start(base, local, last_delta, spec.regions)


def _count_bytes(result: RunResult, deltas: list[EncodedDelta], update: EncodedStream) -> None:
    """Add one round's WAN traffic: every delta up, and the update down to every region."""
    result.max_update_ratio = max(result.max_update_ratio, update.total_bytes / update.fp32_bytes)
    for delta in deltas:
        result.bytes_up += delta.total_bytes
        result.fp32_bytes_up += delta.fp32_bytes
        result.bytes_down += update.total_bytes
        result.fp32_bytes_down += update.fp32_bytes
        result.max_delta_ratio = max(result.max_delta_ratio, delta.total_bytes / delta.fp32_bytes)
        moved = (delta.total_bytes + update.total_bytes) / (delta.fp32_bytes + update.fp32_bytes)
        result.max_round_region_ratio = max(result.max_round_region_ratio, moved)


def _check_reconstruction(
    base: Mapping[str, torch.Tensor],
    update: EncodedStream,
    coordinator_params: Mapping[str, torch.Tensor],
    round_: int,
) -> None:
    """A region's θ_r + decode(update) must hash equal to the coordinator's θ_{r+1} (an
    update that names a fragment adds to its tensors and keeps the others)."""
    region_params = apply_partial_update(base, decode(update.frames()))
    if parameters_vector_hash(region_params) != parameters_vector_hash(coordinator_params):
        raise SimulationError(f"round {round_}: a region's reconstruction differs from θ_(r+1)")


def loss_stats(values: Iterable[float]) -> dict[str, float | int]:
    """Return mean, sample standard deviation (0 for one value), min, max and count."""
    data = list(values)
    if not data:
        raise SimulationError("no values to summarise")
    mean = sum(data) / len(data)
    std = math.sqrt(sum((x - mean) ** 2 for x in data) / (len(data) - 1)) if len(data) > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(data), "max": max(data), "n": len(data)}
