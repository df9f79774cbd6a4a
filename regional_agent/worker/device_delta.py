"""Rank 0's side of a :class:`~regional_agent.handoff.messages.DeltaRequest`: the round's delta,
quantized where the trained parameters are, with its error feedback there too.

Δ = θ_round - θ_local is formed on the parameters' device (θ_round read again from its
immutable file), compensated with the residual the agent kept after its last accepted
delta, and quantized chunk by chunk (:func:`geofed.codec.quantize_tensors`); only the
codes and scales reach the host. The residual the round leaves is kept on the device
and named in the round's residual file for the agent: written in full only when the
round saves the regional checkpoint, otherwise a held file naming it
(:mod:`regional_agent.handoff.residual_file`). When the agent's residual file still names it (the
same id), the next round reads nothing from disk; when it names a residual rank 0 does
not hold, the one written out at the last park or stop (``held_path``) is read, and with
none error feedback starts anew, with a warning.

A request that names some tensors (``overlap: streaming``: the round's fragment) gets a
delta of those alone, in that order: Δ[n] = θ_round[n] - θ_local[n]. Only their residual
is used and replaced (a tensor without one starts from zero); the residual of every other
tensor is carried unchanged, so the residual file keeps every tensor that has one.

A residual whose tensors no longer fit the model (another task, another shape) is
dropped, with a warning, as the agent's own error feedback would refuse it.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from geofed.codec import QuantizedTensors, quantize_tensors
from geofed.codec.tensors import TensorLayout
from geofed.params import federated_state
from geofed.theta_file import ThetaFileError, read_theta
from regional_agent.handoff.delta_terms import UnusableDelta, rounding_generator
from regional_agent.handoff.messages import DeltaRequest, RoundInstruction
from regional_agent.handoff.residual_file import (
    HeldResidual,
    Residual,
    read_residual,
    read_residual_id,
    write_held_residual,
    write_residual,
)
from regional_agent.worker.parallelism import ParallelModel
from regional_agent.worker.place import RankPlace

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DeviceResidual:
    """The residual a job's last quantized delta left, on rank 0's device; ``written``:
    its tensors are in a file (the round's, or the job's held one)."""

    job: str
    round: int
    id: str
    tensors: dict[str, torch.Tensor]
    written: bool


def quantize_round_delta(
    request: DeltaRequest,
    *,
    job: str,
    round_: int,
    region: str,
    base_path: str,
    local: Mapping[str, torch.Tensor],
    residual_path: Path,
    kept: DeviceResidual | None,
    held_path: Path | None = None,
    write_tensors: bool = True,
) -> tuple[QuantizedTensors, DeviceResidual]:
    """Quantize round ``round_``'s delta; name the residual it leaves at ``residual_path``
    (its tensors written there when ``write_tensors``).

    ``local`` is the trained federated state (on rank 0's device, or the host under
    FSDP); ``kept`` is the residual this rank holds from its previous delta, if any;
    ``held_path`` the job's residual written out at a park or stop.
    Raises :class:`~regional_agent.handoff.delta_terms.UnusableDelta` when θ_round and the trained
    state do not match, and the codec's errors on non-finite values.
    """
    quantizer = RoundDeltaQuantizer(
        request,
        job=job,
        round_=round_,
        region=region,
        base_path=base_path,
        shapes={name: tensor.shape for name, tensor in local.items()},
        device=_device_of(local),
        kept=kept,
        held_path=held_path,
    )
    for name in quantizer.wanted:
        quantizer.add(name, local[name])
    return quantizer.finish(residual_path, write_tensors=write_tensors)


class RoundDeltaQuantizer:
    """A round's delta quantized tensor by tensor, as the trained tensors come (rank 0).

    Built with the model's federated shapes, it checks θ_round's file against them and
    takes the residual; :meth:`add` gets each tensor of :attr:`wanted` in that order (a
    sharded model gathers one tensor at a time, so no full copy of the model is ever
    held) and quantizes Δ = θ_round - θ_local plus its residual at once; :meth:`finish`
    writes the residual the round leaves. The payloads are those of quantizing every
    tensor in one call: chunks never span tensors, and stochastic rounding draws from
    one generator in the same order. The residual it takes (``kept``, or the one its
    file holds) is overwritten tensor by tensor with the one the round leaves.
    """

    def __init__(
        self,
        request: DeltaRequest,
        *,
        job: str,
        round_: int,
        region: str,
        base_path: str,
        shapes: Mapping[str, torch.Size],
        device: torch.device,
        kept: DeviceResidual | None,
        held_path: Path | None = None,
    ) -> None:
        self._request, self._job, self._round, self._device = request, job, round_, device
        self._shapes = dict(shapes)
        self._base_path = base_path
        try:
            # Read a tensor at a time as the delta takes it: θ's pages are not kept.
            self._base = read_theta(base_path)
        except ThetaFileError as exc:
            raise UnusableDelta(str(exc)) from None
        base = self._base
        if set(base) != set(shapes):
            names = sorted(set(base) ^ set(shapes))
            raise UnusableDelta(f"θ at {base_path} and the trained state differ in {names}")
        self.wanted: tuple[str, ...] = tuple(shapes) if request.names is None else request.names
        unknown = [name for name in self.wanted if name not in shapes]
        if unknown:
            raise UnusableDelta(f"the delta request names tensors the model lacks: {unknown}")
        # The whole model's shapes: a partial request's residual may name any of them.
        self._residual = _residual_for(request, job, shapes, kept, device, held_path)
        self._generator = (
            rounding_generator(job, round_, region, device)
            if request.codec.stochastic_rounding
            else None
        )
        self._specs: list[TensorLayout] = []
        self._payloads: list[torch.Tensor] = []
        self._after: dict[str, torch.Tensor] = {}
        self._next = 0
        #: Whether :meth:`add` has overwritten tensors of the residual it was given (a
        #: failure after that leaves it neither the old residual nor the new one).
        self.altered_kept = False

    def add(self, name: str, trained: torch.Tensor) -> None:
        """Quantize the delta of ``name``, the next tensor of :attr:`wanted`."""
        if self._next >= len(self.wanted) or self.wanted[self._next] != name:
            raise UnusableDelta(f"{name!r} is not the next tensor of the delta")
        self._next += 1
        start = self._base[name]
        if start.shape != trained.shape:
            raise UnusableDelta(
                f"{name!r}: θ has shape {tuple(start.shape)}, the trained state "
                f"{tuple(trained.shape)}"
            )
        delta = start.to(device=self._device, dtype=torch.float32, copy=True)
        delta.sub_(trained.detach().to(device=self._device, dtype=torch.float32))
        residual = None
        own = None
        if self._residual is not None:
            # A tensor without a residual yet (under streaming, its fragment's first
            # round) starts from zero.
            own = self._residual.get(name)
            residual = {name: torch.zeros_like(delta) if own is None else own}
        quantized, after = quantize_tensors(
            {name: delta},
            self._request.codec,
            chunk_elements=self._request.chunk_elements,
            generator=self._generator,
            residual=residual,
        )
        del delta, residual
        if own is not None:
            # The residual the round leaves takes the place of the one it used, tensor
            # by tensor: rank 0 never holds two residuals of the model.
            own.copy_(after[name])
            after = {name: own}
            self.altered_kept = True
        self._specs.extend(quantized.specs)
        self._payloads.extend(quantized.payloads)
        self._after.update(after)

    def finish(
        self, residual_path: Path, *, write_tensors: bool = True
    ) -> tuple[QuantizedTensors, DeviceResidual]:
        """The round's quantized delta and the residual it leaves, named at
        ``residual_path``: its tensors written there when ``write_tensors``, else a held
        file (the tensors stay on the device only)."""
        if self._next != len(self.wanted):
            raise UnusableDelta(f"the delta holds {self._next} of its {len(self.wanted)} tensors")
        quantized = QuantizedTensors(
            self._specs, self._request.codec, self._request.chunk_elements, self._payloads
        )
        after = self._after
        if self._request.names is not None and self._residual is not None:
            # The other tensors' residual waits, unchanged, for their own round.
            merged = {**self._residual, **after}
            after = {name: merged[name] for name in self._shapes if name in merged}
        del self._base
        if write_tensors:
            id_ = write_residual(residual_path, self._round, after)
        else:
            id_ = write_held_residual(residual_path, self._round)
        return quantized, DeviceResidual(self._job, self._round, id_, after, write_tensors)


def _residual_for(
    request: DeltaRequest,
    job: str,
    shapes: Mapping[str, torch.Size],
    kept: DeviceResidual | None,
    device: torch.device,
    held_path: Path | None,
) -> dict[str, torch.Tensor] | None:
    """The agent's residual on ``device``: the kept one when its file still names it.

    A request for every tensor needs a residual of exactly the model's tensors; one that
    names some takes a residual of any of them (the others' are carried).
    """
    path = Path(request.feedback)
    if kept is not None and kept.job == job and read_residual_id(path) == kept.id:
        residual = kept.tensors
    else:
        read = read_residual(path)
        if isinstance(read, HeldResidual):
            read = _written_out(read, held_path, job)
        if read is None:
            return None
        residual = {name: tensor.to(device) for name, tensor in read.tensors.items()}
    partial = request.names is not None
    unfit = sorted(
        name
        for name in set(residual) | (set() if partial else set(shapes))
        if name not in residual or name not in shapes or residual[name].shape != shapes[name]
    )
    if unfit:
        log.warning(
            "job %s: the error-feedback residual does not fit the model (%s); starting it anew",
            job,
            ", ".join(unfit[:5]),
        )
        return None
    return residual


def _written_out(held: HeldResidual, held_path: Path | None, job: str) -> Residual | None:
    """The residual a held file names, as written out at the last park or stop; None
    (with a warning) when rank 0 no longer has it anywhere."""
    found = None if held_path is None else read_residual(held_path)
    if isinstance(found, Residual) and found.id == held.id:
        return found
    log.warning(
        "job %s: the error-feedback residual of round %d was held by the workers only and "
        "is gone (the group restarted, or a delta the coordinator did not take replaced "
        "it); starting it anew",
        job,
        held.round,
    )
    return None


def payloads_hash(delta: QuantizedTensors) -> str:
    """The sha256 of a quantized delta's payloads, in order (what a round summary names
    when its workers hand over the delta, not the parameters)."""
    digest = hashlib.sha256()
    for payload in delta.payloads:
        digest.update(payload.numpy().data)
    return digest.hexdigest()


def _device_of(tensors: Mapping[str, torch.Tensor]) -> torch.device:
    devices = {tensor.device for tensor in tensors.values()}
    if len(devices) > 1:
        raise UnusableDelta(f"the trained state spans devices {sorted(map(str, devices))}")
    return devices.pop() if devices else torch.device("cpu")


def hand_over_delta(
    place: RankPlace,
    request: DeltaRequest,
    instruction: RoundInstruction,
    base_path: str,
    parallel: ParallelModel,
    write_tensors: bool,
    kept: DeviceResidual | None,
) -> tuple[QuantizedTensors | None, str | None, DeviceResidual | None]:
    """The round's quantized delta, quantized by rank 0 tensor by tensor as each comes:
    from the replica's own tensors under DDP, all-gathered one at a time from the
    shards under FSDP/HSDP (collectives: every rank gathers every tensor, whatever rank
    0 met, so none is left waiting). Rank 0's delta, or why it has none.
    ``write_tensors``: the residual's tensors go to the round's residual file (a round
    that saves the regional checkpoint); otherwise only rank 0 holds them. ``kept``: the
    residual rank 0 holds; returned as the new one (unchanged when none was formed,
    None when a failure came after part of it was overwritten)."""
    started = time.monotonic()
    shapes = {name: t.shape for name, t in federated_state(parallel.model).items()}
    names = tuple(shapes) if request.names is None else request.names
    quantizer: RoundDeltaQuantizer | None = None
    failure: str | None = None
    delta: QuantizedTensors | None = None
    where = f"job {instruction.job} round {instruction.round}"
    if place.rank == 0:
        try:
            quantizer = RoundDeltaQuantizer(
                request,
                job=instruction.job,
                round_=instruction.round,
                region=instruction.region,
                base_path=base_path,
                shapes=shapes,
                device=place.device,
                kept=kept,
                held_path=place.handoff.held_residual_path(instruction.job),
            )
        except Exception as exc:
            log.exception("%s: cannot quantize the delta", where)
            failure = f"cannot hand over the delta: {type(exc).__name__}: {exc}"
    for name, whole in parallel.gathered([n for n in names if n in shapes]):
        if quantizer is not None and failure is None:
            try:
                quantizer.add(name, whole)
            except Exception as exc:
                log.exception("%s: cannot quantize the delta", where)
                failure = f"cannot hand over the delta: {type(exc).__name__}: {exc}"
        del whole
    if quantizer is not None and failure is None:
        try:
            delta, kept = quantizer.finish(
                place.handoff.residual_path(instruction.job, instruction.round),
                write_tensors=write_tensors,
            )
        except Exception as exc:
            log.exception("%s: cannot quantize the delta", where)
            failure = f"cannot hand over the delta: {type(exc).__name__}: {exc}"
    if failure is not None and quantizer is not None and quantizer.altered_kept:
        # Part overwritten: error feedback goes on from the residual's file, if any.
        kept = None
    if delta is not None:
        log.info(
            "%s: delta quantized on %s, tensor by tensor (%s, %.1f MB) in %.3f s",
            where,
            place.device,
            request.codec.scheme,
            sum(p.numel() for p in delta.payloads) / 1e6,
            time.monotonic() - started,
        )
    return delta, failure, kept
