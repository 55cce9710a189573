"""One pass over a disk tier's directory: the complete files, and what a crash left.

Used at start-up (the rebuild, DK-5: every subdirectory, side by side on the I/O pool) and by
an OWNER's periodic rescan (files other engines wrote or removed: one subdirectory at a time).
Reads names and ``stat`` only, never a file's bytes: a file is complete when its name is a
chunk's and its size a positive multiple of the alignment (every file the tier renames into
place is); its content is verified when it is read (DK-1, DK-6). A complete-named file of
another size is truncated. Temporary files are judged by :func:`~.names.is_torn`. Names the
tier never writes are left alone.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from hybridkv.disk.fileformat import ALIGN
from hybridkv.disk.names import is_torn, key_of, parse_temp

__all__ = ["Found", "Listing", "scan", "scan_subdir"]


class Found(NamedTuple):
    """A complete file: its modification time (ns), key and size. Found values sort as
    tuples, oldest first (a million of them sort without a key function)."""

    mtime_ns: int
    key: bytes
    size: int


@dataclass(slots=True)
class Listing:
    """What one pass found: complete files, truncated files and torn temporary files."""

    files: list[Found] = field(default_factory=list)
    truncated: list[Path] = field(default_factory=list)
    torn: list[Path] = field(default_factory=list)

    def merge(self, other: Listing) -> None:
        self.files += other.files
        self.truncated += other.truncated
        self.torn += other.torn


def scan(directory: Path, pool: Executor, stale_temp_s: float) -> Listing:
    """List ``directory``'s chunk subdirectories side by side on ``pool`` (a missing directory
    lists nothing)."""
    try:
        with os.scandir(directory) as entries:
            subdirs = [e.name for e in entries if _is_subdir(e)]
    except FileNotFoundError:
        return Listing()
    now = time.time()
    parts = pool.map(lambda s: _scan_one(directory / s, s, now, stale_temp_s), subdirs)
    listing = Listing()
    for part in parts:
        listing.merge(part)
    return listing


def scan_subdir(directory: Path, subdir: str, stale_temp_s: float) -> Listing:
    """List one chunk subdirectory (``"00"`` to ``"ff"``; a missing one lists nothing)."""
    return _scan_one(directory / subdir, subdir, time.time(), stale_temp_s)


def _is_subdir(entry: os.DirEntry[str]) -> bool:
    name = entry.name
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name) and entry.is_dir()


def _scan_one(path: Path, subdir: str, now: float, stale_temp_s: float) -> Listing:
    listing = Listing()
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return listing
    for entry in entries:
        try:
            _judge(entry, subdir, now, stale_temp_s, listing)
        except FileNotFoundError:
            continue  # removed while we looked: nothing to list
    return listing


def _judge(entry: os.DirEntry[str], subdir: str, now: float, stale: float, out: Listing) -> None:
    name = entry.name
    if name.startswith("."):
        temp = parse_temp(subdir, name)
        if temp is not None and is_torn(temp, now - entry.stat().st_mtime, stale):
            out.torn.append(Path(entry.path))
        return
    key = key_of(subdir, name)
    if key is None or not entry.is_file(follow_symlinks=False):
        return
    info = entry.stat(follow_symlinks=False)
    if info.st_size <= 0 or info.st_size % ALIGN:
        out.truncated.append(Path(entry.path))
    else:
        out.files.append(Found(info.st_mtime_ns, key, info.st_size))
