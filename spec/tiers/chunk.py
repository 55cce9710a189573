"""Chunks of the remote tier: the chunk key and what the chunk codec observably does.

A chunk is the host keys of one prefix step of one request (every group's unit ending at the
same token, attention blocks and the mamba state alike), in group order, with their payloads.
The remote tier writes and reads a chunk whole (one SET, one GET), so the model needs no bytes:
a payload is a *content tag* (a string naming what the slot holds) and the digest is taken over
the tags.

- :func:`chunk_key`: SHA-256 over the namespace, ``0x00``, then each member key prefixed by
  its 4-byte big-endian length. Equal members and namespace give equal keys on every engine;
  a different ``cache_salt`` changes the member keys and so the chunk key: tenant isolation
  comes from content addressing, never from a server-side check.
- :func:`encode` builds the :class:`ChunkValue` a SET writes (header + payloads).
- :func:`verify` is the reader's check: magic, format version, the member keys exactly the
  expected ones in order, each payload's length, the digest. Any mismatch is CORRUPT.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from spec.errors import ConfigError

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "ChunkValue",
    "Verdict",
    "chunk_key",
    "digest",
    "encode",
    "verify",
]

MAGIC = b"HKVC"
FORMAT_VERSION = 1


class Verdict(Enum):
    """What the reader makes of a fetched value: loadable (PROMOTED) or not (CORRUPT)."""

    PROMOTED = "promoted"
    CORRUPT = "corrupt"


@dataclass(frozen=True, slots=True)
class ChunkValue:
    """The value one SET writes: header (magic, version, member keys, payload lengths, digest)
    and the payloads (content tags); the member count is ``len(members)``."""

    magic: bytes
    version: int
    members: tuple[bytes, ...]
    lengths: tuple[int, ...]
    digest: bytes
    payloads: tuple[str, ...]


def chunk_key(namespace: bytes, members: Sequence[bytes]) -> bytes:
    """The content address of the chunk of ``members`` under ``namespace``.

    Pure. Pre: ``namespace`` bytes, ``members`` a non-empty sequence of distinct non-empty bytes
    (``ConfigError`` field ``namespace`` / ``members`` otherwise).
    """
    if not isinstance(namespace, bytes):
        raise ConfigError("namespace", namespace, "is not bytes", "pass the tier's namespace")
    checked = checked_members(members)
    h = hashlib.sha256(namespace + b"\x00")
    for key in checked:
        h.update(len(key).to_bytes(4, "big") + key)
    return h.digest()


def digest(payloads: Sequence[str]) -> bytes:
    """The digest over the payloads, each length-prefixed so the split is part of it. Pure."""
    h = hashlib.sha256()
    for payload in payloads:
        data = payload.encode()
        h.update(len(data).to_bytes(4, "big") + data)
    return h.digest()


def encode(members: Sequence[bytes], payloads: Sequence[str]) -> ChunkValue:
    """The value that holds ``payloads[i]`` for ``members[i]``.

    Pure. Pre: distinct non-empty bytes members, one str payload per member (``ConfigError``
    field ``members`` / ``payloads`` otherwise).
    """
    checked = checked_members(members)
    tags = tuple(payloads)
    if len(tags) != len(checked) or not all(isinstance(t, str) for t in tags):
        raise ConfigError("payloads", payloads, "is not one str per member", "pass one per key")
    lengths = tuple(len(tag.encode()) for tag in tags)
    return ChunkValue(MAGIC, FORMAT_VERSION, checked, lengths, digest(tags), tags)


def verify(value: ChunkValue, expected: Sequence[bytes]) -> Verdict:
    """PROMOTED when ``value`` is a well-formed chunk of exactly ``expected`` (in order) whose
    payloads match their lengths and the digest; CORRUPT otherwise. Pure."""
    ok = (
        value.magic == MAGIC
        and value.version == FORMAT_VERSION
        and value.members == tuple(expected)
        and len(value.payloads) == len(value.members) == len(value.lengths)
        and all(len(p.encode()) == n for p, n in zip(value.payloads, value.lengths, strict=True))
        and value.digest == digest(value.payloads)
    )
    return Verdict.PROMOTED if ok else Verdict.CORRUPT


def checked_members(members: object) -> tuple[bytes, ...]:
    """``members`` as a tuple, or ``ConfigError`` (field ``members``) naming the fix.

    Pure. Pre: none. Post: a non-empty tuple of distinct non-empty bytes keys.
    """
    if isinstance(members, (bytes, str)) or not isinstance(members, Sequence) or not members:
        raise ConfigError("members", members, "is not a non-empty sequence of keys", "pass keys")
    checked = tuple(members)
    if not all(isinstance(k, bytes) and k for k in checked) or len(set(checked)) != len(checked):
        raise ConfigError("members", members, "must be distinct non-empty bytes", "pass each once")
    return checked
