"""One outer round, from accepted deltas to a stored update: aggregate, outer step, encode, sign.

The math (:func:`publication_step`) is pure: given θ_r, the round's pseudo-gradient (the
job's aggregation rule over the deltas; by default their token-weighted mean),
the outer optimizer state and the coordinator's error-feedback residual e, it computes

    target = OuterOptimizer.step(θ_r, mean Δ)
    u      = (target - θ_r) + e                 the update the coordinator intends
    û      = decode(encode(u))                   what every region will reconstruct
    e'     = u - û                               carried into the next round
    θ_r+1  = θ_r + û                             exactly what regions compute

so the coordinator's θ_{r+1} is bit for bit what each region reconstructs from the
published update. A round of an ``overlap: streaming`` job does all of this for its
fragment's tensors only (:meth:`~coordinator.rounds.layout.RoundLayout.round_specs`,
:mod:`geofed.fragments`): the momentum buffers and residuals of the other tensors are
kept, the update names only the fragment, and every other tensor of θ_{r+1} is θ_r's, bit
for bit; θ_{r+1}'s hash is over all of it. :func:`publish_round` wraps it with I/O: it
takes the round's sum folded as deltas arrived when the engine holds it (the job's rule is
a plain mean; :mod:`coordinator.aggregation.accumulator`), or else decodes the durable
deltas chunk by chunk in the round's recorded arrival order and combines them
(:func:`coordinator.aggregation.robust.combine`); both give the same bits, so a restarted
coordinator recomputes the identical round. It then signs and stores the update (and, when
the job's snapshot policy says so, a lossless fp32 snapshot; by default every
``snapshot_every`` rounds) in the job's checkpoint location and writes the new
working-state blobs. Nothing here commits the round:
:mod:`coordinator.publication.publisher` does, in one state-store transaction. Blocking:
run in a worker thread.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

import torch
from pydantic import JsonValue
from torch import Tensor

from coordinator.aggregation.config import AggregationConfig
from coordinator.aggregation.outer_optimizer import OuterOptimizer
from coordinator.aggregation.robust import Combined, NormVerdict, combine, folded
from coordinator.aggregation.weighted import Feed, PieceLike, WeightedSum
from coordinator.rounds.late import late_key, staleness_factor
from coordinator.rounds.layout import RoundLayout, fp32_bytes
from coordinator.state.store import Receipt
from coordinator.storage.artifacts import Location, Signer, StoredArtifact, store_artifact
from coordinator.storage.checkpoints import EntryKind
from coordinator.storage.working_state import ParamsStore, Saved, WorkingState, advanced_pointers
from geofed.blobstore import BlobStore, FsBlobStore
from geofed.codec import (
    DigestMismatch,
    EncodedStream,
    Piece,
    StreamDecoder,
    decode,
    encode_stream,
)
from geofed.codec.host_threads import usable_cpus
from geofed.codec.stored import decode_stored
from geofed.codec_params import CodecParams
from geofed.deltas import apply_update, feedback_residual, update_to_publish
from geofed.manifest import ArtifactProvenance, build_manifest
from geofed.params import parameters_vector_hash
from geofed.types import ArtifactKind

__all__ = [
    "PUBLICATION_PHASES",
    "SNAPSHOT_CODEC",
    "DeltaSource",
    "JobPublishing",
    "PublicationStep",
    "PublishedRound",
    "delta_pieces",
    "delta_sources",
    "mean_delta",
    "publication_step",
    "publish_initial",
    "publish_round",
    "round_step",
    "store_round",
    "stored_delta",
]

#: Snapshots are lossless.
SNAPSHOT_CODEC: Final = CodecParams(scheme="fp32", block_size=128, zstd_level=1)

#: The steps of :func:`publication_step`, in order, as its ``phase`` hook names them.
PUBLICATION_PHASES: Final = ("outer_step", "encode_update", "decode_update", "apply")


@dataclass(frozen=True)
class PublicationStep:
    """The outcome of one outer step (see the module docstring)."""

    params: dict[str, Tensor]
    stream: EncodedStream
    residual: dict[str, Tensor]
    optimizer_state: dict[str, Any]


def _unmeasured(name: str) -> AbstractContextManager[object]:
    del name
    return contextlib.nullcontext()


def publication_step(
    params: Mapping[str, Tensor],
    mean: Mapping[str, Tensor],
    optimizer_state: Mapping[str, Any],
    residual: Mapping[str, Tensor] | None,
    codec: CodecParams,
    *,
    names: Sequence[str] | None = None,
    own_steps: int | None = None,
    phase: Callable[[str], AbstractContextManager[object]] = _unmeasured,
    consume_mean: bool = False,
    in_place: bool = False,
) -> PublicationStep:
    """Apply the outer step to θ_r and encode the update; inputs are not modified unless
    ``in_place``.

    ``names`` restricts the round to those tensors of θ_r (a streaming round's fragment,
    in θ's order): ``mean`` names exactly them, the optimizer steps only them
    (:meth:`OuterOptimizer.step_subset`), the update and the new residual cover only
    them (the residual of every other tensor is carried as it is) and every other tensor
    of θ_{r+1} is θ_r's. None: every tensor of θ_r, as ``mean`` must then name.
    ``own_steps``: the outer steps those tensors took before, which set the momentum
    warm-up (:meth:`JobPublishing.own_steps`). ``consume_mean``: ``mean`` (a dict the
    caller hands over) loses each tensor as soon as the step has used it, so the step
    never holds the whole mean beside its new tensors.

    ``in_place``: the caller hands its inputs over and the step is taken in their own
    tensors, making none of the model's size: θ_r's tensors become θ_{r+1}'s, the momentum
    moves in its buffers, the mean's tensors (``mean`` a dict) become the update the
    coordinator intends, then the new residual, and a ``residual`` dict loses the round's
    tensors once they are carried into the update. The same ops in the same order as out
    of place, so the same bits. After an exception the inputs are not to be used (the
    daemon rebuilds its state from storage: :mod:`coordinator.rounds.engine`); the input is
    checked before anything is written.

    Each step named in :data:`PUBLICATION_PHASES` runs inside ``phase(name)``, so that a
    caller can measure the steps of the very computation the daemon runs (the
    round-overhead benchmark times them and takes their peak memory); ``decode_update``
    decodes the update piece by piece and applies each piece as it comes.
    """
    # Each intermediate is dropped as soon as the next one exists, and the step's own
    # intermediates are reused in place: the round's peak memory is what the coordinator
    # must provision. Every in-place op is the out-of-place op's, so the bits are the same.
    stepped, carried = (params, residual) if names is None else _restricted(params, residual, names)
    # Tensors that share memory (tied weights kept as one) would take their update twice,
    # and a strided θ cannot take it through flat views: those are stepped out of place.
    in_place = in_place and _steppable_in_place(stepped, optimizer_state, mean)
    with phase("outer_step"):
        # The step writes none of the state's momentum tensors: no copy of them.
        optimizer = OuterOptimizer.from_state_dict(optimizer_state, copy=False)
        if in_place and not isinstance(mean, dict):
            raise TypeError("a step taken in place needs the mean as the caller's own dict")
        consume = (consume_mean or in_place) and isinstance(mean, dict)
        if names is None:
            target = optimizer.step(params, mean, consume=consume, in_place=in_place)
        else:
            target = optimizer.step_subset(
                stepped, mean, own_steps=own_steps, consume=consume, in_place=in_place
            )
    with phase("encode_update"):
        # The targets are the step's own new tensors: the update is formed in them.
        intended = _update_in_place(stepped, target, carried)
        del target
        if in_place and isinstance(residual, dict):
            # Handed over and carried into the update: its round's tensors are let go now.
            for name in intended:
                residual.pop(name, None)
            carried = None
        stream = encode_stream(intended, codec)
    with phase("decode_update"):
        # θ_{r+1} = θ_r + û and e' = intended - û, piece by piece: û is never held whole.
        added, new_residual = _apply_pieces(stepped, intended, stream, in_place=in_place)
        del intended
    with phase("apply"):
        if names is None:
            new_params = added
        else:
            new_params = {name: added.get(name, tensor) for name, tensor in params.items()}
            new_residual = _merged_residual(params, residual, new_residual)
        del added
    return PublicationStep(
        params=new_params,
        stream=stream,
        residual=new_residual,
        optimizer_state=optimizer.state_dict(),
    )


def _steppable_in_place(
    params: Mapping[str, Tensor], optimizer_state: Mapping[str, Any], mean: Mapping[str, Tensor]
) -> bool:
    """Whether these tensors (θ's, the momentum's, the mean's) are all contiguous and no
    two of them share memory."""
    buffers = optimizer_state.get("momentum_buffers")
    tensors = [*params.values(), *mean.values()]
    if isinstance(buffers, Mapping):
        tensors += [t for t in buffers.values() if isinstance(t, Tensor)]
    if not all(t.is_contiguous() for t in tensors):
        return False
    places = {t.untyped_storage().data_ptr() for t in tensors if t.numel()}
    return len(places) == sum(1 for t in tensors if t.numel())


def _update_in_place(
    params: Mapping[str, Tensor], target: dict[str, Tensor], residual: Mapping[str, Tensor] | None
) -> dict[str, Tensor]:
    """:func:`geofed.deltas.update_to_publish` formed in ``target``'s own tensors (new
    tensors of the outer step, never θ's: checked), which it returns."""
    for name, tensor in target.items():
        base = params[name]
        if tensor.data_ptr() == base.data_ptr() or tensor.dtype != base.dtype:
            # Not expected of the outer step; fall back to the shared op.
            return update_to_publish(params, target, residual)
    for name, tensor in target.items():
        tensor.sub_(params[name])
        if residual is not None:
            tensor.add_(residual[name])
    return target


def _apply_pieces(
    params: Mapping[str, Tensor],
    intended: dict[str, Tensor],
    stream: EncodedStream,
    *,
    in_place: bool = False,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Decode ``stream`` (the update û of ``intended``) piece by piece: each piece is added
    to θ's slice into θ_{r+1} (:func:`geofed.deltas.apply_update`'s add; in θ's own
    tensors when ``in_place``) and taken off ``intended``'s slice in place
    (:func:`geofed.deltas.feedback_residual`'s subtraction), which becomes the new
    residual. Returns θ_{r+1}'s tensors of the update, in ``intended``'s order, and the
    residual."""
    if any(params[name].dtype != torch.float32 for name in intended):
        if in_place:
            raise TypeError("an update is applied in place to float32 parameters only")
        # Decoded values are float32: other dtypes go through the shared whole-tensor ops.
        decoded = decode(stream.frames())
        residual = feedback_residual(intended, decoded)
        return apply_update({name: params[name] for name in intended}, decoded), residual
    if in_place:
        added = {name: params[name] for name in intended}
        # A view or an error: a reshaped copy would take the update instead of θ.
        flat_params = {name: params[name].view(-1) for name in intended}
    else:
        added = {name: torch.empty_like(params[name]) for name in intended}
        flat_params = {name: params[name].reshape(-1) for name in intended}
    flat_added = {name: tensor.view(-1) for name, tensor in added.items()}
    flat_intended = {name: tensor.view(-1) for name, tensor in intended.items()}
    covered = dict.fromkeys(intended, 0)
    decoder = StreamDecoder()
    for frame in stream.frames():
        for piece in decoder.feed(frame):
            if piece.name not in covered:
                raise ValueError(f"the update decodes a tensor {piece.name!r} it does not carry")
            part = slice(piece.offset, piece.offset + piece.count)
            torch.add(flat_params[piece.name][part], piece.values, out=flat_added[piece.name][part])
            flat_intended[piece.name][part].sub_(piece.values)
            covered[piece.name] += piece.count
    decoder.finish()
    short = [name for name, count in covered.items() if count != intended[name].numel()]
    if short:
        raise ValueError(f"the update does not cover tensors {short[:5]} whole")
    return added, intended


def _restricted(
    params: Mapping[str, Tensor], residual: Mapping[str, Tensor] | None, names: Sequence[str]
) -> tuple[dict[str, Tensor], dict[str, Tensor] | None]:
    """θ_r's tensors ``names`` and their residual (None when none of them has one yet)."""
    unknown = [name for name in names if name not in params]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(
            f"a round's tensors must be distinct tensors of θ (at least one); got "
            f"{list(names)[:5]}, unknown {unknown[:5]}"
        )
    stepped = {name: params[name] for name in names}
    held = {name: residual[name] for name in names if residual is not None and name in residual}
    if not held:
        return stepped, None
    if len(held) != len(names):
        # A fragment's tensors are always published together, so they get residuals together.
        missing = [name for name in names if name not in held]
        raise ValueError(f"the residual covers some of the round's tensors, not {missing[:5]}")
    return stepped, held


def _merged_residual(
    params: Mapping[str, Tensor],
    residual: Mapping[str, Tensor] | None,
    fresh: Mapping[str, Tensor],
) -> dict[str, Tensor]:
    """The round's new residuals with every other tensor's carried, in θ's order."""
    merged = {**(residual or {}), **fresh}
    return {name: merged[name] for name in params if name in merged}


@dataclass(frozen=True, slots=True)
class DeltaSource:
    """An accepted delta: its region, its tokens and its durable stream blob; for a late
    delta merged into a later round, how many rounds late it is."""

    region: str
    tokens: int
    blob_digest: str
    #: A late delta's own round (:mod:`coordinator.rounds.late`); None: the round's own.
    round: int | None = None
    staleness: int = 0

    @property
    def key(self) -> str:
        """Its name in the round's sum (:attr:`coordinator.rounds.state.Arrival.key`)."""
        return self.region if self.round is None else late_key(self.region, self.round)

    @property
    def weight(self) -> float:
        """Its weight in the mean: its tokens, discounted by its staleness."""
        return float(self.tokens) * staleness_factor(self.staleness)


def delta_sources(
    receipts: Iterable[Receipt],
    included: Iterable[str],
    merged: Iterable[Receipt] = (),
    round: int | None = None,
) -> list[DeltaSource]:
    """The accepted deltas round ``round`` aggregates: those of its ``included`` regions,
    then the late deltas it ``merged`` (their receipts, for earlier rounds)."""
    regions = set(included)
    sources = [
        DeltaSource(r.region, r.tokens, r.blob_digest) for r in receipts if r.region in regions
    ]
    for late in merged:
        if round is None or late.round >= round:
            raise ValueError(f"a delta of round {late.round} is not late for round {round}")
        sources.append(
            DeltaSource(late.region, late.tokens, late.blob_digest, late.round, round - late.round)
        )
    return sources


def delta_pieces(blobs: BlobStore, digest: str, max_decoded_bytes: int) -> Iterator[Piece]:
    """Decode a stored delta stream piece by piece (the blob is verified at its end)."""
    decoder = StreamDecoder(max_decoded_bytes=max_decoded_bytes)
    with blobs.open(digest) as reader:
        for part in reader:
            yield from decoder.feed(part)
    decoder.finish()


def stored_delta(deltas: FsBlobStore, digest: str, max_decoded_bytes: int) -> Feed:
    """A stored delta, decoded piece by piece when fed (a round's sum folds accepted deltas
    so): its chunks side by side on every usable CPU, the file checked against its
    blob's digest."""
    path = deltas.read_path(digest)

    def feed(consume: Callable[[PieceLike], None]) -> None:
        found = decode_stored(
            path, consume, workers=usable_cpus(), max_decoded_bytes=max_decoded_bytes
        )
        if found != digest:
            raise DigestMismatch(f"blob {digest} reads as {found}")

    return feed


def mean_delta(
    blobs: BlobStore,
    specs: Mapping[str, tuple[int, ...]],
    sources: Sequence[DeltaSource],
    max_decoded_bytes: int,
    config: AggregationConfig | None = None,
    order: Sequence[str] | None = None,
) -> Combined:
    """The round's delta under the job's aggregation ``config`` (default: the
    weighted mean, summed in ``order`` of their keys, by default sorted) and the
    norm check's verdicts. ``specs`` are the round's tensors
    (:meth:`~coordinator.rounds.layout.RoundLayout.round_specs`). Each source weighs
    :attr:`DeltaSource.weight`."""
    weighted = {
        source.key: (
            source.weight,
            functools.partial(delta_pieces, blobs, source.blob_digest, max_decoded_bytes),
        )
        for source in sources
    }
    if len(weighted) != len(sources):
        raise ValueError(f"sources name a delta twice: {sorted(s.key for s in sources)}")
    return combine(
        specs,
        weighted,
        config or AggregationConfig(),
        order,
    )


@dataclass(frozen=True)
class JobPublishing:
    """What publishing needs to know about one job."""

    job: str
    codec: CodecParams
    snapshot_every: int
    provenance: tuple[ArtifactProvenance, ...]
    #: The tensors each round synchronizes (the job context's, shared).
    layout: RoundLayout
    location: Location
    signer: Signer
    params_store: ParamsStore
    #: Where accepted deltas are, as files: a round's sum decodes them from there.
    deltas: FsBlobStore
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)

    @property
    def max_decoded_bytes(self) -> int:
        return self.layout.fp32_bytes


@dataclass(frozen=True)
class PublishedRound:
    """Round ``round`` computed and stored; committing it is the caller's transaction."""

    round: int
    state: WorkingState
    pointers: dict[str, str]
    update: StoredArtifact
    snapshot: StoredArtifact | None
    tokens: int
    fp32_bytes: int
    norm_checks: tuple[NormVerdict, ...] = ()
    #: The order the mean summed the regions in, and whether their deltas were
    #: "folded on arrival" or "decoded at publication".
    order: tuple[str, ...] = ()
    summation: str = ""
    #: Wall seconds the snapshot took to encode, sign and store (None: no snapshot).
    snapshot_s: float | None = None


def round_step(
    job: JobPublishing,
    state: WorkingState,
    sources: Sequence[DeltaSource],
    *,
    order: Sequence[str] | None = None,
    folded_sum: WeightedSum | None = None,
    in_place: bool = False,
) -> tuple[PublicationStep, tuple[NormVerdict, ...]]:
    """Round ``state.version``'s outer step from its accepted ``sources`` summed in
    ``order`` (see :func:`publish_round`), and the norm check's verdicts. Publishing a
    round and replaying it after a restart (:mod:`coordinator.storage.replay`) both take
    this step, so they give the same bits. ``in_place``: taken in ``state``'s own tensors
    (:func:`publication_step`), which the caller hands over."""
    if not sources:
        raise ValueError(f"job {job.job!r} round {state.version}: no delta to aggregate")
    if folded_sum is not None:
        regions = [source.key for source in sources]
        if sorted(folded_sum.regions) != sorted(regions):
            raise ValueError(
                f"job {job.job!r} round {state.version}: the folded sum holds "
                f"{sorted(folded_sum.regions)}, the round {sorted(regions)}"
            )
        combined = folded(folded_sum.take_mean(), regions, job.aggregation)
    else:
        specs = job.layout.round_specs(state.version)
        combined = mean_delta(job.deltas, specs, sources, fp32_bytes(specs), job.aggregation, order)
    publication = publication_step(
        state.params,
        combined.delta,
        state.optimizer_state,
        state.residual,
        job.codec,
        names=job.layout.round_names(state.version),
        own_steps=job.layout.own_steps(state.version),
        consume_mean=True,
        in_place=in_place,
    )
    return publication, combined.flagged


def publish_round(
    job: JobPublishing,
    state: WorkingState,
    sources: Sequence[DeltaSource],
    now: datetime,
    *,
    order: Sequence[str] | None = None,
    folded_sum: WeightedSum | None = None,
    lineage: Mapping[str, JsonValue] | None = None,
    snapshot: bool | None = None,
    save_state: bool = True,
    in_place: bool = False,
) -> PublishedRound:
    """Compute and store round ``state.version`` from the accepted ``sources``.

    ``order`` is the order the mean sums regions in (the round's arrival order; default
    sorted names). ``folded_sum`` is those very regions already summed in that order as
    they arrived (:mod:`coordinator.aggregation.accumulator`): the deltas are then not decoded
    again, and the result is the same bits. It is consumed. ``lineage`` is the round's
    lineage record (:mod:`coordinator.publication.lineage`), signed into the update's manifest.
    ``snapshot``: whether θ_{r+1} gets a snapshot (:mod:`coordinator.publication.snapshot_policy`);
    None: when r+1 is a multiple of ``job.snapshot_every``. ``save_state``: whether
    θ_{r+1}'s working state is saved
    (:func:`coordinator.publication.snapshot_policy.decide_state_save`). ``in_place``:
    θ_{r+1}'s state is made in ``state``'s tensors (:func:`publication_step`), which are
    not to be used as θ_r's after the call, whether it returned or raised.
    """
    publication, flagged = round_step(
        job, state, sources, order=order, folded_sum=folded_sum, in_place=in_place
    )
    round_ = state.version
    tokens = sum(source.tokens for source in sources)
    took: list[float] = []
    with ThreadPoolExecutor(max_workers=3, thread_name_prefix="geofed-publish") as pool:
        new_state, pointers, update, stored_snapshot = store_round(
            job,
            state,
            publication,
            tokens,
            now,
            pool,
            lineage=lineage,
            snapshot=snapshot,
            save_state=save_state,
            on_snapshot=took.append,
        )
    return PublishedRound(
        round_,
        new_state,
        pointers,
        update,
        stored_snapshot,
        tokens,
        publication.stream.fp32_bytes,
        flagged,
        tuple(order) if order is not None else tuple(sorted(s.key for s in sources)),
        "folded on arrival" if folded_sum is not None else "decoded at publication",
        took[0] if took else None,
    )


def store_round(
    job: JobPublishing,
    state: WorkingState,
    publication: PublicationStep,
    tokens: int,
    now: datetime,
    pool: Executor | None,
    *,
    lineage: Mapping[str, JsonValue] | None = None,
    snapshot: bool | None = None,
    save_state: bool = True,
    on_snapshot: Callable[[float], None] | None = None,
) -> tuple[WorkingState, dict[str, str], StoredArtifact, StoredArtifact | None]:
    """Store what round ``state.version`` published: θ_{r+1}'s working state, the signed
    update (and a snapshot when one is due); return the new state, its pointer values and
    the artifacts.

    The writes are independent, a model's size each: with ``pool`` (3 threads) the
    working state's three blobs are written side by side with θ_{r+1}'s hash and the
    chain's update and snapshot. ``snapshot`` is as in :func:`publish_round`;
    ``on_snapshot`` is told the wall seconds the snapshot took. Without ``save_state``
    (and when ``state`` knows its saved version) only the version pointers move.
    """
    round_ = state.version
    saving = None
    if save_state or state.saved is None:
        saving = job.params_store.begin_save(
            round_ + 1, publication.params, publication.optimizer_state, publication.residual, pool
        )
    new_hash = parameters_vector_hash(publication.params)
    manifest = build_manifest(
        kind=ArtifactKind.GLOBAL_UPDATE,
        job=job.job,
        round=round_,
        producer=job.signer.identity,
        stream=publication.stream,
        provenance=job.provenance,
        created_at=now,
        base_round=round_,
        base_hash=state.params_hash,
        parameters_hash=new_hash,
        tokens=tokens,
        lineage=lineage,
    )
    update = store_artifact(
        job.location,
        EntryKind.UPDATE,
        job.job,
        round_,
        job.signer.sign(manifest),
        publication.stream,
    )
    if snapshot is None:
        snapshot = (round_ + 1) % job.snapshot_every == 0
    stored_snapshot = None
    if snapshot:
        started = time.monotonic()
        stored_snapshot = store_snapshot(job, round_ + 1, publication.params, new_hash, now)
        if on_snapshot is not None:
            on_snapshot(time.monotonic() - started)
    if saving is not None:
        pointers = saving.pointers(new_hash)
        saved = Saved(round_ + 1, new_hash)
    else:
        assert state.saved is not None
        saved = state.saved
        pointers = advanced_pointers(round_ + 1, new_hash, saved)
    new_state = WorkingState(
        version=round_ + 1,
        params=publication.params,
        params_hash=new_hash,
        optimizer_state=publication.optimizer_state,
        residual=publication.residual,
        saved=saved,
    )
    return new_state, pointers, update, stored_snapshot


def publish_initial(
    job: JobPublishing, params: dict[str, Tensor], optimizer: OuterOptimizer, now: datetime
) -> tuple[WorkingState, dict[str, str], StoredArtifact]:
    """θ_0: store its snapshot (round 0) and its working state."""
    state = WorkingState.initial(params, optimizer.state_dict())
    snapshot = store_snapshot(job, 0, params, state.params_hash, now)
    return state, job.params_store.save(state), snapshot


def store_snapshot(
    job: JobPublishing, version: int, params: Mapping[str, Tensor], params_hash: str, now: datetime
) -> StoredArtifact:
    """A lossless snapshot of θ_version, signed and recorded in the chain."""
    stream = encode_stream(params, SNAPSHOT_CODEC)
    manifest = build_manifest(
        kind=ArtifactKind.GLOBAL_CHECKPOINT,
        job=job.job,
        round=version,
        producer=job.signer.identity,
        stream=stream,
        provenance=job.provenance,
        created_at=now,
        parameters_hash=params_hash,
    )
    return store_artifact(
        job.location, EntryKind.SNAPSHOT, job.job, version, job.signer.sign(manifest), stream
    )
