"""A chunk file's bytes: a header, the key, the value, zero padding to the I/O alignment.

Layout (little-endian)::

    magic    4 bytes   b"HKVD"
    version  u16       1
    key_len  u16       1..MAX_KEY
    val_len  u64
    digest   32 bytes  SHA-256 of (key_len u16, val_len u64, key, value)
    key      key_len bytes
    value    val_len bytes
    padding  zeros up to a multiple of ALIGN (4096)

The digest covers the key and the value with their lengths, so a file renamed onto another
key's name (foreign), cut short (truncated), or altered anywhere in its key or value fails
(DK-1). The padding lets an O_DIRECT read fetch whole blocks; byte accounting uses the padded
size (:func:`padded_size`), which is also the file's size on disk, so the start-up scan reads
sizes off ``stat`` without opening a file.
"""

from __future__ import annotations

import hashlib
import struct
from enum import Enum

__all__ = [
    "ALIGN",
    "HEADER",
    "MAGIC",
    "MAX_KEY",
    "VERSION",
    "Damage",
    "decode",
    "encode_into",
    "padded_size",
]

ALIGN = 4096
"""The I/O alignment: file sizes, buffer addresses and O_DIRECT transfers are multiples of it."""
MAGIC = b"HKVD"
VERSION = 1
MAX_KEY = 96
"""The longest key (bytes): its hex name and temporary name fit a 255-byte file name."""
_FIXED = struct.Struct("<4sHHQ")
_LENGTHS = struct.Struct("<HQ")
HEADER = _FIXED.size + 32
"""Bytes before the key."""


class Damage(Enum):
    """Why a file's bytes are not a chunk of the key asked for (each one a miss, DK-6)."""

    TRUNCATED = "truncated"
    MAGIC = "magic"
    VERSION = "version"
    FOREIGN = "foreign"
    LENGTHS = "lengths"
    DIGEST = "digest"


def padded_size(key_len: int, value_len: int) -> int:
    """The file's size: header, key and value rounded up to :data:`ALIGN`."""
    raw = HEADER + key_len + value_len
    return -(-raw // ALIGN) * ALIGN


def _digest(key: bytes | memoryview, value: bytes | memoryview) -> bytes:
    sha = hashlib.sha256(_LENGTHS.pack(len(key), len(value)))
    sha.update(key)
    sha.update(value)
    return sha.digest()


def encode_into(buffer: memoryview, key: bytes, value: bytes | memoryview) -> int:
    """Write the file image of ``key`` and ``value`` at the start of ``buffer`` (at least
    :func:`padded_size` bytes, any content) and return its size. The padding is zeroed."""
    size = padded_size(len(key), len(value))
    _FIXED.pack_into(buffer, 0, MAGIC, VERSION, len(key), len(value))
    buffer[_FIXED.size : HEADER] = _digest(key, value)
    start = HEADER + len(key)
    buffer[HEADER:start] = key
    end = start + len(value)
    buffer[start:end] = value
    buffer[end:size] = bytes(size - end)
    return size


def _framing(image: memoryview) -> tuple[int, int] | Damage:
    """The key and value lengths ``image``'s header gives, or why it is no header of ours."""
    if len(image) < HEADER or len(image) % ALIGN:
        return Damage.TRUNCATED
    magic, version, key_len, value_len = _FIXED.unpack_from(image, 0)
    if magic != MAGIC:
        return Damage.MAGIC
    if version != VERSION:
        return Damage.VERSION
    return key_len, value_len


def decode(image: memoryview, key: bytes) -> bytes | Damage:
    """The value in ``image`` (a whole file's bytes) if it is a complete, verified chunk of
    ``key``; else what is wrong with it. Pure."""
    framing = _framing(image)
    if isinstance(framing, Damage):
        return framing
    key_len, value_len = framing
    if padded_size(key_len, value_len) != len(image):
        # A file cut short at a block boundary, or lengths that were altered.
        return Damage.TRUNCATED if padded_size(key_len, value_len) > len(image) else Damage.LENGTHS
    start = HEADER + key_len
    if image[HEADER:start] != key:
        return Damage.FOREIGN
    value = image[start : start + value_len]
    if _digest(key, value) != image[_FIXED.size : HEADER]:
        return Damage.DIGEST
    return bytes(value)
