"""Block hashing as vLLM 0.33 does it, written plainly from its contract.

Facts mirrored (``vllm/utils/hashing.py``, ``vllm/v1/core/kv_cache_utils.py``,
``vllm/v1/kv_offload/base.py``):

- The default ``prefix_caching_hash_algo`` is ``"sha256"``: SHA-256 of
  ``pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)``. The other algorithms (``sha256_cbor``,
  ``xxhash``, ``xxhash_cbor``) need packages outside the standard library and are refused here.
- ``NONE_HASH = H(seed)``: the seed is the ``PYTHONHASHSEED`` string when set, else
  ``"vllm-none-hash"`` (for the cryptographic algorithms). It stands in for the parent of the
  first block.
- A block's hash is ``H((parent or NONE_HASH, tuple(tokens), extra_keys))``.
- A request's hashes cover FULL blocks of ``hash_block_size`` tokens only, each chained on the
  previous one. ``extra_keys`` is ``None`` when a block has no extra key, else a tuple of tagged
  keys in the order LoRA, multimodal, cache salt, prompt embeds. LoRA (``("lora", name, path)``)
  is on every block; the cache salt (``("cache_salt", salt)``) is on the first block only.
- The hash of coarse block ``i`` at ``scale`` fine blocks per coarse block is fine hash
  ``(i + 1) * scale - 1`` (``BlockHashListWithBlockSize``).
- An offload key is ``block_hash + group_idx.to_bytes(4, "big")`` (``make_offload_key``).

Left out: multimodal and prompt-embeds extra keys, and eagle lookahead hashing
(``num_hash_lookahead_tokens > 0``). A request that uses them cannot be hashed by this model.

The chunk view is ours: chunk ``k`` covers tokens ``[k*c, (k+1)*c)``; each group ``g`` whose unit
``u_g`` divides the chunk end carries the offload key of fine hash ``(k+1)*c/h - 1``.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import NamedTuple

from spec.errors import ConfigError

__all__ = [
    "DEFAULT_NONE_HASH_SEED",
    "NONE_HASH",
    "SUPPORTED_HASH_ALGO",
    "GroupKey",
    "LoRAKey",
    "block_extra_keys",
    "check_hash_algo",
    "chunk_keys",
    "coarse_block_hashes",
    "complete_chunk_keys",
    "hash_block_tokens",
    "next_block_hashes",
    "none_hash",
    "offload_key",
    "request_block_hashes",
    "resolve_none_hash_seed",
    "sha256_pickle",
]

SUPPORTED_HASH_ALGO = "sha256"
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_KNOWN_OTHER_ALGOS = ("sha256_cbor", "xxhash", "xxhash_cbor")
_GROUP_IDX_LIMIT = 2**32


class LoRAKey(NamedTuple):
    """The LoRA adapter a request uses, as its block hashes see it (name and path)."""

    name: str
    path: str


class GroupKey(NamedTuple):
    """One group's offload key at a chunk boundary."""

    group_idx: int
    key: bytes


# ----------------------------------------------------------------------------- validation


def _is_int(value: object) -> bool:
    # bool is an int to Python but never a size or an id here.
    return isinstance(value, int) and not isinstance(value, bool)


def _require_positive(field: str, value: object) -> int:
    if not _is_int(value) or value <= 0:  # type: ignore[operator]
        raise ConfigError(field, value, "must be a positive int", f"pass an int >= 1 as {field}")
    return value  # type: ignore[return-value]


def check_hash_algo(hash_algo: object) -> None:
    """Accept ``"sha256"`` only; refuse the others with the reason and the fix.

    Pure. Refusal: :class:`ConfigError` (field ``hash_algo``): a known algorithm that needs a
    package outside the standard library, or a name vLLM 0.33 does not know.
    """
    if hash_algo == SUPPORTED_HASH_ALGO:
        return
    if hash_algo in _KNOWN_OTHER_ALGOS:
        problem = "needs a package outside the standard library (cbor2 or xxhash)"
    else:
        problem = "is not a vLLM 0.33 prefix_caching_hash_algo"
    raise ConfigError(
        "hash_algo",
        hash_algo,
        problem,
        'use "sha256" (vLLM\'s default prefix_caching_hash_algo)',
    )


def _check_tokens(tokens: Sequence[int]) -> None:
    # Pickle encodes bool, int subclasses and numpy ints differently from int: refuse them.
    for token in tokens:
        if type(token) is not int or token < 0:
            raise ConfigError(
                "tokens",
                token,
                "a token id must be a non-negative int",
                "pass plain Python ints (convert numpy or tensor values with int())",
            )


def _check_cache_salt(cache_salt: object) -> None:
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ConfigError(
            "cache_salt",
            cache_salt,
            "must be None or a non-empty str",
            "pass None for no salt (vLLM ignores an empty salt)",
        )


def _check_lora(lora: object) -> None:
    if lora is None:
        return
    if not isinstance(lora, tuple) or len(lora) != 2 or not all(isinstance(p, str) for p in lora):
        raise ConfigError(
            "lora",
            lora,
            "must be None or a LoRAKey(name, path) of two str",
            "pass LoRAKey(name, path)",
        )


def _check_none_hash(value: object) -> None:
    if not isinstance(value, bytes) or len(value) != hashlib.sha256().digest_size:
        raise ConfigError(
            "none_hash", value, "must be the 32-byte digest of a seed", "use none_hash(seed)"
        )


def _check_group_idx(group_idx: object) -> int:
    if not _is_int(group_idx) or not 0 <= group_idx < _GROUP_IDX_LIMIT:  # type: ignore[operator]
        raise ConfigError(
            "group_idx", group_idx, "must be an int in [0, 2**32)", "pass the KV cache group index"
        )
    return group_idx  # type: ignore[return-value]


# ----------------------------------------------------------------------------- the hash


def sha256_pickle(obj: object) -> bytes:
    """vLLM's ``sha256``: SHA-256 of the object pickled at the highest protocol.

    Pure. Pre: ``obj`` pickles (``pickle`` raises otherwise). Post: a 32-byte digest.
    """
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def resolve_none_hash_seed(pythonhashseed: str | None) -> str:
    """The seed of NONE_HASH: the ``PYTHONHASHSEED`` value when it is set, else the default.

    The caller reads the environment; the model never does. Pure.
    """
    return DEFAULT_NONE_HASH_SEED if pythonhashseed is None else pythonhashseed


def none_hash(seed: str = DEFAULT_NONE_HASH_SEED, hash_algo: str = SUPPORTED_HASH_ALGO) -> bytes:
    """The stand-in parent of a request's first block: ``H(seed)``.

    Pure. Pre: ``hash_algo`` is ``"sha256"`` (:class:`ConfigError`, field ``hash_algo``), then
    ``seed`` a str (field ``seed``).
    """
    check_hash_algo(hash_algo)
    if not isinstance(seed, str):
        raise ConfigError("seed", seed, "must be a str", "pass the PYTHONHASHSEED string")
    return sha256_pickle(seed)


NONE_HASH = none_hash(DEFAULT_NONE_HASH_SEED)


def block_extra_keys(
    start_token_idx: int, cache_salt: str | None, lora: LoRAKey | None = None
) -> tuple[tuple[str, ...], ...] | None:
    """The extra keys of the block that starts at ``start_token_idx``; None when there are none.

    Order: LoRA (every block), then the cache salt (first block only, and only when non-empty).
    Pure; nothing is validated (:func:`request_block_hashes` checks the salt and the LoRA key).
    """
    keys: list[tuple[str, ...]] = []
    if lora:
        keys.append(("lora", lora[0], lora[1]))
    if start_token_idx == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def hash_block_tokens(
    parent: bytes | None,
    tokens: Sequence[int],
    extra_keys: tuple[object, ...] | None,
    *,
    none_hash: bytes = NONE_HASH,
) -> bytes:
    """``H((parent or none_hash, tuple(tokens), extra_keys))``: one block's chained hash.

    Pure; nothing is validated (:func:`request_block_hashes` checks its inputs): a falsy
    ``parent`` (``None`` or ``b""``) chains on ``none_hash``.
    """
    return sha256_pickle((parent or none_hash, tuple(tokens), extra_keys))


def request_block_hashes(
    tokens: Sequence[int],
    hash_block_size: int,
    *,
    cache_salt: str | None = None,
    lora: LoRAKey | None = None,
    none_hash: bytes = NONE_HASH,
    hash_algo: str = SUPPORTED_HASH_ALGO,
) -> list[bytes]:
    """The hashes of every full ``hash_block_size`` block of ``tokens``, computed from scratch.

    Pre: tokens are non-negative ints; hash_block_size >= 1; cache_salt is None or non-empty.
    Post: ``len(result) == len(tokens) // hash_block_size``; entry ``i`` chains on entry ``i-1``.
    Frame: a refused call (ConfigError) computes nothing.
    """
    return next_block_hashes(
        None,
        0,
        tokens,
        hash_block_size,
        cache_salt=cache_salt,
        lora=lora,
        none_hash=none_hash,
        hash_algo=hash_algo,
    )


def next_block_hashes(
    parent: bytes | None,
    start: int,
    tokens: Sequence[int],
    hash_block_size: int,
    *,
    cache_salt: str | None = None,
    lora: LoRAKey | None = None,
    none_hash: bytes = NONE_HASH,
    hash_algo: str = SUPPORTED_HASH_ALGO,
) -> list[bytes]:
    """The hashes of the full blocks of ``tokens``, which begin at token ``start`` of a request.

    The chain goes on from ``parent``, the hash of the block that ends at ``start`` (``None``
    when ``start`` is 0), so a request hashed piece by piece gets exactly the hashes of
    :func:`request_block_hashes` over all its tokens, each block hashed once.

    Pre: ``start`` a multiple of ``hash_block_size``; tokens are non-negative ints.
    Post: ``len(result) == len(tokens) // hash_block_size``. Frame: a refused call
    (ConfigError) computes nothing.
    """
    check_hash_algo(hash_algo)
    h = _require_positive("hash_block_size", hash_block_size)
    if not _is_int(start) or start < 0 or start % h or (start == 0) != (parent is None):
        raise ConfigError(
            "start",
            start,
            f"must be a multiple of {h} >= 0, with a parent exactly when it is past 0",
            "continue the chain at the end of its last full block, from that block's hash",
        )
    _check_cache_salt(cache_salt)
    _check_lora(lora)
    _check_none_hash(none_hash)
    _check_tokens(tokens)
    hashes: list[bytes] = []
    for offset in range(0, len(tokens) - h + 1, h):
        extra = block_extra_keys(start + offset, cache_salt, lora)
        block = tokens[offset : offset + h]
        parent = hash_block_tokens(parent, block, extra, none_hash=none_hash)
        hashes.append(parent)
    return hashes


# ----------------------------------------------------------------------------- views and keys


def coarse_block_hashes(block_hashes: Sequence[bytes], scale: int) -> list[bytes]:
    """The hashes at ``scale`` fine blocks per coarse block: the last fine hash of each.

    Only coarse blocks whose every fine block is hashed appear. Pure. Pre: ``scale`` a positive
    int (:class:`ConfigError`, field ``scale``). Post: ``len(block_hashes) // scale`` hashes.
    """
    s = _require_positive("scale", scale)
    return [block_hashes[(i + 1) * s - 1] for i in range(len(block_hashes) // s)]


def offload_key(block_hash: bytes, group_idx: int) -> bytes:
    """vLLM's ``make_offload_key``: the hash, then the group index as 4 big-endian bytes.

    Pure. Pre: ``group_idx`` an int in ``[0, 2**32)`` (:class:`ConfigError`, field
    ``group_idx``); ``block_hash`` bytes (not checked).
    """
    g = _check_group_idx(group_idx)
    return bytes(block_hash) + g.to_bytes(4, "big")


def _check_chunk_geometry(hash_block_size: int, chunk_size: int, units: Sequence[int]) -> None:
    h = _require_positive("hash_block_size", hash_block_size)
    c = _require_positive("chunk_size", chunk_size)
    if c % h:
        raise ConfigError(
            "chunk_size", c, f"is not a multiple of hash_block_size {h}", "pick a multiple of it"
        )
    if isinstance(units, (str, bytes)) or not isinstance(units, Sequence) or not units:
        raise ConfigError("units", units, "must be a non-empty sequence", "pass one unit per group")
    if len(units) > _GROUP_IDX_LIMIT:
        raise ConfigError("units", len(units), "more groups than 2**32", "pass fewer groups")
    for u in units:
        if not _is_int(u) or u <= 0 or u % h:
            raise ConfigError(
                "units",
                u,
                f"a unit must be a positive multiple of hash_block_size {h}",
                "pass each group's offload unit in tokens",
            )


def chunk_keys(
    block_hashes: Sequence[bytes],
    hash_block_size: int,
    chunk_size: int,
    units: Sequence[int],
    chunk_idx: int,
) -> tuple[GroupKey, ...]:
    """The keys chunk ``chunk_idx`` carries, in ascending group order.

    Group ``g`` carries a key iff ``(chunk_idx + 1) * chunk_size % units[g] == 0``; that key is
    ``offload_key(block_hashes[(chunk_idx + 1) * chunk_size // hash_block_size - 1], g)``.
    Pre: the chunk is complete (its last fine hash exists), else IndexError.
    """
    _check_chunk_geometry(hash_block_size, chunk_size, units)
    if not _is_int(chunk_idx) or chunk_idx < 0:
        raise IndexError(f"chunk index {chunk_idx!r} is not a non-negative int")
    end = (chunk_idx + 1) * chunk_size
    fine = end // hash_block_size - 1
    if fine >= len(block_hashes):
        raise IndexError(f"chunk {chunk_idx} is not complete: {len(block_hashes)} fine hashes")
    return tuple(
        GroupKey(g, offload_key(block_hashes[fine], g))
        for g, unit in enumerate(units)
        if end % unit == 0
    )


def complete_chunk_keys(
    block_hashes: Sequence[bytes], hash_block_size: int, chunk_size: int, units: Sequence[int]
) -> list[tuple[GroupKey, ...]]:
    """``chunk_keys`` of every complete chunk, in order.

    Pure. Pre: ``hash_block_size`` and ``chunk_size`` positive ints, ``chunk_size`` a multiple
    of ``hash_block_size``, ``units`` a non-empty sequence of positive multiples of
    ``hash_block_size`` (:class:`ConfigError` naming the field). Post: one entry per chunk the
    hashes cover, ``len(block_hashes) * hash_block_size // chunk_size`` of them.
    """
    _check_chunk_geometry(hash_block_size, chunk_size, units)
    num_chunks = len(block_hashes) * hash_block_size // chunk_size
    return [
        chunk_keys(block_hashes, hash_block_size, chunk_size, units, k) for k in range(num_chunks)
    ]
