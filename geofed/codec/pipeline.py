"""Compressing (where it pays) and framing chunks, inline or on threads, kept in order."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from geofed.codec.compression import CompressionPolicy, compress_payload, new_compressor
from geofed.codec.layout import ChunkSlot
from geofed.codec.wire import SCHEME_CODES, ChunkFields, FrameKind, Sealed, chunk_fields, seal
from geofed.codec_params import CodecParams


class ChunkSealer:
    """Compresses payloads (where the policy says so) and frames them.

    One zstd context per thread.
    """

    def __init__(
        self,
        codec: CodecParams,
        header_digest: bytes,
        *,
        policy: CompressionPolicy = "auto",
        zstd_threads: int = 0,
    ) -> None:
        self._codec = codec
        self._header_digest = header_digest
        self._policy: CompressionPolicy = policy
        self._zstd_threads = zstd_threads
        self._local = threading.local()

    def seal(self, slot: ChunkSlot, payload: torch.Tensor) -> Sealed:
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = new_compressor(self._codec.zstd_level, self._zstd_threads)
            self._local.compressor = compressor
        compression, body = compress_payload(
            compressor, payload.numpy().data, self._codec.scheme, self._policy
        )
        fields = ChunkFields(
            index=slot.index,
            tensor=slot.tensor,
            scheme_code=SCHEME_CODES[self._codec.scheme],
            offset=slot.offset,
            count=slot.count,
            decoded_size=payload.numel(),
            header_digest=self._header_digest,
            compression=compression,
        )
        return seal(FrameKind.CHUNK, [chunk_fields(fields), body])


class Pipeline:
    """Runs chunk jobs inline (one worker) or on a thread pool, collecting results in order.

    At most ``2 * workers`` jobs are in flight, which bounds the payloads held in memory.
    The pool starts with the second job: a stream of one chunk seals it inline, without
    paying for threads it cannot use.
    """

    def __init__(self, workers: int) -> None:
        self._workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._first: tuple[ChunkSlot, Callable[[], Sealed], Callable[..., None]] | None = None
        self._limit = 2 * workers
        self._pending: deque[tuple[ChunkSlot, Future[Sealed], Callable[..., None]]] = deque()

    def submit(
        self,
        slot: ChunkSlot,
        job: Callable[[], Sealed],
        done: Callable[[ChunkSlot, Sealed], None],
    ) -> None:
        if self._workers == 1:
            done(slot, job())
            return
        if self._pool is None:
            if self._first is None:
                self._first = (slot, job, done)
                return
            self._pool = ThreadPoolExecutor(self._workers, "geofed-codec")
            first_slot, first_job, first_done = self._first
            self._first = None
            self._pending.append((first_slot, self._pool.submit(first_job), first_done))
        self._pending.append((slot, self._pool.submit(job), done))
        while len(self._pending) >= self._limit:
            self._collect_one()

    def _collect_one(self) -> None:
        slot, future, done = self._pending.popleft()
        done(slot, future.result())

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, kind: object, error: object, traceback: object) -> None:
        try:
            if error is None:
                if self._first is not None:
                    slot, job, done = self._first
                    self._first = None
                    done(slot, job())
                while self._pending:
                    self._collect_one()
        finally:
            self._first = None
            for _, future, _ in self._pending:
                future.cancel()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
