"""A :class:`~hybridkv.remote.client.ChunkClient` on a directory: the disk tier's storage.

The remote tier (:class:`hybridkv.remote.RemoteTier`) drives it as it drives a Redis server:
``exists`` for lookups, ``get`` for verified fetches, ``set`` from its write-behind thread. Every
I/O failure is a returned :class:`~hybridkv.remote.values.ClientFault` (FAULT), never an
exception; a bad argument (a key of the wrong type or length) raises HybridKVConfigError.

Roles (:class:`~hybridkv.disk.config.DiskRole`). An OWNER rebuilds its index from the directory
at construction (DK-5: complete files indexed, recency from their modification times, oldest
first; truncated files and torn temporary files removed; when the files exceed the capacity the
oldest are removed), reserves, evicts, writes, reads and removes damaged files, and rescans
the directory (one subdirectory at a time, a whole pass every ``rescan_s``) to adopt files
other engines wrote into it and forget files they removed. A READER (the lookup side, in
another process) keeps no index: ``exists`` stats files, ``get`` reads and verifies; it never
writes, evicts or removes anything.

Operations (pre, post, frame; a refused call changes nothing but its counters):

- ``set(key, value, ttl_s)``: the file is written whole under a temporary name, flushed per
  ``fsync``, and renamed onto the chunk's name (DK-4). Room is made first: the padded size is
  reserved, evicting unpinned files by policy (DK-2, DK-3). A key already indexed, or already
  complete on disk, is not written again (content addressing: its bytes are equal); an indexed
  key whose file another engine removed is written again. ENOSPC, EIO
  or any OSError: FAULT, the temporary file removed, the reservation released. ``ttl_s`` is
  ignored: a file lives until evicted.
- A full filesystem: a write refused with ENOSPC is a FAULT like any I/O error, and lowers the
  byte limit to what the client holds then; while lowered, each write first raises it again
  to what the client holds plus the filesystem's free space (``statvfs``), never above
  ``capacity_bytes``. So a directory on a filesystem smaller than ``disk_bytes``, or one that
  others fill, costs one refused write, after which writes evict to make room instead of
  failing for ever; space freed later lets the tier grow back.
- ``get(key)``: pins ``key`` for the read (DK-3), reads the whole file and verifies its header,
  key and digest (DK-1). A missing file is None (DK-7: removed by another engine); a damaged
  one is None, counted, and removed by an OWNER (DK-6). A hit is the most recent in the policy,
  and its modification time is renewed so the order survives a restart.
- ``exists(keys)``: whether each key's complete file is in the directory now, by a stat (an
  OWNER's index is not asked: another engine may have removed or written the file). Large
  batches are statted side by side on the I/O pool.

Snapshot (:meth:`DiskClient.snapshot`): ``index`` (key hex in eviction order, next victim first),
``bytes`` (complete files, padded), ``reserved`` (writes in flight), ``pins`` ((key hex, count)
sorted), ``counters`` (:data:`~hybridkv.disk.counters.DISK_COUNTER_NAMES`, every one present;
what each counts: :mod:`hybridkv.disk.counters`).

Start-up (the directory made, O_DIRECT probed, the index rebuilt) is :mod:`hybridkv.disk.rebuild`;
the rescans that keep the index in step with other engines are here (they take the lock).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hybridkv.disk.config import DiskConfig, DiskRole, FsyncPolicy
from hybridkv.disk.counters import DISK_COUNTER_NAMES
from hybridkv.disk.fileformat import ALIGN, MAX_KEY, SLICE, Damage, SliceCheck, padded_size
from hybridkv.disk.index import DiskIndex
from hybridkv.disk.io import Buffers, FileIO
from hybridkv.disk.names import chunk_path, temp_path
from hybridkv.disk.rebuild import open_directory, rebuild, unlink_all, unlink_quietly
from hybridkv.disk.scan import scan_subdir
from hybridkv.errors import HybridKVConfigError
from hybridkv.remote.values import ClientFault

__all__ = ["DISK_COUNTER_NAMES", "DiskClient"]


_KEEP_PER_THREAD = 8 << 20  # aligned buffers kept for reuse, per I/O thread
_SUBDIRS = 256  # the first byte of a key names its subdirectory
_STAT_FANOUT = 16  # a lookup statting more keys than this spreads them over the pool
_MISSING = (errno.ENOENT, errno.ENOTDIR)


class DiskClient:
    """Chunks as files in one directory, bounded in bytes, verified on read."""

    def __init__(
        self,
        config: DiskConfig,
        *,
        role: DiskRole = DiskRole.OWNER,
        slice_check: SliceCheck = SliceCheck.CRC32,
    ) -> None:
        """Open the tier on ``config.directory``; an OWNER creates it, checks O_DIRECT and
        rebuilds its index (module docstring). ``slice_check`` is the file format's version
        (:mod:`hybridkv.disk.fileformat`): leave it; SHA256, the format before, is there for a
        benchmark to measure beside it, and files of the other version are misses.

        Errors: HybridKVConfigError ``disk_dir`` (an OWNER cannot create or write the
        directory), ``disk_direct`` (ON where the directory refuses O_DIRECT).
        """
        self.config = config
        self.role = role
        self.directory = config.path
        self._lock = threading.Lock()
        self._index = DiskIndex(config.capacity_bytes, config.policy)
        self._counters = dict.fromkeys(DISK_COUNTER_NAMES, 0)
        self._pool = ThreadPoolExecutor(config.threads, thread_name_prefix="hybridkv-disk")
        pool = self._pool if config.threads > 1 else None
        self._io = FileIO(config.direct, pool, config.path, slice_check)
        self._buffers = Buffers(keep_bytes=(config.threads + 2) * _KEEP_PER_THREAD)
        self._closed = False
        self._active = 0  # calls past the closed check: close() waits for them (pool use)
        self._idle = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._rescanner: threading.Thread | None = None
        if role is DiskRole.OWNER:
            try:
                open_directory(config, self._io, self._buffers, f"{id(self):x}")
                rebuild(
                    self.directory, self._pool, config.stale_temp_s, self._index, self._counters
                )
            except BaseException:
                self._pool.shutdown()
                raise
            if config.rescan_s > 0:
                self._rescanner = threading.Thread(
                    target=self._rescan_loop, name="hybridkv-disk-rescan", daemon=True
                )
                self._rescanner.start()

    # --- the ChunkClient protocol ---

    def exists(self, keys: Sequence[bytes]) -> tuple[bool, ...] | ClientFault:
        """Whether each key has a complete file now (a stat each, DK-4). Frame: counters."""
        for key in keys:
            _check_key(key)
        with self._lock:
            if self._closed:
                return self._closed_call()
            self._counters["exists_calls"] += 1
            self._counters["exists_keys"] += len(keys)
            self._active += 1
        try:
            found = self._stat_all(list(keys))
        finally:
            self._leave()
        if isinstance(found, ClientFault):
            self._count("exists_faults")
            return found
        self._count("exists_found", sum(found))
        return tuple(found)

    def get(self, key: bytes) -> bytes | ClientFault | None:
        """``key``'s value, verified (DK-1); None on a miss or a damaged file (DK-6, DK-7)."""
        _check_key(key)
        with self._lock:
            if self._closed:
                return self._closed_call()
            self._counters["gets"] += 1
            self._index.pin(key)
            self._active += 1
        try:
            return self._read(key)
        finally:
            with self._lock:
                self._index.unpin(key)
            self._leave()

    def set(self, key: bytes, value: bytes, ttl_s: int) -> ClientFault | None:
        """Write ``value`` under ``key`` whole, within the byte limit (module docstring)."""
        _check_key(key)
        size = padded_size(len(key), len(value))
        with self._lock:
            if self._closed:
                return self._closed_call()
            refused = self._admit(key, size)
            if refused is not None:
                return refused if isinstance(refused, ClientFault) else None
            self._active += 1
        outcome: bool | None = False
        try:
            outcome = self._adopt_or_write(key, value, size)
        finally:
            with self._lock:
                self._index.finish(key, complete=outcome is True)
                if outcome is None:
                    self._fit_to_filesystem()
            self._leave()
        return None if outcome else ClientFault.FAULT

    def close(self) -> None:
        """Wait for the calls in flight, stop the rescans and the I/O pool; later calls are
        FAULTs. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._idle.wait_for(lambda: self._active == 0)
        self._stop.set()
        if self._rescanner is not None:
            self._rescanner.join()
        self._pool.shutdown(wait=True)

    def snapshot(self) -> dict[str, Any]:
        """The plain view the spec compares (module docstring). Frame: nothing changes."""
        with self._lock:
            index = self._index
            self._counters["direct_fallbacks"] = self._io.fallbacks
            return {
                "index": tuple(key.hex() for key in index.order()),
                "bytes": index.bytes,
                "reserved": index.reserved,
                "pins": tuple(sorted((key.hex(), n) for key, n in index.pins.items())),
                "counters": dict(self._counters),
            }

    def check(self) -> None:
        """Raise naming the first broken index invariant (DK-2, DK-3); an expensive no-op when
        correct."""
        with self._lock:
            self._index.check()

    # --- writes ---

    def _admit(self, key: bytes, size: int) -> ClientFault | bool | None:
        """Under the lock: reserve room for ``key`` (None), or the refusal: a fault, or True
        for a write not needed. Victims are removed here, before the write begins, so the
        directory itself stays within the limit (DK-2)."""
        counters = self._counters
        counters["sets"] += 1
        if self.role is DiskRole.READER:
            counters["set_refused_reader"] += 1
            return ClientFault.FAULT
        index = self._index
        if key in index.sizes:
            if os.path.exists(chunk_path(self.directory, key)):
                counters["set_present"] += 1
                index.restored(key)  # a store, not a read: ARC keeps it in its list
                return True
            counters["vanished"] += 1  # another engine removed it: write it again
            index.remove(key)
        if key in index.writing:
            counters["set_pending"] += 1
            return True
        if size > self.config.capacity_bytes:
            counters["set_too_large"] += 1
            return ClientFault.FAULT
        if index.capacity < self.config.capacity_bytes:
            self._regrow()
        victims = index.victims_for(size, key)
        if victims is None:
            counters["set_no_space"] += 1
            return ClientFault.FAULT
        index.missed(key)  # before the eviction: ARC records the target the choice used
        self._evict(victims)
        index.reserve(key, size)
        return None

    def _evict(self, victims: Sequence[tuple[bytes, int]]) -> None:
        self._index.evict(victims)
        for key, size in victims:
            self._counters["evictions"] += 1
            self._counters["evicted_bytes"] += size
            try:
                os.unlink(chunk_path(self.directory, key))
            except FileNotFoundError:
                self._counters["vanished"] += 1  # another engine removed it first
            except OSError:
                pass  # the file stays, unindexed; a rescan adopts it again

    def _fit_to_filesystem(self) -> None:
        """Under the lock, after a write the filesystem refused for want of space (ENOSPC):
        the limit becomes what this client holds now, so the next write evicts to make room
        instead of failing like this one. Never above ``capacity_bytes``; DK-2 holds."""
        index = self._index
        index.capacity = min(index.capacity, index.bytes + index.reserved)
        self._counters["capacity_lowered"] += 1

    def _regrow(self) -> None:
        """Under the lock, while the limit is lowered: what this client holds plus the
        filesystem's free space now, within ``capacity_bytes`` (space freed by others lets the
        tier grow back)."""
        index = self._index
        try:
            fs = os.statvfs(self.directory)
        except OSError:
            return
        free = fs.f_bavail * fs.f_frsize
        held = index.bytes + index.reserved
        index.capacity = min(self.config.capacity_bytes, held + free)

    def _adopt_or_write(self, key: bytes, value: bytes, size: int) -> bool | None:
        """Written (or found written): True; failed: False; failed for want of space: None."""
        final = chunk_path(self.directory, key)
        try:
            if os.stat(final).st_size == size:
                self._count("set_adopted")  # another engine wrote it: equal bytes
                return True
        except OSError:
            pass
        temp = temp_path(self.directory, key)
        try:
            self._write(temp, final, key, value, size)
        except OSError as error:
            unlink_quietly(temp)
            with self._lock:
                self._counters["set_faults"] += 1
                if error.errno == errno.ENOSPC:
                    self._counters["set_enospc"] += 1
            return None if error.errno == errno.ENOSPC else False
        with self._lock:
            self._counters["written"] += 1
            self._counters["bytes_written"] += size
        return True

    def _write(self, temp: Path, final: Path, key: bytes, value: bytes, size: int) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        with self._buffers.lease(size) as image:
            try:
                fd, direct = self._io.open(temp, flags)
            except FileNotFoundError:  # the subdirectory's first file (or it was removed)
                os.makedirs(final.parent, exist_ok=True)
                fd, direct = self._io.open(temp, flags)
            try:
                if len(value) > SLICE:
                    # The file's size set first: its slices are then written inside the end
                    # of file, which filesystems (XFS) let run side by side; past it, one by one.
                    os.ftruncate(fd, size)
                self._io.retrying(fd, direct, lambda: self._io.write_chunk(fd, image, key, value))
                if self.config.fsync is FsyncPolicy.FILE:
                    os.fdatasync(fd)
            finally:
                os.close(fd)
        os.rename(temp, final)

    # --- reads ---

    def _read(self, key: bytes) -> bytes | ClientFault | None:
        path = chunk_path(self.directory, key)
        try:
            fd, direct = self._io.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as error:
            if error.errno in _MISSING:
                self._missed(key)
                return None
            self._count("get_faults")
            return ClientFault.FAULT
        try:
            return self._read_open(key, path, fd, direct)
        except OSError:
            self._count("get_faults")
            return ClientFault.FAULT
        finally:
            os.close(fd)

    def _read_open(self, key: bytes, path: Path, fd: int, direct: bool) -> bytes | None:
        info = os.fstat(fd)
        size = info.st_size
        if size <= 0 or size % ALIGN:
            self._damaged(key, path, info, Damage.TRUNCATED)
            return None
        with self._buffers.lease(size) as image:
            value = self._io.retrying(fd, direct, lambda: self._io.read_chunk(fd, image, key, size))
        self._count("bytes_read", size)
        if isinstance(value, Damage):
            self._damaged(key, path, info, value)
            return None
        if self.role is DiskRole.OWNER:
            with self._lock:
                self._counters["hits"] += 1
                self._index.touch(key)
            with contextlib.suppress(OSError):
                os.utime(fd)  # recency for the next rebuild (an OWNER only writes it)
        else:
            self._count("hits")
        return value

    def _missed(self, key: bytes) -> None:
        with self._lock:
            self._counters["misses"] += 1
            if key in self._index.sizes:
                self._counters["vanished"] += 1  # removed by another engine (DK-7)
                self._index.remove(key)

    def _damaged(self, key: bytes, path: Path, info: os.stat_result, why: Damage) -> None:
        """Count a damaged file; an OWNER removes it if the name still holds that very file
        (a writer may have renamed a good copy over it meanwhile)."""
        with self._lock:
            self._counters["damaged"] += 1
            self._counters[f"damaged_{why.value}"] += 1
            if self.role is DiskRole.READER:
                return
            self._index.remove(key)
            try:
                now = os.stat(path)
                if (now.st_ino, now.st_dev) == (info.st_ino, info.st_dev):
                    os.unlink(path)
                    self._counters["removed_damaged"] += 1
            except OSError:
                pass  # gone already, or not ours to remove: a miss either way

    # --- lookups ---

    def _stat_all(self, keys: list[bytes]) -> list[bool] | ClientFault:
        if len(keys) <= _STAT_FANOUT or self.config.threads == 1:
            return self._stat_some(keys)
        step = -(-len(keys) // self.config.threads)
        parts = list(
            self._pool.map(self._stat_some, [keys[i : i + step] for i in range(0, len(keys), step)])
        )
        fault = next((p for p in parts if isinstance(p, ClientFault)), None)
        if fault is not None:
            return fault
        return [found for part in parts if not isinstance(part, ClientFault) for found in part]

    def _stat_some(self, keys: list[bytes]) -> list[bool] | ClientFault:
        found = []
        for key in keys:
            try:
                info = os.stat(chunk_path(self.directory, key))
            except OSError as error:
                if error.errno in _MISSING:
                    found.append(False)
                    continue
                return ClientFault.FAULT
            found.append(
                stat.S_ISREG(info.st_mode) and info.st_size > 0 and not info.st_size % ALIGN
            )
        return found

    # --- rescans ---

    def _rescan_loop(self) -> None:
        # One subdirectory per tick: a whole pass every rescan_s, the lock held briefly.
        first = 0
        while not self._stop.wait(self.config.rescan_s / _SUBDIRS):
            self._rescan_part(first)  # never raises: the thread runs until close()
            first = (first + 1) % _SUBDIRS
            if first == 0:
                self._count("rescans")

    def rescan(self) -> None:
        """One whole pass at once (the rescan thread spreads the same over ``rescan_s``):
        adopt the complete files other engines wrote, forget the indexed files they removed,
        remove torn temporary files and truncated files. Adopting makes room by policy like a
        write; a file there is no room for stays unindexed (``adopt_refused``)."""
        for first in range(_SUBDIRS):
            self._rescan_part(first)
        self._count("rescans")

    def _rescan_part(self, first: int) -> None:
        """The rescan of subdirectory ``first`` (the keys whose first byte it is)."""
        if self.role is DiskRole.READER:
            return
        with self._lock:
            if self._closed:
                return
            since = self._index.generation
        try:
            listing = scan_subdir(self.directory, f"{first:02x}", self.config.stale_temp_s)
        except OSError:
            self._count("rescan_faults")  # unreadable now: the next pass tries again
            return
        removed = unlink_all(listing.torn)
        truncated = unlink_all(listing.truncated)
        on_disk = {found.key for found in listing.files}
        with self._lock:
            self._counters["temps_removed"] += removed
            self._counters["rescan_truncated"] += truncated
            index = self._index
            for key in list(index.groups.get(first, ())):
                if index.born[key] <= since and key not in on_disk and key not in index.pins:
                    self._counters["vanished"] += 1
                    index.remove(key)
            for found in sorted(listing.files):
                if found.key in index.sizes or found.key in index.writing:
                    continue
                victims = index.victims_for(found.size)  # another engine's: no miss of ours
                if victims is None:
                    self._counters["adopt_refused"] += 1
                    continue
                self._evict(victims)
                index.insert(found.key, found.size)
                self._counters["adopted"] += 1

    # --- small helpers ---

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1
            if not self._active:
                self._idle.notify_all()

    def _closed_call(self) -> ClientFault:
        self._counters["closed_calls"] += 1
        return ClientFault.FAULT


def _check_key(key: object) -> None:
    if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_KEY:
        raise HybridKVConfigError(
            "key", key, f"must be 1 to {MAX_KEY} bytes", "pass the chunk's key as bytes"
        )
