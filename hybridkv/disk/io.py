"""Whole-file reads and writes through aligned buffers, O_DIRECT where the filesystem allows.

Buffers are anonymous ``mmap`` regions: page-aligned, as O_DIRECT needs, and handed to
``pwrite``/``preadv`` as they are (no copy). A few are kept for reuse per size class, so a
steady stream of 2 MB chunks does not map and fault in fresh memory for every file.

O_DIRECT (``DirectIO``): AUTO tries it and, at the first refusal (``EINVAL``: tmpfs, some
network filesystems), switches this client to buffered I/O for good, logged once. ON never
falls back: a refusal is an error of the call (a FAULT for the caller). A file larger than one
segment (1 MiB) is written and read as segments side by side on the I/O pool, so a single
chunk keeps several requests in flight at the device.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from pathlib import Path

from hybridkv.disk.config import DirectIO

__all__ = ["SEGMENT", "Buffers", "FileIO"]

logger = logging.getLogger("hybridkv.disk")

SEGMENT = 1 << 20
"""Bytes per parallel piece of a large read or write (a multiple of ALIGN)."""
_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_MIN_CLASS = 1 << 16
_Piece = Callable[[int, memoryview, int], int]


class Buffers:
    """A small free list of aligned ``mmap`` buffers, by power-of-two size class."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def lease(self, size: int) -> Iterator[memoryview]:
        """A view of ``size`` bytes at the start of an aligned buffer (content undefined)."""
        size_class = max(_MIN_CLASS, 1 << max(0, size - 1).bit_length())
        with self._lock:
            free = self._free.get(size_class)
            buffer = free.pop() if free else None
        if buffer is None:
            buffer = mmap.mmap(-1, size_class)
        view = memoryview(buffer)
        try:
            with view[:size] as lent:
                yield lent
        finally:
            view.release()
            with self._lock:
                free = self._free.setdefault(size_class, [])
                if len(free) < self._keep:
                    free.append(buffer)
                    buffer = None
            if buffer is not None:
                buffer.close()


class FileIO:
    """Opens, writes and reads chunk files for one client, O_DIRECT as configured."""

    def __init__(self, direct: DirectIO, pool: Executor | None, directory: Path) -> None:
        self.mode = direct
        self.directory = directory
        self.direct = direct is not DirectIO.OFF and _O_DIRECT != 0
        self.fallbacks = 0
        self._pool = pool
        self._lock = threading.Lock()

    def open(self, path: Path, flags: int) -> tuple[int, bool]:
        """``os.open`` with O_DIRECT while this client uses it; returns (fd, direct)."""
        if self.direct:
            try:
                return os.open(path, flags | _O_DIRECT, 0o644), True
            except OSError as error:
                if error.errno != errno.EINVAL or self.mode is DirectIO.ON:
                    raise
                self.fall_back(error)
        return os.open(path, flags, 0o644), False

    def fall_back(self, error: OSError) -> None:
        """Switch to buffered I/O for good (AUTO only), logged once."""
        with self._lock:
            if not self.direct:
                return
            self.direct = False
            self.fallbacks += 1
        logger.warning(
            "hybridkv disk tier: O_DIRECT refused under %s (%s); using buffered I/O from now on",
            self.directory,
            error,
        )

    def write(self, fd: int, image: memoryview) -> None:
        """Write ``image`` (aligned, a multiple of ALIGN) from offset 0."""
        self._pieces(fd, image, _pwrite_all)

    def read(self, fd: int, image: memoryview) -> int:
        """Read up to ``len(image)`` bytes from offset 0; returns how many (short at EOF)."""
        return sum(self._pieces(fd, image, _pread_all))

    def _pieces(self, fd: int, image: memoryview, one: _Piece) -> list[int]:
        size = len(image)
        if self._pool is None or size <= SEGMENT:
            return [one(fd, image, 0)]
        futures = [
            self._pool.submit(one, fd, image[start : start + SEGMENT], start)
            for start in range(0, size, SEGMENT)
        ]
        # Every piece finishes before the buffer goes back (no write into a reused buffer).
        done = [f.exception() for f in futures]
        failed = next((e for e in done if e is not None), None)
        if failed is not None:
            raise failed
        return [f.result() for f in futures]


def _pwrite_all(fd: int, piece: memoryview, offset: int) -> int:
    written = 0
    while written < len(piece):
        n = os.pwrite(fd, piece[written:], offset + written)
        if n <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        written += n
    return written


def _pread_all(fd: int, piece: memoryview, offset: int) -> int:
    got = 0
    while got < len(piece):
        n = os.preadv(fd, [piece[got:]], offset + got)
        if n == 0:
            break  # end of file: a short read is the caller's to judge (truncated)
        got += n
    return got
