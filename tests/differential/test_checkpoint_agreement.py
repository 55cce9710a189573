"""The optimized core and the reference connector store the same mamba states under the same keys
when vLLM's prefill checkpoint is in play (MB-8).

Hypothesis draws a mamba + full layout (mamba block 2-8 hash blocks, full block one of its
divisors), a checkpoint rule (alignment, cache-hit grid a divisor of the mamba block, EAGLE drop,
lookahead), a step ``[start, end)`` with ``start`` on the scheduler block, and a block table
with null and real slots. Both sides get the same ``build_connector_meta`` call; their store
jobs must carry the same items. ``test_the_rule_moves_the_key`` is the guard: under EAGLE's
drop the checkpoint is stored under the position one block before its slot's end, so this file
exercises the case where slot and position differ. Bad rules and a rule count that is not one per
group are refused on both sides naming the same field (the error types differ, as everywhere).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

import hybridkv.connector.api as core_api
import spec.connector_api as spec_api
from hybridkv.connector import NO_CHECKPOINTS, CheckpointRule, ConnectorCore, ConnectorGeometry
from hybridkv.errors import HybridKVConfigError
from hybridkv.kinds import GroupKind as CoreKind
from hybridkv.planner import HybridOffloadPlanner as CorePlanner
from hybridkv.store import HostStore as CoreStore
from spec.connector import ReferenceConnector
from spec.connector import checkpoints as spec_checkpoints
from spec.connector.geometry import Geometry
from spec.errors import ConfigError
from spec.kinds import GroupKind
from spec.planner import HybridOffloadPlanner
from spec.store import HostStore

HASH = 2
MAX_LEN = 256
TOKENS = tuple(range(1, MAX_LEN + 1))


def _sides(
    mamba_block: int, full_block: int, rule: tuple[int | None, int, bool, int]
) -> tuple[ReferenceConnector, ConnectorCore]:
    alignment, grid, drop, lookahead = rule
    groups = ((GroupKind.MAMBA, mamba_block), (GroupKind.FULL, full_block))
    chunk = full_block
    reference = ReferenceConnector(
        HybridOffloadPlanner(groups, HASH, chunk, MAX_LEN),
        HostStore(512, "lru"),
        (GroupKind.MAMBA, GroupKind.FULL),
        HASH,
        chunk,
        checkpoints=(
            spec_checkpoints.CheckpointRule(alignment, HASH, grid, drop, lookahead),
            spec_checkpoints.NONE,
        ),
    )
    core_groups = ((CoreKind.MAMBA, mamba_block), (CoreKind.FULL, full_block))
    core = ConnectorCore(
        CorePlanner(core_groups, HASH, chunk, MAX_LEN),
        CoreStore(512, "lru"),
        (CoreKind.MAMBA, CoreKind.FULL),
        HASH,
        chunk,
        checkpoints=(CheckpointRule(alignment, HASH, grid, drop, lookahead), NO_CHECKPOINTS),
    )
    return reference, core


def _stored(connector: object, api: object, table: tuple, start: int, end: int) -> list[tuple]:
    view = api.RequestView(api.RequestId("r"), TOKENS[: end + 1], end + 1)  # type: ignore[attr-defined]
    row = api.ScheduledRequest(view, table, start, end - start)  # type: ignore[attr-defined]
    meta = connector.build_connector_meta(api.StepView(0, (row,)))  # type: ignore[attr-defined]
    return sorted(
        (item.group_idx, item.block_id, item.key, item.end_token)
        for job in meta.store_jobs
        for item in job.items
    )


@st.composite
def cases(draw: st.DrawFn) -> tuple:
    mamba_block = HASH * draw(st.integers(1, 8))
    full_block = draw(
        st.sampled_from([d for d in range(HASH, mamba_block + 1, HASH) if mamba_block % d == 0])
    )
    divisors = [d for d in range(HASH, mamba_block + 1, HASH) if mamba_block % d == 0]
    grid = draw(st.sampled_from([mamba_block, *divisors]))  # the block half the time or more
    alignment = draw(st.sampled_from([None, 1, 1, HASH, grid]))
    rule = (alignment, grid, draw(st.booleans()), draw(st.integers(0, 3)))
    scheduler_block = math.lcm(mamba_block, full_block)
    start = scheduler_block * draw(st.integers(0, 3))
    end = start + draw(st.integers(1, 4 * mamba_block))  # a checkpoint needs two blocks or more
    slots = -(-end // min(mamba_block, full_block)) + 2
    mamba = tuple(draw(st.sampled_from([0, 1])) * (100 + i) for i in range(slots))
    full = tuple(200 + i for i in range(slots))
    return mamba_block, full_block, rule, start, min(end, MAX_LEN - 1), (mamba, full)


@given(cases())
def test_core_and_reference_store_the_same_states(case: tuple) -> None:
    mamba_block, full_block, rule, start, end, table = case
    if end <= start:
        return
    reference, core = _sides(mamba_block, full_block, rule)
    expected = _stored(reference, spec_api, table, start, end)
    assert _stored(core, core_api, table, start, end) == expected
    checkpoint = any(group == 0 and at < end for group, _, _, at in expected)
    event("a checkpoint state stored" if checkpoint else "no checkpoint state stored")


def test_the_rule_moves_the_key() -> None:
    """Mamba blocks of 4, EAGLE's drop, grid 4: a step [0, 13) exports the checkpoint at
    floor(13 / 4) * 4 - 4 = 8 into slot ceil(13 / 4) - 2 = 2, whose own end is 12. Both sides
    store block 102 at 8 (not at 12); without the checkpoint rule neither stores a state."""
    table = ((100, 0, 102, 103, 0, 0), (200, 201, 202, 203, 204, 205))
    for rule, expected in (((1, 4, True, 0), [8]), ((None, 4, True, 0), [])):
        reference, core = _sides(4, 4, rule)
        for connector, api in ((reference, spec_api), (core, core_api)):
            mamba = [row for row in _stored(connector, api, table, 0, 13) if row[0] == 0]
            assert [end for _, _, _, end in mamba] == expected
            assert [block for _, block, _, _ in mamba] == [102] * len(expected)


BAD_RULES = [
    ((0, 2, 4, False, 0), "alignment"),
    ((None, 0, 4, False, 0), "hash_block_size"),
    ((None, 2, True, False, 0), "cache_hit_alignment"),
    ((None, 2, 4, 1, 0), "drop_eagle_block"),
    ((None, 2, 4, False, -1), "hash_lookahead"),
]


def test_both_sides_refuse_a_bad_rule_naming_the_same_field() -> None:
    """The one legitimate difference is the error type (HybridKVConfigError / ConfigError)."""
    for fields, field in BAD_RULES:
        with pytest.raises(HybridKVConfigError) as core_error:
            CheckpointRule(*fields)
        with pytest.raises(ConfigError) as spec_error:
            spec_checkpoints.CheckpointRule(*fields)
        assert core_error.value.field == spec_error.value.field == field


def test_both_geometries_refuse_a_rule_count_that_is_not_one_per_group() -> None:
    with pytest.raises(HybridKVConfigError) as core_error:
        ConnectorGeometry.build(
            CorePlanner(((CoreKind.MAMBA, 4), (CoreKind.FULL, 4)), HASH, 4, MAX_LEN),
            (CoreKind.MAMBA, CoreKind.FULL),
            (),
            (NO_CHECKPOINTS,),
        )
    with pytest.raises(ConfigError) as spec_error:
        Geometry.build(
            HybridOffloadPlanner(((GroupKind.MAMBA, 4), (GroupKind.FULL, 4)), HASH, 4, MAX_LEN),
            (GroupKind.MAMBA, GroupKind.FULL),
            (),
            (spec_checkpoints.NONE,),
        )
    assert core_error.value.field == spec_error.value.field == "checkpoints"
