"""Incremental block hashes of one request, byte-identical to vLLM 0.33's ``sha256`` hasher.

A :class:`RequestHashList` grows as tokens arrive (prefill chunks, decoded tokens) and hashes
each full ``hash_block_size`` block exactly once: a connector that re-derives a request's hashes
from scratch at every step does quadratic work (the repeated-recompute bug of seed PR #38261).

It must agree with ``spec.hashing.request_block_hashes`` (fine hashes), ``coarse_block_hashes``,
``offload_key`` and ``chunk_keys`` byte for byte; ``tests/differential/test_hashing_agreement.py``
checks that.

Why one ``pickle.dumps`` per block and no hand-built pickle bytes: composing the frame header,
the parent and a separately pickled token tuple was measured slower (about 2.3 us against 1.7 us
per 16-token block) than letting the C pickler serialize the whole ``(parent, tokens, extra)``
tuple, and it stops being byte-identical once a block's pickle outgrows one 64 KiB frame.
The speed comes from hashing each block once, slicing one tuple per append, and local bindings.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterator, Sequence
from typing import NamedTuple, overload

from hybridkv.errors import HybridKVConfigError, int_at_least

__all__ = [
    "DEFAULT_NONE_HASH_SEED",
    "BlockHashView",
    "ChunkKeyView",
    "GroupKey",
    "LoRAKey",
    "RequestHashList",
    "compute_none_hash",
    "make_offload_key",
]

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_SUPPORTED_ALGO = "sha256"
_NEEDS_PACKAGES = frozenset({"sha256_cbor", "xxhash", "xxhash_cbor"})
_PROTOCOL = pickle.HIGHEST_PROTOCOL  # vLLM's sha256 pickles at HIGHEST_PROTOCOL
_DIGEST_SIZE = 32
_GROUP_LIMIT = 1 << 32


class LoRAKey(NamedTuple):
    """A request's LoRA adapter as its block hashes see it: vLLM keys on name and path."""

    name: str
    path: str


def _positive(field: str, value: object) -> int:
    if not int_at_least(value, 1):
        raise HybridKVConfigError(field, value, "must be a positive int", "pass an int >= 1")
    return value


def _check_algo(hash_algo: object) -> None:
    if hash_algo == _SUPPORTED_ALGO:
        return
    why = (
        "needs cbor2 or xxhash, which hybridkv does not depend on"
        if hash_algo in _NEEDS_PACKAGES
        else "is not a vLLM 0.33 prefix_caching_hash_algo"
    )
    raise HybridKVConfigError("hash_algo", hash_algo, why, 'use "sha256", vLLM\'s default')


def _group_bytes(group_idx: object) -> bytes:
    if isinstance(group_idx, bool) or not isinstance(group_idx, int):
        raise HybridKVConfigError("group_idx", group_idx, "must be an int", "pass the group index")
    if not 0 <= group_idx < _GROUP_LIMIT:
        raise HybridKVConfigError(
            "group_idx", group_idx, "must lie in [0, 2**32)", "pass the KV cache group index"
        )
    return group_idx.to_bytes(4, "big")


def compute_none_hash(
    seed: str = DEFAULT_NONE_HASH_SEED, hash_algo: str = _SUPPORTED_ALGO
) -> bytes:
    """vLLM's NONE_HASH for ``seed``: pass ``os.environ.get("PYTHONHASHSEED")`` when it is set."""
    _check_algo(hash_algo)
    if not isinstance(seed, str):
        raise HybridKVConfigError("seed", seed, "must be a str", "pass the PYTHONHASHSEED string")
    return hashlib.sha256(pickle.dumps(seed, protocol=_PROTOCOL)).digest()


def make_offload_key(block_hash: bytes, group_idx: int) -> bytes:
    """``block_hash`` followed by ``group_idx`` as 4 big-endian bytes (vLLM's offload key)."""
    return block_hash + _group_bytes(group_idx)


DEFAULT_NONE_HASH = compute_none_hash()


class BlockHashView(Sequence[bytes]):
    """A read-only, lazy view of a growing hash list at ``scale`` fine blocks per entry.

    Entry ``i`` is fine hash ``(i + 1) * scale - 1``; the view follows later appends.
    """

    __slots__ = ("_hashes", "_scale")

    def __init__(self, hashes: list[bytes], scale: int) -> None:
        self._hashes = hashes
        self._scale = scale

    def __len__(self) -> int:
        return len(self._hashes) // self._scale

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[bytes, ...]: ...

    def __getitem__(self, index: int | slice) -> bytes | tuple[bytes, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        n = len(self)
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError(f"block index {index} out of range for {n} hashes")
        return self._hashes[(i + 1) * self._scale - 1]

    def __iter__(self) -> Iterator[bytes]:
        hashes, s = self._hashes, self._scale
        return iter(hashes[s - 1 : len(self) * s : s])


class GroupKey(NamedTuple):
    """One group's offload key at a chunk boundary: the entries of a :class:`ChunkKeyView`."""

    group_idx: int
    key: bytes


class ChunkKeyView(Sequence[tuple[GroupKey, ...]]):
    """Per complete chunk, the offload keys of the groups whose unit ends at the chunk's end.

    Chunk ``k`` covers tokens ``[k*c, (k+1)*c)``; group ``g`` carries a key iff
    ``(k+1)*c % units[g] == 0``, namely ``make_offload_key(fine[(k+1)*c//h - 1], g)``.
    Agrees with ``spec.hashing.chunk_keys``. The view follows later appends.
    """

    __slots__ = ("_c", "_h", "_hashes", "_suffixes", "_units")

    def __init__(
        self, hashes: list[bytes], hash_block_size: int, chunk_size: int, units: Sequence[int]
    ) -> None:
        c = _positive("chunk_size", chunk_size)
        if c % hash_block_size:
            raise HybridKVConfigError(
                "chunk_size",
                c,
                f"not a multiple of hash_block_size {hash_block_size}",
                "pick a multiple of hash_block_size",
            )
        if isinstance(units, (str, bytes)) or not isinstance(units, Sequence) or not units:
            raise HybridKVConfigError(
                "units", units, "must be a non-empty sequence", "one per group"
            )
        for u in units:
            if not int_at_least(u, 1) or u % hash_block_size:
                raise HybridKVConfigError(
                    "units",
                    u,
                    f"not a positive multiple of hash_block_size {hash_block_size}",
                    "pass each group's offload unit in tokens",
                )
        self._hashes = hashes
        self._h = hash_block_size
        self._c = c
        self._units = tuple(units)
        self._suffixes = tuple(g.to_bytes(4, "big") for g in range(len(units)))

    def __len__(self) -> int:
        return len(self._hashes) * self._h // self._c

    @overload
    def __getitem__(self, index: int) -> tuple[GroupKey, ...]: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[tuple[GroupKey, ...], ...]: ...

    def __getitem__(
        self, index: int | slice
    ) -> tuple[GroupKey, ...] | tuple[tuple[GroupKey, ...], ...]:
        if isinstance(index, slice):
            return tuple(self[k] for k in range(*index.indices(len(self))))
        n = len(self)
        k = index + n if index < 0 else index
        if not 0 <= k < n:
            raise IndexError(f"chunk index {index} out of range for {n} complete chunks")
        end = (k + 1) * self._c
        block_hash = self._hashes[end // self._h - 1]
        return tuple(
            GroupKey(g, block_hash + suffix)
            for g, (unit, suffix) in enumerate(zip(self._units, self._suffixes, strict=True))
            if end % unit == 0
        )


class RequestHashList:
    """The chained block hashes of one request, grown incrementally, each computed once.

    Invariant: ``hashes_computed == len(self)`` (no hash is ever recomputed), and
    ``len(self) == num_tokens // hash_block_size``.
    """

    __slots__ = (
        "_first_extra",
        "_h",
        "_hashes",
        "_hashes_computed",
        "_none_hash",
        "_num_tokens",
        "_rest_extra",
        "_tail",
    )

    def __init__(
        self,
        hash_block_size: int,
        *,
        cache_salt: str | None = None,
        lora: LoRAKey | None = None,
        none_hash: bytes = DEFAULT_NONE_HASH,
        hash_algo: str = _SUPPORTED_ALGO,
    ) -> None:
        """Pre: hash_block_size >= 1; cache_salt None or a non-empty str; none_hash 32 bytes.

        Raises HybridKVConfigError (fields hash_algo, hash_block_size, cache_salt, lora,
        none_hash) on bad input.
        """
        _check_algo(hash_algo)
        self._h = _positive("hash_block_size", hash_block_size)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise HybridKVConfigError(
                "cache_salt", cache_salt, "must be None or a non-empty str", "pass None for no salt"
            )
        if lora is not None and not (
            isinstance(lora, tuple) and len(lora) == 2 and all(isinstance(p, str) for p in lora)
        ):
            raise HybridKVConfigError("lora", lora, "must be LoRAKey(name, path)", "pass LoRAKey")
        if not isinstance(none_hash, bytes) or len(none_hash) != _DIGEST_SIZE:
            raise HybridKVConfigError(
                "none_hash", none_hash, "must be 32 bytes", "use compute_none_hash(seed)"
            )
        # vLLM's extra keys: LoRA on every block, the salt on the first block only; None if empty.
        lora_keys = (("lora", lora[0], lora[1]),) if lora is not None else ()
        salt_keys = (("cache_salt", cache_salt),) if cache_salt else ()
        self._first_extra = (lora_keys + salt_keys) or None
        self._rest_extra = lora_keys or None
        self._none_hash = none_hash
        self._hashes: list[bytes] = []
        self._tail: list[int] = []
        self._num_tokens = 0
        self._hashes_computed = 0

    @property
    def hash_block_size(self) -> int:
        return self._h

    @property
    def num_tokens(self) -> int:
        """Tokens appended so far, including the partial tail block."""
        return self._num_tokens

    @property
    def hashes_computed(self) -> int:
        """How many block hashes this list has computed in its life (test hook)."""
        return self._hashes_computed

    def append_tokens(self, tokens: Sequence[int]) -> int:
        """Append token ids; hash every block they complete. Returns the number of new hashes.

        Pre: every token is a non-negative int (bool, numpy ints are refused: they pickle
        differently). Post: ``len(self) == num_tokens // hash_block_size``; older hashes are
        untouched. Frame: a refused call (HybridKVConfigError, field "tokens") changes nothing.
        """
        for t in tokens:
            if type(t) is not int or t < 0:
                raise HybridKVConfigError(
                    "tokens", t, "a token id must be a non-negative int", "pass plain Python ints"
                )
        self._num_tokens += len(tokens)
        buf = self._tail + list(tokens) if self._tail else list(tokens)
        h = self._h
        full = len(buf) - len(buf) % h
        if not full:
            self._tail = buf
            return 0
        block_tokens = tuple(buf[:full])
        self._tail = buf[full:]
        hashes = self._hashes
        append, dumps, sha256, proto = hashes.append, pickle.dumps, hashlib.sha256, _PROTOCOL
        start = 0
        if hashes:
            parent = hashes[-1]
        else:
            first = (self._none_hash, block_tokens[:h], self._first_extra)
            parent = sha256(dumps(first, proto)).digest()
            append(parent)
            start = h
        extra = self._rest_extra
        for i in range(start, full, h):
            parent = sha256(dumps((parent, block_tokens[i : i + h], extra), proto)).digest()
            append(parent)
        new = full // h
        self._hashes_computed += new
        return new

    def __len__(self) -> int:
        return len(self._hashes)

    def __getitem__(self, index: int) -> bytes:
        return self._hashes[index]

    @property
    def hashes(self) -> BlockHashView:
        """A read-only view of the fine hashes (follows later appends)."""
        return BlockHashView(self._hashes, 1)

    def coarse(self, scale: int) -> BlockHashView:
        """A lazy view at ``scale`` fine blocks per entry (vLLM's BlockHashListWithBlockSize)."""
        return BlockHashView(self._hashes, _positive("scale", scale))

    def offload_key(self, index: int, group_idx: int) -> bytes:
        """The offload key of fine hash ``index`` for ``group_idx``. IndexError if absent."""
        return self._hashes[index] + _group_bytes(group_idx)

    def chunk_view(self, chunk_size: int, units: Sequence[int]) -> ChunkKeyView:
        """The multi-group chunk keys over complete chunks (validated once, lazy)."""
        return ChunkKeyView(self._hashes, self._h, chunk_size, units)

    def chunk_keys(
        self, chunk_idx: int, chunk_size: int, units: Sequence[int]
    ) -> tuple[GroupKey, ...]:
        """The keys complete chunk ``chunk_idx`` carries; IndexError if it is not complete."""
        return self.chunk_view(chunk_size, units)[chunk_idx]
