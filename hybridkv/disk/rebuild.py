"""An OWNER's start on its directory (:class:`~hybridkv.disk.client.DiskClient`): the directory
made and O_DIRECT probed on it (:func:`open_directory`), then the index rebuilt from the files
found there (:func:`rebuild`, DK-5); and the removal of what a crash or another engine left,
which the client's rescans share (:func:`unlink_all`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hybridkv.disk.config import DirectIO, DiskConfig
from hybridkv.disk.fileformat import ALIGN
from hybridkv.disk.index import DiskIndex
from hybridkv.disk.io import Buffers, FileIO
from hybridkv.disk.names import HOST, chunk_path
from hybridkv.disk.scan import scan
from hybridkv.errors import HybridKVConfigError

__all__ = ["open_directory", "rebuild", "unlink_all", "unlink_quietly"]


def open_directory(config: DiskConfig, io: FileIO, buffers: Buffers, tag: str) -> None:
    """Create ``config.path`` and check that it takes O_DIRECT writes (``config.direct``); under
    AUTO a refusal makes ``io`` fall back to buffered I/O. ``tag`` tells this client's probe
    file from another's in the same process.

    Errors: HybridKVConfigError ``disk_dir`` (the directory cannot be created or written),
    ``disk_direct`` (ON where the directory refuses O_DIRECT).
    """
    directory = config.path
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise HybridKVConfigError(
            "disk_dir", str(directory), f"cannot be created ({error})", "give a writable path"
        ) from None
    if config.direct is DirectIO.OFF:
        return
    probe = directory / f".probe.tmp.{HOST}.{os.getpid()}.{tag}"
    try:
        _probe(probe, io, buffers)
    except OSError as error:
        if config.direct is DirectIO.ON:
            raise HybridKVConfigError(
                "disk_direct",
                "on",
                f"{directory} does not take O_DIRECT writes ({error})",
                "use disk_direct=auto (buffered there) or off, or a directory on a "
                "filesystem with O_DIRECT",
            ) from None
        if error.errno == errno.EINVAL:
            io.fall_back(error)
        else:
            raise HybridKVConfigError(
                "disk_dir",
                str(directory),
                f"cannot be written ({error})",
                "give a writable path",
            ) from None
    finally:
        unlink_quietly(probe)


def _probe(probe: Path, io: FileIO, buffers: Buffers) -> None:
    if not io.direct:
        raise OSError(errno.EINVAL, "this platform has no O_DIRECT")
    fd, _ = io.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC)
    try:
        with buffers.lease(ALIGN) as block:
            block[:] = bytes(ALIGN)
            os.pwrite(fd, block, 0)
    finally:
        os.close(fd)


def rebuild(
    directory: Path,
    pool: ThreadPoolExecutor,
    stale_temp_s: float,
    index: DiskIndex,
    counters: dict[str, int],
) -> None:
    """DK-5: ``index`` (empty) becomes exactly the complete files in ``directory``, newest kept
    when they exceed its capacity; what a crash left is removed. Counted in ``counters``
    (``rebuild_*``, :mod:`hybridkv.disk.counters`)."""
    began = time.perf_counter()
    listing = scan(directory, pool, stale_temp_s)
    counters["rebuild_torn"] += unlink_all(listing.torn)
    counters["rebuild_truncated"] += unlink_all(listing.truncated)
    newest_first = sorted(listing.files, reverse=True)
    room, kept = index.capacity, []
    for found in newest_first:
        if found.size <= room:
            room -= found.size
            kept.append((found.key, found.size))
        else:
            counters["rebuild_over_capacity"] += unlink_all([chunk_path(directory, found.key)])
    kept.reverse()  # oldest first: the last inserted is the most recent
    index.insert_all(kept)
    counters["rebuild_files"] = len(kept)
    counters["rebuild_bytes"] = index.bytes
    counters["rebuild_us"] = int((time.perf_counter() - began) * 1e6)


def unlink_quietly(path: Path) -> None:
    """Remove ``path`` if it is there (a temporary file after a failed write, a probe)."""
    with contextlib.suppress(OSError):
        os.unlink(path)


def unlink_all(paths: Sequence[Path]) -> int:
    """Remove ``paths``; how many this call removed (another engine may be faster)."""
    removed = 0
    for path in paths:
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
    return removed
