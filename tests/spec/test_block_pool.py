"""The shared block pool: free-queue order, hits, eviction, refusals, and BP-* mutation evidence.

Expected queues are worked out by hand from vLLM 0.33's rules: unhashed blocks freed go to the
front in the order given, hashed ones to the back in the order given, allocation pops the front.
"""

from __future__ import annotations

import pytest

from spec.block_pool import NULL_BLOCK, BlockPool, BlockState, HashKey, Refused
from spec.errors import ConfigError
from spec.invariants import check_all


def _holds(pool: BlockPool) -> None:
    assert check_all("block_pool", pool.snapshot()) == {}


def _failing(snapshot: dict) -> set[str]:  # type: ignore[type-arg]
    return set(check_all("block_pool", snapshot))


def test_a_new_pool_queues_every_block_but_the_null_block_in_id_order() -> None:
    pool = BlockPool(5)
    assert pool.free_queue() == (1, 2, 3, 4)
    assert pool.get_num_free_blocks() == 4
    assert pool.state(NULL_BLOCK) is BlockState.NULL
    assert pool.state(1) is BlockState.FREE
    _holds(pool)


@pytest.mark.parametrize("bad", [1, 0, True, 2.0])
def test_pool_size_is_checked(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        BlockPool(bad)  # type: ignore[arg-type]
    assert info.value.field == "num_blocks"


def test_get_new_blocks_pops_the_front_and_refusal_changes_nothing() -> None:
    pool = BlockPool(5)
    assert pool.get_new_blocks(2) == (1, 2)
    assert pool.ref_count(1) == 1
    assert pool.state(2) is BlockState.IN_USE
    before = pool.freeze()
    assert pool.get_new_blocks(3) == Refused(needed=3, available=2)
    assert pool.freeze() == before
    _holds(pool)


def test_unhashed_blocks_freed_tail_first_go_to_the_front() -> None:
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)  # (1, 2, 3); queue (4, 5)
    pool.free_blocks(reversed(blocks))  # a request frees its tail first
    assert pool.free_queue() == (3, 2, 1, 4, 5)
    _holds(pool)


def test_hashed_blocks_go_to_the_back_in_the_order_given() -> None:
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(
        blocks, ["h0", "h1"], num_cached_blocks=0, num_full_blocks=2, kv_cache_group_id=0
    )
    pool.free_blocks(reversed(blocks))  # 3 has no hash -> front; 2 then 1 -> back
    assert pool.free_queue() == (3, 4, 5, 2, 1)
    assert pool.state(2) is BlockState.CACHED_FREE
    _holds(pool)


def test_allocation_evicts_the_popped_block_of_any_group() -> None:
    pool = BlockPool(3)
    (a, b) = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], ["h"], num_cached_blocks=0, num_full_blocks=1, kv_cache_group_id=1)
    pool.free_blocks([a, b])  # queue (b, a): b unhashed to the front
    assert pool.get_cached_block("h", [1]) == (a,)
    assert pool.get_new_blocks(2) == (b, a)  # group 0's allocation takes group 1's cached block
    assert pool.get_cached_block("h", [1]) == ()
    assert pool.block_hash(a) is None
    _holds(pool)


def test_touch_revives_a_cached_free_block_and_refuses_an_unhashed_free_one() -> None:
    pool = BlockPool(4)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], ["h"], num_cached_blocks=0, num_full_blocks=1, kv_cache_group_id=0)
    pool.free_blocks([a])
    pool.touch([NULL_BLOCK, a])
    assert pool.ref_count(a) == 1
    assert a not in pool.free_queue()
    before = pool.freeze()
    with pytest.raises(ConfigError):
        pool.touch([a, 2])  # 2 is free without a hash: no hit can name it
    assert pool.freeze() == before
    _holds(pool)


def test_freeing_more_than_held_is_refused_whole() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    before = pool.freeze()
    with pytest.raises(ConfigError):
        pool.free_blocks([a, b, b])
    assert pool.freeze() == before


def test_null_blocks_are_skipped_by_free_touch_and_cache() -> None:
    pool = BlockPool(4)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(
        [NULL_BLOCK, a], ["h0", "h1"], num_cached_blocks=0, num_full_blocks=2, kv_cache_group_id=0
    )
    assert pool.block_hash(NULL_BLOCK) is None
    assert pool.block_hash(a) == HashKey("h1", 0)
    pool.free_blocks([NULL_BLOCK, a, NULL_BLOCK])
    assert NULL_BLOCK not in pool.free_queue()
    _holds(pool)


def test_duplicate_entries_return_the_first_and_survive_its_eviction() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    for block in (a, b):
        pool.cache_full_blocks(
            [block], ["h"], num_cached_blocks=0, num_full_blocks=1, kv_cache_group_id=0
        )
    assert pool.get_cached_block("h", [0]) == (a,)
    pool.evict_blocks([a])
    assert pool.get_cached_block("h", [0]) == (b,)
    _holds(pool)


def test_a_hit_needs_every_group() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], ["h"], num_cached_blocks=0, num_full_blocks=1, kv_cache_group_id=0)
    assert pool.get_cached_block("h", [0, 1]) == ()
    pool.cache_full_blocks([b], ["h"], num_cached_blocks=0, num_full_blocks=1, kv_cache_group_id=1)
    assert pool.get_cached_block("h", [0, 1]) == (a, b)


def test_evict_blocks_drops_hashes_only() -> None:
    pool = BlockPool(5)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks(
        [a, b], ["h0", "h1"], num_cached_blocks=0, num_full_blocks=2, kv_cache_group_id=0
    )
    pool.free_blocks([a])  # a cached-free at the back: (3, 4, a)
    pool.evict_blocks([a, b])
    assert pool.free_queue() == (3, 4, a)  # a keeps its place
    assert pool.ref_count(b) == 1
    assert pool.state(a) is BlockState.FREE
    _holds(pool)


def test_clone_is_independent_and_freeze_tracks_state() -> None:
    pool = BlockPool(4)
    twin = pool.clone()
    assert twin.freeze() == pool.freeze()
    twin.get_new_blocks(1)
    assert twin.freeze() != pool.freeze()
    assert pool.free_queue() == (1, 2, 3)


# ----------------------------------------------------------------- mutation evidence (BP-*)
def _busy_pool() -> BlockPool:
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(
        blocks, ["h0", "h1"], num_cached_blocks=0, num_full_blocks=2, kv_cache_group_id=0
    )
    pool.free_blocks([blocks[0], blocks[3]])
    _holds(pool)
    return pool


class _LeakyPool(BlockPool):
    """Frees without queueing the block (its reference count drops, it never returns)."""

    def free_blocks(self, ordered_blocks):  # type: ignore[no-untyped-def]
        for block in ordered_blocks:
            if block != NULL_BLOCK:
                self._ref[block] -= 1


class _NullFreeingPool(BlockPool):
    """Frees the null block like any other (vLLM skips it, block_pool.py:830)."""

    def free_blocks(self, ordered_blocks):  # type: ignore[no-untyped-def]
        blocks = list(ordered_blocks)
        super().free_blocks([b for b in blocks if b != NULL_BLOCK])
        if NULL_BLOCK in blocks:
            self._free.insert(0, NULL_BLOCK)
            self._num_free += 1


class _MiscountingPool(BlockPool):
    """Touch forgets to lower the hand-kept free counter."""

    def touch(self, blocks):  # type: ignore[no-untyped-def]
        before = self._num_free
        super().touch(blocks)
        self._num_free = before


def test_bp1_leaky_free_breaks_conservation() -> None:
    pool = _LeakyPool(5)
    pool.free_blocks(pool.get_new_blocks(2))
    assert "BP-1" in _failing(pool.snapshot())


def test_bp2_reports_a_referenced_block_in_the_queue_and_a_duplicate() -> None:
    snap = _busy_pool().snapshot()
    snap["free_queue"] = (*snap["free_queue"], 2)  # block 2 is still referenced
    messages = check_all("block_pool", snap)["BP-2"]
    assert any("block 2 has ref_count 1" in m for m in messages)
    snap = _busy_pool().snapshot()
    snap["free_queue"] = (*snap["free_queue"], snap["free_queue"][0])
    assert any("queued 2 times" in m for m in check_all("block_pool", snap)["BP-2"])


def test_bp3_reports_a_hash_map_out_of_step_both_ways() -> None:
    snap = _busy_pool().snapshot()
    snap["block_hashes"] = ((1, "other", 0), *snap["block_hashes"][1:])
    assert "BP-3" in _failing(snap)
    snap = _busy_pool().snapshot()
    snap["cached"] = snap["cached"][1:]  # an entry vanished, its block still carries the key
    assert "BP-3" in _failing(snap)


def test_bp4_null_block_freed_like_any_other() -> None:
    pool = _NullFreeingPool(4)
    pool.free_blocks([NULL_BLOCK, *pool.get_new_blocks(1)])
    assert "BP-4" in _failing(pool.snapshot())


def test_bp5_hand_kept_free_counter_drifts() -> None:
    pool = _MiscountingPool(4)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], ["h"], num_cached_blocks=0, num_full_blocks=1, kv_cache_group_id=0)
    pool.free_blocks([a])
    pool.touch([a])
    assert "BP-5" in _failing(pool.snapshot())


def test_bp6_negative_reference_count() -> None:
    snap = _busy_pool().snapshot()
    snap["ref_counts"] = (0, 0, 1, -1, 0, 0)
    assert "BP-6" in _failing(snap)


def test_bp7_empty_or_doubled_cache_entry() -> None:
    snap = _busy_pool().snapshot()
    snap["cached"] = (*snap["cached"], ("ghost", 0, ()))
    assert "BP-7" in _failing(snap)
    snap = _busy_pool().snapshot()
    h, g, blocks = snap["cached"][0]
    snap["cached"] = ((h, g, blocks * 2), *snap["cached"][1:])
    assert "BP-7" in _failing(snap)
