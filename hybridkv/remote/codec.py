"""Chunk keys and chunk values: the bytes one SET writes and one GET reads back, verified.

A chunk value is a header, a 32-byte seal, then the payloads::

    magic (4) | version (u16) | member count (u32)
    | per member: key length (u32), key
    | per member: payload length (u64)
    | seal (32)
    | payloads, concatenated (version 4: ciphertext, then a 16-byte tag)

The version says what the seal is (:class:`ValueFormat`):

- 2, DIGEST: SHA-256 over each payload, length-prefixed. Catches corruption, not forgery: anyone
  who can write to the server can compute it. Written and read by engines without a fleet key.
- 3, MAC: HMAC-SHA256 under the fleet key over the chunk key (length-prefixed), the header and
  the payloads (:meth:`~hybridkv.remote.security.FleetKey.mac`). Only a holder of the fleet
  secret can make one, and it binds the value to its chunk key: a value copied under another
  key (another model's namespace, another prefix) fails.
- 4, SEALED: 32 random bytes (the value's own AES key is derived from them), then the payloads
  encrypted with AES-256-GCM; the tag, after the ciphertext, covers the chunk key, the header
  and the seal as associated data, and the ciphertext (hybridkv.remote.security's docstring).

One Redis value holds the whole chunk, so a reader sees all of it or nothing (TT-1). The
reader trusts nothing it did not ask for: :func:`decode_chunk` checks the magic, the version,
that the member keys are exactly the expected ones in order, that the lengths account for every
byte, and the seal; any mismatch is a :class:`~hybridkv.remote.values.Corruption` and nothing
is loaded (TT-2). A reader without a fleet key accepts only version 2; a reader with one
accepts only 3 and 4 (either: both were sealed under the same secret; its own ``encrypt``
setting decides what it writes), and refuses the other kind as KEYING, a seal that does not
verify under its key as MAC. Integers are big-endian.

Why SHA-256 for the digest: the digest is the largest per-byte cost of encoding and verifying
(every payload byte goes through it on write and on read), and where the CPU has SHA extensions
(x86 since Zen and Ice Lake, ARMv8 crypto) OpenSSL's SHA-256 runs about twice as fast as
BLAKE2b (tools/bench_remote.py prints both: 1.76 vs 0.94 GB/s on the development machine),
with the same 256-bit strength; hashlib releases the GIL while it hashes, so the writer
thread's SETs can go on meanwhile on another core. The same holds for HMAC-SHA256 (two SHA-256
passes over 64 bytes plus one over the value). Version 1 was a BLAKE2b digest: a reader of any
later version refuses it as VERSION, a miss.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from hybridkv.errors import HybridKVConfigError
from hybridkv.remote.security import SALT_BYTES, TAG_BYTES, FleetKey
from hybridkv.remote.values import Chunk, Corruption

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "Decoded",
    "ValueFormat",
    "chunk_key",
    "decode_chunk",
    "encode_chunk",
    "make_chunk",
    "redis_key",
]

MAGIC = b"HKVC"


class ValueFormat(IntEnum):
    """A value's version field: what its seal is (module docstring)."""

    DIGEST = 2
    MAC = 3
    SEALED = 4


FORMAT_VERSION = ValueFormat.DIGEST
"""The version of a value written without a fleet key (as before issue 30)."""
_KEYED = (ValueFormat.MAC, ValueFormat.SEALED)
_VERSIONS = frozenset(ValueFormat)
_HEAD = struct.Struct(">4sHI")
_KEY_LEN = struct.Struct(">I")
_PAYLOAD_LEN = struct.Struct(">Q")
_SEAL_BYTES = SALT_BYTES  # a digest, a MAC (32 each) or a sealed value's salt
_REDIS_PREFIX = b"hybridkv:chunk:"


def chunk_key(namespace: bytes, members: Sequence[bytes]) -> bytes:
    """SHA-256 over ``namespace``, 0x00, then each member key length-prefixed (u32).

    Same members and namespace give the same key on every engine; a different salt changes
    the member keys and so the chunk key (TT-6 follows from content addressing).
    Pre: ``namespace`` bytes; members non-empty distinct bytes (field ``members``).
    """
    _check_members(members)
    if not isinstance(namespace, bytes):
        raise HybridKVConfigError("namespace", namespace, "must be bytes", "encode it")
    digest = hashlib.sha256(namespace)
    digest.update(b"\x00")
    for member in members:
        digest.update(_KEY_LEN.pack(len(member)))
        digest.update(member)
    return digest.digest()


def make_chunk(namespace: bytes, members: Sequence[bytes]) -> Chunk:
    """The :class:`Chunk` of ``members`` (group order) under ``namespace``."""
    return Chunk(chunk_key(namespace, members), tuple(members))


def redis_key(key: bytes) -> bytes:
    """The server-side name of chunk ``key`` (readable in ``redis-cli``)."""
    return _REDIS_PREFIX + key.hex().encode()


def encode_chunk(
    members: Sequence[bytes],
    payloads: Sequence[bytes | memoryview],
    key: FleetKey | None = None,
    chunk_key: bytes = b"",
) -> bytes:
    """The chunk value of ``members`` with their ``payloads`` (a fresh copy of every byte):
    version 2 without ``key``; with it, version 3 (MAC) or, where ``key.encrypt``, 4 (sealed),
    bound to ``chunk_key``.

    Pre: one payload per member (field ``payloads``); members as in :func:`chunk_key`; with a
    key, the 32-byte chunk key the value is written under (field ``chunk_key``).
    """
    _check_members(members)
    if len(payloads) != len(members):
        raise HybridKVConfigError(
            "payloads", len(payloads), f"must be one per member ({len(members)})", "pass each"
        )
    _check_chunk_key(key, chunk_key)
    version = ValueFormat.DIGEST if key is None else _KEYED[key.encrypt]
    parts: list[bytes | memoryview] = [_HEAD.pack(MAGIC, version, len(members))]
    for member in members:
        parts += (_KEY_LEN.pack(len(member)), member)
    parts += (_PAYLOAD_LEN.pack(len(p)) for p in payloads)
    if key is None:
        return b"".join([*parts, _digest(payloads), *payloads])
    head = b"".join(parts)
    if not key.encrypt:
        return b"".join([head, key.mac(chunk_key, [head, *payloads]), *payloads])
    salt = os.urandom(SALT_BYTES)
    return b"".join([head, salt, key.seal(salt, _aad(chunk_key, head, salt), b"".join(payloads))])


@dataclass(frozen=True, slots=True)
class Decoded:
    """A verified value's payloads (one per expected member), or what was wrong with it."""

    payloads: tuple[bytes, ...] = ()
    corruption: Corruption | None = None


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where a value's parts are: the seal at ``seal_at``, payloads from ``start``."""

    version: ValueFormat
    lengths: tuple[int, ...]
    seal_at: int
    start: int


def decode_chunk(
    value: bytes, members: Sequence[bytes], key: FleetKey | None = None, chunk_key: bytes = b""
) -> Decoded:
    """Verify ``value`` as the chunk of exactly ``members`` (in order), sealed as a reader with
    ``key`` (or none) expects for ``chunk_key``, and split (decrypt) its payloads.

    Frame: nothing changes; a malformed, unkeyed or forged value is a returned
    :class:`Decoded` with ``corruption`` set and no payloads, never an exception.
    """
    _check_chunk_key(key, chunk_key)
    view = memoryview(value)
    layout = _layout(view, members, key is not None)
    if isinstance(layout, Corruption):
        return Decoded(corruption=layout)
    plain = _opened(view, layout, key, chunk_key)
    if isinstance(plain, Corruption):
        return Decoded(corruption=plain)
    if isinstance(plain, bytes) and len(layout.lengths) == 1:
        return Decoded((plain,))  # a decrypted single payload: no second copy
    return Decoded(tuple(bytes(v) for v in _split(memoryview(plain), layout.lengths)))


def _opened(
    view: memoryview, layout: _Layout, key: FleetKey | None, chunk_key: bytes
) -> memoryview | bytes | Corruption:
    """The payload bytes of a value whose seal verifies (decrypted where sealed), or why not.
    Verified before anything is copied out: a refused value costs no copies."""
    seal = view[layout.seal_at : layout.start]
    body = view[layout.start :]
    if key is None:  # _layout admitted only DIGEST
        ok = _digest(_split(body, layout.lengths)) == seal
        return body if ok else Corruption.DIGEST
    head = view[: layout.seal_at]
    if layout.version is ValueFormat.MAC:
        ok = hmac.compare_digest(key.mac(chunk_key, [head, body]), seal)
        return body if ok else Corruption.MAC
    plain = key.unseal(seal, _aad(chunk_key, head, seal), body)
    return Corruption.MAC if plain is None else plain


# One early return per check, in the order the bytes come: the reader sees each verdict.
def _layout(view: memoryview, members: Sequence[bytes], keyed: bool) -> _Layout | Corruption:  # noqa: PLR0911 - one return per check
    if len(view) < _HEAD.size:
        return Corruption.TRUNCATED
    magic, version, count = _HEAD.unpack_from(view)
    if magic != MAGIC:
        return Corruption.MAGIC
    if version not in _VERSIONS:
        return Corruption.VERSION
    version = ValueFormat(version)
    if (version in _KEYED) != keyed:
        return Corruption.KEYING
    if count != len(members):
        return Corruption.MEMBERS
    at = _HEAD.size
    for member in members:
        end = at + _KEY_LEN.size
        if end > len(view):
            return Corruption.TRUNCATED
        (size,) = _KEY_LEN.unpack_from(view, at)
        if end + size > len(view):
            return Corruption.TRUNCATED
        if view[end : end + size] != member:
            return Corruption.MEMBERS
        at = end + size
    lengths_end = at + count * _PAYLOAD_LEN.size
    if lengths_end + _SEAL_BYTES > len(view):
        return Corruption.TRUNCATED
    lengths = tuple(
        _PAYLOAD_LEN.unpack_from(view, at + i * _PAYLOAD_LEN.size)[0] for i in range(count)
    )
    start = lengths_end + _SEAL_BYTES
    tag = TAG_BYTES if version is ValueFormat.SEALED else 0
    if start + sum(lengths) + tag != len(view):
        return Corruption.LENGTHS
    return _Layout(version, lengths, lengths_end, start)


def _split(body: memoryview, lengths: Sequence[int]) -> list[memoryview]:
    views, at = [], 0
    for size in lengths:
        views.append(body[at : at + size])
        at += size
    return views


def _aad(chunk_key: bytes, head: bytes | memoryview, salt: bytes | memoryview) -> bytes:
    """A sealed value's associated data: the chunk key (length-prefixed), header and salt."""
    return b"".join((len(chunk_key).to_bytes(4, "big"), chunk_key, head, salt))


def _digest(payloads: Sequence[bytes | memoryview]) -> bytes:
    digest = hashlib.sha256()
    for payload in payloads:
        digest.update(_PAYLOAD_LEN.pack(len(payload)))
        digest.update(payload)
    return digest.digest()


def _check_chunk_key(key: FleetKey | None, chunk_key: bytes) -> None:
    if key is not None and (not isinstance(chunk_key, bytes) or len(chunk_key) != 32):
        raise HybridKVConfigError(
            "chunk_key", chunk_key, "a keyed value needs its 32-byte chunk key", "pass chunk.key"
        )


def _check_members(members: object) -> None:
    if isinstance(members, (bytes, str)) or not isinstance(members, Sequence) or not members:
        raise HybridKVConfigError("members", members, "a chunk has >= 1 member", "pass keys")
    for member in members:
        if not isinstance(member, bytes) or not member:
            raise HybridKVConfigError("members", member, "must be non-empty bytes", "pass bytes")
    if len(set(members)) != len(members):
        raise HybridKVConfigError("members", members, "repeats a key", "pass each key once")
