"""hybridkv.planner's contract at its edges: every refusal whole, and each check's boundary.

The differential tests (tests/differential/test_planner_agreement.py) compare the planner
with the reference model on the derived fields and on the ``field`` a refusal names; these
pin the rest of what a user reads when a geometry is refused: the value, the problem, the fix
and the one-line message, with the group index and the numbers the fix suggests. They were
written for the mutants mutmut left alive in ``tools/mutants.py``'s run over the module
(docs/explanation/mutations.md, "Whole modules under mutmut").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from hybridkv.errors import HybridKVConfigError, readable
from hybridkv.kinds import GroupKind
from hybridkv.planner import HybridOffloadPlanner

FULL, SLIDING, MAMBA = GroupKind.FULL, GroupKind.SLIDING, GroupKind.MAMBA
PAIR_FIX = "pass one (kind, block_size) pair per KV cache group"
NOT_A_LIST = "must be a non-empty list or tuple of (kind, block_size)"
KIND_FIX = "use GroupKind.FULL, GroupKind.SLIDING or GroupKind.MAMBA"


def loose(value: object) -> Any:
    """``value`` typed as Any: the refusals below pass what the signatures forbid on purpose."""
    return value


def plan(groups: object, h: object = 16, c: object = 64, max_len: object = 4096) -> Any:
    return HybridOffloadPlanner(loose(groups), loose(h), loose(c), loose(max_len))


def refused(
    call: Callable[[], object], field: str, value: object, problem: str, fix: str
) -> HybridKVConfigError:
    """Run ``call``, which must refuse; check every part of the error and its message."""
    with pytest.raises(HybridKVConfigError) as info:
        call()
    err = info.value
    assert (err.field, err.problem, err.fix) == (field, problem, fix)
    assert type(err.value) is type(value)
    assert err.value == value
    assert str(err) == f"{field}={readable(value)}: {problem}; {fix}"
    return err


_GOOD = (FULL, 64)
_KIND_NAME = [_GOOD, ("mamba", 64)]
_SHORT_PAIR = [_GOOD, (MAMBA,)]
_LONG_PAIR = [_GOOD, (MAMBA, 64, 64)]
_RANGE_PAIR = [_GOOD, range(2)]
_STRING_PAIR = [_GOOD, "ab"]

# (id, groups, value, problem, fix): one row per refusal that names ``groups``.
GROUP_REFUSALS = [
    ("none", None, None, NOT_A_LIST, PAIR_FIX),
    ("empty-list", [], [], NOT_A_LIST, PAIR_FIX),
    ("empty-tuple", (), (), NOT_A_LIST, PAIR_FIX),
    ("a-string", "fu", "fu", NOT_A_LIST, PAIR_FIX),
    ("a-range", range(1), range(1), NOT_A_LIST, PAIR_FIX),
    ("kind-name", _KIND_NAME, _KIND_NAME, "group 1 kind 'mamba' is not a GroupKind", KIND_FIX),
    ("one-item", _SHORT_PAIR, _SHORT_PAIR, f"group 1 is {(MAMBA,)!r}, not a pair", PAIR_FIX),
    (
        "three-items",
        _LONG_PAIR,
        _LONG_PAIR,
        f"group 1 is {(MAMBA, 64, 64)!r}, not a pair",
        PAIR_FIX,
    ),
    ("a-range-entry", _RANGE_PAIR, _RANGE_PAIR, "group 1 is range(0, 2), not a pair", PAIR_FIX),
    ("a-string-entry", _STRING_PAIR, _STRING_PAIR, "group 1 is 'ab', not a pair", PAIR_FIX),
]


@pytest.mark.parametrize(
    ("groups", "value", "problem", "fix"),
    [row[1:] for row in GROUP_REFUSALS],
    ids=[row[0] for row in GROUP_REFUSALS],
)
def test_bad_groups_are_refused_with_value_problem_and_fix(
    groups: object, value: object, problem: str, fix: str
) -> None:
    refused(lambda: plan(groups), "groups", value, problem, fix)


@pytest.mark.parametrize("block", [0, -64, True, 64.0, "64", None])
def test_a_bad_block_size_names_its_group(block: object) -> None:
    refused(
        lambda: plan([_GOOD, (SLIDING, block)]),
        "block_size",
        block,
        "group 1 block_size must be a positive int",
        "set group 1 block_size to an int >= 1",
    )


@pytest.mark.parametrize("name", ["hash_block_size", "chunk_size", "max_model_len"])
@pytest.mark.parametrize("bad", [0, -1, True, 16.0, None])
def test_a_bad_size_is_refused_under_its_own_name(name: str, bad: object) -> None:
    sizes: dict[str, object] = {"h": 16, "c": 64, "max_len": 4096}
    sizes[{"hash_block_size": "h", "chunk_size": "c", "max_model_len": "max_len"}[name]] = bad
    refused(
        lambda: plan([_GOOD], **sizes),
        name,
        bad,
        f"{name} must be a positive int",
        f"set {name} to an int >= 1",
    )


def test_sizes_are_checked_in_the_contract_order() -> None:
    # groups, then each group's block, then hash_block_size, chunk_size and max_model_len,
    # each before the relations between them.
    assert refused_field(lambda: plan(None, 0, 0, 0)) == "groups"
    assert refused_field(lambda: plan([(FULL, 0)], 0, 0, 0)) == "block_size"
    assert refused_field(lambda: plan([(FULL, 48)], 0, 0, 0)) == "hash_block_size"
    assert refused_field(lambda: plan([(FULL, 48)], 32, 0, 0)) == "chunk_size"
    assert refused_field(lambda: plan([(FULL, 48)], 32, 40, 0)) == "max_model_len"
    assert refused_field(lambda: plan([(FULL, 48)], 32, 40, 1)) == "hash_block_size"


def refused_field(call: Callable[[], object]) -> str:
    with pytest.raises(HybridKVConfigError) as info:
        call()
    return info.value.field


def test_one_is_the_smallest_size_accepted() -> None:
    one = plan([(FULL, 1), (MAMBA, 1)], 1, 1, 2)
    assert (one.units, one.claim_unit, one.shortest_hit_prompt) == ((1, 1), 1, 2)


def test_hash_block_size_must_divide_every_block() -> None:
    # Group 0 (32) is divided by 16; group 1 (24) is not: the refusal names group 1 and
    # suggests the blocks' greatest common divisor.
    refused(
        lambda: plan([(FULL, 32), (SLIDING, 24), (MAMBA, 40)], 16, 64),
        "hash_block_size",
        16,
        "does not divide group 1's block_size 24",
        "use a divisor of every group block size, e.g. 8",
    )
    refused(
        lambda: plan([(MAMBA, 80), (FULL, 64)], 32, 64),
        "hash_block_size",
        32,
        "does not divide group 0's block_size 80",
        "use a divisor of every group block size, e.g. 16",
    )


@pytest.mark.parametrize(("chunk", "suggested"), [(40, 48), (17, 32), (8, 16)])
def test_chunk_size_must_be_a_multiple_of_hash_block_size(chunk: int, suggested: int) -> None:
    refused(
        lambda: plan([(FULL, 64)], 16, chunk),
        "chunk_size",
        chunk,
        "is not a multiple of hash_block_size 16",
        f"use a multiple of 16, e.g. {suggested}",
    )


def test_max_model_len_must_leave_room_for_one_hit() -> None:
    # claim_unit = lcm(64, 64, 96) = 192: a prompt of 193 tokens is the shortest that can hit.
    groups = [(FULL, 64), (SLIDING, 96)]
    assert plan(groups, 16, 64, 193).shortest_hit_prompt == 193
    refused(
        lambda: plan(groups, 16, 64, 192),
        "max_model_len",
        192,
        "no prompt can hit: the shortest that can is claim_unit + 1 = 193 tokens",
        "set max_model_len >= 193, or a smaller chunk_size",
    )


@pytest.mark.parametrize("max_len", [128, 100])
def test_a_mamba_block_as_long_as_the_model_suggests_prefix_caching(max_len: int) -> None:
    # Group 0 is a full block as long as the model (no advice about it); group 1, the mamba
    # block, is what makes every hit impossible.
    refused(
        lambda: plan([(FULL, 128), (MAMBA, 128)], 16, 64, max_len),
        "max_model_len",
        max_len,
        "mamba group 1 block_size 128 >= max_model_len (mamba_cache_mode='none'): "
        "its state exists only at the end",
        "enable prefix caching (mamba_cache_mode='align'), or set max_model_len >= 129",
    )


def test_a_short_mamba_block_gets_the_plain_advice() -> None:
    # The mamba block (64) is shorter than the model (150), the claim unit (192) is not.
    refused(
        lambda: plan([(SLIDING, 96), (MAMBA, 64)], 16, 64, 150),
        "max_model_len",
        150,
        "no prompt can hit: the shortest that can is claim_unit + 1 = 193 tokens",
        "set max_model_len >= 193, or a smaller chunk_size",
    )


@pytest.mark.parametrize("bad", [-1, True, 1.0, None])
@pytest.mark.parametrize(
    "method", ["chunk_count_for_tokens", "storable_prefix_tokens", "claimable_prefix_tokens"]
)
def test_a_bad_token_count_is_refused(method: str, bad: object) -> None:
    planner = plan([(FULL, 64)])
    refused(
        lambda: getattr(planner, method)(bad),
        "num_tokens",
        bad,
        "num_tokens must be an int >= 0",
        "pass num_tokens >= 0",
    )


@pytest.mark.parametrize("bad", [-1, False, 2.0, None])
def test_a_bad_chunk_count_is_refused(bad: object) -> None:
    refused(
        lambda: plan([(FULL, 64)]).group_covered_tokens(bad),
        "num_chunks",
        bad,
        "num_chunks must be an int >= 0",
        "pass num_chunks >= 0",
    )


@pytest.mark.parametrize("bad", [-1, True, 0.0, None])
def test_a_bad_group_index_is_refused(bad: object) -> None:
    refused(
        lambda: plan([(FULL, 64), (MAMBA, 64)]).unit_hash_index(bad, 0),
        "group_index",
        bad,
        "group_index must be an int >= 0",
        "pass group_index >= 0",
    )


@pytest.mark.parametrize("index", [2, 3])
def test_a_group_index_past_the_groups_is_refused(index: int) -> None:
    planner = plan([(FULL, 64), (MAMBA, 64)])
    assert planner.unit_hash_index(1, 0) == 3
    refused(
        lambda: planner.unit_hash_index(index, 0),
        "group_index",
        index,
        "there are only 2 groups",
        "use an index below 2",
    )


@pytest.mark.parametrize("bad", [-1, True, 0.5, None])
def test_a_bad_unit_index_is_refused(bad: object) -> None:
    refused(
        lambda: plan([(FULL, 64)]).unit_hash_index(0, bad),
        "unit_index",
        bad,
        "unit_index must be an int >= 0",
        "pass unit_index >= 0",
    )


def test_zero_is_a_count_every_query_accepts() -> None:
    planner = plan([(FULL, 64), (SLIDING, 96), (MAMBA, 128)])
    assert planner.chunk_count_for_tokens(0) == 0
    assert planner.storable_prefix_tokens(0) == 0
    assert planner.claimable_prefix_tokens(0) == 0
    assert planner.group_covered_tokens(0) == (0, 0, 0)
    assert planner.unit_hash_index(0, 0) == 3


def test_a_list_of_list_pairs_is_kept_as_a_tuple_of_tuples() -> None:
    planner = plan([[FULL, 64], [MAMBA, 128]])
    assert planner.groups == ((FULL, 64), (MAMBA, 128))
    assert type(planner.groups) is tuple
    assert all(type(pair) is tuple for pair in planner.groups)


def test_the_derived_geometry_of_a_mixed_model() -> None:
    # c = 64: the full block (128) splits into two chunk units; the sliding block (96) is not
    # a multiple of 64 and stays whole; the mamba block (64) is never split.
    planner = plan([(FULL, 128), (SLIDING, 96), (MAMBA, 64)], 16, 64, 4096)
    assert planner.units == (64, 96, 64)
    assert planner.hash_factors == (4, 6, 4)
    assert planner.splittable == (True, False, False)
    assert planner.first_storable_chunks == (0, 2, 0)
    assert (planner.claim_unit, planner.shortest_hit_prompt) == (192, 193)
    # 250 tokens: two 96-token sliding units end at 192, so three chunks; 191 tokens: one unit
    # (96), one chunk.
    assert planner.chunk_count_for_tokens(250) == 3
    assert planner.chunk_count_for_tokens(191) == 1
    assert planner.storable_prefix_tokens(250) == 192
    assert planner.claimable_prefix_tokens(193) == 192
    assert planner.claimable_prefix_tokens(192) == 0
    assert planner.claimable_prefix_tokens(385) == 384
    assert planner.group_covered_tokens(1) == (64, 96, 64)
    assert planner.group_covered_tokens(3) == (192, 192, 192)
    assert planner.unit_hash_index(1, 2) == 17


def test_the_snapshot_is_plain_data_in_the_schema_order() -> None:
    planner = plan([(FULL, 128), (MAMBA, 64)], 16, 64, 4096)
    shot = planner.snapshot()
    assert list(shot) == [
        "groups",
        "hash_block_size",
        "chunk_size",
        "max_model_len",
        "units",
        "hash_factors",
        "splittable",
        "first_storable_chunks",
        "claim_unit",
        "shortest_hit_prompt",
    ]
    assert shot["groups"] == (("full", 128), ("mamba", 64))
    assert shot["units"] == (64, 64)
    shot["units"] = ()
    assert planner.snapshot()["units"] == (64, 64)


def test_every_derived_count_is_an_int() -> None:
    # The PL-* predicates and the snapshot schema read ints: a float that equals the int
    # (2.0 for 2) would pass an equality and still change what the snapshot exports.
    planner = plan([(FULL, 128), (SLIDING, 96), (MAMBA, 64)], 16, 64, 4096)
    counts = (
        *planner.units,
        *planner.hash_factors,
        *planner.first_storable_chunks,
        planner.claim_unit,
        planner.shortest_hit_prompt,
        planner.chunk_count_for_tokens(250),
        planner.storable_prefix_tokens(250),
        planner.claimable_prefix_tokens(250),
        *planner.group_covered_tokens(3),
        planner.unit_hash_index(1, 2),
    )
    assert [type(count) for count in counts] == [int] * len(counts)
    assert [type(flag) for flag in planner.splittable] == [bool] * 3
