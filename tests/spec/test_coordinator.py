"""Several groups over ONE pool: the hybrid fixed-point hit, cross-group eviction, the two-phase
adoption of vLLM #33775, and GR-* mutation evidence. Block ids are worked out by hand."""

from __future__ import annotations

import random
from typing import ClassVar

import pytest

from spec.block_pool import NULL_BLOCK, BlockPool, Refused
from spec.errors import ConfigError, InvariantViolation
from spec.invariants import check_all
from spec.kinds import GroupKind
from spec.managers import (
    FullAttentionManager,
    GroupSpec,
    KVCacheCoordinator,
    MambaManager,
    SlidingWindowManager,
    cdiv,
)
from spec.managers.coordinator import _MANAGERS

N = NULL_BLOCK
H = [f"h{i}" for i in range(8)]
FULL = GroupSpec(GroupKind.FULL, 4)
MAMBA = GroupSpec(GroupKind.MAMBA, 4)


def _failing(coord: KVCacheCoordinator) -> set[str]:
    snap = coord.snapshot()
    return set(check_all("kv_cache_groups", snap)) | set(
        check_all("block_pool", snap["block_pool"])
    )


def _variant(**swap: type) -> type[KVCacheCoordinator]:
    """A coordinator whose managers for the named kinds are swapped for broken ones."""
    kinds = {GroupKind[name.upper()]: cls for name, cls in swap.items()}

    class Variant(KVCacheCoordinator):
        manager_classes: ClassVar = {**_MANAGERS, **kinds}

    return Variant


# ----------------------------------------------------------------- the hybrid fixed point
def test_two_groups_full_attention_then_mamba_shrinks_to_the_last_common_state() -> None:
    coord = KVCacheCoordinator([FULL, MAMBA], 10)
    coord.allocate_slots("a", 8)  # full (1, 2); mamba (N, 3)
    coord.cache_blocks("a", H, 8)
    coord.allocate_slots("a", 4, num_computed_tokens=8)  # full (1, 2, 4); mamba (N, 3, 5)
    coord.cache_blocks("a", H, 12)
    assert coord.get_blocks("a") == ((1, 2, 4), (N, 3, 5))
    coord.pool.evict_blocks([5])  # the mamba state after 12 tokens is gone
    coord.free("a")  # queue (5, 6, 7, 8, 9, 4, 2, 1, 3)
    assert coord.find_longest_cache_hit_per_group(H[:4], 15) == (12, 8)
    hit = coord.find_longest_cache_hit(H[:4], 15)
    assert (hit.blocks, hit.num_tokens) == (((1, 2), (N, 3)), 8)
    assert hit.shared_prefix_boundary == 12  # full attention alone would hit 12
    coord.new_step_starts()  # b is admitted in a later step than a cached its states
    # b adopts the hit and asks for 8 more tokens: full takes 5, 6; mamba's new state is 7.
    assert coord.allocate_slots("b", 8, hit=hit) == ((5, 6), (7,))
    assert coord.get_blocks("b") == ((1, 2, 5, 6), (N, 3, N, 7))
    assert _failing(coord) == set()


def _three_groups() -> KVCacheCoordinator:
    sliding = GroupSpec(GroupKind.SLIDING, 4, sliding_window=5)  # a hit needs 1 block
    coord = KVCacheCoordinator([FULL, sliding, MAMBA], 24)
    for done in range(0, 16, 4):
        coord.allocate_slots("a", 4, num_computed_tokens=done)
        coord.cache_blocks("a", H, done + 4)
        assert _failing(coord) == set()
    coord.free("a")
    for group, position in ((1, 2), (2, 3)):  # drop sliding's block 2 and mamba's state 3
        coord.pool.evict_blocks(coord.pool.get_cached_block(H[position], [group]))
    return coord


def test_three_groups_need_a_second_pass_to_agree() -> None:
    coord = _three_groups()
    assert coord.find_longest_cache_hit_per_group(H[:5], 19) == (16, 16, 12)
    # Pass 1: full 16 -> sliding 16 -> mamba 12. Pass 2: full 12 -> sliding 8 -> mamba 8.
    hit = coord.find_longest_cache_hit(H[:5], 19)
    assert hit.num_tokens == 8
    assert [len(blocks) for blocks in hit.blocks] == [2, 2, 2]
    # Stability: each group, bounded by the result, accepts exactly the result.
    for manager in coord.managers:
        assert manager.find_longest_cache_hit(coord.pool, H[:5], 8).num_tokens == 8
    # A single pass would stop at 12, which the sliding-window group does not accept.
    assert coord.managers[1].find_longest_cache_hit(coord.pool, H[:5], 12).num_tokens == 8


def test_the_hit_is_aligned_to_the_scheduler_block() -> None:
    # full attention blocks of 4 and mamba blocks of 8: hits land on multiples of lcm = 8.
    coord = KVCacheCoordinator([FULL, GroupSpec(GroupKind.MAMBA, 8)], 12)
    assert (coord.scheduler_block_size, coord.hash_block_size) == (8, 4)
    for done in (0, 8):
        coord.allocate_slots("a", 8, num_computed_tokens=done)
        coord.cache_blocks("a", H, done + 8)
    coord.free("a")
    coord.pool.evict_blocks(coord.pool.get_cached_block("h3", [0]))  # full keeps h0..h2
    assert all(coord.pool.get_cached_block(h, [0]) for h in H[:3])
    # Full attention's 12-token prefix rounds down to 8; mamba's state at 8 is the match.
    assert coord.find_longest_cache_hit_per_group(H[:5], 19) == (8, 16)
    assert coord.find_longest_cache_hit(H[:5], 19).num_tokens == 8


def test_a_mamba_hit_ends_on_the_alignment_when_it_exceeds_the_mamba_block() -> None:
    """Full attention blocks of 8 and mamba blocks of 4: the alignment (lcm = 8) is larger than
    the mamba block, so a mamba hit must end on a multiple of 8 even where a state at 12 is
    cached (vLLM ``single_type_kv_cache_manager.py:1470-1533``: the rightmost cached block
    whose end is aligned)."""
    coord = KVCacheCoordinator([GroupSpec(GroupKind.FULL, 8), GroupSpec(GroupKind.MAMBA, 4)], 16)
    assert (coord.scheduler_block_size, coord.hash_block_size) == (8, 4)
    assert coord.managers[1].alignment_tokens == 8
    coord.allocate_slots("a", 8)  # full (1,); mamba (N, 2): the state after 8
    coord.cache_blocks("a", H, 8)
    coord.allocate_slots("a", 4, num_computed_tokens=8)  # full (1, 3); mamba (N, 2, 4)
    coord.cache_blocks("a", H, 12)  # whole scheduler blocks only: nothing new
    coord.allocate_slots("a", 4, num_computed_tokens=12)  # mamba (N, N, 4, 5): 2 freed, cached
    coord.cache_blocks("a", H, 16)  # full caches 3; mamba caches 4 (after 12) and 5 (after 16)
    assert coord.get_blocks("a") == ((1, 3), (N, N, 4, 5))
    coord.free("a")
    # Mamba's states after 8, 12 and 16 tokens are cached; the one after 16 is evicted.
    assert [coord.pool.get_cached_block(h, [1]) for h in H[1:4]] == [(2,), (4,), (5,)]
    coord.pool.evict_blocks([5])
    # Mamba's own answer skips the state after 12 (12 is not a multiple of 8) for the one
    # after 8; full attention alone reaches 16.
    assert coord.find_longest_cache_hit_per_group(H[:5], 19) == (16, 8)
    hit = coord.find_longest_cache_hit(H[:5], 19)
    assert (hit.blocks, hit.num_tokens) == (((1,), (N, 2)), 8)
    assert hit.shared_prefix_boundary == 16
    # The same pool read at the block size (alignment 4) would take the state after 12:
    # the alignment, not the cache's content, decides.
    unaligned = MambaManager(GroupSpec(GroupKind.MAMBA, 4), 1, 4)
    assert unaligned.find_longest_cache_hit(coord.pool, H[:5], 19).num_tokens == 12
    coord.new_step_starts()
    assert coord.allocate_slots("b", 8, hit=hit) == ((6,), (7,))
    assert coord.get_blocks("b") == ((1, 6), (N, 2, N, 7))
    assert _failing(coord) == set()


# ----------------------------------------------------------------- the shared pool
def test_one_groups_allocation_evicts_another_groups_cached_block() -> None:
    coord = KVCacheCoordinator([FULL, MAMBA], 6)
    coord.allocate_slots("a", 8)  # full (1, 2), mamba (N, 3)
    coord.cache_blocks("a", H, 8)
    coord.free("a")  # hashed blocks to the back: queue (4, 5, 2, 1, 3)
    assert coord.pool.free_queue() == (4, 5, 2, 1, 3)
    assert coord.find_longest_cache_hit(H[:3], 11).num_tokens == 8
    # b (other tokens, 12 of them): full takes 4, 5, 2; mamba's one state block is 1, which
    # carried full attention's entry for h0: mamba's allocation evicts full attention's prefix.
    assert coord.allocate_slots("b", 12) == ((4, 5, 2), (1,))
    assert coord.get_blocks("b") == ((4, 5, 2), (N, N, 1))
    assert coord.pool.get_cached_block("h0", [0]) == ()
    assert coord.find_longest_cache_hit(H[:3], 11).num_tokens == 0
    assert _failing(coord) == set()


def _two_phase_scene(cls: type[KVCacheCoordinator]) -> KVCacheCoordinator:
    """Sliding window (9, a hit needs 2 blocks) beside full attention; a's early sliding block
    leaves the window mid-prefill, so it sits at the FRONT of the LRU order when b hits it."""
    sliding = GroupSpec(GroupKind.SLIDING, 4, sliding_window=9)
    coord = cls([FULL, sliding], 9)
    for done in range(0, 16, 4):
        coord.allocate_slots("a", 4, num_computed_tokens=done)
        coord.cache_blocks("a", H, done + 4)
    assert coord.get_blocks("a") == ((1, 3, 5, 7), (N, 4, 6, 8))
    coord.free("a")
    assert coord.pool.free_queue() == (2, 7, 5, 3, 1, 8, 6, 4)
    # b shares the first block only, and a connector claims its next 4 tokens.
    hit = coord.find_longest_cache_hit(["h0", "x1", "x2"], 11)
    assert (hit.blocks, hit.num_tokens) == (((1,), (2,)), 4)
    coord.allocate_slots("b", 0, hit=hit, num_external_computed_tokens=4)
    return coord


def test_two_phase_adoption_touches_every_hit_before_any_external_block() -> None:
    coord = _two_phase_scene(KVCacheCoordinator)
    # Both hits are touched first; then full takes 7 and sliding takes 5 from the front.
    assert coord.get_blocks("b") == ((1, 7), (2, 5))
    assert _failing(coord) == set()


class _OnePhaseCoordinator(KVCacheCoordinator):
    """Adopts group by group: group 0's external block may be group 1's untouched hit."""

    def _adopt_groups(self, request_id, hit_blocks, num_local, num_external):  # type: ignore[no-untyped-def]
        for i, manager in enumerate(self.managers):
            manager.add_local_computed_blocks(
                request_id, hit_blocks[i], num_local, num_external, self.pool
            )
            manager.allocate_external_computed_blocks(
                request_id, num_local, num_external, self.pool
            )


def test_gr2_one_phase_adoption_hands_a_hit_block_to_two_groups() -> None:
    coord = _two_phase_scene(_OnePhaseCoordinator)
    assert coord.get_blocks("b") == ((1, 2), (2, 7))  # block 2 in both groups
    assert "GR-2" in _failing(coord)


# ----------------------------------------------------------------- GR-* mutation evidence
class _ForgetfulFull(FullAttentionManager):
    """Drops the table on free without returning its blocks."""

    def free(self, request_id, pool):  # type: ignore[no-untyped-def]
        self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)


def test_gr1_blocks_held_by_no_table() -> None:
    coord = _variant(full=_ForgetfulFull)([FULL, MAMBA], 8)
    coord.allocate_slots("a", 8)
    coord.free("a")
    assert "GR-1" in _failing(coord)


class _StickyHashPool(BlockPool):
    """Hands out blocks without dropping their cache entries."""

    def get_new_blocks(self, num_blocks):  # type: ignore[no-untyped-def]
        keys = dict(self._key)
        got = super().get_new_blocks(num_blocks)
        for block in got if isinstance(got, tuple) else ():
            if block in keys:
                self._key[block] = keys[block]
                self._cached.setdefault(keys[block], []).append(block)
        return got


def test_gr3_a_reallocated_block_keeps_the_other_groups_key() -> None:
    coord = KVCacheCoordinator([FULL, MAMBA], 6)
    coord.pool.__class__ = _StickyHashPool
    coord.allocate_slots("a", 8)
    coord.cache_blocks("a", H, 8)
    coord.free("a")
    coord.allocate_slots("b", 12)  # mamba gets block 1, which still says (h0, group 0)
    failing = _failing(coord)
    assert "GR-3" in failing


class _AllocateThenFreeSliding(SlidingWindowManager):
    """vLLM #30166: external tokens get blocks for the whole prefix, freed a step later."""

    def allocate_external_computed_blocks(self, request_id, num_local, num_external, pool):  # type: ignore[no-untyped-def]
        table = self.req_to_blocks.setdefault(request_id, [])
        total = num_local + num_external
        nulls = [i for i, b in enumerate(table) if b == NULL_BLOCK]
        fresh = self._take(pool, len(nulls) + max(0, cdiv(total, self.block_size) - len(table)))
        for i, block in zip(nulls, fresh, strict=False):
            table[i] = block
        table.extend(fresh[len(nulls) :])


def test_gr4_allocate_then_free_on_an_external_claim() -> None:
    sliding = GroupSpec(GroupKind.SLIDING, 4, sliding_window=8)
    coord = _variant(sliding=_AllocateThenFreeSliding)([FULL, sliding], 16)
    coord.allocate_slots("r", 0, num_external_computed_tokens=20)
    assert coord.get_blocks("r")[1][0] != NULL_BLOCK
    failing = _failing(coord)
    assert "GR-4" in failing
    assert "GR-7" in failing  # and it took more than it reserved


class _EveryPositionMamba(MambaManager):
    """Treats the state like attention KV: a real block for every position of a claim."""

    def get_num_skipped_tokens(self, num_computed_tokens):  # type: ignore[no-untyped-def]
        return 0


def test_gr5_mamba_claim_that_allocates_every_position() -> None:
    coord = _variant(mamba=_EveryPositionMamba)([MAMBA], 12)
    coord.allocate_slots("r", 0, num_external_computed_tokens=16)
    assert coord.get_blocks("r") == ((1, 2, 3, 4),)
    assert "GR-5" in _failing(coord)


class _UnderReservingFull(FullAttentionManager):
    def get_num_blocks_to_allocate(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return 0


def test_gr7_a_group_takes_more_than_it_reserved() -> None:
    coord = _variant(full=_UnderReservingFull)([FULL, MAMBA], 12)
    coord.allocate_slots("r", 8)
    assert "GR-7" in _failing(coord)


def test_gr7_raised_when_the_under_reservation_meets_an_empty_pool() -> None:
    coord = _variant(full=_UnderReservingFull)([FULL, MAMBA], 3)
    with pytest.raises(InvariantViolation) as info:
        coord.allocate_slots("r", 16)
    assert info.value.invariant_id == "GR-7"


def test_gr8_null_block_in_a_full_attention_table() -> None:
    coord = KVCacheCoordinator([FULL, MAMBA], 8)
    coord.allocate_slots("r", 8)
    snap = coord.snapshot()
    group = dict(snap["groups"][0])
    group["tables"] = (("r", 8, (NULL_BLOCK, 2)),)
    snap["groups"] = (group, snap["groups"][1])
    assert "GR-8" in check_all("kv_cache_groups", snap)


# ----------------------------------------------------------------- seeded random walks
_LAYOUTS = (
    (FULL, MAMBA),
    (FULL, GroupSpec(GroupKind.SLIDING, 4, sliding_window=6)),
    (
        FULL,
        GroupSpec(GroupKind.SLIDING, 4, sliding_window=9),
        GroupSpec(GroupKind.MAMBA, 4, num_speculative_blocks=1),
    ),
    (FULL, GroupSpec(GroupKind.MAMBA, 8)),
)


def _admit(coord: KVCacheCoordinator, rng: random.Random, rid: str) -> list[object] | None:
    """A new request: prefix hit, maybe an aligned external claim, maybe new tokens."""
    prompt = rng.choice([8, 12, 16, 20])
    hashes = [f"{rng.choice('ab')}{i}" for i in range(prompt // coord.hash_block_size)]
    hit = coord.find_longest_cache_hit(hashes, prompt - 1)
    unit = coord.scheduler_block_size
    external = (prompt - 1 - hit.num_tokens) // unit * unit if rng.random() < 0.4 else 0
    new = min(rng.choice([0, 4]) if external else 4, prompt - hit.num_tokens - external)
    if new == 0 and external == 0 and hit.num_tokens == 0:
        return None
    got = coord.allocate_slots(rid, new, hit=hit, num_external_computed_tokens=external)
    if not isinstance(got, tuple):
        return None
    done = hit.num_tokens + external + new
    coord.cache_blocks(rid, hashes, done)
    return [hashes, done]


def _step(coord: KVCacheCoordinator, rng: random.Random, rid: str, state: list) -> None:  # type: ignore[type-arg]
    hashes, done = state
    chunk = rng.choice([1, 4, 8])
    if isinstance(coord.allocate_slots(rid, chunk, num_computed_tokens=done), tuple):
        done += chunk
        while len(hashes) * coord.hash_block_size < done:
            hashes.append(f"{rid}-{len(hashes)}")
        coord.cache_blocks(rid, hashes, done)
        state[1] = done


@pytest.mark.parametrize("seed", range(60))
def test_seeded_random_walks_keep_every_invariant(seed: int) -> None:
    rng = random.Random(seed)
    coord = KVCacheCoordinator(_LAYOUTS[seed % len(_LAYOUTS)], rng.randint(4, 14))
    live: dict[str, list] = {}  # type: ignore[type-arg]
    for step in range(30):
        roll = rng.random()
        if roll < 0.3 and len(live) < 3:
            state = _admit(coord, rng, f"r{step}")
            if state is not None:
                live[f"r{step}"] = state
        elif roll < 0.7 and live:
            rid = rng.choice(sorted(live))
            _step(coord, rng, rid, live[rid])
        elif live:
            rid = rng.choice(sorted(live))
            del live[rid]
            coord.free(rid)
        assert _failing(coord) == set(), (seed, step)
    for rid in live:
        coord.free(rid)
    assert coord.pool.get_num_free_blocks() == coord.pool.num_blocks - 1


@pytest.mark.parametrize("seed", range(20))
def test_freeze_separates_exactly_the_states_snapshot_separates(seed: int) -> None:
    # The explorer deduplicates on freeze(): two states may share a freeze only if every piece of
    # per-request state agrees. Walk two layouts, keep every (freeze, snapshot) pair, and check
    # the map freeze -> snapshot is a function and injective on these walks.
    rng = random.Random(seed)
    coord = KVCacheCoordinator(_LAYOUTS[seed % len(_LAYOUTS)], rng.randint(4, 14))
    live: dict[str, list] = {}  # type: ignore[type-arg]
    seen: dict[object, object] = {}
    for step in range(30):
        if rng.random() < 0.4 and len(live) < 3:
            state = _admit(coord, rng, f"r{step}")
            if state is not None:
                live[f"r{step}"] = state
        elif live:
            rid = rng.choice(sorted(live))
            _step(coord, rng, rid, live[rid])
        snap = coord.snapshot()
        for group in snap["groups"]:
            del group["reserved"], group["taken"]
        frozen = coord.freeze()
        assert hash(frozen) == hash(coord.clone().freeze())
        assert seen.setdefault(frozen, snap) == snap, (seed, step)
    snaps = list(seen.values())
    assert len({repr(s) for s in snaps}) == len(snaps)


# ----------------------------------------------------------------- the hash list's granularity


def _hashes(tokens: tuple[int, ...], size: int) -> list[str]:
    from spec.scheduler.request import Request, block_hashes

    return list(block_hashes(Request("x", tokens, 1), size))


def test_a_hash_list_finer_than_the_blocks_is_read_at_its_own_granularity() -> None:
    """One full group of 2-token blocks, hashes every token. r0 (1,2,3,4) caches blocks (1,2)
    and (3,4); r1 (1,2,9,9,9) shares one block only. Read as if hashes were per block, r1's
    hashes 0 and 1 would be the hashes of (1) and (1,2), the coarse hashes of r0's two blocks
    at a 1-token granularity: a false 4-token hit over (3,4)."""
    group = GroupSpec(GroupKind.FULL, 2)
    coord = KVCacheCoordinator((group,), 9, hash_block_size=1)
    r0 = (1, 2, 3, 4)
    assert not isinstance(coord.allocate_slots("r0", 4, num_computed_tokens=0), Refused)
    coord.cache_blocks("r0", _hashes(r0, 1), 4)
    hit = coord.find_longest_cache_hit(_hashes((1, 2, 9, 9, 9), 1), 4)
    assert hit.num_tokens == 2
    assert coord.find_longest_cache_hit(_hashes((1, 2, 3, 4, 7), 1), 4).num_tokens == 4


def test_the_default_hash_granularity_is_the_gcd_and_a_non_divisor_is_refused() -> None:
    groups = (GroupSpec(GroupKind.FULL, 4), GroupSpec(GroupKind.MAMBA, 6))
    assert KVCacheCoordinator(groups, 5).hash_block_size == 2
    with pytest.raises(ConfigError) as info:
        KVCacheCoordinator(groups, 5, hash_block_size=4)
    assert info.value.field == "hash_block_size"


def test_data1_no_false_local_hit_when_hashes_are_finer_than_blocks() -> None:
    """The whole engine on the trace that found it: DATA-1 holds (r1 reads its own content)."""
    from spec.connector_api import RequestId
    from spec.scheduler import SchedulerConfig
    from spec.system.engine import Engine, EngineConfig, RequestSpec

    config = EngineConfig(
        SchedulerConfig((GroupSpec(GroupKind.FULL, 2),), 9, 8, 2, 1),
        (
            RequestSpec(RequestId("r0"), (1, 2, 3, 4, 5), 1),
            RequestSpec(RequestId("r1"), (1, 2, 9, 9, 9), 1),
        ),
        chunk_size=2,
        store_capacity=8,
        max_model_len=32,
    )
    engine = Engine.create(config)
    engine.arrive(RequestId("r0"))
    engine.step()
    engine.arrive(RequestId("r1"))
    for _ in range(3):
        engine.step()
        assert check_all("system", engine.snapshot()) == {}
    assert engine.statuses()["r1"].startswith("FINISHED")
