"""Cutting a byte stream that arrives in arbitrary parts into whole frames."""

from __future__ import annotations

from collections.abc import Callable

from geofed.codec.wire import PREFIX, Bytes


class FrameReader:
    """Collects bytes and hands out whole frames.

    A frame that lies whole in the part just pushed is handed out as a view of it (no
    copy); one split across parts is gathered in an internal buffer first. A frame's
    size is learnt from its prefix through ``frame_size``, which may refuse it (raise)
    before its body is buffered.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._pending = memoryview(b"")

    @property
    def buffered(self) -> int:
        """Bytes received but not yet handed out as a frame."""
        return len(self._buffer) + len(self._pending)

    def push(self, data: Bytes) -> None:
        """Add the next part; call :meth:`keep_rest` before the next push."""
        self._pending = memoryview(data).cast("B")

    def next_frame(self, frame_size: Callable[[Bytes], int]) -> memoryview | None:
        """Return the next whole frame, or ``None`` if more bytes are needed."""
        if self._buffer:
            self._fill(PREFIX.size)
            if len(self._buffer) < PREFIX.size:
                return None
            size = frame_size(self._buffer)
            self._fill(size)
            return memoryview(self._buffer) if len(self._buffer) == size else None
        if len(self._pending) < PREFIX.size:
            return None
        size = frame_size(self._pending)
        if len(self._pending) < size:
            return None
        frame, self._pending = self._pending[:size], self._pending[size:]
        return frame

    def done_with(self, frame: memoryview) -> None:
        """Release a frame handed out by :meth:`next_frame`."""
        frame.release()
        self._buffer.clear()

    def keep_rest(self) -> None:
        """Copy what is left of the pushed part, so the caller may reuse its buffer."""
        self._buffer += self._pending
        self._pending = memoryview(b"")

    def _fill(self, size: int) -> None:
        take = max(0, size - len(self._buffer))
        if take:
            self._buffer += self._pending[:take]
            self._pending = self._pending[take:]
