"""Hand-computed geometries for the hybrid offload planner, run against both implementations.

Every expected number below is worked out in the comment beside it from the contract in
spec/planner.py (units, lcm, floors), not read back from either implementation. Each case runs
on the reference model and on the optimized planner (one contract, two sides, as CPython's heapq
tests do), and the PL-* predicates must hold on both snapshots.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest

import hybridkv.errors
import hybridkv.kinds
import hybridkv.planner
import spec.errors
import spec.kinds
import spec.planner
from spec.invariants import check, check_all, invariants_for


class Side(NamedTuple):
    name: str
    planner: Any
    kinds: Any
    error: type[ValueError]

    def build(self, groups: list[tuple[str, int]], h: int, c: int, max_len: int) -> Any:
        typed = [(self.kinds(kind), block) for kind, block in groups]
        return self.planner(typed, h, c, max_len)


SIDES = [
    Side("spec", spec.planner.HybridOffloadPlanner, spec.kinds.GroupKind, spec.errors.ConfigError),
    Side(
        "hybridkv",
        hybridkv.planner.HybridOffloadPlanner,
        hybridkv.kinds.GroupKind,
        hybridkv.errors.HybridKVConfigError,
    ),
]


@pytest.fixture(params=SIDES, ids=lambda side: side.name)
def side(request: pytest.FixtureRequest) -> Side:
    return request.param  # type: ignore[no-any-return]


def _assert_pl_holds(planner: Any) -> None:
    assert check_all("planner", planner.snapshot()) == {}


def test_qwen35_like_one_unified_block(side: Side) -> None:
    # FULL 544 + MAMBA 544 with h = c = 544: one unit per block, nothing split, claim 544.
    p = side.build([("full", 544), ("mamba", 544)], 544, 544, 8192)
    assert p.units == (544, 544)
    assert p.hash_factors == (1, 1)
    assert p.splittable == (False, False)
    assert p.first_storable_chunks == (0, 0)
    assert p.claim_unit == 544
    assert p.shortest_hit_prompt == 545
    assert [p.chunk_count_for_tokens(n) for n in (0, 543, 544, 1087, 1088)] == [0, 0, 1, 1, 2]
    # The last token is always computed: 544 tokens claim nothing, 545 claim one block.
    assert [p.claimable_prefix_tokens(n) for n in (544, 545, 1088, 1089)] == [0, 544, 544, 1088]
    assert p.unit_hash_index(1, 0) == 0
    assert p.unit_hash_index(1, 2) == 2
    _assert_pl_holds(p)


def test_qwen35_like_fine_hash_half_block_chunk(side: Side) -> None:
    # FULL 544 + MAMBA 544, h = 16, c = 272: 272 divides 544, so the attention block splits in
    # two units of 272 (17 hashes each); mamba keeps 544 (34 hashes). lcm(272, 272, 544) = 544.
    p = side.build([("full", 544), ("mamba", 544)], 16, 272, 8192)
    assert p.units == (272, 544)
    assert p.hash_factors == (17, 34)
    assert p.splittable == (True, False)
    # Mamba: chunk 0 ends at 272 (not a multiple of 544), chunk 1 ends at 544.
    assert p.first_storable_chunks == (0, 1)
    assert p.claim_unit == 544
    # n = 543: mamba has no complete unit -> 0. n = 816: attention covers 3 chunks, mamba one
    # unit (544 tokens) = 2 chunks -> 2. n = 1088: both cover 4.
    counts = [p.chunk_count_for_tokens(n) for n in (271, 272, 543, 544, 815, 816, 1088)]
    assert counts == [0, 0, 0, 2, 2, 2, 4]
    assert p.storable_prefix_tokens(1000) == 544
    assert p.group_covered_tokens(0) == (0, 0)
    assert p.group_covered_tokens(1) == (272, 544)
    assert p.group_covered_tokens(3) == (816, 1088)
    # Unit j of group g is keyed by fine hash (j + 1) * f_g - 1.
    assert p.unit_hash_index(0, 0) == 16
    assert p.unit_hash_index(0, 1) == 33
    assert p.unit_hash_index(1, 0) == 33
    assert p.unit_hash_index(1, 1) == 67
    _assert_pl_holds(p)


def test_attention_block_smaller_than_chunk_is_unsplittable(side: Side) -> None:
    # FULL 16 + MAMBA 544, h = 16, c = 272: 16 % 272 != 0 so attention keeps its 16-token block.
    p = side.build([("full", 16), ("mamba", 544)], 16, 272, 4096)
    assert p.units == (16, 544)
    assert p.hash_factors == (1, 34)
    assert p.splittable == (False, False)
    assert p.first_storable_chunks == (0, 1)
    assert p.claim_unit == 544  # lcm(272, 16, 544)
    # n = 300: attention holds 18 blocks = 288 tokens -> 1 chunk; mamba none -> 0.
    assert p.chunk_count_for_tokens(300) == 0
    assert p.chunk_count_for_tokens(544) == 2
    _assert_pl_holds(p)


def test_chunk_that_does_not_divide_the_mamba_block_raises_the_claim(side: Side) -> None:
    # Same groups, c = 64: lcm(64, 16, 544) = 2^6 * 17 = 1088; mamba's first storable chunk
    # is the one ending at 1088, i.e. 1088 / 64 - 1 = 16.
    p = side.build([("full", 16), ("mamba", 544)], 16, 64, 4096)
    assert p.units == (16, 544)
    assert p.claim_unit == 1088
    assert p.shortest_hit_prompt == 1089
    assert p.first_storable_chunks == (0, 16)
    # n = 1000: mamba has one unit (544 tokens) = 8.5 chunks -> 8.
    assert p.chunk_count_for_tokens(1000) == 8
    assert p.claimable_prefix_tokens(1088) == 0
    assert p.claimable_prefix_tokens(1089) == 1088
    _assert_pl_holds(p)


def test_gpt_oss_like_full_and_sliding(side: Side) -> None:
    # FULL 16 + SLIDING 16, h = 16, c = 256: neither block can be split by 256; claim 256.
    p = side.build([("full", 16), ("sliding", 16)], 16, 256, 131072)
    assert p.units == (16, 16)
    assert p.hash_factors == (1, 1)
    assert p.splittable == (False, False)
    assert p.first_storable_chunks == (0, 0)
    assert p.claim_unit == 256
    counts = [p.chunk_count_for_tokens(n) for n in (255, 256, 1000, 131072)]
    assert counts == [0, 1, 3, 512]
    assert p.group_covered_tokens(3) == (768, 768)
    # 131071 // 256 = 511 claim units.
    assert p.claimable_prefix_tokens(131072) == 511 * 256
    assert p.claimable_prefix_tokens(257) == 256
    assert p.claimable_prefix_tokens(256) == 0
    _assert_pl_holds(p)


def test_blocks_larger_than_the_chunk_both_split(side: Side) -> None:
    # FULL 64 + SLIDING 128, h = 16, c = 32: 32 divides both, so both split into 32-token units.
    p = side.build([("full", 64), ("sliding", 128)], 16, 32, 1000)
    assert p.units == (32, 32)
    assert p.hash_factors == (2, 2)
    assert p.splittable == (True, True)
    assert p.claim_unit == 32
    assert p.chunk_count_for_tokens(100) == 3
    _assert_pl_holds(p)


def test_unsplittable_block_that_is_not_a_multiple_of_the_chunk(side: Side) -> None:
    # FULL 48 + SLIDING 32, h = 16, c = 32: 32 does not divide 48, so FULL keeps 48-token units;
    # its first unit boundary on a chunk end is 96 = lcm(32, 48) -> chunk index 2; claim 96.
    p = side.build([("full", 48), ("sliding", 32)], 16, 32, 1000)
    assert p.units == (48, 32)
    assert p.splittable == (False, False)
    assert p.first_storable_chunks == (2, 0)
    assert p.claim_unit == 96
    # n = 48: FULL covers 48 >= 32 -> 1 chunk. n = 95: FULL still one unit (48) -> 1 chunk.
    # n = 96: two units, 96 tokens -> 3 chunks; SLIDING 96 -> 3.
    counts = [p.chunk_count_for_tokens(n) for n in (31, 48, 64, 95, 96)]
    assert counts == [0, 1, 1, 1, 3]
    # Two chunks (64 tokens) need two FULL units (96 tokens) and two SLIDING units (64).
    assert p.group_covered_tokens(2) == (96, 64)
    assert p.group_covered_tokens(1) == (48, 32)
    assert p.claimable_prefix_tokens(96) == 0
    assert p.claimable_prefix_tokens(97) == 96
    _assert_pl_holds(p)


def test_shortest_hit_exactly_at_max_model_len_is_accepted(side: Side) -> None:
    # claim 544 -> the shortest hit is 545 tokens; max_model_len 545 is just enough.
    p = side.build([("full", 544), ("mamba", 544)], 16, 544, 545)
    assert p.shortest_hit_prompt == p.max_model_len == 545
    with pytest.raises(side.error) as info:
        side.build([("full", 544), ("mamba", 544)], 16, 544, 544)
    assert info.value.field == "max_model_len"  # type: ignore[attr-defined]


def test_mamba_none_mode_block_as_long_as_the_model_is_refused(side: Side) -> None:
    # mamba_cache_mode='none' makes the mamba block max_model_len: no prefix can be restored.
    with pytest.raises(side.error) as info:
        side.build([("full", 16), ("mamba", 4096)], 16, 16, 4096)
    err: Any = info.value
    assert err.field == "max_model_len"
    assert "prefix caching" in str(err)
    assert "4097" in str(err)  # lcm(16, 16, 4096) + 1


def test_unreachable_geometry_names_the_minimum_max_model_len(side: Side) -> None:
    # c = 64 with mamba 544 gives claim 1088: max_model_len 1000 cannot hold 1089 tokens.
    with pytest.raises(side.error) as info:
        side.build([("full", 16), ("mamba", 544)], 16, 64, 1000)
    err: Any = info.value
    assert err.field == "max_model_len"
    assert "1089" in str(err)
    assert "chunk_size" in str(err)


def test_groups_list_is_stored_as_a_tuple(side: Side) -> None:
    groups = [(side.kinds("full"), 16)]
    p = side.planner(groups, 16, 16, 64)
    groups.append((side.kinds("mamba"), 16))  # the caller's list is not shared
    assert p.groups == ((side.kinds("full"), 16),)


def test_snapshot_is_plain_data(side: Side) -> None:
    p = side.build([("full", 544), ("mamba", 544)], 16, 272, 8192)
    snap = p.snapshot()
    assert snap["groups"] == (("full", 544), ("mamba", 544))

    def plain(value: object) -> bool:
        if isinstance(value, tuple):
            return all(plain(item) for item in value)
        return isinstance(value, (int, str))

    assert all(plain(value) for value in snap.values())
    assert {inv.id for inv in invariants_for("planner")} <= {f"PL-{i}" for i in range(1, 20)}


def test_make_planner_equals_the_constructor() -> None:
    kinds = spec.kinds.GroupKind
    made = spec.planner.make_planner([(kinds.FULL, 16), (kinds.MAMBA, 64)], 16, 64, 1024)
    built = spec.planner.HybridOffloadPlanner(((kinds.FULL, 16), (kinds.MAMBA, 64)), 16, 64, 1024)
    assert made == built
    assert made.claim_unit == 64


# ----------------------------------------------------------------- each PL-* check can fail

# A valid snapshot (FULL 544 + MAMBA 544, h = 16, c = 272) and, per invariant, edits that
# break exactly the statement the invariant makes. If a predicate were vacuous (always
# empty), its row would fail.
_CORRUPTIONS: list[tuple[str, str, dict[str, object]]] = [
    ("PL-1", "hash block does not divide the chunk", {"hash_block_size": 32}),
    ("PL-1", "hash block is zero", {"hash_block_size": 0}),
    ("PL-2", "mamba block split in two", {"units": (272, 272)}),
    ("PL-2", "one unit for two groups", {"units": (272,)}),
    ("PL-3", "attention kept whole though the chunk divides it", {"units": (544, 544)}),
    ("PL-3", "chunk size is zero", {"chunk_size": 0}),
    ("PL-4", "splittable flag disagrees with the unit", {"splittable": (False, False)}),
    ("PL-5", "hash factor miscounted", {"hash_factors": (17, 17)}),
    ("PL-5", "unit is not a multiple of the hash block", {"units": (272, 550)}),
    ("PL-6", "mamba said to store from chunk 0", {"first_storable_chunks": (0, 0)}),
    ("PL-7", "claim is a common multiple but not the least", {"claim_unit": 1088}),
    ("PL-7", "claim is not a multiple of the mamba unit", {"claim_unit": 272}),
    ("PL-8", "shortest hit does not recount", {"shortest_hit_prompt": 544}),
    ("PL-8", "shortest hit longer than the model", {"max_model_len": 500}),
]


def _valid_snapshot() -> dict[str, object]:
    kinds = spec.kinds.GroupKind
    planner = spec.planner.HybridOffloadPlanner(
        ((kinds.FULL, 544), (kinds.MAMBA, 544)), 16, 272, 8192
    )
    return planner.snapshot()


@pytest.mark.mutation("PL-1", "PL-2", "PL-3", "PL-4", "PL-5", "PL-6", "PL-7", "PL-8")
@pytest.mark.parametrize(
    ("inv_id", "edits"),
    [(inv_id, edits) for inv_id, _, edits in _CORRUPTIONS],
    ids=[f"{inv_id}-{why}" for inv_id, why, _ in _CORRUPTIONS],
)
def test_each_planner_invariant_catches_its_corruption(
    inv_id: str, edits: dict[str, object]
) -> None:
    snapshot = _valid_snapshot()
    assert check_all("planner", snapshot) == {}
    snapshot.update(edits)
    failing = check_all("planner", snapshot)
    assert inv_id in failing, failing
    assert all(isinstance(message, str) and message for message in failing[inv_id])
    with pytest.raises(spec.errors.InvariantViolation) as info:
        check(inv_id, snapshot)
    assert info.value.invariant_id == inv_id


def test_every_planner_invariant_has_a_corruption_case() -> None:
    registered = {inv.id for inv in invariants_for("planner")}
    assert len(registered) >= 5
    assert registered == {inv_id for inv_id, _, _ in _CORRUPTIONS}
