"""θ_r made on the ranks, from θ_{r-1} their shards hold and round r-1's update.

A serial round's hand-over puts θ_r back into the model's federated tensors as rank 0
reads it to form the delta (:func:`regional_agent.worker.device_delta.hand_over_delta`):
the trained values are spent once the delta is quantized, and the group then holds
θ_r, recorded as :class:`HeldBase`. The next round's θ_{r+1} is θ_r plus round r's
update, which the agent verified and chained after θ_r (:mod:`geofed.theta_chain`). So
rank 0 reads no θ at all: :func:`planned_updates` finds that update in the round's chain
(the updates of every round since, when the region sat some out),
and :func:`apply_update` sends the update's chunk frames (the int8 or int4 codes and
their scales, about 1 byte a parameter; up to :data:`BATCH_BYTES` a broadcast, so a
round takes few collectives and no rank holds more than that of them) to every rank,
which checks each chunk it
decodes against the digest the agent verified, decodes only the chunks of its own
shard, and adds them to its shard on its device: the float32 additions the coordinator
and the agent make (:func:`geofed.theta_file.patch_theta`), element by element in the
rounds' order, so the shards hold θ_{r+1} bit for bit.

Anything else reads θ whole as before (rank 0 reads it and scatters it): the first round
of a group or of a job, a round after a failure, a stop, a delayed or streaming round,
and whenever the agent wrote θ whole (every ``transfer.theta_file_every`` rounds), which
also checks the group's θ against the announced hash.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from geofed.params import federated_state
from geofed.theta_chain import StoredUpdate, ThetaChain, UpdateReader, held_chain
from geofed.theta_file import ThetaFileError
from regional_agent.handoff.messages import RoundInstruction
from regional_agent.worker.parallelism import ParallelModel

log = logging.getLogger(__name__)

#: The most bytes of an update's frames sent in one broadcast (one chunk larger than
#: this goes alone): few collectives, and no rank holds more than this of them at once.
BATCH_BYTES = 64 << 20


class UpdateNotApplied(ValueError):
    """Some rank could not add the round's update to its shards; the message names which
    and why."""


@dataclass(frozen=True, slots=True)
class HeldBase:
    """The θ a group's model holds after a serial round's hand-over restored it: job
    ``job``'s θ of ``round`` hashing ``hash``; ``chain`` (rank 0's; None elsewhere) is
    where rank 0 read it, ``stamp`` that chain's base file as it was then."""

    job: str
    round: int
    hash: str
    chain: ThetaChain | None
    stamp: tuple[int, int, int] | None


def held_base(instruction: RoundInstruction, base_hash: str, rank: int) -> HeldBase:
    """What a group holds once the hand-over of ``instruction``'s round restored θ
    (``base_hash``, the hash it reported training from)."""
    chain: ThetaChain | None = None
    stamp = None
    if rank == 0:
        try:
            chain = held_chain(instruction.base_params, instruction.round)
            stamp = _stamp(chain.base)
        except (ThetaFileError, OSError) as exc:
            log.warning("job %s: θ_%d's chain: %s", instruction.job, instruction.round, exc)
            chain = None
    return HeldBase(instruction.job, instruction.round, base_hash, chain, stamp)


def planned_updates(
    held: HeldBase | None, instruction: RoundInstruction
) -> tuple[StoredUpdate, ...] | None:
    """Rank 0: the updates, in their rounds' order, that make ``instruction``'s θ from the
    θ the group ``held`` (one, or more when the region sat out rounds since), or None
    when θ must be read whole (the reason is logged)."""
    if held is None or held.chain is None or instruction.base_hash is None:
        return None
    where = f"job {instruction.job} round {instruction.round}"
    if held.job != instruction.job or instruction.round <= held.round:
        return None
    try:
        chain = held_chain(instruction.base_params, instruction.round)
        stamp = _stamp(chain.base)
    except (ThetaFileError, OSError) as exc:
        log.info("%s: reading θ whole (its chain: %s)", where, exc)
        return None
    if not chain.updates:
        log.info("%s: θ_%d is a θ file; reading it whole", where, instruction.round)
        return None
    kept = len(chain.updates) - (instruction.round - held.round)
    before = ThetaChain(chain.base, chain.base_round, chain.updates[: max(kept, 0)])
    if kept < 0 or not _same_chain(before, held.chain) or stamp != held.stamp:
        log.info(
            "%s: θ_%d does not follow the θ the group holds; reading it whole",
            where,
            instruction.round,
        )
        return None
    return chain.updates[kept:]


def apply_updates(
    parallel: ParallelModel,
    updates: Sequence[StoredUpdate] | None,
    group: dist.ProcessGroup | None,
) -> bool:
    """:func:`apply_update` for each of rank 0's ``updates`` in turn (a collective; None
    on the other ranks); False when the shards' layout takes none of them."""
    box = [len(updates) if updates is not None and dist.get_rank(group) == 0 else 0]
    dist.broadcast_object_list(box, src=0, group=group)
    for index in range(box[0]):
        update = updates[index] if updates is not None else None
        if not apply_update(parallel, update, group):
            return False  # the layout is the same for every update: at the first
    return box[0] > 0


def apply_update(
    parallel: ParallelModel, update: StoredUpdate | None, group: dist.ProcessGroup | None
) -> bool:
    """Add rank 0's ``update`` to every rank's shards (a collective; ``update`` is
    rank 0's, None elsewhere; ``group`` the control group, None: the default one).

    Returns False, with nothing changed, when some rank's shards are not a contiguous
    block of elements of each tensor (then θ is read whole). Raises
    :class:`UpdateNotApplied` on every rank, naming what each rank met (a frame whose
    digest differs, a tensor the update does not fit), once every tensor has been
    through, so that no rank is left in a collective; the shards are then neither θ_r
    nor θ_{r+1}, and the round is refused.
    """
    started = time.monotonic()
    rank0 = dist.get_rank(group) == 0
    own = federated_state(parallel.model)
    spans = {name: _local_span(tensor) for name, tensor in own.items()}
    flag = torch.tensor([int(any(span is None for span in spans.values()))], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item():
        return False
    # Rank 0 reads the file; every rank, rank 0 too, decodes the frames it was sent.
    source: UpdateReader | None = None
    failure: Exception | None = None
    sent: list[tuple[StoredUpdate, bytes] | None] = [None]
    if rank0 and update is None:
        failure = ValueError("rank 0 was given no update to send")
    elif rank0 and update is not None:
        try:
            source = UpdateReader(update)
            _check_fits(source, own)
            sent = [(update, source.header)]
        except (ThetaFileError, ValueError) as exc:
            failure, sent = exc, [None]
    dist.broadcast_object_list(sent, src=0, group=group)
    if sent[0] is None:
        raise UpdateNotApplied(f"rank 0 could not read the round's update: {failure}")
    header_update, header = sent[0]
    frames = _ReceivedFrames(header)
    reader: UpdateReader | None = None
    try:
        reader = UpdateReader(header_update, frames.frame)
    except ThetaFileError as exc:
        failure = exc
    moved = 0
    with torch.no_grad():
        for first, end in _batches(header_update):
            data, missed = _batch_frames(
                source if failure is None else None, first, end, header_update, group
            )
            failure = failure or missed
            moved += len(data)
            if failure is not None or reader is None:
                continue
            frames.hold(1 + first, reader.chunk_sizes(first, end), data)
            try:
                _add_batch(reader, own, spans, first, end)
            except (ThetaFileError, ValueError, RuntimeError) as exc:
                failure = exc
    errors: list[str | None] = [None] * dist.get_world_size(group)
    mine = None if failure is None else f"rank {dist.get_rank(group)}: {failure}"
    dist.all_gather_object(errors, mine, group=group)
    met = [error for error in errors if error is not None]
    if met:
        raise UpdateNotApplied("; ".join(met))
    log.info(
        "θ_%d made from the shards' θ_%d and its update (%.1f MB of frames) in %.3f s",
        header_update.round + 1,
        header_update.round,
        moved / 1e6,
        time.monotonic() - started,
    )
    return True


class _ReceivedFrames:
    """The frames a rank was sent: the header, and the chunk frames of one batch."""

    def __init__(self, header: bytes) -> None:
        self._header = header
        self._first, self._starts, self._data = 0, [0], b""

    def hold(self, first: int, sizes: Sequence[int], data: bytes) -> None:
        self._first, self._data = first, data
        self._starts = [0]
        for size in sizes:
            self._starts.append(self._starts[-1] + size)

    def frame(self, index: int) -> bytes:
        if index == 0:
            return self._header
        at = index - self._first
        if not 0 <= at < len(self._starts) - 1:
            raise ThetaFileError(f"frame {index} was not sent with this batch")
        return self._data[self._starts[at] : self._starts[at + 1]]


def _batches(update: StoredUpdate) -> list[tuple[int, int]]:
    """The update's chunks in runs [first, end) of at most :data:`BATCH_BYTES` of frames
    (a chunk larger than that alone): each run is one broadcast, the same on every rank."""
    runs: list[tuple[int, int]] = []
    first, size = 0, 0
    chunks = len(update.sizes) - 2
    for chunk in range(chunks):
        frame = update.sizes[1 + chunk]
        if chunk > first and size + frame > BATCH_BYTES:
            runs.append((first, chunk))
            first, size = chunk, 0
        size += frame
    if chunks > first:
        runs.append((first, chunks))
    return runs


def _batch_frames(
    reader: UpdateReader | None,
    first: int,
    end: int,
    update: StoredUpdate,
    group: dist.ProcessGroup | None,
) -> tuple[bytes, Exception | None]:
    """Rank 0's frames of chunks ``first`` to ``end`` on every rank (one broadcast; their
    size is known from the update's frame sizes), and rank 0's failure to read them (then
    zeros are sent: they fail every chunk's check where they are decoded)."""
    size = sum(update.sizes[1 + first : 1 + end])
    data, failure = b"", None
    if reader is not None:
        try:
            data = reader.chunk_frames(first, end)
        except ThetaFileError as exc:
            failure = exc
    buffer = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.zeros(size, dtype=torch.uint8)
    )
    dist.broadcast(buffer, src=0, group=group)
    return (data or buffer.numpy().tobytes()), failure


def _add_batch(
    reader: UpdateReader,
    own: dict[str, torch.Tensor],
    spans: dict[str, tuple[int, int] | None],
    first: int,
    end: int,
) -> None:
    """Add the decoded chunks ``first`` to ``end`` to this rank's shards: of each tensor
    they hold, the elements of this rank's span."""
    per = reader.chunk_elements
    for name, run in reader.runs.items():
        low, high = max(first, run.first), min(end, run.first + run.count)
        span = spans[name]
        if low >= high or span is None:
            continue
        start = max(span[0], (low - run.first) * per)
        stop = min(span[1], (high - run.first) * per)
        if start >= stop:
            continue
        tensor = own[name]
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        reader.add_to(name, local.view(-1), start, stop, offset=span[0])


def _check_fits(reader: UpdateReader, own: dict[str, torch.Tensor]) -> None:
    """The update fits the model's federated tensors, which are float32 where it names them."""
    reader.check_fits({name: tuple(tensor.shape) for name, tensor in own.items()})
    other = sorted(n for n in reader.shapes if own[n].dtype != torch.float32)
    if other:
        raise ValueError(f"the model's tensors {other[:5]} are not float32")


def _local_span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The elements [begin, end) of ``tensor``'s flattened values this rank holds, or
    None when they are not one contiguous block (then θ is read whole)."""
    if not isinstance(tensor, DTensor):
        return (0, tensor.numel()) if tensor.is_contiguous() else None
    local = tensor.to_local()
    if not local.is_contiguous():
        return None
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    rows = tensor.shape[0] if tensor.dim() else 1
    begin_row, count = 0, rows
    for dim, placement in enumerate(tensor.placements):
        if placement.is_replicate():
            continue
        if not placement.is_shard(0) or begin_row != 0 or count != rows:
            return None  # another dimension, or sharded twice
        shards = tensor.device_mesh.size(dim)
        block = math.ceil(rows / shards)
        begin_row = min(coordinate[dim] * block, rows)
        count = min(block, rows - begin_row)
    if tuple(local.shape) != (count, *tensor.shape[1:]):
        return None
    per_row = math.prod(tensor.shape[1:])
    return begin_row * per_row, (begin_row + count) * per_row


def _same_chain(one: ThetaChain, other: ThetaChain) -> bool:
    def key(chain: ThetaChain) -> tuple[object, ...]:
        return (
            Path(chain.base),
            chain.base_round,
            tuple((u.round, u.digests) for u in chain.updates),
        )

    return key(one) == key(other)


def _stamp(path: Path) -> tuple[int, int, int]:
    """The file's identity and last change: a θ file written anew at the same place is
    not the one read before."""
    stat = Path(path).stat()
    return stat.st_ino, stat.st_size, stat.st_mtime_ns
