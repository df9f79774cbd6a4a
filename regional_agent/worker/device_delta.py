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
from typing import Literal

import torch

from geofed.codec import QuantizedTensors, quantize_tensors
from geofed.codec.tensors import TensorLayout
from geofed.params import federated_state
from geofed.theta_chain import read_params
from geofed.theta_file import ThetaFileError
from regional_agent.handoff.delta_stream import DeltaStreamWriter, WrittenDelta
from regional_agent.handoff.delta_terms import UnusableDelta, rounding_generator
from regional_agent.handoff.messages import DeltaRequest, RoundInstruction
from regional_agent.handoff.residual_file import (
    HeldResidual,
    Residual,
    ResidualWriter,
    read_residual,
    read_residual_id,
    residual_shapes,
    write_held_residual,
)
from regional_agent.worker.parallelism import ParallelModel, load_whole_tensor
from regional_agent.worker.place import RankPlace
from regional_agent.worker.residual_shards import DeviceResidual, ResidualGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ResidualPlan:
    """Rank 0's decision about a round's residual, sent to every rank before the first
    tensor: where the residual the round starts from is (``kept``: the slices the ranks
    hold; ``file``: read by rank 0 from the agent's file; ``none``: error feedback starts
    anew), the tensors it holds (θ's order), and whether the round writes the new one."""

    source: Literal["kept", "file", "none"]
    names: tuple[str, ...]
    write_tensors: bool


@dataclass(frozen=True, slots=True)
class _Outcome:
    """Rank 0's word after the last tensor: the new residual's id (None: no delta), and
    whether the ranks must drop the residual they held (overwritten part way)."""

    id: str | None
    drop: bool


class RoundResidual:
    """One rank's side of a round's residual: the one the round starts from, taken whole
    by rank 0 a tensor at a time (:meth:`take`), and the one it leaves, scattered back
    into each rank's slices (:meth:`put`), in place of the old one's where there was one.
    Every rank calls :meth:`take`/:meth:`put` (or :meth:`skip`) for the same tensors in
    the same order, then :meth:`carry`: they are collectives."""

    def __init__(
        self,
        group: ResidualGroup,
        plan: ResidualPlan,
        shapes: Mapping[str, tuple[int, ...]],
        kept: DeviceResidual | None,
        from_file: Mapping[str, torch.Tensor] | None = None,
        writer: ResidualWriter | None = None,
    ) -> None:
        self._group, self._plan, self._shapes = group, plan, shapes
        self._old = kept.slices if plan.source == "kept" and kept is not None else {}
        self._file = from_file
        self._writer = writer
        self._new: dict[str, torch.Tensor] = {}
        #: Rank 0: whether a put replaced part of the kept residual with a new one.
        self.altered = False
        #: Rank 0: why a tensor of the old residual could not be read, or of the new one
        #: written (the round then fails).
        self.error: Exception | None = None

    def take(self, name: str) -> torch.Tensor | None:
        """Rank 0: ``name``'s residual whole, on the device (None: it has none); the
        other ranks: None."""
        if name not in self._plan.names:
            return None
        shape = self._shapes[name]
        if self._plan.source == "kept":
            return self._group.gather(self._old[name], shape)
        if self._file is None:
            return None
        return self._file[name].to(self._group.device, torch.float32).reshape(shape)

    def put(self, name: str, whole: torch.Tensor | None, *, fresh: bool) -> None:
        """Keep each rank's slice of rank 0's ``whole`` (None: zeros; ``fresh``: the
        round's new residual, not the old one put back), written to the round's file."""
        into = self._old.get(name)
        self._new[name] = self._group.scatter(whole, self._shapes[name], into)
        if fresh and into is not None:
            self.altered = True
        if whole is not None:
            self._write(name, whole)

    def _write(self, name: str, whole: torch.Tensor) -> None:
        """Rank 0: write ``name`` to the round's residual file; a failure (a full disk)
        is kept in :attr:`error` and drops the file, and the ranks' collectives go on."""
        if self._writer is None:
            return
        try:
            self._writer.put(name, whole)
        except Exception as exc:
            self.error = self.error or exc
            self.abort()

    def skip(self, name: str) -> None:
        """Put ``name``'s residual back as it was (a rank whose delta failed, or any rank
        but 0)."""
        whole = None
        try:
            whole = self.take(name)
        except Exception as exc:  # rank 0's file read: the round fails, the ranks go on
            self.error = self.error or exc
        self.put(name, whole, fresh=False)

    def carry(self) -> None:
        """The tensors of the old residual the round did not quantize: kept as they are,
        scattered from the file, gathered to be written when the round writes them."""
        for name in self._plan.names:
            if name in self._new:
                continue
            if self._plan.source == "kept":
                if self._plan.write_tensors:
                    whole = self._group.gather(self._old[name], self._shapes[name])
                    if whole is not None:
                        self._write(name, whole)
                self._new[name] = self._old[name]
            else:
                self.skip(name)

    def slices(self) -> dict[str, torch.Tensor]:
        """This rank's slices of the round's new residual, in θ's order."""
        return {name: self._new[name] for name in self._shapes if name in self._new}

    def commit(self) -> str:
        """Rank 0: make the round's residual file durable; its id."""
        if self._writer is None:
            raise UnusableDelta("the round writes no residual file")
        return self._writer.commit()

    def abort(self) -> None:
        """Rank 0: leave the round's residual file as it was."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None


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
    """Quantize round ``round_``'s delta in a group of one rank; name the residual it
    leaves at ``residual_path`` (its tensors written there when ``write_tensors``).

    ``local`` is the trained federated state; ``kept`` is the residual this rank holds
    from its previous delta, if any; ``held_path`` the job's residual written out at a
    park or stop. Raises :class:`~regional_agent.handoff.delta_terms.UnusableDelta` when
    θ_round and the trained state do not match, and the codec's errors on non-finite values.
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
        residual_path=residual_path,
        write_tensors=write_tensors,
        held_path=held_path,
    )
    try:
        for name in quantizer.wanted:
            quantizer.add(name, local[name])
        quantizer.residual.carry()
        quantized, residual = quantizer.finish()
    except BaseException:
        quantizer.abort()
        raise
    assert isinstance(quantized, QuantizedTensors)  # no stream file: the payloads in memory
    return quantized, residual


class RoundDeltaQuantizer:
    """A round's delta quantized tensor by tensor, as the trained tensors come (rank 0).

    Built with the model's federated shapes, it checks θ_round's file against them and
    decides where the residual comes from (:attr:`plan`); :meth:`add` gets each tensor
    of :attr:`wanted` in that order (a sharded model gathers one tensor at a time, so no
    full copy of the model is ever held) and quantizes Δ = θ_round - θ_local plus its
    residual (gathered whole from the ranks' slices) at once, the new residual scattered
    back to the ranks and written as it comes when the round writes it; :meth:`finish`
    names it. The payloads are those of quantizing every tensor in one call: chunks never
    span tensors, and stochastic rounding draws from one generator in the same order.
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
        residual_path: Path,
        write_tensors: bool = True,
        held_path: Path | None = None,
        group: ResidualGroup | None = None,
        stream_path: Path | None = None,
    ) -> None:
        self._request, self._job, self._round, self._device = request, job, round_, device
        self._stream: DeltaStreamWriter | None = None
        self._shapes = {name: tuple(shape) for name, shape in shapes.items()}
        self._residual_path = residual_path
        try:
            # Read a tensor at a time as the delta takes it: θ's pages are not kept.
            self._base = read_params(base_path)
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
        source, held, from_file = _residual_source(request, job, self._shapes, kept, held_path)
        self.plan = ResidualPlan(source, held, write_tensors)
        #: The tensors of the residual the round leaves, in θ's order.
        self.leaves = {
            name: shape
            for name, shape in self._shapes.items()
            if name in held or name in self.wanted
        }
        self._specs = [TensorLayout(n, "float32", self._shapes[n]) for n in self.wanted]
        self._payloads: list[torch.Tensor] = []
        self._last_base: tuple[str | None, torch.Tensor | None] = (None, None)
        self._next = 0
        self._generator = (
            rounding_generator(job, round_, region, device)
            if request.codec.stochastic_rounding
            else None
        )
        writer = ResidualWriter(residual_path, round_, self.leaves) if write_tensors else None
        group = group or ResidualGroup(0, 1, device)
        #: The round's residual on this rank (every rank of the group has its own), and
        #: the file it writes.
        self.residual = RoundResidual(group, self.plan, self._shapes, kept, from_file, writer)
        if stream_path is not None:
            try:
                self._stream = DeltaStreamWriter(
                    stream_path, self._specs, request.codec, request.chunk_elements
                )
            except BaseException:
                self.abort()
                raise

    @property
    def altered_kept(self) -> bool:
        """Whether :meth:`add` has overwritten tensors of the residual it was given (a
        failure after that leaves it neither the old residual nor the new one)."""
        return self.residual.altered

    def add(self, name: str, trained: torch.Tensor) -> None:
        """Quantize the delta of ``name``, the next tensor of :attr:`wanted` (its residual
        put back as it was if that fails: the ranks' collectives go on)."""
        old = None
        try:
            old = self.residual.take(name)  # the other ranks take part whatever comes next
            self._advance(name)
            after = self._quantize(name, trained, old)
        except BaseException:
            self.residual.put(name, old, fresh=False)
            raise
        self.residual.put(name, after, fresh=True)
        if self.residual.error is not None:
            raise self.residual.error

    def _advance(self, name: str) -> None:
        if self._next >= len(self.wanted) or self.wanted[self._next] != name:
            raise UnusableDelta(f"{name!r} is not the next tensor of the delta")
        self._next += 1

    def base_of(self, name: str) -> torch.Tensor | None:
        """θ_round's tensor ``name`` as :meth:`add` read it for its delta (the last
        tensor added; None for any other)."""
        return self._last_base[1] if self._last_base[0] == name else None

    def _quantize(
        self, name: str, trained: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor | None:
        start = self._base[name]
        self._last_base = (name, start)
        if start.shape != trained.shape:
            raise UnusableDelta(
                f"{name!r}: θ has shape {tuple(start.shape)}, the trained state "
                f"{tuple(trained.shape)}"
            )
        delta = start.to(device=self._device, dtype=torch.float32, copy=True)
        delta.sub_(trained.detach().to(device=self._device, dtype=torch.float32))
        given = None
        if self.plan.source != "none":
            # A tensor without a residual yet (under streaming, its fragment's first
            # round) starts from zero.
            given = {name: torch.zeros_like(delta) if residual is None else residual}
        quantized, after = quantize_tensors(
            {name: delta},
            self._request.codec,
            chunk_elements=self._request.chunk_elements,
            generator=self._generator,
            residual=given,
        )
        if quantized.specs != self._specs[self._next - 1 : self._next]:
            raise UnusableDelta(f"{name!r} quantized as {quantized.specs}, not as announced")
        if self._stream is not None:
            self._stream.add(quantized.payloads)  # sealed into the file as it comes
        else:
            self._payloads.extend(quantized.payloads)
        return after.get(name)

    def finish(self) -> tuple[QuantizedTensors | WrittenDelta, DeviceResidual]:
        """The round's quantized delta (sealed in its stream file when the quantizer was
        given one) and the residual it leaves (after the residual's
        :meth:`RoundResidual.carry`), named at the round's residual path: its tensors
        written there when the round writes them, else a held file (the tensors stay on
        the ranks' devices only)."""
        if self._next != len(self.wanted):
            raise UnusableDelta(f"the delta holds {self._next} of its {len(self.wanted)} tensors")
        if self.residual.error is not None:
            raise self.residual.error
        del self._base
        self._last_base = (None, None)
        # The residual's file first: a delta sealed and renamed cannot be taken back.
        written = self.plan.write_tensors
        if written:
            id_ = self.residual.commit()
        else:
            id_ = write_held_residual(self._residual_path, self._round)
        quantized: QuantizedTensors | WrittenDelta
        if self._stream is not None:
            quantized = self._stream.finish()
        else:
            quantized = QuantizedTensors(
                self._specs, self._request.codec, self._request.chunk_elements, self._payloads
            )
        residual = DeviceResidual(
            self._job, self._round, id_, self.residual.slices(), self.leaves, written
        )
        return quantized, residual

    def abort(self) -> None:
        """Leave the round's residual and stream files as they were (a failed delta)."""
        self.residual.abort()
        if self._stream is not None:
            self._stream.abort()


def _residual_source(
    request: DeltaRequest,
    job: str,
    shapes: Mapping[str, tuple[int, ...]],
    kept: DeviceResidual | None,
    held_path: Path | None,
) -> tuple[Literal["kept", "file", "none"], tuple[str, ...], Mapping[str, torch.Tensor] | None]:
    """Where the agent's residual is: the kept one when its file still names it, else
    its file; its tensors (θ's order) and, from a file, their reads.

    A request for every tensor needs a residual of exactly the model's tensors; one that
    names some takes a residual of any of them (the others' are carried).
    """
    path = Path(request.feedback)
    source: Literal["kept", "file", "none"]
    from_file = None
    if kept is not None and kept.job == job and read_residual_id(path) == kept.id:
        source, held = "kept", dict(kept.shapes)
    else:
        read = read_residual(path)
        if isinstance(read, HeldResidual):
            read = _written_out(read, held_path, job)
        if read is None:
            return "none", (), None
        source, held, from_file = "file", residual_shapes(read), read.tensors
    partial = request.names is not None
    unfit = sorted(
        name
        for name in set(held) | (set() if partial else set(shapes))
        if name not in held or name not in shapes or tuple(held[name]) != shapes[name]
    )
    if unfit:
        log.warning(
            "job %s: the error-feedback residual does not fit the model (%s); starting it anew",
            job,
            ", ".join(unfit[:5]),
        )
        return "none", (), None
    return source, tuple(name for name in shapes if name in held), from_file


def _written_out(held: HeldResidual, held_path: Path | None, job: str) -> Residual | None:
    """The residual a held file names, as written out at the last park or stop; None
    (with a warning) when the ranks no longer have it anywhere."""
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
    *,
    restore: bool = False,
) -> tuple[WrittenDelta | None, str | None, DeviceResidual | None, bool]:
    """The round's quantized delta, quantized by rank 0 tensor by tensor as each comes:
    from the replica's own tensors under DDP, all-gathered one at a time from the
    shards under FSDP/HSDP, each with its residual gathered from the ranks' slices and
    the new one scattered back (collectives: every rank takes part in every tensor,
    whatever rank 0 met, so none is left waiting). Rank 0's delta, or why it has none.
    ``write_tensors``: the residual's tensors go to the round's residual file (a round
    that saves the regional checkpoint); otherwise only the ranks hold them. ``kept``:
    this rank's slices of the residual the group holds; returned as the new one
    (unchanged when rank 0 could not start, None when a failure came after part of it
    was overwritten or the round started from another residual). ``restore`` (a
    request for every tensor): each tensor's θ_round, as rank 0 read it for its delta,
    is put back into the model's own tensors once its delta is taken (scattered or
    broadcast, :func:`~regional_agent.worker.parallelism.load_whole_tensor`); the last
    value returned says whether every one was (:mod:`regional_agent.worker.base_update`)."""
    started = time.monotonic()
    shapes = {name: tuple(t.shape) for name, t in federated_state(parallel.model).items()}
    names = tuple(shapes) if request.names is None else request.names
    group = ResidualGroup(place.rank, place.world_size, place.device, place.control)
    quantizer: RoundDeltaQuantizer | None = None
    failure: str | None = None
    where = f"job {instruction.job} round {instruction.round}"
    if place.rank == 0:
        quantizer, failure = _start_quantizer(
            place, request, instruction, base_path, shapes, write_tensors, kept, group
        )
    plan: ResidualPlan | None = group.broadcast(None if quantizer is None else quantizer.plan)
    residual: RoundResidual | None = None
    if plan is not None:
        residual = (
            quantizer.residual
            if quantizer is not None
            else RoundResidual(group, plan, shapes, kept)
        )
    restorer = _Restorer(parallel, group) if restore and request.names is None else None
    for name, whole in parallel.gathered([n for n in names if n in shapes]):
        if quantizer is not None and failure is None:
            try:
                quantizer.add(name, whole)
            except Exception as exc:
                log.exception("%s: cannot quantize the delta", where)
                failure = f"cannot hand over the delta: {type(exc).__name__}: {exc}"
        elif residual is not None:
            residual.skip(name)
        del whole
        if restorer is not None:
            restorer.put(name, None if failure is not None else quantizer)
    restored = restorer is not None and restorer.agreed()
    if residual is None or plan is None:  # rank 0 could not start: nothing changed
        return None, failure, kept, restored
    residual.carry()
    delta, formed, failure = _finish(quantizer, failure, where)
    outcome: _Outcome = group.broadcast(
        _Outcome(
            id=None if formed is None else formed.id,
            drop=quantizer is not None and quantizer.altered_kept,
        )
    )
    if outcome.id is not None:
        kept = DeviceResidual(
            instruction.job,
            instruction.round,
            outcome.id,
            residual.slices(),
            {n: shapes[n] for n in shapes if n in plan.names or n in names},
            plan.write_tensors,
        )
    elif outcome.drop or plan.source != "kept":
        kept = None  # part overwritten, or another residual: feedback goes on from its file
    if not isinstance(delta, WrittenDelta):  # rank 0 seals into the stream file
        return None, failure, kept, restored
    log.info(
        "%s: delta quantized on %s, tensor by tensor, and sealed (%s, %.1f MB) in %.3f s",
        where,
        place.device,
        request.codec.scheme,
        delta.payload_bytes / 1e6,
        time.monotonic() - started,
    )
    return delta, failure, kept, restored


def _finish(
    quantizer: RoundDeltaQuantizer | None, failure: str | None, where: str
) -> tuple[QuantizedTensors | WrittenDelta | None, DeviceResidual | None, str | None]:
    """Rank 0's delta and the residual it leaves, or why it has none (the quantizer's
    files then left as they were)."""
    if quantizer is None:
        return None, None, failure
    if failure is None:
        try:
            return (*quantizer.finish(), None)
        except Exception as exc:
            log.exception("%s: cannot quantize the delta", where)
            failure = f"cannot hand over the delta: {type(exc).__name__}: {exc}"
    quantizer.abort()
    return None, None, failure


class _Restorer:
    """θ_round put back into the model's tensors one at a time, as rank 0's quantizer
    read each for its delta (zeros, and no θ held, after a failure)."""

    def __init__(self, parallel: ParallelModel, group: ResidualGroup) -> None:
        self._own = federated_state(parallel.model)
        self._group = group
        self._whole = True

    def put(self, name: str, quantizer: RoundDeltaQuantizer | None) -> None:
        """Put back ``name`` (a collective; ``quantizer`` rank 0's, None after a failure)."""
        source = None
        if self._group.rank == 0:
            source = quantizer.base_of(name) if quantizer is not None else None
            if source is None:
                self._whole, source = False, torch.zeros(self._own[name].shape)
        load_whole_tensor(self._own[name], source)

    def agreed(self) -> bool:
        """Whether every tensor was put back (rank 0's word, on every rank)."""
        (whole,) = self._group.broadcast((self._whole,))
        return bool(whole)


def _start_quantizer(
    place: RankPlace,
    request: DeltaRequest,
    instruction: RoundInstruction,
    base_path: str,
    shapes: Mapping[str, tuple[int, ...]],
    write_tensors: bool,
    kept: DeviceResidual | None,
    group: ResidualGroup,
) -> tuple[RoundDeltaQuantizer | None, str | None]:
    """Rank 0's quantizer for the round, or why it has none."""
    try:
        return RoundDeltaQuantizer(
            request,
            job=instruction.job,
            round_=instruction.round,
            region=instruction.region,
            base_path=base_path,
            shapes={name: torch.Size(shape) for name, shape in shapes.items()},
            device=place.device,
            kept=kept,
            residual_path=place.handoff.residual_path(instruction.job, instruction.round),
            write_tensors=write_tensors,
            held_path=place.handoff.held_residual_path(instruction.job),
            group=group,
            stream_path=place.handoff.delta_stream_path(instruction.job, instruction.round),
        ), None
    except Exception as exc:
        log.exception(
            "job %s round %d: cannot quantize the delta", instruction.job, instruction.round
        )
        return None, f"cannot hand over the delta: {type(exc).__name__}: {exc}"
