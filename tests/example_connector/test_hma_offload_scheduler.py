"""examples/hma_offload's scheduler side on its own (no vLLM): claims, loads and stores over
the host store, on a sliding + full layout of 16-token blocks whose window reaches 31 tokens."""

from __future__ import annotations

import pytest

from examples.hma_offload.layout import Layout
from examples.hma_offload.scheduler import JobKind, OffloadScheduler, Scheduled
from hybridkv.canonical import CacheGroupSpec
from hybridkv.hashing import make_offload_key
from hybridkv.planner import GroupKind
from hybridkv.store import LookupResult

BLOCK = 16
LAYOUT = Layout(
    groups=(
        CacheGroupSpec(GroupKind.FULL, BLOCK, 1024, 1024, ("full.0",)),
        CacheGroupSpec(GroupKind.SLIDING, BLOCK, 1024, 1024, ("sliding.0",)),
    ),
    reaches=(0, 31),
    hash_block_size=BLOCK,
    num_blocks=64,
    max_model_len=1024,
)
PROMPT = [bytes([i]) * 32 for i in range(5)]  # 5 blocks of hashes: 80 tokens
TABLE = ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])  # full, sliding


def _stored(side: OffloadScheduler) -> None:
    """The prompt's first 64 tokens stored by one request and reported."""
    plan = side.plan_step([Scheduled(PROMPT, TABLE, 0, 64)])
    assert plan.loads == ()
    (job,) = plan.stores
    assert job.kind is JobKind.STORE
    assert [(p.group, p.block) for p in job.pairs] == [
        (0, 1), (0, 2), (0, 3), (0, 4), (1, 6), (1, 7), (1, 8), (1, 9)
    ]  # fmt: skip
    side.reported([(job.job_id, True)])


def test_an_empty_host_claims_nothing() -> None:
    side = OffloadScheduler(LAYOUT, host_slots=32)
    decision = side.claim("a", PROMPT, 80, 0)
    assert (decision.end, decision.defer) == (0, False)


def test_a_key_still_storing_defers_the_claim() -> None:
    side = OffloadScheduler(LAYOUT, host_slots=32)
    (job,) = side.plan_step([Scheduled(PROMPT, TABLE, 0, 64)]).stores
    assert side.claim("b", PROMPT, 80, 0).defer
    side.reported([(job.job_id, True)])
    decision = side.claim("b", PROMPT, 80, 0)
    assert (decision.end, decision.defer) == (64, False)


def test_a_load_pins_the_full_prefix_and_the_window_only() -> None:
    side = OffloadScheduler(LAYOUT, host_slots=32)
    _stored(side)
    assert side.claim("b", PROMPT, 80, 0).end == 64
    # vLLM's sliding table holds null blocks before the window of the claim's end (GR-4).
    side.allocated("b", PROMPT, ([11, 12, 13, 14], [0, 0, 17, 18]), 64)
    (load,) = side.plan_step([]).loads
    assert [(p.group, p.block) for p in load.pairs] == [
        (0, 11), (0, 12), (0, 13), (0, 14), (1, 17), (1, 18)
    ]  # fmt: skip
    keys = [make_offload_key(PROMPT[j], 0) for j in range(4)]
    keys += [make_offload_key(PROMPT[j], 1) for j in (2, 3)]
    assert [p.slot for p in load.pairs] == list(side.store.slots(keys))
    assert side.store.stats().pinned == 6
    side.reported([(load.job_id, True)])
    assert side.store.stats().pinned == 0
    assert side.hit_tokens == 64


def test_a_claimed_unit_without_a_block_is_an_error() -> None:
    side = OffloadScheduler(LAYOUT, host_slots=32)
    _stored(side)
    side.claim("b", PROMPT, 80, 0)
    with pytest.raises(RuntimeError, match="group 1 has no block"):
        side.allocated("b", PROMPT, ([11, 12, 13, 14], [0, 0, 0, 18]), 64)


def test_another_prefix_finds_nothing_and_a_failed_store_leaves() -> None:
    side = OffloadScheduler(LAYOUT, host_slots=32)
    other = [bytes([100 + i]) * 32 for i in range(5)]  # another prompt's chain
    (job,) = side.plan_step([Scheduled(PROMPT, TABLE, 0, 64)]).stores
    side.reported([(job.job_id, False)])
    key = make_offload_key(PROMPT[0], 0)
    assert side.store.status(key) is LookupResult.MISS
    assert side.claim("c", PROMPT, 80, 0).end == 0
    assert side.claim("d", other, 80, 0).end == 0


def test_a_full_host_stores_nothing_rather_than_evict_a_pinned_entry() -> None:
    side = OffloadScheduler(LAYOUT, host_slots=8)
    _stored(side)
    side.claim("b", PROMPT, 80, 0)
    side.allocated("b", PROMPT, ([11, 12, 13, 14], [0, 0, 17, 18]), 64)
    other = [bytes([100 + i]) * 32 for i in range(5)]  # another prompt's chain
    plan = side.plan_step([Scheduled(other, TABLE, 0, 64)])
    assert len(plan.loads) == 1
    # 6 of the 8 slots are pinned by the load; 2 unpinned READY entries cannot make room
    # for 8 new keys, so the store is refused whole (NO_SPACE) and nothing is evicted.
    assert plan.stores == ()
    assert side.store.stats().used == 8
