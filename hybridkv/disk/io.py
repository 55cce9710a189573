"""Whole-file reads and writes through aligned buffers, O_DIRECT where the filesystem allows.

Buffers are anonymous ``mmap`` regions: page-aligned, as O_DIRECT needs, and handed to
``pwrite``/``preadv`` as they are (no copy). A few are kept for reuse per size class, so a
steady stream of 2 MB chunks does not map and fault in fresh memory for every file.

O_DIRECT (``DirectIO``): AUTO tries it and, at the first refusal (``EINVAL``: tmpfs, some
network filesystems), switches this client to buffered I/O for good, logged once. ON never
falls back: a refusal is an error of the call (a FAULT for the caller).

A value larger than one slice (:data:`~hybridkv.disk.fileformat.SLICE`) is copied, checked and
written (or read and checked) slice by slice, side by side on the I/O pool: one large chunk keeps
several requests in flight at the device and its checks spread over several threads, each
slice's check beside the other slices' I/O.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from hybridkv.disk.config import DirectIO
from hybridkv.disk.fileformat import (
    ALIGN,
    SLICE,
    Damage,
    SliceCheck,
    encode_header,
    parse_header,
    slices,
    top_digest,
)

__all__ = ["Buffers", "FileIO"]

logger = logging.getLogger("hybridkv.disk")

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_MIN_CLASS = 1 << 16
_T = TypeVar("_T")


class Buffers:
    """A free list of aligned ``mmap`` buffers by power-of-two size class, keeping at most
    ``keep_bytes`` of them (pages of a buffer never touched take no memory)."""

    def __init__(self, keep_bytes: int) -> None:
        self._keep_bytes = keep_bytes
        self._kept = 0
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def lease(self, size: int) -> Iterator[memoryview]:
        """A view of ``size`` bytes at the start of an aligned buffer (content undefined)."""
        size_class = max(_MIN_CLASS, 1 << max(0, size - 1).bit_length())
        with self._lock:
            free = self._free.get(size_class)
            buffer = free.pop() if free else None
            if buffer is not None:
                self._kept -= size_class
        if buffer is None:
            buffer = mmap.mmap(-1, size_class)
        view = memoryview(buffer)
        try:
            with view[:size] as lent:
                yield lent
        finally:
            view.release()
            with self._lock:
                if self._kept + size_class <= self._keep_bytes:
                    self._free.setdefault(size_class, []).append(buffer)
                    self._kept += size_class
                    buffer = None
            if buffer is not None:
                buffer.close()


class FileIO:
    """Opens, writes and reads chunk files for one client, O_DIRECT as configured, in the
    format version of ``check`` (the format's own unless a benchmark asks for the other)."""

    def __init__(
        self,
        direct: DirectIO,
        pool: Executor | None,
        directory: Path,
        check: SliceCheck = SliceCheck.CRC32,
    ) -> None:
        self.mode = direct
        self.check = check
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

    def retrying(self, fd: int, direct: bool, transfer: Callable[[], _T]) -> _T:
        """``transfer()`` on ``fd``; where it is an O_DIRECT transfer the filesystem refuses
        (EINVAL) under AUTO, :meth:`buffered` and once more."""
        try:
            return transfer()
        except OSError as error:
            if not direct or error.errno != errno.EINVAL or self.mode is DirectIO.ON:
                raise
            self.buffered(fd, error)
        return transfer()

    def buffered(self, fd: int, error: OSError) -> None:
        """Fall back (:meth:`fall_back`) and clear O_DIRECT on the open ``fd`` itself, so the
        call goes on with the same file (which another engine may have unlinked since)."""
        self.fall_back(error)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)

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

    def write_chunk(self, fd: int, image: memoryview, key: bytes, value: bytes) -> None:
        """Write the file of ``key`` and ``value`` through ``image`` (aligned, at least the
        padded size) from offset 0. Slices after the first are copied, checked and written side
        by side on the pool; the first block (the header, which needs every slice's digest)
        goes last, in one write with the first slice."""
        view = memoryview(value)
        parts = slices(len(value))

        def one(a: int, b: int) -> bytes:
            start, stop = ALIGN + a, ALIGN + _blocks(b)
            image[start : ALIGN + b] = view[a:b]
            image[ALIGN + b : stop] = bytes(stop - ALIGN - b)
            digest = self.check.of(view[a:b])
            if a:
                _pwrite_all(fd, image[start:stop], start)
            return digest

        digests = self._each(one, parts)
        digest = top_digest(key, len(value), digests)
        encode_header(image[:ALIGN], key, len(value), digest, self.check.value)
        _pwrite_all(fd, image[: ALIGN + _blocks(min(len(value), SLICE))], 0)

    def read_chunk(self, fd: int, image: memoryview, key: bytes, size: int) -> bytes | Damage:
        """Read and verify the file of ``size`` bytes that should hold ``key``: its first block
        and first slice in one read, the header checked, then the other slices read and
        checked side by side on the pool. The value, or what is wrong with the file."""
        first = min(size, ALIGN + SLICE)
        got = _pread_all(fd, image[:first], 0)
        header = parse_header(image[:ALIGN], key, size if got == first else got, self.check.value)
        if isinstance(header, Damage):
            return header
        value_len = header.value_len

        def one(a: int, b: int) -> bytes | None:
            start, stop = ALIGN + a, ALIGN + _blocks(b)
            if a and _pread_all(fd, image[start:stop], start) < stop - start:
                return None  # cut short while we read
            return self.check.of(image[start : ALIGN + b])

        read = self._each(one, slices(value_len))
        digests = [digest for digest in read if digest is not None]
        if len(digests) < len(read):
            return Damage.TRUNCATED
        if top_digest(key, value_len, digests) != header.digest:
            return Damage.DIGEST
        return bytes(image[ALIGN : ALIGN + value_len])

    def _each(self, one: Callable[[int, int], _T], parts: list[tuple[int, int]]) -> list[_T]:
        """``one`` of each part: the first on this thread, the others on the pool (if any)."""
        if self._pool is None or len(parts) <= 1:
            return [one(a, b) for a, b in parts]
        futures = [self._pool.submit(one, a, b) for a, b in parts[1:]]
        try:
            head = one(*parts[0])
        finally:
            # Every part finishes before the buffer goes back (none writes a reused buffer).
            errors = [f.exception() for f in futures]
        failed = next((e for e in errors if e is not None), None)
        if failed is not None:
            raise failed
        return [head, *(f.result() for f in futures)]


def _blocks(n: int) -> int:
    """``n`` rounded up to whole blocks."""
    return -(-n // ALIGN) * ALIGN


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
