"""The GPU block pool of vLLM 0.33 (``v1/core/block_pool.py``), as a small executable model.

ONE pool serves every KV cache group: the groups overlay the same bytes, and a block id is owned
by one group at a time. So one group's :meth:`BlockPool.get_new_blocks` may pop a free block that
still carries another group's cache entry and drop that entry: cross-group eviction is the normal
case, not an accident, and the invariants ``BP-*`` and ``GR-*`` are written with it in mind.

Facts carried over from vLLM 0.33 (file:line relative to ``vllm/``):

- block 0 is the null block, popped off the free queue at start-up and never freed, cached or
  counted as free (``v1/core/block_pool.py:188-192``, ``free_blocks`` skips it at 830, ``touch``
  at 802, ``cache_full_blocks`` at 281);
- the free queue starts in block-id order; ``free_blocks`` PREPENDS the blocks that reach
  reference count 0 without a hash, in the order given, and APPENDS those with a hash, in the order
  given (``block_pool.py:816-849``, ``FreeKVCacheBlockQueue.prepend_n`` keeps the list order,
  ``v1/core/kv_cache_utils.py:438-457``);
- ``get_new_blocks(n)`` pops the first ``n`` blocks of the queue and drops each popped block's
  cache entry (``block_pool.py:706-740``);
- ``touch`` takes a cached-free block off the queue and raises reference counts
  (``block_pool.py:792-810``);
- cache keys are ``block_hash + kv_cache_group_id`` and one key may list several blocks (no
  de-duplication); a look-up returns the first one listed (``block_pool.py:36-140``, 202-228);
- ``evict_blocks(ids)`` drops cache entries only; the blocks keep their place and reference count
  (``block_pool.py:851-869``).

Divergence (catalogued): vLLM's ``get_new_blocks`` raises ``ValueError`` when too few blocks are
free (``block_pool.py:718-719``); here that is an expected refusal, returned as :class:`Refused`,
and the pool is left unchanged. Partial-block cache entries (``cache_partial_block``), pinned
blocks with reuse watchers and KV events are not modelled.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple, NewType

from spec.errors import ConfigError

__all__ = [
    "NULL_BLOCK",
    "BlockHash",
    "BlockId",
    "BlockPool",
    "BlockState",
    "HashKey",
    "Refused",
    "freeze",
]

BlockId = NewType("BlockId", int)
"""Index of a block in the pool; the same id names the same bytes in every group."""

BlockHash = NewType("BlockHash", str)
"""An abstract block hash (vLLM's ``BlockHash`` bytes; any string stands for one here)."""

NULL_BLOCK = BlockId(0)
"""The shared placeholder for skipped positions (sliding window, mamba); vLLM's block id 0."""


class HashKey(NamedTuple):
    """A cache key: vLLM's ``BlockHashWithGroupId`` (``kv_cache_utils.py:52-79``)."""

    block_hash: BlockHash
    kv_cache_group_id: int


class BlockState(Enum):
    """Where a block is in its lifecycle.

    - ``NULL``: block 0, the placeholder; never free, cached or referenced.
    - ``FREE``: in the free queue, no cache entry.
    - ``CACHED_FREE``: in the free queue with a cache entry: a prefix hit can still revive it,
      an allocation evicts it.
    - ``IN_USE``: reference count above 0 (with or without a cache entry).
    """

    NULL = "null"
    FREE = "free"
    CACHED_FREE = "cached_free"
    IN_USE = "in_use"


@dataclass(frozen=True, slots=True)
class Refused:
    """An expected refusal: ``needed`` blocks were asked for, only ``available`` could be given."""

    needed: int
    available: int


class BlockPool:
    """Reference counts, the free queue and the prefix-cache map of one shared pool.

    State is plain: a list of reference counts, the free queue as a list of ids (front first),
    the hash each block carries and the key -> block ids map. ``num_free_blocks`` is kept by hand,
    as vLLM keeps it, so ``BP-5`` can recount it.
    """

    def __init__(self, num_blocks: int) -> None:
        """Pre: ``num_blocks`` is an int >= 2 (the null block and at least one usable block).

        Post: every block but the null block is FREE, queued in id order.
        """
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 2:
            raise ConfigError(
                "num_blocks",
                num_blocks,
                "the pool needs the null block and at least one usable block",
                "pass an int >= 2",
            )
        self._ref: list[int] = [0] * num_blocks
        self._free: list[BlockId] = [BlockId(i) for i in range(1, num_blocks)]
        self._num_free = num_blocks - 1
        self._key: dict[BlockId, HashKey] = {}
        self._cached: dict[HashKey, list[BlockId]] = {}

    # ----------------------------------------------------------------- observations
    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the null block included."""
        return len(self._ref)

    def get_num_free_blocks(self) -> int:
        """Blocks an allocation may take now (FREE and CACHED_FREE); never the null block.

        Pure."""
        return self._num_free

    def ref_count(self, block: BlockId) -> int:
        """The block's reference count (0 for the null block, whose count is not kept).

        Pure. Pre: ``block`` is a block of this pool (else :class:`ConfigError`, field
        ``block``).
        """
        return self._ref[self._checked(block, "block")]

    def block_hash(self, block: BlockId) -> HashKey | None:
        """The cache key the block carries, or ``None`` when it carries none.

        Pure (an unknown id carries no hash: ``None``)."""
        return self._key.get(block)

    def state(self, block: BlockId) -> BlockState:
        """The block's lifecycle state.

        Pure. Pre: ``block`` is a block of this pool (else :class:`ConfigError`, field
        ``block``).
        """
        block = self._checked(block, "block")
        if block == NULL_BLOCK:
            return BlockState.NULL
        if self._ref[block] > 0:
            return BlockState.IN_USE
        return BlockState.CACHED_FREE if block in self._key else BlockState.FREE

    def free_queue(self) -> tuple[BlockId, ...]:
        """The free queue, front (next to be allocated) first.

        Pure."""
        return tuple(self._free)

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]
    ) -> tuple[BlockId, ...]:
        """One cached block per group for ``block_hash``, or ``()`` if any group misses.

        Pure: changes nothing. Where a key lists several blocks the first one listed is returned,
        as vLLM's ``get_one_block`` does.
        """
        found: list[BlockId] = []
        for group_id in kv_cache_group_ids:
            blocks = self._cached.get(HashKey(block_hash, group_id))
            if not blocks:
                return ()
            found.append(blocks[0])
        return tuple(found)

    # ----------------------------------------------------------------- transitions
    def get_new_blocks(self, num_blocks: int) -> tuple[BlockId, ...] | Refused:
        """Pop ``num_blocks`` blocks off the front of the free queue for a new owner.

        Pre: ``num_blocks`` is an int >= 0.
        Post: the popped blocks have reference count 1 and no cache entry (an entry they carried,
        whatever its group, is dropped: the eviction). Returns them in queue order.
        Refusal: fewer than ``num_blocks`` free blocks -> :class:`Refused`; nothing changes.
        """
        _check_count(num_blocks, "num_blocks")
        if num_blocks > self._num_free:
            return Refused(needed=num_blocks, available=self._num_free)
        taken = self._free[:num_blocks]
        del self._free[:num_blocks]
        self._num_free -= num_blocks
        for block in taken:
            self._drop_hash(block)
            self._ref[block] = 1
        return tuple(taken)

    def touch(self, blocks: Iterable[BlockId]) -> None:
        """Take a reference on prefix-hit blocks; a cached-free one leaves the free queue.

        Pre: every non-null block is IN_USE or CACHED_FREE (a hit is a cached block).
        Post: each non-null block's count is one higher; null blocks are skipped.
        Refusal: a precondition failure raises :class:`ConfigError` before anything changes.
        """
        real = [self._checked(b, "blocks") for b in blocks if b != NULL_BLOCK]
        for block in real:
            if self._ref[block] == 0 and block not in self._key:
                raise ConfigError("blocks", block, "touching a free block with no hash", _FIX)
        for block in real:
            if self._ref[block] == 0:
                self._free.remove(block)
                self._num_free -= 1
            self._ref[block] += 1

    def free_blocks(self, ordered_blocks: Iterable[BlockId]) -> None:
        """Drop one reference per listed block, in eviction-priority order (first = evict first).

        Pre: each non-null block is listed at most as often as its reference count.
        Post: blocks that reach 0 without a hash go to the FRONT of the queue in the given order
        (reused first); those with a hash go to the BACK in the given order (LRU). Null blocks are
        skipped.
        Refusal: a precondition failure raises :class:`ConfigError` before anything changes.
        """
        real = [self._checked(b, "ordered_blocks") for b in ordered_blocks if b != NULL_BLOCK]
        for block in set(real):
            if real.count(block) > self._ref[block]:
                raise ConfigError("ordered_blocks", block, "freed more often than held", _FIX)
        front: list[BlockId] = []
        back: list[BlockId] = []
        for block in real:
            self._ref[block] -= 1
            if self._ref[block] == 0:
                (back if block in self._key else front).append(block)
        self._free[:0] = front
        self._free.extend(back)
        self._num_free += len(front) + len(back)

    def cache_full_blocks(
        self,
        blocks: Sequence[BlockId],
        block_hashes: Sequence[BlockHash],
        *,
        num_cached_blocks: int,
        num_full_blocks: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        """Give ``blocks[num_cached_blocks:num_full_blocks]`` their cache entries.

        ``block_hashes[i]`` is the hash of position ``i`` at this group's block size.
        ``block_mask`` (aligned with the new range) leaves out blocks no hit can ever use.

        Pre: ``len(block_hashes) >= num_full_blocks <= len(blocks)``; each new non-null block is
        IN_USE and carries no hash or already this key.
        Post: each such block carries ``HashKey(hash, kv_cache_group_id)`` and is listed under it
        (after any block already listed there). Null and masked-out blocks are skipped.
        Refusal: a precondition failure raises :class:`ConfigError` before anything changes.
        """
        if num_full_blocks > min(len(blocks), len(block_hashes)):
            raise ConfigError("num_full_blocks", num_full_blocks, "beyond blocks or hashes", _FIX)
        todo: list[tuple[BlockId, HashKey]] = []
        for offset, index in enumerate(range(num_cached_blocks, num_full_blocks)):
            block = self._checked(blocks[index], "blocks")
            if block == NULL_BLOCK or (block_mask is not None and not block_mask[offset]):
                continue
            key = HashKey(block_hashes[index], kv_cache_group_id)
            if self._ref[block] == 0 or self._key.get(block, key) != key:
                raise ConfigError("blocks", block, "not in use or carries another hash", _FIX)
            todo.append((block, key))
        for block, key in todo:
            if block not in self._key:
                self._key[block] = key
                self._cached.setdefault(key, []).append(block)

    def evict_blocks(self, block_ids: Iterable[BlockId]) -> None:
        """Drop the cache entries of ``block_ids``; reference counts and queue places stay.

        Pre: every id is a block of this pool. Post: none of them carries a hash.
        Refusal: an unknown id raises :class:`ConfigError` before anything changes.
        """
        checked = [self._checked(b, "block_ids") for b in block_ids]
        for block in checked:
            self._drop_hash(block)

    # ----------------------------------------------------------------- copies and snapshots
    def clone(self) -> BlockPool:
        """An independent copy (the explorer branches on it).

        Frame: nothing changes in ``self``. Post: equal :meth:`snapshot`; no container shared."""
        twin = BlockPool.__new__(BlockPool)
        twin._ref = list(self._ref)
        twin._free = list(self._free)
        twin._num_free = self._num_free
        twin._key = dict(self._key)
        twin._cached = {key: list(ids) for key, ids in self._cached.items()}
        return twin

    def snapshot(self) -> dict[str, Any]:
        """The plain state the ``BP-*`` invariants read (subject ``"block_pool"``).

        Keys: ``num_blocks``; ``ref_counts`` (index = block id); ``free_queue`` (front first);
        ``num_free_blocks`` (the hand-kept counter); ``block_hashes``: sorted
        ``(block_id, hash, group_id)``; ``cached``: sorted ``(hash, group_id, (block ids...))``.

        Frame: nothing changes.
        """
        return {
            "num_blocks": self.num_blocks,
            "ref_counts": tuple(self._ref),
            "free_queue": tuple(int(b) for b in self._free),
            "num_free_blocks": self._num_free,
            "block_hashes": tuple(sorted((int(b), k[0], k[1]) for b, k in self._key.items())),
            "cached": tuple(
                sorted((k[0], k[1], tuple(int(b) for b in ids)) for k, ids in self._cached.items())
            ),
        }

    def freeze(self) -> tuple[Any, ...]:
        """A hashable value equal exactly for states with equal :meth:`snapshot` (built directly:
        the explorer calls it for every state).

        Frame: nothing changes."""
        return (
            tuple(self._ref),
            tuple(self._free),
            self._num_free,
            tuple(sorted(self._key.items())),
            tuple(sorted((k, tuple(ids)) for k, ids in self._cached.items())),
        )

    # ----------------------------------------------------------------- helpers
    def _checked(self, block: object, field: str) -> BlockId:
        if isinstance(block, bool) or not isinstance(block, int):
            raise ConfigError(field, block, "a block id is an int", _FIX)
        if not 0 <= block < len(self._ref):
            raise ConfigError(field, block, f"no such block in a pool of {len(self._ref)}", _FIX)
        return BlockId(block)

    def _drop_hash(self, block: BlockId) -> None:
        key = self._key.pop(block, None)
        if key is None:
            return
        listed = self._cached[key]
        listed.remove(block)
        if not listed:
            del self._cached[key]


_FIX = "pass only blocks the pool handed out, as the contract allows"


def _check_count(value: int, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(field, value, "must be an int >= 0", "pass a non-negative int")


def freeze(value: Any) -> Any:
    """Turn a snapshot (mappings, sequences, scalars) into nested tuples, hashable and ordered.

    Pure. Pre: keys of mappings are strings or stringify uniquely."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value
