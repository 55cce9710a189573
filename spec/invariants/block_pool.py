"""BP-*: invariants of the shared block pool (snapshot subject ``"block_pool"``).

Each predicate reads the plain mapping :meth:`spec.block_pool.BlockPool.snapshot` returns
(``num_blocks``, ``ref_counts``, ``free_queue``, ``num_free_blocks``, ``block_hashes``,
``cached``) and recounts one property from the raw fields. Block 0 is the null block.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from spec.invariants._registry import invariant

__all__ = [
    "cache_entries_list_blocks_once",
    "free_count_recounts",
    "free_iff_unreferenced",
    "hash_map_consistent",
    "null_block_never_free_or_cached",
    "pool_conserves_blocks",
    "ref_counts_non_negative",
]

Snapshot = Mapping[str, Any]
NULL = 0


def _referenced(snapshot: Snapshot) -> list[int]:
    return [b for b, ref in enumerate(snapshot["ref_counts"]) if b != NULL and ref > 0]


@invariant("block_pool")
def pool_conserves_blocks(snapshot: Snapshot) -> list[str]:
    """BP-1: free-queue blocks + referenced blocks + the null block = all blocks of the pool."""
    free = len(snapshot["free_queue"])
    referenced = len(_referenced(snapshot))
    total = snapshot["num_blocks"]
    if free + referenced + 1 != total:
        return [f"{free} free + {referenced} referenced + 1 null != {total} blocks"]
    return []


@invariant("block_pool")
def free_iff_unreferenced(snapshot: Snapshot) -> list[str]:
    """BP-2: a non-null block is in the free queue, exactly once, iff its reference count is 0."""
    queue: Counter[int] = Counter(snapshot["free_queue"])
    messages = [f"block {b} queued {n} times" for b, n in sorted(queue.items()) if n > 1]
    for block, ref in enumerate(snapshot["ref_counts"]):
        if block != NULL and (ref == 0) != (block in queue):
            where = "queued" if block in queue else "not queued"
            messages.append(f"block {block} has ref_count {ref} but is {where}")
    return messages


@invariant("block_pool")
def hash_map_consistent(snapshot: Snapshot) -> list[str]:
    """BP-3: every cache entry lists blocks that carry its key, and every carried key is listed.

    A block may carry several keys: vLLM 0.33 with a hash block below the block size
    (``prefix_match_unit``) keeps a block's partial-prefix keys beside its own
    (``cached_block_hashes_by_block``); the spec's own pool gives each block one.
    """
    carried: dict[int, set[tuple[Any, int]]] = {}
    for block, h, g in snapshot["block_hashes"]:
        carried.setdefault(block, set()).add((h, g))
    listed = {(h, g, b) for h, g, blocks in snapshot["cached"] for b in blocks}
    messages = [
        f"cache entry ({h!r}, {g}) lists block {b}, which carries "
        f"{sorted(carried.get(b, ()), key=repr)!r}"
        for h, g, b in sorted(listed)
        if (h, g) not in carried.get(b, ())
    ]
    messages += [
        f"block {b} carries ({h!r}, {g}) but no entry lists it"
        for b, keys in sorted(carried.items())
        for h, g in sorted(keys, key=repr)
        if (h, g, b) not in listed
    ]
    return messages


@invariant("block_pool")
def null_block_never_free_or_cached(snapshot: Snapshot) -> list[str]:
    """BP-4: the null block (id 0) is never free, never carries a hash, never listed by a key."""
    messages = []
    if NULL in snapshot["free_queue"]:
        messages.append("the null block is in the free queue")
    if any(block == NULL for block, _h, _g in snapshot["block_hashes"]):
        messages.append("the null block carries a hash")
    if any(NULL in blocks for _h, _g, blocks in snapshot["cached"]):
        messages.append("a cache entry lists the null block")
    return messages


@invariant("block_pool")
def free_count_recounts(snapshot: Snapshot) -> list[str]:
    """BP-5: the hand-kept num_free_blocks equals the length of the free queue."""
    kept, counted = snapshot["num_free_blocks"], len(snapshot["free_queue"])
    return [f"num_free_blocks is {kept}, the queue holds {counted}"] if kept != counted else []


@invariant("block_pool")
def ref_counts_non_negative(snapshot: Snapshot) -> list[str]:
    """BP-6: there is one reference count per block and none is negative."""
    refs = snapshot["ref_counts"]
    messages = [f"block {b} has ref_count {ref}" for b, ref in enumerate(refs) if ref < 0]
    if len(refs) != snapshot["num_blocks"]:
        messages.append(f"{len(refs)} reference counts for {snapshot['num_blocks']} blocks")
    return messages


@invariant("block_pool")
def cache_entries_list_blocks_once(snapshot: Snapshot) -> list[str]:
    """BP-7: every cache entry lists at least one block and no block twice."""
    messages = []
    for h, g, blocks in snapshot["cached"]:
        if not blocks:
            messages.append(f"cache entry ({h!r}, {g}) lists no block")
        elif len(set(blocks)) != len(blocks):
            messages.append(f"cache entry ({h!r}, {g}) lists a block twice: {blocks}")
    return messages
