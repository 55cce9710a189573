"""The optimized core and the reference connector store the same mamba states under the same keys
when vLLM's prefill checkpoint is in play (MB-8).

Hypothesis draws a mamba + full layout (mamba block 2-8 hash blocks, full block one of its
divisors), a checkpoint rule (alignment, cache-hit grid a divisor of the mamba block, EAGLE drop,
lookahead), a step ``[start, end)`` with ``start`` on the scheduler block, and a block table
with null and real slots. Both sides get the same ``build_connector_meta`` call; their store
jobs must carry the same items. ``test_the_rule_moves_the_key`` is the guard: under EAGLE's
drop the checkpoint is stored under the position one block before its slot's end, so this file
exercises the case where slot and position differ.
"""

from __future__ import annotations

import math

from hypothesis import event, given
from hypothesis import strategies as st

import hybridkv.connector.api as core_api
import spec.connector_api as spec_api
from hybridkv.connector import NO_CHECKPOINTS, CheckpointRule, ConnectorCore
from hybridkv.kinds import GroupKind as CoreKind
from hybridkv.planner import HybridOffloadPlanner as CorePlanner
from hybridkv.store import HostStore as CoreStore
from spec.connector import ReferenceConnector
from spec.connector import checkpoints as spec_checkpoints
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
