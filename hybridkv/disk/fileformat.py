"""A chunk file's bytes: one header block, then the value, zero padding to the I/O alignment.

Layout (little-endian)::

    block 0 (ALIGN = 4096 bytes):
        magic    4 bytes   b"HKVD"
        version  u16       2 (1: the format before, below)
        key_len  u16       1..MAX_KEY
        val_len  u64
        digest   32 bytes  (below)
        key      key_len bytes
        zeros    to the end of the block
    from offset ALIGN:
        value    val_len bytes
        zeros    up to a multiple of ALIGN

The digest is SHA-256 over the key and the value with their lengths: ``SHA-256(key_len u16,
val_len u64, key, check(slice 0), check(slice 1), ...)``, a slice being each :data:`SLICE`
(256 KiB) of the value in order (an empty value has none) and its check the slice's CRC-32
(``zlib.crc32``, u32). Checking the value slice by slice lets a large chunk be checked on
several threads, each slice while its own blocks are written or read (:mod:`hybridkv.disk.io`),
instead of one thread going over the whole value before or after the I/O. A file renamed onto
another key's name (foreign), cut short (truncated), or altered anywhere in its header, key or
value fails (DK-1); the zeros are not covered.

What the check is for: torn and corrupt files (a crash, a bad block, an outside hand, another
engine's file under a name), not forgery. CRC-32 misses a random alteration of a slice with odds
of 2**-32 and never misses one confined to 32 consecutive bits; anyone who can write the
directory can also write a file whose checks match. Forgery is the codec's to catch: the value a
tier stores is already sealed (:func:`hybridkv.remote.encode_chunk`: a SHA-256 per payload, or
the fleet's MAC), and that seal is checked again on every fetch of a chunk from any tier. So the
disk does not pay SHA-256 a second time over every byte: CRC-32 runs at about 4x SHA-256's
bytes per second on one core, and the tier reads and writes 2 MB chunks faster with it
(docs/benchmarks/disk.md, ``tools/bench_disk.py --digest``). The top digest stays SHA-256: it
runs over a few dozen bytes (lengths, key, checks), nothing beside the value's cost.

Version 1 (SHA-256 per slice, same layout) is not read: its files are a version miss
(:attr:`Damage.VERSION`), counted and removed as any damage. :class:`SliceCheck` keeps its check
so a benchmark can write and read it side by side with version 2 in one run
(``tools/bench_disk.py --digest``).

The value starts on a block boundary, so each slice is whole blocks of the file and an O_DIRECT
transfer of it needs no copy to align it. Byte accounting uses the padded size
(:func:`padded_size`), which is also the file's size on disk, so the start-up scan reads sizes
off ``stat`` without opening a file.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Sequence
from enum import Enum

__all__ = [
    "ALIGN",
    "HEADER",
    "MAGIC",
    "MAX_KEY",
    "SLICE",
    "VERSION",
    "Damage",
    "Header",
    "SliceCheck",
    "decode",
    "encode_header",
    "encode_into",
    "padded_size",
    "parse_header",
    "slice_digest",
    "slices",
    "top_digest",
]

ALIGN = 4096
"""The I/O alignment: file sizes, buffer addresses and O_DIRECT transfers are multiples of it."""
SLICE = 1 << 18
"""Bytes of value per slice digest (256 KiB, a multiple of ALIGN)."""
MAGIC = b"HKVD"
VERSION = 2
"""The format this library writes and reads (:class:`SliceCheck`)."""
MAX_KEY = 96
"""The longest key (bytes): its hex name and temporary name fit a 255-byte file name."""
_FIXED = struct.Struct("<4sHHQ")
_LENGTHS = struct.Struct("<HQ")
_CRC = struct.Struct("<I")
HEADER = _FIXED.size + 32
"""Bytes of the header block before the key."""


class Damage(Enum):
    """Why a file's bytes are not a chunk of the key asked for (each one a miss, DK-6)."""

    TRUNCATED = "truncated"
    MAGIC = "magic"
    VERSION = "version"
    FOREIGN = "foreign"
    LENGTHS = "lengths"
    DIGEST = "digest"


def padded_size(key_len: int, value_len: int) -> int:
    """The file's size for a key of ``key_len`` bytes (at most MAX_KEY, so the header is one
    block) and a value of ``value_len``: the header block and the value rounded up to ALIGN."""
    del key_len  # the header block holds any key up to MAX_KEY
    return ALIGN + -(-value_len // ALIGN) * ALIGN


def slices(value_len: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` offsets in the value of each slice, in order."""
    return [(start, min(start + SLICE, value_len)) for start in range(0, value_len, SLICE)]


class SliceCheck(Enum):
    """A slice's check, by the format version that uses it (the member's value)."""

    SHA256 = 1
    """Version 1: SHA-256 of the slice (32 bytes). Written and read only by a client asked
    for it (a benchmark's comparison)."""
    CRC32 = 2
    """Version 2, the format: CRC-32 of the slice (u32, 4 bytes)."""

    def of(self, piece: bytes | memoryview) -> bytes:
        """The check of one slice (zlib and hashlib release the GIL on a slice: slices are
        checked side by side)."""
        if self is SliceCheck.CRC32:
            return _CRC.pack(zlib.crc32(piece))
        return hashlib.sha256(piece).digest()


def slice_digest(piece: bytes | memoryview) -> bytes:
    """The format's check of one slice of a value (:attr:`SliceCheck.CRC32`)."""
    return SliceCheck.CRC32.of(piece)


def top_digest(key: bytes | memoryview, value_len: int, digests: Sequence[bytes]) -> bytes:
    """The header's digest (SHA-256) of ``key`` and a value of ``value_len`` whose slices'
    checks are ``digests``."""
    sha = hashlib.sha256(_LENGTHS.pack(len(key), value_len))
    sha.update(key)
    for digest in digests:
        sha.update(digest)
    return sha.digest()


def encode_header(
    block: memoryview, key: bytes, value_len: int, digest: bytes, version: int = VERSION
) -> None:
    """Write the header block (ALIGN bytes, zeros after the key) of format ``version`` into
    ``block``."""
    _FIXED.pack_into(block, 0, MAGIC, version, len(key), value_len)
    block[_FIXED.size : HEADER] = digest
    end = HEADER + len(key)
    block[HEADER:end] = key
    block[end:ALIGN] = bytes(ALIGN - end)


class Header:
    """What a verified-looking header block says: the value's length and the digest to match."""

    __slots__ = ("digest", "value_len")

    def __init__(self, value_len: int, digest: bytes) -> None:
        self.value_len = value_len
        self.digest = digest


def _framing(block: memoryview, file_size: int, version: int) -> tuple[int, int] | Damage:
    """The key and value lengths a header block gives, or why it is no header of ours."""
    if file_size < ALIGN or file_size % ALIGN or len(block) < ALIGN:
        return Damage.TRUNCATED
    magic, found, key_len, value_len = _FIXED.unpack_from(block, 0)
    if magic != MAGIC:
        return Damage.MAGIC
    if found != version:
        return Damage.VERSION
    return key_len, value_len


def parse_header(
    block: memoryview, key: bytes, file_size: int, version: int = VERSION
) -> Header | Damage:
    """The header of a file of ``file_size`` bytes whose first block is ``block``, checked
    against ``key``, the size and the format ``version`` expected; or what is wrong with it.
    Pure."""
    framing = _framing(block, file_size, version)
    if isinstance(framing, Damage):
        return framing
    key_len, value_len = framing
    if key_len != len(key) or block[HEADER : HEADER + key_len] != key:
        return Damage.FOREIGN
    expected = padded_size(key_len, value_len)
    if expected != file_size:
        # Cut short at a block boundary, or lengths that were altered.
        return Damage.TRUNCATED if expected > file_size else Damage.LENGTHS
    return Header(value_len, bytes(block[_FIXED.size : HEADER]))


def encode_into(buffer: memoryview, key: bytes, value: bytes | memoryview) -> int:
    """Write the whole file image of ``key`` and ``value`` at the start of ``buffer`` (at least
    :func:`padded_size` bytes, any content), on this thread; return its size."""
    size = padded_size(len(key), len(value))
    end = ALIGN + len(value)
    buffer[ALIGN:end] = value
    buffer[end:size] = bytes(size - end)
    view = memoryview(value)
    digests = [slice_digest(view[a:b]) for a, b in slices(len(value))]
    encode_header(buffer[:ALIGN], key, len(value), top_digest(key, len(value), digests))
    return size


def decode(image: memoryview, key: bytes) -> bytes | Damage:
    """The value in ``image`` (a whole file's bytes) if it is a complete, verified chunk of
    ``key``; else what is wrong with it. Pure; on this thread."""
    header = parse_header(image[:ALIGN], key, len(image))
    if isinstance(header, Damage):
        return header
    value = image[ALIGN : ALIGN + header.value_len]
    digests = [slice_digest(value[a:b]) for a, b in slices(header.value_len)]
    if top_digest(key, header.value_len, digests) != header.digest:
        return Damage.DIGEST
    return bytes(value)
