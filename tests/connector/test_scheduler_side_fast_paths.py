"""The scheduler side's fast paths answer exactly what the plain computation answers.

- :class:`RequestKeys` keeps the keys it built; they must equal a fresh chain's keys, follow
  the engine's hashes when those change under them, and refuse a unit past the hashed tokens.
- ``decide_claim(groups=(g,))`` scans one group; it must equal the whole scan with every other
  group's keys READY (the per-group prefix metric's definition).
- ``HostStore`` checks keys in one pass; a wrong key is still refused, naming the field.
- ``ConnectorCore.stats().held_blocks`` is a running count; it must equal ``held_blocks()``.
"""

from __future__ import annotations

import random

import pytest

from hybridkv.connector import (
    ConnectorCore,
    ConnectorGeometry,
    JobId,
    JobResult,
    KVConnectorOutput,
    RequestId,
    RequestView,
    ScheduledRequest,
    StepView,
)
from hybridkv.connector.claims import decide_claim
from hybridkv.connector.requests import RequestKeys
from hybridkv.errors import HybridKVConfigError
from hybridkv.kinds import GroupKind
from hybridkv.planner import HybridOffloadPlanner
from hybridkv.store import HostStore, LookupResult

HBS = 4
PLANNER = HybridOffloadPlanner(((GroupKind.FULL, 4), (GroupKind.MAMBA, 8)), HBS, 8, 64)
GEOMETRY = ConnectorGeometry.build(PLANNER, (GroupKind.FULL, GroupKind.MAMBA), ())
TOKENS = tuple(range(64))


def _hashes(seed: int, n: int) -> tuple[bytes, ...]:
    rng = random.Random(seed)
    return tuple(rng.randbytes(8) for _ in range(n))


def _view(tokens: int, hashes: tuple[bytes, ...] | None) -> RequestView:
    return RequestView(RequestId("r"), TOKENS[:tokens], tokens, None, hashes)


def _all_keys(keys: RequestKeys, tokens: int) -> list[bytes]:
    return [keys.key(g, j) for g in range(2) for j in range(tokens // GEOMETRY.units[g])]


@pytest.mark.parametrize("engine", [True, False])
def test_kept_keys_equal_a_fresh_chain_as_the_request_grows(engine: bool) -> None:
    hashes = _hashes(1, len(TOKENS) // HBS)
    kept = None
    for tokens in (16, 17, 40, 64):
        view = _view(tokens, hashes[: tokens // HBS] if engine else None)
        if kept is None:
            kept = RequestKeys.for_view(GEOMETRY, view)
        assert kept.matches(view)
        kept.sync(view)
        fresh = RequestKeys.for_view(GEOMETRY, view)
        fresh.sync(view)
        assert _all_keys(kept, tokens) == _all_keys(fresh, tokens)
        assert len(set(_all_keys(kept, tokens))) == len(_all_keys(kept, tokens)) > 0


def test_kept_keys_follow_engine_hashes_that_changed_under_them() -> None:
    before = _hashes(2, 8)
    keys = RequestKeys.for_view(GEOMETRY, _view(32, before))
    keys.sync(_view(32, before))
    old = _all_keys(keys, 32)
    after = before[:5] + _hashes(3, 3)  # blocks 5.. re-hashed (a streaming session's update)
    keys.sync(_view(32, after))
    fresh = RequestKeys.for_view(GEOMETRY, _view(32, after))
    fresh.sync(_view(32, after))
    assert _all_keys(keys, 32) == _all_keys(fresh, 32) != old


def test_a_unit_past_the_hashes_is_refused_and_a_negative_one_read_as_before() -> None:
    hashes = _hashes(4, 4)
    keys = RequestKeys.for_view(GEOMETRY, _view(16, hashes))
    keys.sync(_view(16, hashes))
    with pytest.raises(IndexError):
        keys.key(0, 4)
    assert keys.key(0, 3) == hashes[3] + GEOMETRY.suffixes[0]  # the units below were kept
    assert keys.key(0, -1) == hashes[-1] + GEOMETRY.suffixes[0]  # index -1, as it always was


def test_one_group_scan_equals_the_whole_scan_with_other_groups_ready() -> None:
    rng = random.Random(7)
    for case in range(300):
        hashes = _hashes(100 + case, len(TOKENS) // HBS)
        view = _view(len(TOKENS), hashes)
        keys = RequestKeys.for_view(GEOMETRY, view)
        keys.sync(view)
        every = _all_keys(keys, len(TOKENS))
        state = {k: rng.choice(list(LookupResult)) for k in every if rng.random() < 0.8}
        failed = {k for k in every if rng.random() < 0.05}
        start = rng.choice((0, 8, 16, 24))
        for g, suffix in enumerate(GEOMETRY.suffixes):

            def whole(
                key: bytes, suffix: bytes = suffix, state: dict[bytes, LookupResult] = state
            ) -> LookupResult:
                if not key.endswith(suffix):
                    return LookupResult.HIT
                found = state.get(key, LookupResult.MISS)
                return found if found is LookupResult.HIT else LookupResult.MISS

            mine = {k for k in failed if k.endswith(suffix)}
            expected = decide_claim(
                GEOMETRY, keys.key, len(TOKENS), start, status=whole, failed=mine
            )
            got = decide_claim(
                GEOMETRY, keys.key, len(TOKENS), start, status=whole, failed=failed, groups=(g,)
            )
            assert got == expected


def test_store_refuses_wrong_keys_as_before() -> None:
    store = HostStore(4, "lru")
    key = b"k" * 8
    prepared = store.prepare_store([key])
    assert prepared.keys_to_store == (key,)
    store.complete_store([key], success=True)
    assert store.status(key) is LookupResult.HIT
    for wrong in (b"", "text", ["unhashable"], memoryview(key)):
        with pytest.raises(HybridKVConfigError) as refused:
            store.status(wrong)  # type: ignore[arg-type]
        assert refused.value.field == "key"
    for keys in ([key, b""], [key, "text"], (key, 3)):
        with pytest.raises(HybridKVConfigError) as refused:
            store.touch(keys)  # type: ignore[arg-type]
        assert refused.value.field == "keys"

    other = b"o" * 8
    with pytest.raises(HybridKVConfigError) as refused:
        store.slots([key, other])
    assert refused.value.field == "keys"
    assert refused.value.value == other  # names the first key without an entry
    assert store.slots([key]) == (0,)

    class Key(bytes):
        """A bytes subclass is a key, as before."""

    assert store.status(Key(key)) is LookupResult.HIT
    assert store.lookup([Key(key), key]).hits == 2


class _Pool:
    """A GPU block pool that counts references (touch +1, free -1)."""

    def __init__(self) -> None:
        self.refs: dict[int, int] = {}

    def touch(self, blocks: object) -> None:
        for b in blocks:  # type: ignore[attr-defined]
            self.refs[b] = self.refs.get(b, 0) + 1

    def free_blocks(self, ordered_blocks: object) -> None:
        for b in ordered_blocks:  # type: ignore[attr-defined]
            self.refs[b] -= 1


def test_held_count_equals_the_held_blocks_through_stores_and_reports() -> None:
    planner = HybridOffloadPlanner(((GroupKind.FULL, 4), (GroupKind.SLIDING, 4)), 2, 4, 1 << 14)
    core = ConnectorCore(
        planner,
        HostStore(64, "lru"),
        (GroupKind.FULL, GroupKind.SLIDING),
        2,
        4,
        sliding_windows=(0, 7),
    )
    pool = _Pool()
    core.bind_gpu_block_pool(pool)
    tables = {}
    in_flight: list[tuple[JobId, bool]] = []
    for step in range(12):
        rows = []
        for r in range(2):
            rid = f"r{r}"
            tokens = tuple(range(r * 1000, r * 1000 + 8 * (step + 1)))
            tables[rid] = tuple(
                tuple(100 * g + r * 50 + i for i in range(step + 1)) for g in (1, 2)
            )
            view = RequestView(RequestId(rid), tokens, len(tokens))
            rows.append(ScheduledRequest(view, tables[rid], 8 * step, 8))
        meta = core.build_connector_meta(StepView(step, tuple(rows)))
        in_flight += [(JobId(j.job_id), step % 3 != 1) for j in meta.store_jobs]
        held = core.held_blocks()
        assert core.stats().held_blocks == len(held) == sum(pool.refs.values())
        if step % 2:  # report the older half, one failed in three
            done, in_flight = in_flight[: len(in_flight) // 2], in_flight[len(in_flight) // 2 :]
            results = tuple(JobResult(j, ok) for j, ok in done)
            core.update_connector_output(KVConnectorOutput(completed_jobs=results))
            assert core.stats().held_blocks == len(core.held_blocks()) == sum(pool.refs.values())
    assert in_flight
    assert core.stats().held_blocks > 0  # the count was non-zero when compared


def test_request_keys_lend_the_cores_chain_only_for_engine_hashes() -> None:
    planner = HybridOffloadPlanner(((GroupKind.FULL, 4), (GroupKind.MAMBA, 8)), HBS, 8, 64)
    core = ConnectorCore(planner, HostStore(64, "lru"), (GroupKind.FULL, GroupKind.MAMBA), 4, 8)
    engine = _view(32, _hashes(9, 8))
    core.get_num_new_matched_tokens(engine, 0)
    lent = core.request_keys(engine)
    assert lent is core.request_keys(engine)  # the core's own chain, not a copy
    fresh = RequestKeys.for_view(GEOMETRY, engine)
    fresh.sync(engine)
    assert _all_keys(lent, 32) == _all_keys(fresh, 32)
    own = _view(32, None)
    before = core.stats()
    first, second = core.request_keys(own), core.request_keys(own)
    assert first is not second  # hashed here: a fresh chain each time, never kept
    assert _all_keys(first, 32) == _all_keys(second, 32)
    assert core.stats() == before  # nothing counted or recorded


def _fresh(view: RequestView) -> list[bytes]:
    chain = RequestKeys.for_view(GEOMETRY, view)
    chain.sync(view)
    return _all_keys(chain, len(view.token_ids))


def _core() -> ConnectorCore:
    planner = HybridOffloadPlanner(((GroupKind.FULL, 4), (GroupKind.MAMBA, 8)), HBS, 8, 64)
    return ConnectorCore(planner, HostStore(64, "lru"), (GroupKind.FULL, GroupKind.MAMBA), 4, 8)


def test_request_keys_answer_a_request_the_core_never_saw() -> None:
    core = _core()
    unseen = _view(32, _hashes(9, 8))
    assert _all_keys(core.request_keys(unseen), 32) == _fresh(unseen)  # no chain of its own yet
    assert core.stats().hashes_computed == 0  # and none is made: nothing hashed in the core
    core.get_num_new_matched_tokens(unseen, 0)
    assert _all_keys(core.request_keys(unseen), 32) == _fresh(unseen)


def test_request_keys_without_engine_hashes_never_grow_the_cores_own_chain() -> None:
    """Hashed outside the core, the chain is fresh each time: the core's own chain (built
    without engine hashes too) stays where it was, so what the core later hashes and counts is
    what a core never asked counts."""
    asked, quiet = _core(), _core()
    for core in (asked, quiet):
        core.get_num_new_matched_tokens(_view(16, None), 0)
    grown = _view(32, None)
    lent = asked.request_keys(grown)
    assert _all_keys(lent, 32) == _fresh(grown)
    assert lent is not asked.request_keys(grown)
    for core in (asked, quiet):
        core.get_num_new_matched_tokens(grown, 0)
    assert asked.stats() == quiet.stats()
    assert asked.stats().hashes_computed == 32 // HBS  # each hash block once, in the core
