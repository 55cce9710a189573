"""The optimized load path (``hybridkv.connector.loads``) agrees with the reference's
(``spec.connector.loads``) item for item.

The core's load path works on runs of units (a slice of keys per group, one loadability pass per
group, a slice of the block table), where the reference walks unit by unit. Hypothesis draws a
layout (with chunks smaller than a block, so several units share one block, and sliding windows
of several reaches), a claim ``[start, end)``, a block table with null slots and a short tail,
and the set of keys a load may read. Both sides build the same items from the same engine
hashes, split them into the same segments, and give the same resume point for the same
successful jobs.
"""

from __future__ import annotations

import zlib

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

import hybridkv.connector.api as core_api
import spec.connector_api as spec_api
from hybridkv.connector import ConnectorGeometry, RequestId, RequestView
from hybridkv.connector.loads import LoadRecord as CoreRecord
from hybridkv.connector.loads import load_items as core_load_items
from hybridkv.connector.loads import resume_point as core_resume_point
from hybridkv.connector.loads import segments as core_segments
from hybridkv.connector.requests import RequestKeys
from hybridkv.kinds import GroupKind as CoreKind
from hybridkv.planner import HybridOffloadPlanner as CorePlanner
from spec.connector.geometry import Geometry
from spec.connector.loads import LoadRecord as SpecRecord
from spec.connector.loads import load_items as spec_load_items
from spec.connector.loads import resume_point as spec_resume_point
from spec.connector.loads import segments as spec_segments
from spec.kinds import GroupKind
from spec.planner import HybridOffloadPlanner

FULL, SLIDING, MAMBA = "full", "sliding", "mamba"
MAX_LEN = 96

# name -> (groups (kind, block), hash block, chunk, sliding reaches or ())
LAYOUTS = {
    "full4+sliding4": (((FULL, 4), (SLIDING, 4)), 4, 4, (0, 9)),
    "full4+mamba8": (((FULL, 4), (MAMBA, 8)), 4, 8, ()),
    "mamba+sliding+full": (((MAMBA, 4), (SLIDING, 4), (FULL, 4)), 4, 8, (0, 13, 0)),
    "sliding13+sliding5+full": (((SLIDING, 4), (SLIDING, 4), (FULL, 4)), 4, 4, (13, 5, 0)),
    # Chunks smaller than the blocks: 2 or 4 units per attention block.
    "full16+mamba8-chunk4": (((FULL, 16), (MAMBA, 8)), 4, 4, ()),
    "full8+sliding8-chunk4": (((FULL, 8), (SLIDING, 8)), 4, 4, (0, 11)),
    "full2+sliding2-align2": (((FULL, 2), (SLIDING, 2)), 2, 2, (0, 3)),
    # Loads that restore every group at each aligned point, not only at their end: full
    # attention alone, and a window that reaches past the whole load.
    "full4": (((FULL, 4),), 4, 4, ()),
    "full4+sliding4-wide": (((FULL, 4), (SLIDING, 4)), 4, 4, (0, 99)),
}


def _sides(name: str) -> tuple[Geometry, ConnectorGeometry]:
    groups, hbs, chunk, reaches = LAYOUTS[name]
    spec_groups = tuple((GroupKind(kind), block) for kind, block in groups)
    core_groups = tuple((CoreKind(kind), block) for kind, block in groups)
    reference = Geometry.build(
        HybridOffloadPlanner(spec_groups, hbs, chunk, MAX_LEN),
        tuple(kind for kind, _ in spec_groups),
        reaches,
    )
    core = ConnectorGeometry.build(
        CorePlanner(core_groups, hbs, chunk, MAX_LEN),
        tuple(kind for kind, _ in core_groups),
        reaches,
    )
    return reference, core


def _plain(items: tuple[object, ...]) -> list[tuple[int, int, bytes, int]]:
    return [(i.group_idx, i.block_id, i.key, i.end_token) for i in items]  # type: ignore[attr-defined]


@st.composite
def loads(draw: st.DrawFn) -> tuple[str, int, int, tuple[tuple[int, ...], ...], float, int]:
    name = draw(st.sampled_from(sorted(LAYOUTS)))
    groups, hbs, _, _ = LAYOUTS[name]
    scheduler_block = max(block for _, block in groups)
    num_tokens = draw(st.integers(1, MAX_LEN))
    start = draw(st.integers(0, (num_tokens - 1) // scheduler_block)) * scheduler_block
    end = draw(st.integers(start + 1, num_tokens))
    tables = []
    for _, block in groups:
        whole = -(-num_tokens // block)
        # Mostly a whole table; sometimes one shorter than the claim needs (its tail is cut).
        length = draw(st.sampled_from((whole, whole, whole, draw(st.integers(0, whole)))))
        # Real blocks and some null slots (0).
        ids = st.lists(st.integers(0, 9), min_size=length, max_size=length)
        tables.append(tuple(draw(ids)))
    # Sometimes the table names fewer groups than the layout has: the missing ones load nothing.
    tables = tables[: draw(st.sampled_from((len(groups),) * 3 + (len(groups) - 1,)))]
    loadable_share = draw(st.sampled_from((1.0, 1.0, 0.8, 0.3)))
    seed = draw(st.integers(0, 2**16))
    del hbs
    return name, start, end, tuple(tables), loadable_share, num_tokens * 1000 + seed


@given(loads())
def test_load_items_segments_and_resume_points_agree(
    case: tuple[str, int, int, tuple[tuple[int, ...], ...], float, int],
) -> None:
    name, start, end, tables, share, seed = case
    reference, core = _sides(name)
    num_tokens = seed // 1000
    hbs = LAYOUTS[name][1]
    # The engine's block hashes: distinct, so every (group, unit) has its own key.
    hashes = tuple(f"h{seed}:{i}".encode().ljust(32, b".") for i in range(num_tokens // hbs))
    view = RequestView(RequestId("r"), tuple(range(num_tokens)), num_tokens, None, hashes)
    keys = RequestKeys.for_view(core, view)
    keys.sync(view)
    # Which keys a load may read: every key, or a share of them picked by the key's hash.
    readable = {
        key: zlib.crc32(key) % 100 < share * 100
        for g in range(core.num_groups)
        for key in (keys.key(g, j) for j in range(num_tokens // core.units[g]))
    }
    core_items = core_load_items(
        core, keys, tables, start, end, loadable=lambda batch: [readable[k] for k in batch]
    )
    spec_items = spec_load_items(
        reference, hashes, tables, start, end, loadable=lambda key: readable[key]
    )
    assert _plain(core_items) == _plain(spec_items)
    event(f"items: {'none' if not core_items else 'some'}; share {share}")
    align = core.align
    core_parts = core_segments(core_items, align)
    spec_parts = spec_segments(spec_items, align)
    assert [_plain(p) for p in core_parts] == [_plain(p) for p in spec_parts]
    # Resume points: the jobs picked by the seed succeed, the others fail.
    ids = range(1, len(core_parts) + 1)
    good = {job for job in ids if (seed >> job) & 1}
    core_jobs = tuple(core_api.JobId(job) for job in ids)
    spec_jobs = tuple(spec_api.JobId(job) for job in ids)
    core_record = CoreRecord(
        start=start, end=end, num_tokens=num_tokens, sync=False, cache_salt=None,
        items=core_items, jobs=core_jobs,
    )  # fmt: skip
    spec_record = SpecRecord(start, end, num_tokens, False, None, spec_items, spec_jobs)
    for core_job, core_part in zip(core_jobs, core_parts, strict=True):
        if core_job in good:
            core_record.jobs_succeeded([core_job], [item.key for item in core_part])
        else:
            core_record.job_failed(core_job, core_part)
    for spec_job, spec_part in zip(spec_jobs, spec_parts, strict=True):
        spec_record = spec_record.with_result(spec_job, spec_part, success=spec_job in good)
    assert core_record.good_keys == spec_record.good_keys
    assert core_record.bad_blocks == spec_record.bad_blocks
    assert core_resume_point(core, keys, core_record) == spec_resume_point(
        reference, hashes, spec_record
    )


def test_a_loadability_answer_of_the_wrong_length_is_refused() -> None:
    """``loadable`` answers one flag per key; a shorter answer is a caller's bug, refused
    rather than read as "the rest are not loadable"."""
    _, core = _sides("full4+sliding4")
    hashes = tuple(f"h{i}".encode().ljust(32, b".") for i in range(8))
    view = RequestView(RequestId("r"), tuple(range(32)), 32, None, hashes)
    keys = RequestKeys.for_view(core, view)
    keys.sync(view)
    tables = ((1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 5, 6, 7, 8))
    with pytest.raises(ValueError, match="zip"):
        core_load_items(core, keys, tables, 0, 16, loadable=lambda batch: [True])


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("outcomes", range(16))
def test_every_failure_pattern_of_a_four_segment_load_resumes_where_the_reference_does(
    name: str, outcomes: int
) -> None:
    """Every success/failure pattern of a load's first four segments (bit k: segment k+1
    succeeded), on every layout: the same resume point as the reference, including the first
    aligned point above the claim start when only the first segment landed (on the layouts
    whose loads restore every group at each aligned point)."""
    reference, core = _sides(name)
    num_tokens = MAX_LEN
    hbs = LAYOUTS[name][1]
    hashes = tuple(f"p{i}".encode().ljust(32, b".") for i in range(num_tokens // hbs))
    view = RequestView(RequestId("r"), tuple(range(num_tokens)), num_tokens, None, hashes)
    keys = RequestKeys.for_view(core, view)
    keys.sync(view)
    start, end = core.align, core.align * 5  # four segments past an aligned start
    tables = tuple(tuple(range(1, num_tokens // block + 1)) for _, block in LAYOUTS[name][0])
    core_items = core_load_items(
        core, keys, tables, start, end, loadable=lambda batch: [True] * len(batch)
    )
    spec_items = spec_load_items(reference, hashes, tables, start, end, loadable=lambda key: True)
    core_parts = core_segments(core_items, core.align)
    spec_parts = spec_segments(spec_items, core.align)
    ids = range(1, len(core_parts) + 1)
    core_record = CoreRecord(
        start=start, end=end, num_tokens=num_tokens, sync=False, cache_salt=None,
        items=core_items, jobs=tuple(map(core_api.JobId, ids)),
    )  # fmt: skip
    spec_record = SpecRecord(
        start, end, num_tokens, False, None, spec_items, tuple(map(spec_api.JobId, ids))
    )
    for job, core_part, spec_part in zip(ids, core_parts, spec_parts, strict=True):
        landed = bool(outcomes >> (job - 1) & 1) if job <= 4 else True
        if landed:
            core_record.jobs_succeeded([core_api.JobId(job)], [item.key for item in core_part])
        else:
            core_record.job_failed(core_api.JobId(job), core_part)
        spec_record = spec_record.with_result(spec_api.JobId(job), spec_part, success=landed)
    assert core_resume_point(core, keys, core_record) == spec_resume_point(
        reference, hashes, spec_record
    )
