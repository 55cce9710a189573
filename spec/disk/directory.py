"""The directory a disk tier lives in: final files, temp files, and what may happen to them.

Names (the contract): a final file is ``<dir>/<2 hex>/<key hex>``, a temp file
``<dir>/<2 hex>/.<key hex>.tmp.<host>.<pid>.<random>``. The model keeps names abstract: a
final file is known by its key, a temp by a number no other temp shares.

File format (the contract): a header (magic, version, key length and key, value length, a
digest over key + value: SHA-256 over the lengths, the key and a CRC-32 of each slice of the
value), the value, zero padding to the alignment. The model keeps what a reader can check: the
key the header names, the value, the digest, and whether the file holds every byte its header
announces. The digest is there to catch torn and corrupt files, not forgery (the chunk values
carry their own seal), so the model needs only that any change to key or value fails it. A
file's size is its padded size (:meth:`FileLayout.footprint`), the size byte accounting uses.

A file is an inode: a rename over a final name replaces the name, and a reader that opened the
old inode still reads it whole (POSIX). Each file carries an ``inode`` number, so the model
tells "the file this read opened" from "a file of the same name now".

What may happen besides the tier's own writes:

- an outside hand damages a final file: ``corrupt`` flips a byte of the value (the digest
  fails), ``truncate`` cuts the file short (the length fails), ``foreign`` puts a whole file of
  another key under this name (the key fails); or removes it (another engine's eviction);
- a crash: ``KILL`` (the process dies, the page cache survives: every renamed file is whole,
  the dead writer's temps stay behind, torn) or ``POWER`` (also the page cache is lost: a file
  renamed without an fsync of its data, ``FsyncPolicy.NEVER``, may come back empty; the model
  empties every such file. With ``FsyncPolicy.FILE`` the data was synced before the rename and
  comes back whole. A rename itself may be lost, which leaves the key absent: any absence is a
  miss, so the model does not add that case).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from dataclasses import dataclass, replace
from enum import Enum

from spec.errors import ConfigError

__all__ = [
    "Crash",
    "Damage",
    "Directory",
    "DiskFile",
    "FileLayout",
    "FsyncPolicy",
    "Temp",
    "Verdict",
    "digest",
    "verify",
]


class FsyncPolicy(Enum):
    """When the tier syncs a file's data: FILE before the rename (survives power loss whole),
    NEVER (survives a killed process; after power loss the file may be empty)."""

    FILE = "file"
    NEVER = "never"


class Crash(Enum):
    """How the owner's process ends: KILL (kill -9; the kernel keeps the page cache) or POWER
    (the machine goes down; unsynced data is lost)."""

    KILL = "kill"
    POWER = "power"


class Damage(Enum):
    """What an outside hand does to a final file (module docstring)."""

    CORRUPT = "corrupt"
    TRUNCATE = "truncate"
    FOREIGN = "foreign"


class Verdict(Enum):
    """A reader's check of a file under a key's name: WHOLE (loadable), or why it is not."""

    WHOLE = "whole"
    TRUNCATED = "truncated"
    FOREIGN = "foreign"
    CORRUPT = "corrupt"
    WRITING = "writing"


@dataclass(frozen=True, slots=True)
class FileLayout:
    """The file format's sizes: ``header_bytes`` (the header without the key), the
    ``alignment`` every file is padded to (4096 in the library, so O_DIRECT reads whole
    blocks; the explorer uses small numbers), and whether the value starts on a block of its
    own (``value_aligned``: the header and key padded to a block, then the value padded)."""

    alignment: int = 4096
    header_bytes: int = 64
    value_aligned: bool = False

    def __post_init__(self) -> None:
        """Pre: ``alignment`` an int >= 1, ``header_bytes`` an int >= 0 (``ConfigError``)."""
        for name, least in (("alignment", 1), ("header_bytes", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(name, value, f"must be an int >= {least}", "give a size")

    def footprint(self, key: bytes, value: bytes) -> int:
        """The padded size of the file of ``key`` holding ``value``. Pure."""
        if self.value_aligned:
            return self.padded(self.header_bytes + len(key)) + self.padded(len(value))
        return self.padded(self.header_bytes + len(key) + len(value))

    def padded(self, size: int) -> int:
        """``size`` rounded up to the alignment. Pure."""
        return -(-size // self.alignment) * self.alignment

    def plausible(self, size: int) -> bool:
        """Whether a final file of ``size`` bytes may be complete (a positive multiple of the
        alignment): what a scan, which reads no content, can tell from ``stat``. Pure."""
        return size > 0 and size % self.alignment == 0


def digest(key: bytes, value: bytes) -> bytes:
    """The model's header digest over the key (length-prefixed) and the value: a stand-in for
    the file's (module docstring) with the one property the model relies on, that any change
    to key or value fails it. Pure."""
    return hashlib.sha256(len(key).to_bytes(4, "big") + key + value).digest()


@dataclass(frozen=True, slots=True)
class DiskFile:
    """One inode under a final name: the header's key, the value, the header's digest, whether
    every announced byte is there (``whole``), whether a writer still fills it (``writing``),
    its size, its mtime (a logical clock), its inode, and whether its data was synced."""

    header_key: bytes
    value: bytes
    digest: bytes
    whole: bool
    writing: bool
    size: int
    mtime: int
    inode: int
    durable: bool


@dataclass(frozen=True, slots=True)
class Temp:
    """A temp file: the key it will become, its writer (``"self"``: the owner modelled,
    ``"peer"``: another engine on the directory), whether the writer is alive, its size."""

    key: bytes
    writer: str
    live: bool
    size: int


def verify(file: DiskFile, key: bytes) -> Verdict:
    """The reader's check of ``file`` opened under ``key``'s name (length, key, digest). Pure."""
    if file.writing:
        return Verdict.WRITING
    if not file.whole:
        return Verdict.TRUNCATED
    if file.header_key != key:
        return Verdict.FOREIGN
    if file.digest != digest(key, file.value):
        return Verdict.CORRUPT
    return Verdict.WHOLE


class Directory:
    """Final files by key and temps by number; a logical clock for mtimes and inodes."""

    def __init__(self) -> None:
        """An empty directory."""
        self.files: dict[bytes, DiskFile] = {}
        self.temps: dict[int, Temp] = {}
        self._clock = 0

    def tick(self) -> int:
        """The next mtime / inode / temp number. Post: strictly greater than every earlier one;
        nothing else changes."""
        self._clock += 1
        return self._clock

    def create_temp(self, key: bytes, writer: str, size: int) -> int:
        """A writer opens a new temp for ``key``; its number. Frame: final files unchanged."""
        number = self.tick()
        self.temps[number] = Temp(key, writer, True, size)
        return number

    def rename(self, number: int, value: bytes, *, durable: bool) -> bool:
        """The temp ``number``, filled with ``value``, becomes the final file of its key.

        Post: the final name holds a new whole inode (any file of that name replaced), the
        temp is gone; True. Refusal: the temp is gone (False): nothing changes."""
        temp = self.temps.pop(number, None)
        if temp is None:
            return False
        when = self.tick()
        self.files[temp.key] = DiskFile(
            temp.key, value, digest(temp.key, value), True, False, temp.size, when, when, durable
        )
        return True

    def touch(self, key: bytes, inode: int) -> None:
        """Renew the mtime of ``key``'s file if it is inode ``inode`` (a hit's recency, which a
        restart reads back); otherwise nothing changes."""
        file = self.files.get(key)
        if file is not None and file.inode == inode:
            self.files[key] = replace(file, mtime=self.tick())

    def remove_temp(self, number: int) -> None:
        """The temp ``number`` is unlinked (absent: nothing changes)."""
        self.temps.pop(number, None)

    def unlink(self, key: bytes, inode: int | None = None) -> bool:
        """Unlink the final file of ``key`` (only if it is inode ``inode``, when given).
        Returns whether a file was removed; ENOENT (absent, or another inode) changes nothing."""
        file = self.files.get(key)
        if file is None or (inode is not None and file.inode != inode):
            return False
        del self.files[key]
        return True

    def damage(self, key: bytes, how: Damage, other: tuple[bytes, bytes, int]) -> None:
        """An outside hand damages the final file of ``key``; ``other`` is another key, its
        value and its file's size, whose file FOREIGN copies under this name. CORRUPT and
        TRUNCATE change the inode in place (a read that opened it sees the damage); each keeps
        the mtime (the hand restores it). Pre: the file exists."""
        file = self.files[key]
        if how is Damage.CORRUPT:
            flipped = bytes([file.value[0] ^ 0xFF]) + file.value[1:]
            self.files[key] = replace(file, value=flipped)
        elif how is Damage.TRUNCATE:
            self.files[key] = replace(file, whole=False, size=file.size // 2)
        else:
            # A copy put under this name is a new inode (a read that opened the old one keeps it).
            inode = self.tick()
            self.files[key] = replace(
                file,
                header_key=other[0],
                value=other[1],
                digest=digest(other[0], other[1]),
                size=other[2],
                inode=inode,
            )

    def crash(self, how: Crash, writer: str) -> None:
        """``writer``'s process dies.

        Post: its temps stay, torn (writer dead); POWER also empties every final file whose
        data was never synced. Frame: other writers' temps and synced files are unchanged."""
        for number, temp in self.temps.items():
            if temp.writer == writer:
                self.temps[number] = replace(temp, live=False)
        if how is Crash.POWER:
            for key, file in self.files.items():
                if not file.durable:
                    self.files[key] = replace(file, value=b"", whole=False, size=0)

    def listing(self) -> dict[str, tuple[tuple[object, ...], ...]]:
        """The plain view DK-4 and DK-5 read: ``files`` ((key_hex, size, verdict), ...) and
        ``temps`` ((key_hex, writer, live), ...), both sorted. Pure."""
        files = tuple(
            sorted((key.hex(), f.size, verify(f, key).value) for key, f in self.files.items())
        )
        temps = tuple(sorted((t.key.hex(), t.writer, t.live) for t in self.temps.values()))
        return {"files": files, "temps": temps}

    def freeze(self) -> Hashable:
        """A hashable value equal for directories with the same future. mtimes count only in
        their order (frozen as ranks); inodes only in whether an open read still names the
        current file, which the caller freezes with the read. Pure."""
        order = {m: rank for rank, m in enumerate(sorted(f.mtime for f in self.files.values()))}
        files = tuple(
            sorted(
                (key, f.header_key, f.value, f.whole, f.writing, f.size, order[f.mtime], f.durable)
                for key, f in self.files.items()
            )
        )
        temps = tuple(sorted((t.key, t.writer, t.live, t.size) for t in self.temps.values()))
        return (files, temps)

    def copy(self) -> Directory:
        """An independent copy (files and temps are frozen values). Frame: ``self`` unchanged."""
        twin = Directory()
        twin.files = dict(self.files)
        twin.temps = dict(self.temps)
        twin._clock = self._clock
        return twin
