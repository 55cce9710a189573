"""Every kind of bad planner input, table-driven, on the reference model and the optimized one.

Each row gives the arguments, the field the error must carry, and a phrase the message must
contain (the group index, the minimum to set...). Both sides must raise their own config error
type (a ValueError), with that field, and a message that starts with the field's name.
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


class Side(NamedTuple):
    name: str
    planner: Any
    kinds: Any
    error: type[ValueError]


SIDES = [
    Side("spec", spec.planner.HybridOffloadPlanner, spec.kinds.GroupKind, spec.errors.ConfigError),
    Side(
        "hybridkv",
        hybridkv.planner.HybridOffloadPlanner,
        hybridkv.kinds.GroupKind,
        hybridkv.errors.HybridKVConfigError,
    ),
]


class Kind(NamedTuple):
    """A placeholder each side turns into its own GroupKind member."""

    value: str


FULL, SLIDING, MAMBA = Kind("full"), Kind("sliding"), Kind("mamba")
GOOD = [(FULL, 544), (MAMBA, 544)]


class Bad(NamedTuple):
    why: str
    groups: object
    h: object
    c: object
    max_len: object
    field: str
    phrase: str


# The good baseline is GOOD, h = 16, c = 272, max_model_len = 8192.
CONSTRUCTION = [
    Bad("groups empty", [], 16, 272, 8192, "groups", "non-empty"),
    Bad("groups not a sequence", None, 16, 272, 8192, "groups", "non-empty"),
    Bad("groups a string", "full", 16, 272, 8192, "groups", "non-empty"),
    Bad("groups a dict", {FULL: 16}, 16, 272, 8192, "groups", "non-empty"),
    Bad("entry not a pair", [(FULL, 16), 16], 16, 272, 8192, "groups", "group 1"),
    Bad("entry too short", [(FULL,)], 16, 272, 8192, "groups", "group 0"),
    Bad("entry too long", [(FULL, 16, 1)], 16, 272, 8192, "groups", "group 0"),
    Bad("kind as a string", [("full", 16)], 16, 272, 8192, "groups", "GroupKind"),
    Bad("kind missing", [(None, 16)], 16, 272, 8192, "groups", "group 0"),
    Bad("block zero", [(FULL, 544), (MAMBA, 0)], 16, 272, 8192, "block_size", "group 1"),
    Bad("block negative", [(FULL, -16)], 16, 272, 8192, "block_size", "group 0"),
    Bad("block float", [(FULL, 16.0)], 16, 272, 8192, "block_size", "group 0"),
    Bad("block bool", [(FULL, 544), (MAMBA, True)], 16, 272, 8192, "block_size", "group 1"),
    Bad("block string", [(FULL, "16")], 16, 272, 8192, "block_size", "group 0"),
    Bad("hash zero", GOOD, 0, 272, 8192, "hash_block_size", "positive"),
    Bad("hash negative", GOOD, -16, 272, 8192, "hash_block_size", "positive"),
    Bad("hash bool", GOOD, True, 272, 8192, "hash_block_size", "positive"),
    Bad("hash float", GOOD, 16.0, 272, 8192, "hash_block_size", "positive"),
    Bad("hash string", GOOD, "16", 272, 8192, "hash_block_size", "positive"),
    Bad("chunk zero", GOOD, 16, 0, 8192, "chunk_size", "positive"),
    Bad("chunk bool", GOOD, 16, False, 8192, "chunk_size", "positive"),
    Bad("chunk float", GOOD, 16, 272.0, 8192, "chunk_size", "positive"),
    Bad("chunk none", GOOD, 16, None, 8192, "chunk_size", "positive"),
    Bad("max len zero", GOOD, 16, 272, 0, "max_model_len", "positive"),
    Bad("max len negative", GOOD, 16, 272, -5, "max_model_len", "positive"),
    Bad("max len bool", GOOD, 16, 272, True, "max_model_len", "positive"),
    Bad("max len string", GOOD, 16, 272, "8192", "max_model_len", "positive"),
    # vLLM's hash contract: h divides every group block; the fix offers their gcd (16).
    Bad("hash misses a block", [(FULL, 48), (MAMBA, 64)], 32, 64, 8192, "hash_block_size", "16"),
    Bad(
        "hash misses group 1", [(FULL, 64), (MAMBA, 48)], 32, 64, 8192, "hash_block_size", "group 1"
    ),
    # c must be a multiple of h; the fix rounds 24 up to 32.
    Bad("chunk not a multiple", GOOD, 16, 24, 8192, "chunk_size", "32"),
    Bad("chunk below hash", GOOD, 16, 8, 8192, "chunk_size", "16"),
    # claim = lcm(64, 16, 544) = 1088: needs max_model_len >= 1089, or a smaller chunk.
    Bad("unreachable", [(FULL, 16), (MAMBA, 544)], 16, 64, 1000, "max_model_len", "1089"),
    Bad("one short", GOOD, 16, 272, 544, "max_model_len", "545"),
    # mamba_cache_mode='none': mamba block = max_model_len.
    Bad("mamba none mode", [(FULL, 16), (MAMBA, 4096)], 16, 16, 4096, "max_model_len", "prefix"),
    Bad("mamba longer", [(MAMBA, 8192)], 16, 16, 4096, "max_model_len", "mamba_cache_mode"),
    # Order: the first failing check wins (groups before sizes, sizes before relations).
    Bad("groups before sizes", [], 0, 0, 0, "groups", "non-empty"),
    Bad("block before hash", [(FULL, 0)], 0, 16, 64, "block_size", "group 0"),
    Bad("hash before chunk", GOOD, 0, 0, 0, "hash_block_size", "positive"),
    Bad("sizes before relations", [(FULL, 48)], 32, 24, 0, "max_model_len", "positive"),
    Bad("hash contract before chunk", [(FULL, 48)], 32, 24, 64, "hash_block_size", "group 0"),
]


def _typed(side: Side, groups: object) -> object:
    """Swap each Kind placeholder for the side's GroupKind; leave everything else as given."""
    if not isinstance(groups, list):
        return groups
    out: list[object] = []
    for entry in groups:
        if isinstance(entry, tuple):
            out.append(tuple(side.kinds(x.value) if isinstance(x, Kind) else x for x in entry))
        else:
            out.append(entry)
    return out


def _assert_config_error(side: Side, err: BaseException, field: str, phrase: str) -> None:
    assert type(err) is side.error
    assert isinstance(err, ValueError)
    assert err.field == field  # type: ignore[attr-defined]
    message = str(err)
    assert message.startswith(f"{field}="), message
    assert phrase in message, message


@pytest.mark.parametrize("side", SIDES, ids=lambda s: s.name)
@pytest.mark.parametrize("bad", CONSTRUCTION, ids=lambda b: b.why)
def test_bad_construction_is_refused_with_the_field(side: Side, bad: Bad) -> None:
    with pytest.raises(side.error) as info:
        side.planner(_typed(side, bad.groups), bad.h, bad.c, bad.max_len)
    _assert_config_error(side, info.value, bad.field, bad.phrase)


class BadQuery(NamedTuple):
    why: str
    method: str
    args: tuple[object, ...]
    field: str


QUERIES = [
    BadQuery("count negative", "chunk_count_for_tokens", (-1,), "num_tokens"),
    BadQuery("count bool", "chunk_count_for_tokens", (True,), "num_tokens"),
    BadQuery("count float", "chunk_count_for_tokens", (1.0,), "num_tokens"),
    BadQuery("count none", "chunk_count_for_tokens", (None,), "num_tokens"),
    BadQuery("storable string", "storable_prefix_tokens", ("3",), "num_tokens"),
    BadQuery("storable negative", "storable_prefix_tokens", (-544,), "num_tokens"),
    BadQuery("claimable negative", "claimable_prefix_tokens", (-1,), "num_tokens"),
    BadQuery("claimable bool", "claimable_prefix_tokens", (False,), "num_tokens"),
    BadQuery("covered negative", "group_covered_tokens", (-1,), "num_chunks"),
    BadQuery("covered float", "group_covered_tokens", (2.0,), "num_chunks"),
    BadQuery("group index past the end", "unit_hash_index", (2, 0), "group_index"),
    BadQuery("group index negative", "unit_hash_index", (-1, 0), "group_index"),
    BadQuery("group index bool", "unit_hash_index", (True, 0), "group_index"),
    BadQuery("unit index negative", "unit_hash_index", (0, -1), "unit_index"),
    BadQuery("unit index float", "unit_hash_index", (0, 1.5), "unit_index"),
]


@pytest.mark.parametrize("side", SIDES, ids=lambda s: s.name)
@pytest.mark.parametrize("bad", QUERIES, ids=lambda b: b.why)
def test_bad_query_is_refused_with_the_field(side: Side, bad: BadQuery) -> None:
    planner = side.planner(_typed(side, GOOD), 16, 272, 8192)
    before = planner.snapshot()
    with pytest.raises(side.error) as info:
        getattr(planner, bad.method)(*bad.args)
    _assert_config_error(side, info.value, bad.field, bad.field)
    assert planner.snapshot() == before  # a refused query changes nothing
