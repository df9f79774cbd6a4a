"""The agent's side of ``overlap_start: eager``: S, the start of round r+1, from round r.

Once round r's result y_r is read, the agent computes S = θ_r stepped by the job's outer
optimizer on the estimate ĝ_r (:mod:`geofed.eager_start`) and hands it to the workers
(:meth:`regional_agent.handoff.directory.HandoffDir.write_start`). What the estimate needs between
rounds is kept in the job's state directory (``eager.pt``): the outer optimizer's replica
(its momentum buffer and ḡ_{r-1}) and the last raw delta Δ_{r-1}, three fp32 model copies
with the θ round and hash the replica has reached.

The replica replays θ_{r-1} → θ_r only when it stands at θ_{r-1} (same hash) and that θ
file is still held; otherwise (the job's first round, a resync, a rollback, a lost file)
it starts again at zero with the coordinator's step count: the estimate is then worse for
a round, never wrong in kind, since the fold y ← θ_{r+1} + (y - S) puts the region on
θ_{r+1} whatever S was. All functions block (disk, tensor math): the agent runs them in a
thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from geofed.codec import CodecError
from geofed.eager_start import EagerStartError, OuterReplica
from geofed.outer_step import OuterOptimizerConfig
from geofed.params import parameters_vector_hash
from geofed.theta_chain import map_params, params_hash
from geofed.theta_file import ThetaFileError
from regional_agent.handoff.delta_stream import DeltaStream
from regional_agent.handoff.directory import HandoffDir
from regional_agent.handoff.messages import StartReady
from regional_agent.state import JobDirectory, StateError

log = logging.getLogger(__name__)

_FORMAT = 1


@dataclass(slots=True)
class EagerState:
    """The replica at θ ``theta_round`` (hash ``theta_hash``) and Δ of ``delta_round``."""

    replica: OuterReplica
    theta_round: int
    theta_hash: str
    delta_round: int | None = None
    delta: dict[str, torch.Tensor] | None = None

    def to_state(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "replica": self.replica.state_dict(),
            "theta_round": self.theta_round,
            "theta_hash": self.theta_hash,
            "delta_round": self.delta_round,
            "delta": self.delta,
        }

    @staticmethod
    def from_state(raw: Mapping[str, Any], config: OuterOptimizerConfig) -> EagerState:
        """Restore a saved state; :class:`EagerStartError` when it is unusable (another
        outer config included)."""
        try:
            if raw["format"] != _FORMAT:
                raise EagerStartError(f"format {raw['format']!r} is not {_FORMAT}")
            theta_round, theta_hash = raw["theta_round"], raw["theta_hash"]
            delta_round, delta = raw["delta_round"], raw["delta"]
        except (KeyError, TypeError) as exc:
            raise EagerStartError(f"saved eager state lacks {exc}") from None
        if not isinstance(theta_round, int) or not isinstance(theta_hash, str):
            raise EagerStartError("saved eager state: bad θ round or hash")
        if (delta is None) != (delta_round is None) or (
            delta is not None and not isinstance(delta, dict)
        ):
            raise EagerStartError("saved eager state: bad last delta")
        replica = OuterReplica.from_state_dict(raw["replica"], config)
        return EagerState(replica, theta_round, theta_hash, delta_round, delta)


def replays(saved: EagerState | None, round_: int) -> bool:
    """Whether the saved replica can replay θ_{round_-1} → θ_round (it stands at round_-1)."""
    return saved is not None and round_ >= 1 and saved.theta_round == round_ - 1


def next_state(
    saved: EagerState | None,
    config: OuterOptimizerConfig,
    round_: int,
    theta: Mapping[str, torch.Tensor],
    theta_hash: str,
    local: Mapping[str, torch.Tensor],
    regions: int,
    before: Mapping[str, torch.Tensor] | None,
) -> tuple[dict[str, torch.Tensor], EagerState, bool]:
    """S for round ``round_ + 1``, the state to keep after it, and whether the saved
    replica was replayed (else it started at zero). ``before`` is θ_{round_-1} when
    :func:`replays` holds and its file was read (None: start at zero)."""
    last_delta: Mapping[str, torch.Tensor] | None = None
    if saved is not None and before is not None and replays(saved, round_):
        replica = saved.replica
        replica.observe(before, theta)
        if saved.delta_round == round_ - 1:
            last_delta = saved.delta
        replayed = True
    else:
        replica = OuterReplica(config, steps=round_)
        replayed = False
    start = replica.start(theta, local, last_delta, regions)
    delta = {name: theta[name] - local[name] for name in theta}
    return start, EagerState(replica, round_, theta_hash, round_, delta), replayed


def hand_start(
    job: JobDirectory,
    handoff: HandoffDir,
    config: OuterOptimizerConfig,
    round_: int,
    theta_path: str,
    theta_hash: str,
    local: Mapping[str, torch.Tensor],
    regions: int,
    delta: DeltaStream | None = None,
) -> StartReady:
    """Compute S for round ``round_ + 1`` from round ``round_``'s result and hand it over.

    The result is the trained ``local`` state or, when the workers handed over the
    quantized ``delta``, θ minus the delta it decodes to (what the coordinator receives).

    S goes first, the state after: a crash between the two leaves an old state, which the
    next round finds not standing at its θ and restarts from zero. A failure hands the
    workers a marker without S (they start from their own parameters) and drops the state.
    """
    started = time.monotonic()
    try:
        saved: EagerState | None = None
        raw = job.load_eager()
        if raw is not None:
            try:
                saved = EagerState.from_state(raw, config)
            except EagerStartError as exc:
                log.warning("job %s: dropping the eager-start state: %s", job.job, exc)
        before = _previous_theta(job, saved, round_)
        theta = map_params(theta_path)
        if delta is not None:
            decoded = delta.decode()
            local = {name: theta[name] - decoded[name] for name in theta}
        start, state, replayed = next_state(
            saved, config, round_, theta, theta_hash, local, regions, before
        )
    except (
        StateError,
        EagerStartError,
        CodecError,
        OSError,
        ValueError,
        KeyError,
        RuntimeError,
    ) as exc:
        log.warning(
            "job %s: no eager estimate for round %d (%s: %s); it starts from the local parameters",
            job.job,
            round_ + 1,
            type(exc).__name__,
            exc,
        )
        job.forget_eager()
        return handoff.write_start(job.job, round_ + 1, None, reason=f"{type(exc).__name__}")
    ready = handoff.write_start(job.job, round_ + 1, start, parameters_vector_hash(start))
    job.save_eager(state.to_state())
    log.info(
        "job %s: round %d starts from the eager estimate (%s; %.3f s)",
        job.job,
        round_ + 1,
        "outer optimizer replayed" if replayed else "outer optimizer replica started at zero",
        time.monotonic() - started,
    )
    return ready


def _previous_theta(
    job: JobDirectory, saved: EagerState | None, round_: int
) -> Mapping[str, torch.Tensor] | None:
    """θ_{round_-1}, when the saved replica stands at it and its files are still held."""
    if saved is None or not replays(saved, round_):
        return None
    path = job.held_path(round_ - 1)
    try:
        found = params_hash(path)
    except ThetaFileError as exc:
        log.info(
            "job %s: θ_%d is not held (%s); the replica starts at zero", job.job, round_ - 1, exc
        )
        return None
    if found != saved.theta_hash:
        log.info(
            "job %s: θ_%d is not the one the replica saw; it starts at zero", job.job, round_ - 1
        )
        return None
    return map_params(path)
