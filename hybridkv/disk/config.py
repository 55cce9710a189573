"""The disk tier's settings, checked eagerly, one user-facing ``disk_*`` key each.

What each fsync policy survives (a chunk file is written under a temporary name and renamed
into place once whole, so a reader never sees a file before its rename, DK-4):

- :attr:`FsyncPolicy.FILE` (default): the file's data is flushed to the device (``fdatasync``)
  before the rename. A ``kill -9`` of the writer and a power loss both leave, under a chunk's
  name, either nothing or the whole file. A power loss may lose the most recent renames (the
  directory itself is not flushed): those chunks are misses after the restart.
- :attr:`FsyncPolicy.NEVER`: renamed without a flush. A ``kill -9`` loses nothing that was
  renamed (the page cache is the kernel's, not the process's). After a power loss a renamed file
  may hold zeros or a part of its bytes: its digest then fails on the first read, which makes it
  a miss, counted and removed (DK-1, DK-6), never wrong bytes.

Either way a write the process did not finish leaves a temporary file, removed as torn at the
next start or rescan (DK-5, :mod:`hybridkv.disk.names`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TypeVar

from hybridkv.errors import HybridKVConfigError, int_at_least

__all__ = ["POLICIES", "DirectIO", "DiskConfig", "DiskRole", "FsyncPolicy"]

_E = TypeVar("_E", bound=Enum)

POLICIES = ("lru", "arc")
"""The eviction policies the disk index runs (``disk_policy``)."""


class FsyncPolicy(Enum):
    """When a chunk's bytes are flushed to the device (module docstring: what each survives)."""

    FILE = "file"
    NEVER = "never"


class DirectIO(Enum):
    """O_DIRECT use. AUTO: try it, fall back to buffered I/O where the filesystem refuses it
    (logged once). ON: refuse at start-up where the directory does not support it. OFF: buffered."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class DiskRole(Enum):
    """OWNER: keeps the index, writes, evicts, removes bad files. READER: the lookup side of
    another process: stats files, reads, never writes or removes anything."""

    OWNER = "owner"
    READER = "reader"


@dataclass(frozen=True, slots=True)
class DiskConfig:
    """One disk tier's directory, byte limit, policy and I/O settings.

    Attributes:
        directory: the exact directory this client's files live in (created by an OWNER if
            missing). Engines that share it share its chunks.
        capacity_bytes: the byte limit (> 0): the padded sizes of complete files plus the
            reservations of writes in flight never exceed it (DK-2).
        policy: ``"lru"`` or ``"arc"``: which unpinned chunk is evicted first.
        threads: the I/O thread pool's size (>= 1): parallel stats of a lookup, parallel
            segments of a large read or write, the start-up scan.
        fsync: :class:`FsyncPolicy` (or its value, ``"file"`` / ``"never"``).
        direct: :class:`DirectIO` (or its value, ``"auto"`` / ``"on"`` / ``"off"``).
        stale_temp_s: a temporary file older than this (>= 0 seconds) whose writer is not a live
            process on this host is torn, and removed. A temporary file of a process of this
            host that is gone is torn at any age.
        rescan_s: how often (> 0 seconds, or 0 = never) an OWNER rescans the directory to adopt
            files other engines wrote into it and forget files they removed.
    """

    directory: str | Path
    capacity_bytes: int
    policy: str = "lru"
    threads: int = 4
    fsync: FsyncPolicy = FsyncPolicy.FILE
    direct: DirectIO = DirectIO.AUTO
    stale_temp_s: float = 300.0
    rescan_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.directory, str | Path) or not str(self.directory):
            raise HybridKVConfigError(
                "disk_dir", self.directory, "must be a directory path", "pass a path"
            )
        if not int_at_least(self.capacity_bytes, 1):
            raise HybridKVConfigError(
                "disk_bytes", self.capacity_bytes, "must be an int > 0", "pass the byte limit"
            )
        if self.policy not in POLICIES:
            raise HybridKVConfigError(
                "disk_policy", self.policy, "is not a disk policy", f"pick one of {POLICIES}"
            )
        if not int_at_least(self.threads, 1):
            raise HybridKVConfigError(
                "disk_threads", self.threads, "must be an int >= 1", "pass the I/O pool's size"
            )
        object.__setattr__(self, "fsync", _member(FsyncPolicy, "disk_fsync", self.fsync))
        object.__setattr__(self, "direct", _member(DirectIO, "disk_direct", self.direct))
        _seconds("disk_stale_temp_s", self.stale_temp_s)
        _seconds("disk_rescan_s", self.rescan_s)

    @property
    def path(self) -> Path:
        """``directory`` as a :class:`~pathlib.Path`."""
        return Path(self.directory)


def _member(kind: type[_E], field: str, value: object) -> _E:
    """``value`` as a member of ``kind`` (the member itself or its string value)."""
    if isinstance(value, kind):
        return value
    for member in kind:
        if value == member.value:
            return member
    names = tuple(str(m.value) for m in kind)
    raise HybridKVConfigError(field, value, f"is not one of {names}", f"pick one of {names}")


def _seconds(field: str, value: object) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(float(value)) or float(value) < 0:  # type: ignore[arg-type]
        raise HybridKVConfigError(field, value, "must be a finite number >= 0", "pass seconds")
