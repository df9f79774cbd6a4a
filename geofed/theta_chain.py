"""θ_r held as the θ file of an earlier version and the verified updates after it.

θ_{r+1} is θ_r plus round r's update, added in float32 element by element
(:func:`geofed.theta_file.patch_theta`). Whoever keeps θ_k's file and the update streams
of rounds k..r-1 (each verified once, where it was downloaded, and left in its file) holds
θ_r without writing it: :class:`ChainReads` reads each tensor as θ_k's values plus every
update's pieces of it, added in the rounds' order: the additions ``patch_theta`` makes,
in the same order, so every value is bit for bit θ_r's. Each element's additions happen
in that order on one thread; a large tensor's elements are split into ranges read side by
side on ``threads`` threads (zstd and torch release the GIL; each range's ops stay on its
thread, :func:`geofed.codec.host_threads.one_thread`). An update's pieces of one tensor
are found from its stream's header (the chunks' layout is the header's,
:func:`geofed.codec.layout.chunk_slots`), so reading a tensor costs that tensor's chunks of
each update, each checked against the digest its manifest gave, as a whole-stream decoder
checks it (:meth:`geofed.codec.decoder.StreamDecoder.from_chunk`). :func:`chain_hash`
hashes θ_r one tensor at a time (:func:`geofed.params.parameters_vector_hash`'s hash);
:func:`write_chain` writes θ_r's file. Neither holds more than one tensor of θ.

A chain is described by a small JSON file (:meth:`ThetaChain.save`, :meth:`ThetaChain.load`)
naming the base file, its round and each update's file, frames and digests.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from geofed.artifact_check import (
    FileFrames,
    VerifiedArtifact,
    apply_update_to_file,
    check_update_fits,
)
from geofed.codec.decoder import StreamDecoder
from geofed.codec.errors import CodecError
from geofed.codec.host_threads import one_thread, usable_cpus
from geofed.codec.layout import chunk_slots
from geofed.fsutil import AtomicFile
from geofed.params import HashingReads
from geofed.theta_file import (
    ThetaFileError,
    ThetaReads,
    fill_theta,
    hash_theta,
    map_theta,
    read_layout,
    read_theta,
)

FORMAT = "geofed-theta-chain-1"
#: Threads a chain's reader uses at most by default: one per usable CPU, up to this.
MAX_READ_THREADS = 8
#: How a chain's description starts (its JSON, compact, the format first): no θ file
#: starts so, as these bytes read as a header length no θ file has.
_MAGIC = b'{"format":"' + FORMAT.encode() + b'"'


class ThetaChainError(ThetaFileError):
    """A chain that does not describe θ: unreadable, inconsistent, or an update whose
    stored frames no longer match their digests. The message names the file."""


@dataclass(frozen=True)
class StoredUpdate:
    """A verified global update of ``round`` (θ_round to θ_round+1) whose stream stays
    in its file: where its frames lie, and every frame's sha256 from its manifest."""

    round: int
    path: Path
    start: int
    sizes: tuple[int, ...]
    digests: tuple[str, ...]

    @classmethod
    def of(cls, artifact: VerifiedArtifact) -> StoredUpdate:
        """The update ``artifact`` verified from its file (frames left there)."""
        frames = artifact.frames
        if not isinstance(frames, FileFrames):
            raise ThetaChainError(
                f"update {artifact.manifest.job}/{artifact.manifest.round}: verified in "
                "memory; a chain keeps updates verified from their files"
            )
        digests = tuple(record.sha256 for record in artifact.manifest.chunks)
        return cls(artifact.manifest.round, frames.path, frames.start, frames.sizes, digests)

    def to_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "path": str(self.path),
            "start": self.start,
            "sizes": list(self.sizes),
            "digests": list(self.digests),
        }

    @classmethod
    def from_dict(cls, data: object, where: str) -> StoredUpdate:
        if not isinstance(data, dict):
            raise ThetaChainError(f"{where}: not an object")
        try:
            update = cls(
                round=_natural(data["round"], f"{where}.round"),
                path=Path(_text(data["path"], f"{where}.path")),
                start=_natural(data["start"], f"{where}.start"),
                sizes=tuple(_natural(s, f"{where}.sizes") for s in _list(data, "sizes", where)),
                digests=tuple(_text(d, f"{where}.digests") for d in _list(data, "digests", where)),
            )
        except KeyError as exc:
            raise ThetaChainError(f"{where}: no key {exc}") from None
        if len(update.sizes) < 2 or len(update.sizes) != len(update.digests):
            raise ThetaChainError(
                f"{where}: {len(update.sizes)} frame sizes and {len(update.digests)} digests "
                "(a stream has a header and a trailer, each frame a digest)"
            )
        return update


@dataclass(frozen=True)
class ThetaChain:
    """θ_{base_round + len(updates)}: the θ file ``base`` (θ_base_round) and the updates
    of rounds base_round, base_round + 1, ... in order."""

    base: Path
    base_round: int
    updates: tuple[StoredUpdate, ...] = ()

    def __post_init__(self) -> None:
        rounds = [update.round for update in self.updates]
        wanted = list(range(self.base_round, self.base_round + len(rounds)))
        if rounds != wanted:
            raise ThetaChainError(
                f"θ_{self.base_round} at {self.base}: updates of rounds {rounds} do not follow "
                f"it one round at a time ({wanted})"
            )

    @property
    def round(self) -> int:
        """The round of the θ the chain holds."""
        return self.base_round + len(self.updates)

    def then(self, update: StoredUpdate) -> ThetaChain:
        """This chain with ``update`` (of its round) after it."""
        return ThetaChain(self.base, self.base_round, (*self.updates, update))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the chain's description at ``path`` (temp + fsync + rename)."""
        document = {
            "format": FORMAT,
            "base": str(self.base),
            "base_round": self.base_round,
            "updates": [update.to_dict() for update in self.updates],
        }
        with AtomicFile(path, private=True) as f:
            f.write(json.dumps(document, separators=(",", ":")).encode())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ThetaChain:
        """The chain described at ``path``; :class:`ThetaChainError` naming what is wrong."""
        try:
            document = json.loads(Path(path).read_bytes())
        except OSError as exc:
            raise ThetaChainError(f"{path}: {exc.strerror or exc}") from None
        except ValueError:
            raise ThetaChainError(f"{path}: not JSON") from None
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise ThetaChainError(f"{path}: not a θ chain of format {FORMAT}")
        try:
            base = Path(_text(document["base"], f"{path}: base"))
            base_round = _natural(document["base_round"], f"{path}: base_round")
        except KeyError as exc:
            raise ThetaChainError(f"{path}: no key {exc}") from None
        updates = tuple(
            StoredUpdate.from_dict(entry, f"{path}: updates[{index}]")
            for index, entry in enumerate(_list(document, "updates", str(path)))
        )
        return cls(base, base_round, updates)


@dataclass(frozen=True)
class _Run:
    """The consecutive chunks of one tensor in one update: the first's index, how many."""

    first: int
    count: int


class UpdateReader:
    """One stored update's header, read once, and its chunks read a tensor at a time.

    ``frames`` gives the stream's frame of an index (0 the header, 1 + i chunk i); by
    default each is read from the update's file. A rank that holds no file passes the
    frames it was sent (:meth:`tensor_frames` is what the holder of the file sends)."""

    def __init__(self, update: StoredUpdate, frames: Callable[[int], bytes] | None = None) -> None:
        self._update = update
        self._where = f"update of round {update.round} at {update.path}"
        self._frames = frames or self._read_frame
        self._starts = [update.start]
        for size in update.sizes[:-1]:
            self._starts.append(self._starts[-1] + size)
        self._header = self._frames(0)
        try:
            probe = self._decoder(0)
        except CodecError as exc:
            raise ThetaChainError(f"{self._where}: {exc}") from None
        specs = probe.specs
        self.chunk_elements = probe.chunk_elements
        self.shapes = {spec.name: tuple(spec.shape) for spec in specs}
        self.dtypes = {spec.name: spec.dtype for spec in specs}
        self.runs: dict[str, _Run] = {}
        slots = list(chunk_slots(specs, probe.chunk_elements))
        if len(slots) != len(update.sizes) - 2:
            raise ThetaChainError(
                f"{self._where}: {len(update.sizes) - 2} chunk frames, its header lays out "
                f"{len(slots)}"
            )
        for slot in slots:
            name = specs[slot.tensor].name
            run = self.runs.get(name)
            self.runs[name] = _Run(slot.index, 1) if run is None else _Run(run.first, run.count + 1)

    def check_fits(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Refuse (:class:`ThetaChainError`) an update naming a tensor θ (of ``shapes``)
        lacks or has in another shape, or a tensor not in float32."""
        unknown = sorted(set(self.shapes) - set(shapes))
        if unknown:
            raise ThetaChainError(f"{self._where}: names tensors θ does not have: {unknown[:5]}")
        differ = sorted(n for n, shape in self.shapes.items() if shape != tuple(shapes[n]))
        if differ:
            raise ThetaChainError(f"{self._where}: tensors {differ[:5]} differ in shape from θ's")
        other = sorted(n for n, dtype in self.dtypes.items() if dtype != "float32")
        if other:
            raise ThetaChainError(f"{self._where}: tensors {other[:5]} are not float32")

    @property
    def header(self) -> bytes:
        """The stream's header frame."""
        return self._header

    def add_to(self, name: str, flat: Tensor, start: int, end: int, offset: int = 0) -> None:
        """Add this update's pieces of tensor ``name`` to its values, elements ``start``
        to ``end`` only (the chunks holding them are decoded whole); ``flat`` holds the
        tensor's elements from ``offset`` on (0: the whole tensor)."""
        run = self.runs.get(name)
        if run is None or start >= end:
            return
        first = run.first + start // self.chunk_elements
        last = run.first + min(run.count, -(-end // self.chunk_elements))
        try:
            decoder = self._decoder(first)
            for index in range(first, last):
                for piece in decoder.feed(self._frames(1 + index)):
                    low, high = max(start, piece.offset), min(end, piece.offset + piece.count)
                    values = piece.values.reshape(-1)[low - piece.offset : high - piece.offset]
                    flat[low - offset : high - offset].add_(values.to(flat.device))
        except CodecError as exc:
            raise ThetaChainError(f"{self._where}: tensor {name!r}: {exc}") from None

    @property
    def chunks(self) -> int:
        """How many chunk frames the update has."""
        return len(self._update.sizes) - 2

    def chunk_sizes(self, first: int, end: int) -> tuple[int, ...]:
        """The sizes of the frames of chunks ``first`` to ``end``."""
        return self._update.sizes[1 + first : 1 + end]

    def chunk_frames(self, first: int, end: int) -> bytes:
        """The frames of chunks ``first`` to ``end`` as they lie in the file, one after
        the other."""
        begin, stop = self._starts[1 + first], self._starts[1 + end]
        return self._pread(begin, stop - begin, f"the frames of chunks {first} to {end - 1}")

    def _decoder(self, chunk: int) -> StreamDecoder:
        digests = self._update.digests
        return StreamDecoder.from_chunk(
            self._header,
            chunk,
            self._starts[1 + chunk],
            expected_header_digest=digests[0],
            expected_digests=digests[1:-1],
        )

    def _read_frame(self, index: int) -> bytes:
        return self._pread(self._starts[index], self._update.sizes[index], f"frame {index}")

    def _pread(self, start: int, size: int, what: str) -> bytes:
        try:
            with open(self._update.path, "rb", buffering=0) as f:
                data = os.pread(f.fileno(), size, start)
        except OSError as exc:
            raise ThetaChainError(f"{self._where}: {exc.strerror or exc}") from None
        if len(data) != size:
            raise ThetaChainError(f"{self._where}: the file ends inside {what}")
        return data


class ChainReads(Mapping[str, Tensor]):
    """θ_r's tensors from a :class:`ThetaChain`, each read when asked for (a new tensor
    every time, in θ's order); :meth:`shapes` from the headers alone.

    Every update must name tensors of θ with θ's shapes, in float32, or the chain is
    refused here, before any value is read. ``threads``: how many read a tensor's element
    ranges side by side (default one per usable CPU, at most :data:`MAX_READ_THREADS`).
    """

    def __init__(self, chain: ThetaChain, threads: int | None = None) -> None:
        default = min(MAX_READ_THREADS, usable_cpus())
        self._threads = max(1, threads if threads is not None else default)
        try:
            layout = read_layout(chain.base)
        except ThetaFileError as exc:
            raise ThetaChainError(f"the chain's base: {exc}") from None
        self._chain = chain
        self._base = ThetaReads(chain.base, layout)
        shapes = layout.shapes()
        self._updates = [UpdateReader(update) for update in chain.updates]
        for reader in self._updates:
            reader.check_fits(shapes)

    @property
    def chain(self) -> ThetaChain:
        return self._chain

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return self._base.shapes()

    def __getitem__(self, name: str) -> Tensor:
        try:
            tensor = self._base[name]
        except ThetaFileError as exc:
            raise ThetaChainError(f"the chain's base: {exc}") from None
        flat = tensor.view(-1)
        ranges = self._ranges(name, flat.numel())
        if len(ranges) == 1:
            self._add_range(name, flat, *ranges[0])
            return tensor
        with ThreadPoolExecutor(len(ranges), thread_name_prefix="geofed-chain") as pool:
            done = [pool.submit(self._add_range, name, flat, *r) for r in ranges]
        for future in done:
            future.result()  # the first failure, once every range stopped
        return tensor

    def _add_range(self, name: str, flat: Tensor, start: int, end: int) -> None:
        with one_thread():
            for reader in self._updates:  # in the rounds' order, element by element
                reader.add_to(name, flat, start, end)

    def _ranges(self, name: str, numel: int) -> list[tuple[int, int]]:
        """Element ranges of ``name`` read side by side: whole chunks of the first update
        naming it, as many ranges as threads (one for a tensor of one chunk)."""
        readers = [reader for reader in self._updates if name in reader.runs]
        if not readers or self._threads == 1:
            return [(0, numel)]
        step = readers[0].chunk_elements
        chunks = -(-numel // step)
        per = -(-chunks // min(self._threads, chunks))
        return [(start, min(numel, start + per * step)) for start in range(0, numel, per * step)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._base)

    def __len__(self) -> int:
        return len(self._base)


def chain_hash(reads: ChainReads) -> str:
    """The :func:`~geofed.params.parameters_vector_hash` of the θ ``reads`` holds, hashed
    one tensor at a time."""
    return HashingReads(reads, reads.shapes()).hexdigest()


def write_chain(reads: ChainReads, target: str | os.PathLike[str]) -> str:
    """Write the θ ``reads`` holds as the θ file at ``target`` (a tensor at a time);
    return its hash. On an error ``target`` is left as it was."""
    pieces = ((name, 0, reads[name]) for name in reads)
    try:
        return fill_theta(target, reads.shapes(), pieces)
    except ThetaFileError as exc:
        raise ThetaChainError(f"{target}: {exc}") from None


def chain_update(
    held: ThetaChain,
    held_hash: str,
    update: VerifiedArtifact,
    *,
    keep_at: Path,
    whole_at: Path | None = None,
) -> tuple[ThetaChain, str]:
    """θ after ``update`` (round ``held.round``'s, verified from its file, made from θ of
    ``held_hash``) as a chain, and its hash, checked against the update's manifest.

    ``whole_at`` None: the update's file is moved to ``keep_at`` and chained after
    ``held``; else θ is written whole at ``whole_at`` (a θ file, the chain then its base
    alone) and the update's file is left where it is. On a refusal
    (:class:`ThetaChainError`, or :class:`~geofed.artifact_check.ArtifactRefused` for an
    update that does not fit θ, :func:`~geofed.artifact_check.check_update_fits`) nothing
    was moved or written.
    """
    manifest = update.manifest
    where = f"update {manifest.job}/{manifest.round}"
    try:
        shapes = read_layout(held.base).shapes()
    except ThetaFileError as exc:
        raise ThetaChainError(f"the chain's base: {exc}") from None
    check_update_fits(update, held.round, held_hash, shapes)
    if whole_at is not None and not held.updates:
        found = apply_update_to_file(held.base, whole_at, held.round, held_hash, update)
        return ThetaChain(whole_at, held.round + 1), found
    longer = held.then(StoredUpdate.of(update))
    reads = ChainReads(longer)
    found = write_chain(reads, whole_at) if whole_at is not None else chain_hash(reads)
    if found != manifest.parameters_hash:
        if whole_at is not None:
            whole_at.unlink(missing_ok=True)
        raise ThetaChainError(
            f"{where}: parameters hash {found}, the manifest says {manifest.parameters_hash}"
        )
    if whole_at is not None:
        return ThetaChain(whole_at, held.round + 1), found
    longer.updates[-1].path.replace(keep_at)
    kept = dataclasses.replace(longer.updates[-1], path=keep_at)
    return ThetaChain(held.base, held.base_round, (*held.updates, kept)), found


def held_chain(path: str | os.PathLike[str], round_: int) -> ThetaChain:
    """The θ of ``round_`` at ``path`` as a chain: its description, or a θ file alone."""
    if is_chain(path):
        chain = ThetaChain.load(path)
        if chain.round != round_:
            raise ThetaChainError(f"{path}: describes θ_{chain.round}, not θ_{round_}")
        return chain
    return ThetaChain(Path(path), round_)


def is_chain(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a chain's description (rather than a θ file)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(_MAGIC)) == _MAGIC
    except OSError as exc:
        raise ThetaFileError(f"{path}: {exc.strerror or exc}") from None


def read_params(path: str | os.PathLike[str]) -> Mapping[str, Tensor]:
    """θ's tensors at ``path``, a θ file or a chain's description, each read when asked
    for (:func:`geofed.theta_file.read_theta`, :class:`ChainReads`)."""
    if is_chain(path):
        return ChainReads(ThetaChain.load(path))
    return read_theta(path)


def map_params(path: str | os.PathLike[str]) -> Mapping[str, Tensor]:
    """θ's tensors at ``path``: a θ file's mapped (:func:`geofed.theta_file.map_theta`),
    a chain's read when asked for (mapped when it is its base alone)."""
    if not is_chain(path):
        return map_theta(path)
    chain = ThetaChain.load(path)
    return map_theta(chain.base) if not chain.updates else ChainReads(chain)


def params_hash(path: str | os.PathLike[str]) -> str:
    """The hash of the θ at ``path``, a θ file or a chain's description."""
    if not is_chain(path):
        return hash_theta(path)
    chain = ThetaChain.load(path)
    return hash_theta(chain.base) if not chain.updates else chain_hash(ChainReads(chain))


def params_shapes(path: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """θ's tensors' names (in θ's order) and shapes, from the headers alone."""
    base = ThetaChain.load(path).base if is_chain(path) else path
    return read_layout(base).shapes()


def _natural(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ThetaChainError(f"{where}: {value!r} is not a natural number")
    return value


def _text(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ThetaChainError(f"{where}: {value!r} is not a non-empty string")
    return value


def _list(data: dict[str, Any], key: str, where: str) -> list[Any]:
    if key not in data:
        raise ThetaChainError(f"{where}: no key {key!r}")
    value = data[key]
    if not isinstance(value, list):
        raise ThetaChainError(f"{where}.{key}: {value!r} is not a list")
    return value
