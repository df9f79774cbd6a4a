"""θ on disk: float32 tensors in one file that is written, patched and hashed piece by piece.

A θ file is a safetensors file (8-byte little-endian header size, a JSON header naming
each tensor's dtype, shape and byte range, then the raw bytes) whose tensors are all
float32 and stored back to back in θ's own order (the model's: streaming fragments are
planned over it, so it survives the file), the header's keys in the same order. Any
safetensors reader opens it; :func:`map_theta` maps it without reading it (the workers
page in only what they use) and gives the tensors in that order.

Nothing here holds a model-sized buffer: :func:`write_theta` writes tensors it is given
chunk by chunk, :func:`patch_theta` builds θ_{r+1} as a copy of θ_r with an update's
decoded pieces added where they fall (reading each piece's values from θ_r, so one
piece's values are in memory at a time), :func:`fill_theta` writes a decoded snapshot's
pieces into a new file, and :func:`hash_theta` reads a file in fixed chunks. Each writes
temp + fsync + rename (:class:`geofed.fsutil.AtomicFile`): a crash leaves the old file or
none, never a torn one. A file of another layout is refused with :class:`ThetaFileError`.
A state dict saved by ``torch.save`` (θ of the format before) is still mapped by
:func:`map_theta`.
"""

from __future__ import annotations

import errno
import json
import math
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from geofed.fsutil import AtomicFile
from geofed.params import StateHasher

#: Bytes read or written at a time when a whole file is streamed.
CHUNK_BYTES = 8 << 20
_ALIGN = 8
_MAX_HEADER_BYTES = 64 << 20
_ZIP_MAGIC = b"PK\x03\x04"
_FORMAT = "geofed-theta-1"


class ThetaFileError(ValueError):
    """A θ file that is unreadable or not of the layout described above."""


@dataclass(frozen=True)
class ThetaEntry:
    """One tensor of a θ file: its shape and where its bytes start in the file."""

    name: str
    shape: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return 4 * self.numel


@dataclass(frozen=True)
class ThetaLayout:
    """The tensors of a θ file, in the file's order, and the header that declares them."""

    entries: tuple[ThetaEntry, ...]
    header: bytes
    #: The header's ``__metadata__`` beside its format (strings, as safetensors has them).
    metadata: Mapping[str, str] = field(hash=False)

    @classmethod
    def of_shapes(
        cls, shapes: Mapping[str, Iterable[int]], metadata: Mapping[str, str] | None = None
    ) -> ThetaLayout:
        """The layout of a θ file holding float32 tensors of these names and shapes, its
        header's metadata holding ``metadata`` too."""
        extra = dict(metadata or {})
        if "format" in extra or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in extra.items()
        ):
            raise ThetaFileError(f"θ metadata must map strings to strings, not 'format': {extra}")
        described: dict[str, object] = {"__metadata__": {"format": _FORMAT, **extra}}
        offset = 0
        normal = {name: tuple(int(d) for d in shape) for name, shape in shapes.items()}
        for name in normal:
            nbytes = 4 * math.prod(normal[name])
            described[name] = {
                "dtype": "F32",
                "shape": list(normal[name]),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        body = json.dumps(described, separators=(",", ":")).encode()
        body += b" " * (-(8 + len(body)) % _ALIGN)
        header = struct.pack("<Q", len(body)) + body
        entries, start = [], len(header)
        for name in normal:
            entries.append(ThetaEntry(name, normal[name], start))
            start += 4 * math.prod(normal[name])
        return cls(tuple(entries), header, extra)

    @property
    def size(self) -> int:
        """The file's size in bytes."""
        last = self.entries[-1] if self.entries else None
        return len(self.header) if last is None else last.start + last.nbytes

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {entry.name: entry.shape for entry in self.entries}

    def entry(self, name: str) -> ThetaEntry:
        for entry in self.entries:
            if entry.name == name:
                return entry
        raise ThetaFileError(f"θ has no tensor {name!r}")


def read_layout(path: str | os.PathLike[str]) -> ThetaLayout:
    """The layout of the θ file at ``path``; :class:`ThetaFileError` if it is not one."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if head[:4] == _ZIP_MAGIC:
                raise ThetaFileError(f"{path}: a torch.save file, not a θ file")
            if len(head) != 8:
                raise ThetaFileError(f"{path}: too short for a θ file")
            (length,) = struct.unpack("<Q", head)
            if length > _MAX_HEADER_BYTES:
                raise ThetaFileError(f"{path}: a header of {length} bytes")
            body = f.read(length)
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise ThetaFileError(f"{path}: {exc.strerror or exc}") from None
    try:
        described = json.loads(body)
    except ValueError:
        raise ThetaFileError(f"{path}: the header is not JSON") from None
    layout = _layout_from(described, str(path))
    if layout.header != head + body:
        raise ThetaFileError(f"{path}: not a θ file of format {_FORMAT} (tensors out of order)")
    if size != layout.size:
        raise ThetaFileError(f"{path}: {size} bytes, its header declares {layout.size}")
    return layout


def _layout_from(described: object, where: str) -> ThetaLayout:
    if not isinstance(described, dict):
        raise ThetaFileError(f"{where}: the header is not an object")
    found: list[tuple[int, str, list[int]]] = []
    for name, spec in described.items():
        if name == "__metadata__":
            continue
        if not isinstance(spec, dict) or spec.get("dtype") != "F32":
            raise ThetaFileError(f"{where}: tensor {name!r} is not float32")
        shape = spec.get("shape")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ThetaFileError(f"{where}: tensor {name!r} has shape {shape!r}")
        offsets = spec.get("data_offsets")
        if not isinstance(offsets, list) or not offsets or not isinstance(offsets[0], int):
            raise ThetaFileError(f"{where}: tensor {name!r} has data_offsets {offsets!r}")
        found.append((offsets[0], name, shape))
    meta = described.get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise ThetaFileError(f"{where}: not a θ file of format {_FORMAT}")
    extra = {k: v for k, v in meta.items() if k != "format"}
    if not all(isinstance(v, str) for v in extra.values()):
        raise ThetaFileError(f"{where}: the header's metadata holds values that are not strings")
    return ThetaLayout.of_shapes({name: shape for _, name, shape in sorted(found)}, extra)


def map_theta(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """θ's tensors mapped from the file, not read: pages come in as they are used.

    The tensors are copy-on-write views of the file (writing them never changes it). A
    ``torch.save``-d state dict (the format before) is mapped by ``torch.load``.
    """
    try:
        with open(path, "rb") as f:
            zipped = f.read(4) == _ZIP_MAGIC
    except OSError as exc:
        raise ThetaFileError(f"{path}: {exc.strerror or exc}") from None
    if zipped:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise ThetaFileError(f"{path}: unreadable state dict: {exc}") from None
        if not isinstance(loaded, Mapping) or not all(
            isinstance(k, str) and isinstance(v, Tensor) for k, v in loaded.items()
        ):
            raise ThetaFileError(f"{path}: not a state dict of named tensors")
        return dict(loaded)
    layout = read_layout(path)
    whole = torch.from_file(str(path), shared=False, size=layout.size, dtype=torch.uint8)
    return {
        e.name: whole[e.start : e.start + e.nbytes].view(torch.float32).view(e.shape)
        for e in layout.entries
    }


def read_theta(path: str | os.PathLike[str]) -> Mapping[str, Tensor]:
    """θ's tensors, each read from the file when it is asked for: a new tensor every time,
    and none of the file kept mapped, for a pass that takes each tensor once (rank 0's
    delta) and would otherwise keep the whole file resident. A ``torch.save``-d state dict
    (the format before) is mapped instead (:func:`map_theta`)."""
    try:
        layout = read_layout(path)
    except ThetaFileError:
        return map_theta(path)  # the format before, or an error that names the file
    return ThetaReads(Path(path), layout)


class ThetaReads(Mapping[str, Tensor]):
    """:func:`read_theta`'s tensors of a θ file, read when asked for; :meth:`shapes` from
    the header already read, with no value read."""

    def __init__(self, path: Path, layout: ThetaLayout) -> None:
        self._path = path
        self._layout = layout
        self._entries = {entry.name: entry for entry in layout.entries}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return self._layout.shapes()

    def __getitem__(self, name: str) -> Tensor:
        entry = self._entries[name]
        tensor = torch.empty(entry.shape, dtype=torch.float32)
        if entry.numel:
            raw = tensor.view(-1).view(torch.uint8).numpy()
            with open(self._path, "rb", buffering=0) as f:
                if os.preadv(f.fileno(), [raw.data], entry.start) != entry.nbytes:
                    raise ThetaFileError(f"{self._path}: ends inside tensor {name!r}")
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def write_theta(
    path: str | os.PathLike[str], tensors: Mapping[str, Tensor], *, private: bool = True
) -> str:
    """Write ``tensors`` (float32, any device) as the θ file at ``path``, in their order;
    return their :func:`~geofed.params.parameters_vector_hash` (of the bytes written)."""
    bad = [name for name, t in tensors.items() if t.dtype != torch.float32]
    if bad:
        raise ThetaFileError(f"θ holds float32 tensors only; {bad[:5]} are not")
    layout = ThetaLayout.of_shapes({name: tuple(t.shape) for name, t in tensors.items()})
    atomic = AtomicFile(path, private=private)
    with atomic as f:
        f.write(layout.header)
        step = CHUNK_BYTES // 4
        for entry in layout.entries:
            flat = tensors[entry.name].detach().reshape(-1)
            for begin in range(0, entry.numel, step):
                piece = flat[begin : begin + step].to("cpu").contiguous()
                f.write(piece.view(torch.uint8).numpy().data)
        f.flush()
        return _hash_open(_written(atomic), layout)


def hash_theta(path: str | os.PathLike[str]) -> str:
    """The :func:`~geofed.params.parameters_vector_hash` of the θ file at ``path``."""
    layout = read_layout(path)
    return _hash_open(path, layout)


def _hash_open(path: str | os.PathLike[str], layout: ThetaLayout) -> str:
    hasher = StateHasher(len(layout.entries))
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    try:
        with open(path, "rb", buffering=0) as f:
            for entry in sorted(layout.entries, key=lambda e: e.name):
                f.seek(entry.start)
                hasher.begin(entry.name, torch.float32, entry.shape)
                left = entry.nbytes
                while left:
                    got = f.readinto(view[: min(left, CHUNK_BYTES)])
                    if not got:
                        raise ThetaFileError(f"{path}: ends inside tensor {entry.name!r}")
                    hasher.update(view[:got])
                    left -= got
    except OSError as exc:
        raise ThetaFileError(f"{path}: {exc.strerror or exc}") from None
    return hasher.hexdigest()


#: A decoded piece of a tensor: its name, the element offset it starts at, its values.
Piece = tuple[str, int, Tensor]


def patch_theta(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    pieces: Iterable[Piece],
    *,
    private: bool = True,
) -> str:
    """Write θ at ``target`` as ``source`` plus ``pieces`` (each added to the source's values
    where it falls, in float32, element by element); return the result's hash.

    Each element is patched at most once per call (an update's stream names each element
    once), so a piece's base values are read from ``source``. Pieces in file order (an
    update's, in θ's order) are written once: the bytes before each are copied from
    ``source`` just ahead of it, so no page is written twice (a copy followed by the
    patches would write a large θ twice once writeback starts mid-copy); one out of order
    is written over the copy. ``pieces`` may raise part way: ``target`` is then left as
    it was.
    """
    layout = read_layout(source)
    by_name = {entry.name: entry for entry in layout.entries}
    atomic = AtomicFile(target, private=private)
    with open(source, "rb", buffering=0) as src, atomic as dst:
        copied = 0  # source bytes [0, copied) are in the target already
        buffer = torch.empty(0, dtype=torch.float32)  # one, grown as pieces need
        for name, offset, values in pieces:
            where = _piece_bytes(by_name, name, offset, values)
            if buffer.numel() < values.numel():
                buffer = torch.empty(values.numel(), dtype=torch.float32)
            base = buffer[: values.numel()]
            raw = base.view(torch.uint8).numpy()
            if os.preadv(src.fileno(), [raw.data], where) != raw.nbytes:
                raise ThetaFileError(f"{source}: ends inside tensor {name!r}")
            base.add_(values.reshape(-1).to(torch.float32))
            if where >= copied:
                _copy_range(src.fileno(), dst.fileno(), copied, where)
                copied = where + raw.nbytes
            os.pwrite(dst.fileno(), raw.data, where)
        _copy_range(src.fileno(), dst.fileno(), copied, layout.size)
        return _hash_open(_written(atomic), layout)


#: What ``copy_file_range`` fails with where the kernel or the filesystems cannot do it.
_NO_KERNEL_COPY = frozenset(
    {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM}
)


def _copy_range(src: int, dst: int, start: int, end: int) -> None:
    """Copy bytes [start, end) of ``src`` to the same place in ``dst``: in the kernel
    where it can, else through a buffer (a filesystem without the call, two of them)."""
    while start < end:
        count = min(end - start, CHUNK_BYTES)
        try:
            done = os.copy_file_range(src, dst, count, start, start)
        except OSError as exc:
            if exc.errno not in _NO_KERNEL_COPY:
                raise
            done = 0
        if done <= 0:  # refused, or none copied where bytes remain: copy them ourselves
            chunk = os.pread(src, count, start)
            if not chunk:
                raise ThetaFileError(f"the source θ ends at byte {start}, before {end}")
            done = os.pwrite(dst, chunk, start)
        start += done


def fill_theta(
    target: str | os.PathLike[str],
    shapes: Mapping[str, Iterable[int]],
    pieces: Iterable[Piece],
    *,
    private: bool = True,
) -> str:
    """Write the θ file of these tensors from ``pieces`` (their values, each element once,
    as a decoder yields them: the caller checks that every element came); return its hash."""
    layout = ThetaLayout.of_shapes(shapes)
    by_name = {entry.name: entry for entry in layout.entries}
    atomic = AtomicFile(target, private=private)
    with atomic as dst:
        dst.write(layout.header)
        dst.truncate(layout.size)
        dst.flush()
        for name, offset, values in pieces:
            where = _piece_bytes(by_name, name, offset, values)
            flat = values.reshape(-1).to(torch.float32).contiguous()
            os.pwrite(dst.fileno(), flat.view(torch.uint8).numpy().data, where)
        dst.flush()
        return _hash_open(_written(atomic), layout)


def _piece_bytes(entries: Mapping[str, ThetaEntry], name: str, offset: int, values: Tensor) -> int:
    entry = entries.get(name)
    if entry is None:
        raise ThetaFileError(f"θ has no tensor {name!r}")
    if offset < 0 or offset + values.numel() > entry.numel:
        raise ThetaFileError(
            f"a piece of {name!r} at {offset} with {values.numel()} values passes its "
            f"{entry.numel} elements"
        )
    return entry.start + 4 * offset


def _written(atomic: AtomicFile) -> Path:
    path = atomic.temp_path
    if path is None:  # pragma: no cover - only while the context is open
        raise ThetaFileError(f"{atomic.path}: not being written")
    return path
