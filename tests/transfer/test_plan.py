"""The vectorised copy planner against the per-pair reference, and host region boundaries."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from plan_reference import reference_plan

from hybridkv.cache_layouts import all_layout_cases
from hybridkv.canonical import CacheGroupSpec, CanonicalCaches, build_canonical_caches
from hybridkv.errors import HybridKVConfigError
from hybridkv.kinds import GroupKind
from hybridkv.transfer import Direction, TransferPair
from hybridkv.transfer.plan import CopyPlanner, CopyRun

NUM_BLOCKS = 6
NUM_SLOTS = 8
CASES = all_layout_cases(NUM_BLOCKS)
CACHES = [build_canonical_caches(c.kv_caches, c.groups, NUM_BLOCKS) for c in CASES]

# Mostly in range, sometimes just outside it, sometimes the wrong type.
_VALUE = st.one_of(
    st.integers(0, NUM_SLOTS - 1),
    st.integers(0, NUM_SLOTS - 1),
    st.integers(0, NUM_SLOTS - 1),
    st.sampled_from([-1, NUM_SLOTS, 1 << 70]),
    st.sampled_from([True, 1.0, "1", None]),
)


@st.composite
def _pair(draw: st.DrawFn, groups: int) -> object:
    if draw(st.integers(0, 40)) == 0:
        return draw(st.sampled_from([(0, 0), (0, 0, 0, 0), "pair", None]))
    if draw(st.integers(0, 20)) == 0:
        return draw(_VALUE), draw(_VALUE), draw(_VALUE)
    group = draw(st.one_of(st.integers(0, groups - 1), st.integers(0, groups - 1), _VALUE))
    block = draw(st.one_of(st.integers(0, NUM_BLOCKS - 1), _VALUE))
    slot = draw(st.one_of(st.integers(0, NUM_SLOTS - 1), _VALUE))
    if draw(st.booleans()):
        return (group, block, slot)  # a plain tuple: valid when its values are
    return TransferPair(group, block, slot)  # type: ignore[arg-type]


def _outcome(fn: object, *args: object) -> object:
    try:
        return fn(*args)  # type: ignore[operator]
    except HybridKVConfigError as err:
        return ("refused", err.field, repr(err.value), err.problem, err.fix)


@pytest.mark.parametrize("scalar_runs", [0, 128], ids=["vectorised", "short-job loop"])
@given(data=st.data())
def test_vectorised_planner_matches_the_reference(scalar_runs: int, data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(CASES) - 1))
    cc = CACHES[i]
    groups = len(CASES[i].groups)
    slot_bytes = max(cc.group_bytes(g) for g in range(groups))
    direction = data.draw(st.sampled_from([Direction.STORE, Direction.LOAD, "store"]))
    pairs = data.draw(st.lists(_pair(groups), max_size=10))
    planner = CopyPlanner(cc, NUM_SLOTS, slot_bytes, scalar_runs=scalar_runs)
    got = _outcome(lambda: planner.plan(direction, pairs).runs())  # type: ignore[arg-type]
    want = _outcome(reference_plan, cc, NUM_SLOTS, slot_bytes, direction, pairs)
    assert got == want


@pytest.mark.parametrize("scalar_runs", [0, 128], ids=["vectorised", "short-job loop"])
@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.name for c in CASES])
def test_every_layout_plans_valid_jobs_like_the_reference(index: int, scalar_runs: int) -> None:
    # Well-formed jobs (each path end to end, no fallback), every group at once.
    cc, groups = CACHES[index], len(CASES[index].groups)
    slot_bytes = max(cc.group_bytes(g) for g in range(groups))
    planner = CopyPlanner(cc, NUM_SLOTS, slot_bytes, scalar_runs=scalar_runs)
    stores = [TransferPair(b % groups, b, (5 * b + 3) % NUM_SLOTS) for b in range(NUM_BLOCKS)]
    loads = [TransferPair(b % groups, (b + 1) % NUM_BLOCKS, b) for b in range(NUM_BLOCKS)]
    for direction, pairs in ((Direction.STORE, stores), (Direction.LOAD, loads)):
        runs = planner.plan(direction, pairs).runs()
        assert runs == reference_plan(cc, NUM_SLOTS, slot_bytes, direction, pairs)
        assert sum(r.nbytes for r in runs) == sum(cc.group_bytes(p.group) for p in pairs)


def _flat(block: int, blocks: int) -> CanonicalCaches:
    import torch

    t = torch.zeros(blocks, block, dtype=torch.int8)
    spec = CacheGroupSpec(GroupKind.FULL, 16, block, block, ("flat",))
    return build_canonical_caches({"flat": t}, [spec], blocks)


def test_runs_never_cross_a_host_region_boundary() -> None:
    # Six consecutive blocks into six consecutive slots: one run in one region, three runs
    # when host memory is registered in regions of two slots.
    cc = _flat(256, 8)
    pairs = [TransferPair(0, b, b + 1) for b in range(6)]
    whole = CopyPlanner(cc, 8, 256).plan(Direction.STORE, pairs).runs()
    assert whole == [CopyRun(0, 0, 256, 6 * 256)]
    for scalar_runs in (0, 128):
        planner = CopyPlanner(cc, 8, 256, host_region_bytes=512, scalar_runs=scalar_runs)
        split = planner.plan(Direction.LOAD, pairs).runs()
        assert split == [
            CopyRun(0, 0, 256, 256),
            CopyRun(0, 256, 512, 512),
            CopyRun(0, 768, 1024, 512),
            CopyRun(0, 1280, 1536, 256),
        ]
        assert all(r.host_offset // 512 == (r.host_offset + r.nbytes - 1) // 512 for r in split)


def test_a_job_of_thousands_of_blocks_plans_as_arrays() -> None:
    # Scattered slots: no run merges; consecutive slots: all runs merge into one.
    n = 4096
    cc = _flat(64, n)
    planner = CopyPlanner(cc, n, 64)
    scattered = [TransferPair(0, b, (b * 7) % n) for b in range(n)]
    plan = planner.plan(Direction.STORE, scattered)
    assert len(plan) == n
    assert plan.host_offset.tolist() == [((b * 7) % n) * 64 for b in range(n)]
    contiguous = planner.plan(Direction.LOAD, [TransferPair(0, b, b) for b in range(n)])
    assert contiguous.runs() == [CopyRun(0, 0, 0, n * 64)]
    with pytest.raises(HybridKVConfigError) as err:
        planner.plan(Direction.STORE, [*scattered, TransferPair(0, 0, 7)])
    assert err.value.field == f"pairs[{n}].slot"
