"""Atomic file writes: the old content survives every failure, and no temp file is left."""

from __future__ import annotations

import errno
import io
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from geofed.fsutil import (
    PUBLIC_MODE,
    AtomicFile,
    atomic_write_bytes,
    atomic_write_stream,
    create_temp,
    fsync_dir,
    replace_durably,
)

OLD = b"old content that must survive\n"


class FullDiskFile(io.FileIO):
    """Fake of a disk at its outer edge: accepts ``capacity`` bytes, then ENOSPC.

    ``fail_flush`` instead fails at flush time, as a delayed write error (EIO) would.
    """

    def __init__(self, fd: int, capacity: int, fail_flush: bool = False) -> None:
        super().__init__(fd, "wb", closefd=True)
        self.room = capacity
        self.fail_flush = fail_flush

    def write(self, b) -> int:
        data = bytes(b)
        if self.fail_flush:
            return super().write(data) or 0
        part = data[: max(self.room, 0)]
        if part:
            super().write(part)
            self.room -= len(part)
        if len(part) < len(data):
            raise OSError(errno.ENOSPC, "No space left on device")
        return len(data)

    def flush(self) -> None:
        if self.fail_flush and not self.closed:
            raise OSError(errno.EIO, "Input/output error")
        super().flush()


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


@pytest.fixture
def target(tmp_path: Path) -> Path:
    path = tmp_path / "state.json"
    path.write_bytes(OLD)
    return path


def test_write_bytes_creates_and_replaces(tmp_path: Path) -> None:
    path = tmp_path / "new.bin"
    atomic_write_bytes(path, b"first")
    assert path.read_bytes() == b"first"
    atomic_write_bytes(path, bytearray(b"second, longer"))
    assert path.read_bytes() == b"second, longer"
    atomic_write_bytes(path, memoryview(b"3"))
    assert path.read_bytes() == b"3"
    assert leftovers(tmp_path) == []


def test_write_stream_counts_bytes(tmp_path: Path) -> None:
    path = tmp_path / "stream.bin"
    total = atomic_write_stream(path, (bytes([i]) * 1000 for i in range(10)))
    assert total == 10_000
    assert path.read_bytes() == b"".join(bytes([i]) * 1000 for i in range(10))


def test_private_mode_is_0600_and_default_follows_umask(tmp_path: Path) -> None:
    private = tmp_path / "key.pem"
    atomic_write_bytes(private, b"secret", private=True)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    # Replacing a world-readable file privately makes it private.
    public = tmp_path / "public.txt"
    public.write_bytes(b"x")
    public.chmod(0o644)
    atomic_write_bytes(public, b"y", private=True)
    assert stat.S_IMODE(public.stat().st_mode) == 0o600
    old_umask = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "plain", b"z")
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE((tmp_path / "plain").stat().st_mode) == 0o644


def test_an_explicit_mode_is_the_files_mode_from_creation(tmp_path: Path) -> None:
    old_umask = os.umask(0)
    try:
        atomic_write_bytes(tmp_path / "cert.pem", b"cert", mode=PUBLIC_MODE)
        with AtomicFile(tmp_path / "group.txt", mode=0o640) as f:
            assert stat.S_IMODE(os.fstat(f.fileno()).st_mode) == 0o640
            f.write(b"g")
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE((tmp_path / "cert.pem").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "group.txt").stat().st_mode) == 0o640
    with pytest.raises(ValueError, match="exclude each other"):
        AtomicFile(tmp_path / "both", private=True, mode=0o644)
    assert leftovers(tmp_path) == []


def test_error_inside_block_keeps_old_content(target: Path) -> None:
    def write_then_fail() -> None:
        with AtomicFile(target) as f:
            f.write(b"partial new content")
            raise RuntimeError("writer failed midway")

    with pytest.raises(RuntimeError, match="writer failed"):
        write_then_fail()
    assert target.read_bytes() == OLD
    assert leftovers(target.parent) == []


def test_stream_raising_midway_keeps_old_content(target: Path) -> None:
    def chunks() -> Iterator[bytes]:
        yield b"new part 1"
        yield b"new part 2"
        raise ValueError("producer broke")

    with pytest.raises(ValueError, match="producer broke"):
        atomic_write_stream(target, chunks())
    assert target.read_bytes() == OLD
    assert leftovers(target.parent) == []


def test_stream_failure_creates_nothing_when_no_old_file(tmp_path: Path) -> None:
    def chunks() -> Iterator[bytes]:
        yield b"x"
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        atomic_write_stream(tmp_path / "absent", chunks())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("capacity", [0, 5, 4096])
def test_disk_full_midway_keeps_old_content(target: Path, capacity: int) -> None:
    data = b"n" * 10_000
    af = AtomicFile(target, fdopen=lambda fd: FullDiskFile(fd, capacity))
    with pytest.raises(OSError, match="No space left") as info, af as f:
        f.write(data)
    assert info.value.errno == errno.ENOSPC
    assert target.read_bytes() == OLD
    assert leftovers(target.parent) == []


def test_failure_at_flush_keeps_old_content(target: Path) -> None:
    af = AtomicFile(target, fdopen=lambda fd: FullDiskFile(fd, 0, fail_flush=True))
    with pytest.raises(OSError, match="Input/output") as info, af as f:
        f.write(b"new content")
    assert info.value.errno == errno.EIO
    assert target.read_bytes() == OLD
    assert leftovers(target.parent) == []


def test_failed_rename_removes_temp(tmp_path: Path) -> None:
    # A directory in the way makes the final rename fail after the temp file is complete.
    blocker = tmp_path / "blocked"
    blocker.mkdir()
    (blocker / "keep").write_bytes(b"k")
    with pytest.raises(IsADirectoryError):
        atomic_write_bytes(blocker, b"data")
    assert (blocker / "keep").read_bytes() == b"k"
    assert leftovers(tmp_path) == []


def test_missing_directory_fails_cleanly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        atomic_write_bytes(tmp_path / "no" / "such" / "dir" / "f", b"x")
    assert list(tmp_path.iterdir()) == []


def test_atomic_file_is_not_reentrant(tmp_path: Path) -> None:
    af = AtomicFile(tmp_path / "f")
    with af as f:
        f.write(b"a")
        with pytest.raises(RuntimeError, match="already open"):
            af.__enter__()
    assert (tmp_path / "f").read_bytes() == b"a"
    assert af.temp_path is None


def test_temp_lives_next_to_target_and_is_hidden(tmp_path: Path) -> None:
    af = AtomicFile(tmp_path / "target.bin")
    with af:
        tmp = af.temp_path
        assert tmp is not None
        assert tmp.parent == tmp_path
        assert tmp.name.startswith(".target.bin.")
        assert tmp.name.endswith(".tmp")
        assert tmp.exists()
    assert not tmp.exists()


def test_concurrent_writers_never_tear(tmp_path: Path) -> None:
    path = tmp_path / "contended"
    payloads = [bytes([65 + i]) * (50_000 + i) for i in range(4)]
    errors: list[BaseException] = []

    def writer(data: bytes) -> None:
        try:
            for _ in range(10):
                atomic_write_bytes(path, data)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        if path.exists():
            assert path.read_bytes() in payloads
    for t in threads:
        t.join()
    assert errors == []
    assert path.read_bytes() in payloads
    assert leftovers(tmp_path) == []


def test_fsync_dir(tmp_path: Path) -> None:
    fsync_dir(tmp_path)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        fsync_dir(tmp_path / "file")
    with pytest.raises(FileNotFoundError):
        fsync_dir(tmp_path / "missing")


def test_create_temp_and_replace_durably_across_directories(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    fd, tmp = create_temp(tmp_path / "a", "x", private=True)
    os.write(fd, b"moved")
    os.close(fd)
    assert stat.S_IMODE(tmp.stat().st_mode) == 0o600
    replace_durably(tmp, tmp_path / "b" / "x")
    assert (tmp_path / "b" / "x").read_bytes() == b"moved"
    assert list((tmp_path / "a").iterdir()) == []


def test_a_non_durable_write_replaces_whole_without_fsync(
    target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_fsync(fd: int) -> None:
        raise AssertionError("fsync called for a non-durable write")

    monkeypatch.setattr(os, "fsync", no_fsync)
    atomic_write_bytes(target, b"advisory", durable=False)
    assert target.read_bytes() == b"advisory"
    assert leftovers(target.parent) == []
    with pytest.raises(AssertionError, match="fsync called"):
        atomic_write_bytes(target, b"durable")
    assert target.read_bytes() == b"advisory"
    assert leftovers(target.parent) == []
