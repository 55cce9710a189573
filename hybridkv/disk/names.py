"""Where a chunk's file and its temporary files live, and when a temporary file is torn.

A chunk of key ``k`` (the bytes given to ``set``/``get``) is ``<dir>/<2 hex>/<k hex>``, the
subdirectory being the first two hex digits, so no directory holds more than 1/256 of the
chunks. A write goes to ``<dir>/<2 hex>/.<k hex>.tmp.<host>.<pid>.<random>`` and is renamed
onto the chunk's name once whole (DK-4). The writer's host and pid in the name let a later
scan tell a write in progress (a live process of this host) from a torn one.

Torn (DK-5): a temporary file whose writer is a process of this host that no longer runs, at
any age; or one older than ``stale_temp_s`` whose writer is not a live process of this host (a
writer on another host is judged by age alone: its liveness cannot be seen from here).
A pid reused by a new process of this host keeps its predecessor's temporary file until a
scan after that process ends.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

from hybridkv.disk.fileformat import MAX_KEY

__all__ = ["HOST", "TempName", "chunk_path", "is_torn", "key_of", "parse_temp", "temp_path"]

HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:24] or "host"
"""This host's name as temporary names carry it (no dots, at most 24 characters)."""
_HEX = re.compile(f"[0-9a-f]{{2,{2 * MAX_KEY}}}")
_TEMP = re.compile(rf"\.([0-9a-f]{{2,{2 * MAX_KEY}}})\.tmp\.(.+)\.([0-9]+)\.([0-9a-f]+)")


@dataclass(frozen=True, slots=True)
class TempName:
    """What a temporary file's name says: whose chunk, written by which process."""

    key: bytes
    host: str
    pid: int


def chunk_path(directory: Path, key: bytes) -> Path:
    """The complete file of ``key``."""
    name = key.hex()
    return directory / name[:2] / name


def temp_path(directory: Path, key: bytes) -> Path:
    """A fresh temporary name for a write of ``key`` by this process."""
    name = key.hex()
    return directory / name[:2] / f".{name}.tmp.{HOST}.{os.getpid()}.{secrets.token_hex(4)}"


def key_of(subdir: str, name: str) -> bytes | None:
    """The key of a complete file's ``name`` in ``subdir``, None for a name the tier never
    writes (left alone)."""
    if len(name) % 2 or not _HEX.fullmatch(name) or name[:2] != subdir:
        return None
    return bytes.fromhex(name)


def parse_temp(subdir: str, name: str) -> TempName | None:
    """What a temporary file's ``name`` says, None for a name that is not one of the tier's."""
    match = _TEMP.fullmatch(name)
    if match is None or len(match[1]) % 2 or match[1][:2] != subdir:
        return None
    return TempName(bytes.fromhex(match[1]), match[2], int(match[3]))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def is_torn(temp: TempName, age_s: float, stale_temp_s: float) -> bool:
    """Whether the write that left ``temp`` (``age_s`` seconds old) is over (module docstring)."""
    if temp.host == HOST:
        return not _alive(temp.pid)
    return age_s > stale_temp_s
