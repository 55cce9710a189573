"""Per-group managers on a single-group coordinator: hand-computed tables and counts.

Block ids follow from the pool's rules (a fresh pool hands out 1, 2, 3... in order).
"""

from __future__ import annotations

from typing import ClassVar

import pytest

from spec.block_pool import NULL_BLOCK, Refused
from spec.errors import ConfigError, InvariantViolation
from spec.invariants import check_all
from spec.kinds import GroupKind
from spec.managers import NO_HIT, GroupSpec, KVCacheCoordinator, MambaManager, cdiv

N = NULL_BLOCK
HASHES = [f"h{i}" for i in range(8)]


def _holds(coord: KVCacheCoordinator) -> None:
    snap = coord.snapshot()
    assert check_all("block_pool", snap["block_pool"]) == {}
    assert check_all("kv_cache_groups", snap) == {}


def _one(spec: GroupSpec, num_blocks: int = 12) -> KVCacheCoordinator:
    return KVCacheCoordinator([spec], num_blocks)


FULL = GroupSpec(GroupKind.FULL, 4)


# ----------------------------------------------------------------- group specs
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kind": GroupKind.FULL, "block_size": 0}, "block_size"),
        ({"kind": GroupKind.FULL, "block_size": True}, "block_size"),
        ({"kind": GroupKind.SLIDING, "block_size": 4}, "sliding_window"),
        ({"kind": GroupKind.FULL, "block_size": 4, "sliding_window": 8}, "sliding_window"),
        (
            {"kind": GroupKind.FULL, "block_size": 4, "num_speculative_blocks": 1},
            "num_speculative_blocks",
        ),
        ({"kind": "full", "block_size": 4}, "kind"),
    ],
)
def test_group_spec_rejects_bad_fields(kwargs: dict, field: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError) as info:
        GroupSpec(**kwargs)
    assert info.value.field == field


def test_allocate_slots_needs_something_to_allocate() -> None:
    with pytest.raises(ConfigError):
        _one(FULL).allocate_slots("r", 0)


# ----------------------------------------------------------------- full attention
def test_full_attention_allocates_cdiv_blocks_and_hits_the_cached_prefix() -> None:
    coord = _one(FULL)
    assert coord.allocate_slots("a", 10) == ((1, 2, 3),)
    coord.cache_blocks("a", HASHES[:2], 10)  # two full blocks get entries
    coord.free("a")
    _holds(coord)
    # b shares 8 tokens and has 12: the hit stops at max_length = 11 -> 2 blocks, 8 tokens.
    hit = coord.find_longest_cache_hit(HASHES[:3], 11)
    assert (hit.blocks, hit.num_tokens) == (((1, 2),), 8)
    assert coord.allocate_slots("b", 4, hit=hit) == ((3,),)
    assert coord.get_blocks("b") == ((1, 2, 3),)
    _holds(coord)


def test_full_attention_refusal_leaves_the_pool_alone() -> None:
    coord = _one(FULL, num_blocks=3)
    before = coord.freeze()
    assert coord.allocate_slots("a", 9) == Refused(needed=3, available=2)
    assert coord.freeze() == before


# ----------------------------------------------------------------- sliding window
SLIDING = GroupSpec(GroupKind.SLIDING, 4, sliding_window=8)


def test_sliding_window_external_claim_allocates_the_window_only() -> None:
    coord = _one(SLIDING)
    # 20 external tokens: skipped = 20 - 8 + 1 = 13 -> 3 null blocks; cdiv(20, 4) = 5 positions.
    new = coord.allocate_slots("r", 0, num_external_computed_tokens=20)
    assert coord.get_blocks("r") == ((N, N, N, 1, 2),)
    assert new == ((),)  # the table already covers the 20 tokens
    assert coord.snapshot()["groups"][0]["reserved"] == 2
    assert coord.snapshot()["groups"][0]["taken"] == 2
    _holds(coord)


def test_sliding_window_external_claim_matches_the_interface_example() -> None:
    # window 128, block 16, 1000 external tokens: 873 skipped -> 54 nulls, 63 - 54 = 9 real.
    coord = _one(GroupSpec(GroupKind.SLIDING, 16, sliding_window=128), num_blocks=12)
    coord.allocate_slots("r", 0, num_external_computed_tokens=1000)
    (table,) = coord.get_blocks("r")
    assert table[:54] == (N,) * 54
    assert table[54:] == tuple(range(1, 10))
    _holds(coord)


def test_sliding_window_frees_blocks_that_leave_the_window() -> None:
    coord = _one(SLIDING)
    assert coord.allocate_slots("r", 16) == ((1, 2, 3, 4),)
    # computed 16: skipped 9 -> positions 0 and 1 freed, highest first: queue (2, 1, 5...).
    assert coord.allocate_slots("r", 4, num_computed_tokens=16) == ((2,),)
    assert coord.get_blocks("r") == ((N, N, 3, 4, 2),)
    assert coord.pool.free_queue()[0] == 1
    _holds(coord)


def test_sliding_window_hit_needs_a_window_of_contiguous_blocks() -> None:
    coord = _one(SLIDING)
    coord.allocate_slots("a", 16)  # (1, 2, 3, 4)
    coord.cache_blocks("a", HASHES[:4], 16)
    coord.free("a")
    # need = cdiv(8 - 1, 4) = 2 blocks: positions 2 and 3 are enough, nulls before them.
    hit = coord.find_longest_cache_hit(HASHES[:5], 19)
    assert (hit.blocks, hit.num_tokens) == (((N, N, 3, 4),), 16)
    coord.pool.evict_blocks([3])  # position 2 gone: 3 alone is no window; 0..1 from the start is
    hit = coord.find_longest_cache_hit(HASHES[:5], 19)
    assert (hit.blocks, hit.num_tokens) == (((1, 2),), 8)
    _holds(coord)


# ----------------------------------------------------------------- mamba (align)
MAMBA = GroupSpec(GroupKind.MAMBA, 4)


def test_mamba_external_claim_gets_one_state_block_at_the_last_position() -> None:
    coord = _one(MAMBA)
    coord.allocate_slots("r", 0, num_external_computed_tokens=10)
    assert coord.get_blocks("r") == ((N, N, 1),)  # cdiv(10, 4) - 1 = 2
    assert coord.snapshot()["groups"][0]["reserved"] == 1
    _holds(coord)


def test_mamba_external_claim_with_a_speculative_block() -> None:
    coord = _one(GroupSpec(GroupKind.MAMBA, 4, num_speculative_blocks=1))
    coord.allocate_slots("r", 0, num_external_computed_tokens=8)
    assert coord.get_blocks("r") == ((N, 1, 2),)  # state at 1, scratch after it
    assert coord.snapshot()["groups"][0]["reserved"] == 2
    _holds(coord)


def test_mamba_steady_state_keeps_the_previous_and_the_new_state_only() -> None:
    coord = _one(MAMBA)
    assert coord.allocate_slots("r", 8) == ((1,),)
    assert coord.get_blocks("r") == ((N, 1),)
    assert coord.allocate_slots("r", 8, num_computed_tokens=8) == ((2,),)
    assert coord.get_blocks("r") == ((N, 1, N, 2),)  # previous state 1 is the input
    _holds(coord)
    # computed 16: everything below position cdiv(16, 4) - 1 = 3 is freed, so 1 goes back.
    assert coord.allocate_slots("r", 4, num_computed_tokens=16) == ((1,),)
    assert coord.get_blocks("r") == ((N, N, N, 2, 1),)
    _holds(coord)


class VllmMambaManager(MambaManager):
    """vLLM 0.33's align-mode count (single_type_kv_cache_manager.py:1742-1795): not clamped at
    0, and blind to the external state block of a first allocation."""

    def get_num_blocks_to_allocate(  # type: ignore[no-untyped-def]
        self,
        request_id,
        num_tokens,
        hit_blocks,
        *,
        total_computed_tokens,
        num_local_computed_tokens,
        pool,
    ):
        spec_blocks = self.spec.num_speculative_blocks
        held = len(self.req_to_blocks.get(request_id, ()))
        num_new = cdiv(num_tokens, self.block_size) + spec_blocks - len(hit_blocks) - held
        if num_new > 0:
            num_new = min(num_new, 1 + (spec_blocks if request_id not in self.allocated else 0))
        return num_new + sum(1 for b in hit_blocks if b != N and pool.ref_count(b) == 0)


class VllmCoordinator(KVCacheCoordinator):
    manager_classes: ClassVar = {
        **KVCacheCoordinator.manager_classes,
        GroupKind.MAMBA: VllmMambaManager,
    }


def _truncated(cls: type[KVCacheCoordinator]) -> KVCacheCoordinator:
    coord = cls([MAMBA], 12)
    coord.allocate_slots("r", 16)  # table (N, N, N, 1)
    free_before = coord.pool.get_num_free_blocks()
    # A recovery truncates the request to 8 computed tokens and schedules 4: 3 positions < 4.
    assert coord.allocate_slots("r", 4, num_computed_tokens=8) == ((),)
    assert coord.get_blocks("r") == ((N, N, N, 1),)
    assert coord.pool.get_num_free_blocks() == free_before  # allocates NOTHING
    return coord


def test_mamba_after_truncation_allocates_nothing_and_counts_zero() -> None:
    coord = _truncated(KVCacheCoordinator)
    assert coord.snapshot()["groups"][0]["reserved"] == 0
    _holds(coord)


def test_gr6_vllm_unclamped_count_goes_negative_after_truncation() -> None:
    coord = _truncated(VllmCoordinator)
    assert coord.snapshot()["groups"][0]["reserved"] == -1
    assert "GR-6" in check_all("kv_cache_groups", coord.snapshot())


MAMBA8 = GroupSpec(GroupKind.MAMBA, 8)


def test_mamba_external_claim_plus_new_tokens_reserves_both_state_blocks() -> None:
    coord = _one(MAMBA8)
    # 8 external tokens and 4 new ones: the external state at 0, the new state at 1.
    assert coord.allocate_slots("r", 4, num_external_computed_tokens=8) == ((2,),)
    assert coord.get_blocks("r") == ((1, 2),)
    group = coord.snapshot()["groups"][0]
    assert (group["reserved"], group["taken"]) == (2, 2)
    _holds(coord)


def test_gr7_vllm_count_misses_the_external_state_block() -> None:
    coord = VllmCoordinator([MAMBA8], 12)
    coord.allocate_slots("r", 4, num_external_computed_tokens=8)
    group = coord.snapshot()["groups"][0]
    assert (group["reserved"], group["taken"]) == (1, 2)
    assert "GR-7" in check_all("kv_cache_groups", coord.snapshot())


def test_one_free_block_refuses_in_the_spec_and_breaks_vllms_reservation() -> None:
    spec_coord = _one(MAMBA8, num_blocks=2)
    before = spec_coord.freeze()
    assert spec_coord.allocate_slots("r", 4, num_external_computed_tokens=8) == Refused(2, 1)
    assert spec_coord.freeze() == before
    with pytest.raises(InvariantViolation) as info:  # vLLM: ValueError in get_new_blocks
        VllmCoordinator([MAMBA8], 2).allocate_slots("r", 4, num_external_computed_tokens=8)
    assert info.value.invariant_id == "GR-7"


def test_mamba_hit_is_the_last_cached_state() -> None:
    coord = _one(MAMBA)
    coord.allocate_slots("a", 8)  # (N, 1)
    coord.cache_blocks("a", HASHES[:2], 8)  # only the state at position 1 is cached
    coord.free("a")
    hit = coord.find_longest_cache_hit(HASHES[:3], 11)
    assert (hit.blocks, hit.num_tokens) == (((N, 1),), 8)
    coord.new_step_starts()  # b is admitted a step later
    coord.allocate_slots("b", 4, hit=hit)
    assert coord.get_blocks("b") == ((N, 1, 2),)
    _holds(coord)


def test_mamba_state_cached_this_step_is_not_adopted_until_the_next() -> None:
    """vLLM ``single_type_kv_cache_manager.py:1704-1712``: a state cached in this step is
    written by this step's forward, so a hit on it is refused (more blocks than the pool) until
    a new step starts; the refusal changes nothing."""
    coord = _one(MAMBA)
    coord.allocate_slots("a", 8)
    coord.cache_blocks("a", HASHES[:2], 8)
    hit = coord.find_longest_cache_hit(HASHES[:3], 11)
    assert hit.num_tokens == 8
    before = coord.freeze()
    assert isinstance(coord.allocate_slots("b", 4, hit=hit), Refused)
    assert coord.freeze() == before
    coord.new_step_starts()
    assert not isinstance(coord.allocate_slots("b", 4, hit=hit), Refused)
    assert coord.get_blocks("b") == ((N, 1, 2),)


def test_clone_is_independent() -> None:
    coord = _one(MAMBA)
    coord.allocate_slots("a", 8)
    twin = coord.clone()
    twin.allocate_slots("a", 8, num_computed_tokens=8)
    assert coord.get_blocks("a") == ((N, 1),)
    assert twin.get_blocks("a") == ((N, 1, N, 2),)
    assert coord.freeze() != twin.freeze()
    assert coord.clone().freeze() == coord.freeze()


def test_no_hit_constant_is_empty() -> None:
    assert NO_HIT.num_tokens == 0
    assert NO_HIT.blocks == ()
