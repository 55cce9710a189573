"""Mutation evidence through the explorer: for every invariant id, a broken model it catches.

Each test injects one deliberately broken variant of one part into the engine (a method of the
block pool, a manager, the planner or the host store patched for the test; a subclass of the
scheduler or the connector handed to :func:`spec.system.scenarios.build_engines`), runs
:func:`spec.explorer.explore` over :class:`spec.system.model.EngineModel`, which checks EVERY
registered invariant in every state, and asserts that a counterexample names the targeted id,
with its shortest trace spelled out. Other ids may break in the same state; the search stops at
the first level with a violation, except where a test says why it looks further. The scenarios
are those of ``hybridkv check`` or small variants (explorer_harness.py);
``test_the_correct_model_breaks_nothing`` explores each one on the correct model at least as
deep as its mutations.

Where a variant reproduces a bug of the field notes, its docstring names it.
``docs/explanation/mutations.md`` tabulates id -> variant -> scenario -> trace, and
tests/test_mutation_evidence.py requires a test here marked ``mutation("<ID>")`` for every id,
or a state-machine test listed in :data:`STATE_MACHINE_EVIDENCE`.

One module for all families, past the house's few hundred lines: it is the table of evidence,
one short variant and one short test per id, read by id rather than top to bottom.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from enum import Enum
from typing import Any

import pool_harness
import pytest
from explorer_harness import (
    FairEngineModel,
    arc_store,
    caught,
    empty,
    salted,
    seeded,
    sliding,
    small_store,
    two_token_blocks,
    wedge,
    whole_prefix,
)
from test_connector_mutations import (
    AlwaysDelays,
    AttentionOnlyLoad,
    ForgetsFailures,
    NeverUnpins,
    OneTokenMore,
    SaltBlind,
    StoresOverPresentKeys,
)
from test_scheduler_mutations import _SingleGroupTruncation
from test_system_mutations import StoreBeforeCompute, UnpinnedStores

from spec.block_pool import NULL_BLOCK, BlockPool, HashKey
from spec.connector import ReferenceConnector
from spec.connector_api import RequestId, TransferItem
from spec.errors import ConfigError
from spec.explorer import explore
from spec.kinds import GroupKind
from spec.managers.base import SingleTypeManager
from spec.managers.full import FullAttentionManager
from spec.managers.group_spec import cdiv
from spec.managers.mamba import MambaManager
from spec.managers.sliding import SlidingWindowManager
from spec.planner import HybridOffloadPlanner
from spec.policies.arc import ARCPolicy
from spec.scheduler.request import RequestStatus
from spec.scheduler.scheduler import Scheduler
from spec.store import (
    EntryState,
    EventKind,
    HostStore,
    PrepareStoreOutput,
    StoreEvent,
    StorePriority,
    _Entry,
)
from spec.system.engine import Engine
from spec.system.model import EngineModel
from spec.system.scenarios import Recovery, Start

MAMBA = GroupKind.MAMBA

STATE_MACHINE_EVIDENCE: dict[str, str] = {
    # GR-6 breaks only when a mamba table is longer than the next allocation needs, which
    # takes a request put back to an earlier point with its tables kept: a block-level report
    # on a RUNNING request (the "39 < 40" regression, tests/regressions/test_crashes.py) or
    # rejected speculative tokens. The engine makes neither (a load's report names the
    # loading request's own blocks; no speculative decoding), so the coordinator machine,
    # which rolls requests back, finds it.
    "GR-6": (
        "stateful/test_coordinator_machine.py::test_gr6_unclamped_mamba_count_after_a_roll_back"
    ),
}
"""Ids the engine explorer cannot reach, and the state-machine test that breaks each one."""

CONTROLS: Mapping[str, tuple[Callable[[], list[Engine]], int, type[EngineModel]]] = {
    "seeded": (seeded, 6, EngineModel),
    "seeded, one request": (lambda: seeded(1), 5, EngineModel),
    "empty": (empty, 5, EngineModel),
    "full,sliding seeded": (sliding, 3, EngineModel),
    "whole prefix in the host, vllm": (lambda: whole_prefix(Recovery.VLLM), 3, EngineModel),
    "whole prefix in the host, shared": (lambda: whole_prefix(Recovery.SHARED), 5, EngineModel),
    "store of 4, empty": (lambda: small_store(Start.EMPTY, 4), 5, EngineModel),
    "store of 3, seeded": (lambda: small_store(Start.SEEDED, 3), 3, EngineModel),
    "ARC store of 2, seeded": (arc_store, 7, EngineModel),
    "salted tenants": (salted, 4, EngineModel),
    "wedge, fair": (wedge, 12, FairEngineModel),  # the whole reachable space
    "two-token blocks": (two_token_blocks, 5, EngineModel),
    "two-token blocks, host 4": (lambda: two_token_blocks(host=4), 3, EngineModel),
    "two-token blocks, store of 2": (lambda: two_token_blocks(store=2), 5, EngineModel),
    "two-token blocks, chunk 1": (lambda: two_token_blocks(hash_block=1, chunk=1), 4, EngineModel),
}


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_the_correct_model_breaks_nothing(name: str) -> None:
    """Every scenario above, unbroken: no violation at any level up to its mutations' depth."""
    build, depth, model = CONTROLS[name]
    result = explore(model(build()), depth, stop_at_first=False)
    assert result.violations == ()
    assert result.states > 1


# ----------------------------------------------------------------- BP: the block pool

_free_blocks = BlockPool.free_blocks
_cache_full_blocks = BlockPool.cache_full_blocks


def _free_without_requeue(self: BlockPool, ordered_blocks: Iterable[Any]) -> None:
    for block in ordered_blocks:
        if block != NULL_BLOCK:
            self._ref[block] -= 1


@pytest.mark.mutation("BP-1")
def test_bp1_free_forgets_to_requeue(monkeypatch: pytest.MonkeyPatch) -> None:
    """free_blocks drops the references but never queues a block that reaches 0: it leaks."""
    monkeypatch.setattr(BlockPool, "free_blocks", _free_without_requeue)
    found = caught("BP-1", seeded(), 3)
    assert found.trace == "step | load job 1 of r0 fails | step"
    assert found.messages == ("4 free + 0 referenced + 1 null != 7 blocks",)


def _touch_leaving_queued(self: BlockPool, blocks: Iterable[Any]) -> None:
    for block in (b for b in blocks if b != NULL_BLOCK):
        if self._ref[block] == 0:
            self._num_free -= 1
        self._ref[block] += 1


@pytest.mark.mutation("BP-2")
def test_bp2_touch_leaves_a_revived_block_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefix hit revives a cached free block but leaves it in the free queue (vLLM's touch
    removes it, block_pool.py:792-810): the next allocation hands out a block in use."""
    monkeypatch.setattr(BlockPool, "touch", _touch_leaving_queued)
    found = caught("BP-2", seeded(), 6)
    assert found.trace == "step | step | step | load job 1 of r0 completes | step | step"
    assert "block 3 has ref_count 1 but is queued" in found.messages


def _drop_hash_keeping_the_listing(self: BlockPool, block: Any) -> None:
    self._key.pop(block, None)


@pytest.mark.mutation("BP-3")
def test_bp3_eviction_leaves_the_block_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Evicting a block forgets its hash but leaves it listed under the key: a stale hit."""
    monkeypatch.setattr(BlockPool, "_drop_hash", _drop_hash_keeping_the_listing)
    found = caught("BP-3", empty(), 5)
    assert found.trace == "arrive r0 | step | store job 1 of r0 completes | step | step"
    assert found.ids == ("BP-3",)


def _cache_the_null_block_too(self: BlockPool, blocks: Any, block_hashes: Any, **kw: Any) -> None:
    _cache_full_blocks(self, blocks, block_hashes, **kw)
    for index in range(kw["num_cached_blocks"], kw["num_full_blocks"]):
        if blocks[index] == NULL_BLOCK and NULL_BLOCK not in self._key:
            key = HashKey(block_hashes[index], kw["kv_cache_group_id"])
            self._key[NULL_BLOCK] = key
            self._cached.setdefault(key, []).append(NULL_BLOCK)


@pytest.mark.mutation("BP-4")
def test_bp4_caching_does_not_skip_the_null_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """cache_full_blocks gives the null block (a mamba table's skipped position) a cache
    entry: a later hit would adopt the shared placeholder as a state."""
    monkeypatch.setattr(BlockPool, "cache_full_blocks", _cache_the_null_block_too)
    found = caught("BP-4", seeded(), 3)
    assert found.trace == "step | step | step"
    assert found.ids == ("BP-4",)


def _free_without_counting(self: BlockPool, ordered_blocks: Iterable[Any]) -> None:
    num_free = self._num_free
    _free_blocks(self, ordered_blocks)
    self._num_free = num_free


@pytest.mark.mutation("BP-5")
def test_bp5_free_forgets_the_free_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """free_blocks queues the blocks but does not update the hand-kept num_free_blocks."""
    monkeypatch.setattr(BlockPool, "free_blocks", _free_without_counting)
    found = caught("BP-5", seeded(), 3)
    assert found.trace == "step | load job 1 of r0 fails | step"
    assert found.messages == ("num_free_blocks is 4, the queue holds 6",)


def _free_counting_the_null_block(self: BlockPool, ordered_blocks: Iterable[Any]) -> None:
    blocks = list(ordered_blocks)
    _free_blocks(self, blocks)
    self._ref[NULL_BLOCK] -= blocks.count(NULL_BLOCK)


def _free_the_whole_table(self: SingleTypeManager, request_id: str, pool: BlockPool) -> None:
    table = self.req_to_blocks.pop(request_id, [])
    self.num_cached_block.pop(request_id, None)
    pool.free_blocks(list(reversed(table)))


@pytest.mark.mutation("BP-6")
def test_bp6_the_null_block_is_freed_like_a_real_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A manager frees its whole table, leading nulls included, and the pool decrements every
    block it is handed, as vLLM's free_blocks does: the null block's count goes negative."""
    monkeypatch.setattr(BlockPool, "free_blocks", _free_counting_the_null_block)
    monkeypatch.setattr(SingleTypeManager, "free", _free_the_whole_table)
    found = caught("BP-6", seeded(), 4)
    assert found.trace == "step | step | step | step"
    assert found.messages == ("block 0 has ref_count -1",)


def _drop_hash_keeping_an_empty_entry(self: BlockPool, block: Any) -> None:
    key = self._key.pop(block, None)
    if key is not None:
        self._cached[key].remove(block)


@pytest.mark.mutation("BP-7")
def test_bp7_eviction_leaves_an_empty_cache_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Evicting the last block of a key leaves the key in the map with no block."""
    monkeypatch.setattr(BlockPool, "_drop_hash", _drop_hash_keeping_an_empty_entry)
    found = caught("BP-7", empty(), 5)
    assert found.trace == "arrive r0 | step | store job 1 of r0 completes | step | step"
    assert found.ids == ("BP-7",)


# ----------------------------------------------------------------- GR: the groups

_count = SingleTypeManager.get_num_blocks_to_allocate


def _adopt_without_a_reference(  # noqa: PLR0917 - the signature it replaces
    self: SingleTypeManager,
    request_id: str,
    hit_blocks: Any,
    num_local_computed_tokens: int,
    num_external_computed_tokens: int,
    pool: BlockPool,
) -> None:
    total = num_local_computed_tokens + num_external_computed_tokens
    skipped = self.get_num_skipped_tokens(total) // self.block_size
    table = [NULL_BLOCK] * skipped + list(hit_blocks[skipped:])
    self.req_to_blocks[request_id] = table
    self.num_cached_block[request_id] = len(table)


@pytest.mark.mutation("GR-1")
def test_gr1_hit_adopted_without_a_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefix hit puts the cached blocks in the table without touching them: two tables
    list a block that counts one reference."""
    monkeypatch.setattr(SingleTypeManager, "add_local_computed_blocks", _adopt_without_a_reference)
    found = caught("GR-1", empty(), 5)
    assert found.trace == "arrive r0 | arrive r1 | step | abort r0 | step"
    assert found.ids == ("GR-1",)


def _lookup_ignoring_the_group(self: BlockPool, block_hash: Any, group_ids: Any) -> tuple[Any, ...]:
    found = []
    for _ in group_ids:
        blocks = self._cached.get(HashKey(block_hash, 0))
        if not blocks:
            return ()
        found.append(blocks[0])
    return tuple(found)


@pytest.mark.mutation("GR-2")
def test_gr2_lookup_ignores_the_group_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """A look-up ignores the group id of the key (vLLM keys blocks by hash AND group,
    BlockHashWithGroupId): the mamba group adopts a full-attention block as its state."""
    monkeypatch.setattr(BlockPool, "get_cached_block", _lookup_ignoring_the_group)
    found = caught("GR-2", seeded(), 6)
    assert found.trace == "step | step | step | load job 1 of r0 completes | step | step"
    assert found.messages == ("block 4 is in groups [0, 1]",)


def _cache_under_group_0(self: BlockPool, blocks: Any, block_hashes: Any, **kw: Any) -> None:
    _cache_full_blocks(self, blocks, block_hashes, **{**kw, "kv_cache_group_id": 0})


@pytest.mark.mutation("GR-3")
def test_gr3_every_group_caches_under_group_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cache entries are filed under group 0 whatever the group: a mamba state carries a
    full-attention key."""
    monkeypatch.setattr(BlockPool, "cache_full_blocks", _cache_under_group_0)
    found = caught("GR-3", seeded(), 3)
    assert found.trace == "step | step | step"
    assert found.messages == ("block 5 in group 1 carries a key of group 0",)


def _external_blocks_for_the_whole_prefix(
    self: SlidingWindowManager,
    request_id: str,
    num_local_computed_tokens: int,
    num_external_computed_tokens: int,
    pool: BlockPool,
) -> None:
    total = num_local_computed_tokens + num_external_computed_tokens
    table = self.req_to_blocks.setdefault(request_id, [])
    for index, block in enumerate(table):
        if block == NULL_BLOCK:
            table[index] = self._take(pool, 1)[0]
    table.extend(self._take(pool, max(0, cdiv(total, self.block_size) - len(table))))


@pytest.mark.mutation("GR-4")
def test_gr4_sliding_window_allocated_for_the_whole_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM #30166: the external tokens get real sliding-window blocks for the whole prefix,
    freed a step later (memory wasted, and a race with a connector still copying)."""
    monkeypatch.setattr(
        SlidingWindowManager,
        "allocate_external_computed_blocks",
        _external_blocks_for_the_whole_prefix,
    )
    found = caught("GR-4", sliding(), 1)
    assert found.trace == "step"
    assert found.messages == ("r0: real blocks at [0], window starts at 1",)


@pytest.mark.mutation("GR-5")
def test_gr5_mamba_keeps_its_older_states(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mamba manager never frees the state it no longer reads (align mode kept like
    mamba_cache_mode='all'): a running request holds one block per position."""
    monkeypatch.setattr(MambaManager, "_null_out", lambda self, table, end: [])
    found = caught("GR-5", empty(), 4)
    assert found.trace == "arrive r0 | step | step | abort r0"
    assert found.messages == ("r0: real blocks at [1] before the state at 2",)


def _count_without_the_external_tokens(
    self: SingleTypeManager, request_id: str, num_tokens: int, hit_blocks: Any, **kw: Any
) -> int:
    external = kw["total_computed_tokens"] - kw["num_local_computed_tokens"]
    return _count(self, request_id, num_tokens - external, hit_blocks, **kw)


@pytest.mark.mutation("GR-7")
def test_gr7_reservation_leaves_out_the_external_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention groups reserve for the new tokens only, not the claimed ones, so a load
    takes blocks nobody reserved (the class of D8, vLLM's count that misses the external mamba
    block, where get_new_blocks raises on a pool without slack)."""
    monkeypatch.setattr(
        SingleTypeManager, "get_num_blocks_to_allocate", _count_without_the_external_tokens
    )
    found = caught("GR-7", seeded(), 1)
    assert found.trace == "step"
    assert found.messages == ("group 0 took 1 blocks, reserved 0",)


@pytest.mark.mutation("GR-8")
def test_gr8_full_attention_given_a_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """The full-attention group skips tokens as a one-token window would (the kinds mixed up,
    the reverse of #41830): its table gets a null block and its forward reads garbage."""
    monkeypatch.setattr(FullAttentionManager, "get_num_skipped_tokens", lambda self, n: n - 1)
    found = caught("GR-8", seeded(), 4)
    assert found.trace == "step | step | step | step"
    assert found.ids == ("DATA-1", "GR-8")


# ----------------------------------------------------------------- PL: the planner
# The planner is fixed at construction, so a broken one is caught in the initial state.


@pytest.mark.mutation("PL-1")
def test_pl1_chunk_not_a_multiple_of_the_hash_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hash contract goes unchecked, so a 3-token chunk over 2-token hash blocks is
    accepted (the correct planner refuses it, naming chunk_size)."""
    with pytest.raises(ConfigError, match="chunk_size"):
        two_token_blocks(chunk=3)
    monkeypatch.setattr(HybridOffloadPlanner, "_check_hash_contract", lambda self: None)
    found = caught("PL-1", two_token_blocks(chunk=3), 0)
    assert found.trace == "(initial state)"
    assert found.messages == ("chunk_size 3 is not a multiple of 2",)


def _unit_by_the_chunk_rule(self: HybridOffloadPlanner, kind: GroupKind, block: int) -> int:
    return self.chunk_size if block % self.chunk_size == 0 else block


@pytest.mark.mutation("PL-2")
def test_pl2_mamba_split_into_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mamba group gets the attention chunk rule: 1-token units over 2-token blocks, states
    that exist only at block boundaries (LMCache's rule: chunk a multiple of the block)."""
    monkeypatch.setattr(HybridOffloadPlanner, "_unit", _unit_by_the_chunk_rule)
    found = caught("PL-2", two_token_blocks(hash_block=1, chunk=1), 0)
    assert found.trace == "(initial state)"
    assert found.messages == ("mamba group 1 has unit 1, block_size 2",)


def _attention_unit_always_the_chunk(
    self: HybridOffloadPlanner, kind: GroupKind, block: int
) -> int:
    return block if kind is MAMBA else self.chunk_size


@pytest.mark.mutation("PL-3")
def test_pl3_attention_unit_always_the_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """An attention unit is the chunk even when the chunk does not divide the block."""
    monkeypatch.setattr(HybridOffloadPlanner, "_unit", _attention_unit_always_the_chunk)
    found = caught("PL-3", empty(), 0)
    assert found.trace == "(initial state)"
    assert found.messages == ("full group 0 (block 1) has unit 2, not 1",)


@pytest.mark.mutation("PL-4")
def test_pl4_splittable_off_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group counts as splittable when its unit equals its block."""

    def splittable(self: HybridOffloadPlanner) -> tuple[bool, ...]:
        return tuple(u <= block for u, (_, block) in zip(self.units, self.groups, strict=True))

    monkeypatch.setattr(HybridOffloadPlanner, "splittable", property(splittable))
    found = caught("PL-4", seeded(), 0)
    assert found.trace == "(initial state)"
    assert "group 0: splittable=True but unit 1, block 1" in found.messages


@pytest.mark.mutation("PL-5")
def test_pl5_hash_factor_not_divided_by_the_hash_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hash factor is the unit in tokens, not in hash blocks (u instead of u / h)."""
    monkeypatch.setattr(HybridOffloadPlanner, "hash_factors", property(lambda self: self.units))
    found = caught("PL-5", two_token_blocks(), 0)
    assert found.trace == "(initial state)"
    assert "group 1 hash factor 2 != unit 2 / 2" in found.messages


def _first_chunk_from_1(self: HybridOffloadPlanner, unit: int) -> int:
    chunk = 1
    while (chunk + 1) * self.chunk_size % unit:
        chunk += 1
    return chunk


@pytest.mark.mutation("PL-6")
def test_pl6_first_storable_chunk_off_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The search for the first storable chunk starts at chunk 1."""
    monkeypatch.setattr(HybridOffloadPlanner, "_first_chunk_ending_on", _first_chunk_from_1)
    found = caught("PL-6", seeded(), 0)
    assert found.trace == "(initial state)"
    assert "group 1 first storable chunk 1, recount 0" in found.messages


@pytest.mark.mutation("PL-7")
def test_pl7_claim_unit_ignores_the_mamba_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Claims are per chunk, whatever the group units: a 1-token claim over a 2-token mamba
    block, whose state exists only every second token (wrong output, LMCache #2863's class)."""
    monkeypatch.setattr(HybridOffloadPlanner, "claim_unit", property(lambda self: self.chunk_size))
    found = caught("PL-7", two_token_blocks(hash_block=1, chunk=1), 0)
    assert found.trace == "(initial state)"
    assert found.messages == ("claim_unit 1 != lcm 2",)


@pytest.mark.mutation("PL-8")
def test_pl8_shortest_hit_forgets_the_computed_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shortest prompt that can hit is taken as one claim unit, forgetting the last
    prompt token, which is always computed."""
    monkeypatch.setattr(
        HybridOffloadPlanner, "shortest_hit_prompt", property(lambda self: self.claim_unit)
    )
    found = caught("PL-8", seeded(), 0)
    assert found.trace == "(initial state)"
    assert found.messages == ("shortest_hit_prompt 1 != claim_unit + 1",)


# ----------------------------------------------------------------- SC: the scheduler


class AcceptsAsIs(Scheduler):
    """vLLM 0.33 (D2 off): a claim is taken as the connector gives it, aligned or not."""

    def _accept(self, r: Any, local: int, claim: Any) -> int:
        return int(claim.num_tokens)


@pytest.mark.mutation("SC-1")
def test_sc1_unaligned_claim_allowed() -> None:
    """A connector claims one token past its alignment and the scheduler allows it: the
    computed count leaves the 2-token scheduler block (the alignment contract of #42554)."""
    found = caught(
        "SC-1", two_token_blocks(host=4, connector_cls=OneTokenMore, scheduler_cls=AcceptsAsIs), 1
    )
    assert found.trace == "step"
    assert found.messages == ("r0: claim ends at 5, not a multiple of 2",)


class WedgeOnEmptyChunk(Scheduler):
    """The field's async-claim wedge (as tests/spec/test_scheduler_mutations.py): the 0-token
    chunk of an async load is floored and breaks out before WAITING_FOR_REMOTE_KVS."""

    def _stops_on_empty_chunk(self, plan: object) -> bool:
        return True


@pytest.mark.mutation("SC-2")
def test_sc2_async_claim_floors_to_0_and_breaks_out() -> None:
    found = caught("SC-2", seeded(1, scheduler_cls=WedgeOnEmptyChunk), 1)
    assert found.trace == "step"
    assert found.messages == ("r0: async claim of 1 ended no_progress",)


class NoReserve(Scheduler):
    """#45387/#45388, before the reserve of #44560: admissions leave nothing for in-flight
    async loads."""

    def _reserves(self, r: Any, plan: Any) -> bool:
        return False


@pytest.mark.mutation("SC-3")
def test_sc3_deadlock_without_a_reserve_for_async_loads() -> None:
    """Both requests' loads are admitted; once they land neither can allocate its next token
    (one block free), nothing runs, nothing can be preempted: Running=0, Waiting=2. Every
    report arrives (the fair model), so the wedge is the scheduler's."""
    found = caught("SC-3", wedge(scheduler_cls=NoReserve), 9, model=FairEngineModel)
    assert found.trace == (
        "step | load job 1 of r0 completes | load job 2 of r1 completes"
        " | step | step | step | step | step | step"
    )
    assert found.messages == (
        "r0: waiting after 7 steps (bound 6)",
        "r1: waiting_for_remote_kvs after 7 steps (bound 6)",
    )


@pytest.mark.mutation("SC-4")
def test_sc4_single_group_truncation_on_a_two_group_layout() -> None:
    """The first load job (full attention up to 1) lands, the second (up to 2, with the mamba
    state) fails: full attention alone could resume at 1, the mamba group only at 0."""
    found = caught("SC-4", whole_prefix(Recovery.SHARED, scheduler_cls=_SingleGroupTruncation), 4)
    assert found.trace == "step | load job 1 of r0 completes | load job 2 of r0 fails | step"
    assert found.messages[0] == "r0: truncated to 1, group 1 valid only at (0,)"


class LostPreempted(Scheduler):
    """Preemption forgets to put the victim back in the waiting queue."""

    def _preempt(self, rid: RequestId) -> None:
        super()._preempt(rid)
        self.waiting.remove(rid)


@pytest.mark.mutation("SC-5")
def test_sc5_preempted_request_lost_from_the_queues() -> None:
    found = caught("SC-5", empty(scheduler_cls=LostPreempted), 4)
    assert found.trace == "arrive r0 | step | step | step"
    assert found.messages == ("r0 (preempted) is in no queue",)


class UncountedStatus(Scheduler):
    """Status changes that forget the hand-kept WAITING_FOR_REMOTE_KVS count."""

    def _set_status(self, rid: RequestId, status: RequestStatus, **changes: int) -> None:
        self.requests[rid] = self.requests[rid].evolve(status=status, **changes)


@pytest.mark.mutation("SC-6")
def test_sc6_remote_wait_count_not_updated() -> None:
    found = caught("SC-6", seeded(1, scheduler_cls=UncountedStatus), 1)
    assert found.trace == "step"
    assert found.messages == ("num_waiting_for_remote_kvs 0 != 1",)


class ForgottenLoad(Scheduler):
    """Enters WAITING_FOR_REMOTE_KVS without recording the load it waits for."""

    def _start_load(self, rid: RequestId, *args: Any) -> None:
        super()._start_load(rid, *args)
        del self.loads[rid]


@pytest.mark.mutation("SC-7")
def test_sc7_waiting_for_remote_kvs_without_a_load() -> None:
    found = caught("SC-7", seeded(1, scheduler_cls=ForgottenLoad), 1)
    assert found.trace == "step"
    assert found.messages == ("r0 waits for remote KV without a load",)


class LeakOnRelease(Scheduler):
    """Drops a finished request's hold but never frees its blocks."""

    def _release(self, rid: RequestId, hold: object) -> None:
        del self.holds[rid]


@pytest.mark.mutation("SC-8")
def test_sc8_finished_request_keeps_blocks_without_reason() -> None:
    found = caught("SC-8", seeded(1, scheduler_cls=LeakOnRelease), 3)
    assert found.trace == "step | load job 1 of r0 fails | step"
    assert found.messages == ("r0 is finished and holds blocks with no reason",)


class DeadlineIgnored(Scheduler):
    """vLLM #49829: a pending load has no deadline; the request waits for ever."""

    def _expire_loads(self) -> frozenset[RequestId]:
        return frozenset()


@pytest.mark.mutation("SC-9")
def test_sc9_deadline_ignored() -> None:
    found = caught("SC-9", seeded(1, scheduler_cls=DeadlineIgnored), 3)
    assert found.trace == "step | step | step"
    assert found.messages == ("r0: load pending for 2 steps (deadline 1)",)


# ----------------------------------------------------------------- SC-10..12: loads and the pool
# Issue 29, found by the pool model (spec.scheduler.pool_model): the claim rule before the
# admission rule, an async claim of the shared prefix for every request, on a pool of three.


@pytest.mark.mutation("SC-11")
def test_sc11_every_request_claims_the_shared_prefix() -> None:
    """One step admits four loads of three blocks into twelve: no room left for a tail."""
    found = pool_harness.caught("SC-11", pool_harness.ISSUE_29, 1)
    assert found.trace == "step"
    assert found.messages == (
        "loads hold 12 blocks (r0 3, r1 3, r2 3, r3 3); the least next chunk needs 1 more; "
        "the pool has 12",
    )


@pytest.mark.mutation("SC-10")
def test_sc10_loaded_requests_fill_the_pool() -> None:
    """Once the four loads land nothing runs, nothing loads, and no tail fits: the wedge."""
    found = pool_harness.caught("SC-10", pool_harness.ISSUE_29, 5)
    assert found.trace == "step | r0 lands | r1 lands | r2 lands | r3 lands"
    assert found.messages == (
        "wedge: nothing runs or loads, 0 of 12 blocks free, 12 held by loaded requests; "
        "next blocks needed: r0 1, r1 1, r2 1, r3 1",
    )


@pytest.mark.mutation("SC-12")
def test_sc12_the_engine_spins_without_progress() -> None:
    """After the wedge every step changes nothing: the window (2 steps) runs out."""
    found = pool_harness.caught("SC-12", pool_harness.ISSUE_29, 8)
    assert found.trace == "step | r0 lands | r1 lands | r2 lands | r3 lands | step | step | step"
    assert found.messages == ("3 steps without progress (window 2); unfinished: r0, r1, r2, r3",)


# ----------------------------------------------------------------- MB, SEC: the connector
# The variants of tests/spec/test_connector_mutations.py, now found by the explorer.


@pytest.mark.mutation("MB-1")
def test_mb1_attention_loaded_without_mamba_state() -> None:
    """LMCache #2863/#2845: the load restores attention KV and leaves the mamba state behind."""
    found = caught("MB-1", seeded(1, connector_cls=AttentionOnlyLoad), 1)
    assert found.trace == "step"
    assert found.messages == ("load of r0 ends at 1 but restores mamba group 1 at []",)


class StateAtStepEnd(ReferenceConnector):
    """A step ending off a block boundary stores the state block as it is (the state after the
    step's last token) under the last boundary's key: align mode keeps states at boundaries
    only."""

    def _store_items(self, hashes: Any, block_ids: Any, start: int, end: int) -> tuple[Any, ...]:
        items = super()._store_items(hashes, block_ids, start, end)
        unit = self.geometry.planner.units[1]
        if end % unit and block_ids[1] and block_ids[1][-1]:
            ref = self.geometry.unit(1, end // unit - 1)
            items += (TransferItem(1, block_ids[1][-1], self.geometry.key(hashes, ref), end),)
        return items


@pytest.mark.mutation("MB-2")
def test_mb2_mamba_state_stored_off_its_boundary() -> None:
    """r0's first step [0, 4) cannot store its state at 4 (a 2-entry store is full); the
    second step [4, 5) stores the state after 5 tokens under that key."""
    found = caught("MB-2", two_token_blocks(store=2, connector_cls=StateAtStepEnd), 3)
    assert found.trace == "arrive r0 | step | step"
    assert found.messages == ("store job 2 takes mamba group 1 at 5 (1x, unit 2)",)


@pytest.mark.mutation("MB-3")
def test_mb3_claim_through_the_last_token() -> None:
    """One token past the aligned claim: with the whole prompt but one in the host the load
    takes the last token too, which must be computed (vLLM asserts, scheduler.py:1331)."""
    found = caught("MB-3", whole_prefix(Recovery.VLLM, connector_cls=OneTokenMore), 1)
    assert found.trace == "step"
    assert found.messages == ("load of r0 spans [0, 3) of 3 tokens, alignment 1",)


@pytest.mark.mutation("MB-4")
def test_mb4_pins_outlive_the_load() -> None:
    """complete_load is never called: finished loads keep their host entries pinned."""
    found = caught("MB-4", seeded(1, connector_cls=NeverUnpins), 3)
    assert found.trace == "step | load job 1 of r0 completes | step"


@pytest.mark.mutation("MB-5")
def test_mb5_failed_prefix_claimed_again() -> None:
    """The failure memory is ignored: r1's load fails while r0's aborted load still pins the
    keys (so they stay in the host), and r1's re-ask claims them again."""
    found = caught("MB-5", seeded(connector_cls=ForgetsFailures), 6)
    assert found.trace == "step | abort r0 | step | load job 2 of r1 fails | step | step"


@pytest.mark.mutation("MB-6")
def test_mb6_store_job_over_ready_keys() -> None:
    """Every completed unit is written, those the host already holds READY included."""
    found = caught("MB-6", seeded(1, connector_cls=StoresOverPresentKeys), 3)
    assert found.trace == "step | step | step"


@pytest.mark.mutation("MB-7")
def test_mb7_free_delayed_without_a_store() -> None:
    """Every free is delayed, stores in flight or not."""
    found = caught("MB-7", seeded(1, connector_cls=AlwaysDelays), 1)
    assert found.trace == "abort r0"
    assert found.messages == ("r0 is delayed with no store in flight",)


class StateKeyedBySlot(ReferenceConnector):
    """A step ending off a block boundary stores its state block under the key of that block's
    start, the unit end the slot stands for one block earlier: the slot taken for the position,
    as vLLM's prefill checkpoint block was under EAGLE/MTP (one block before its slot's end)."""

    def _store_items(self, hashes: Any, block_ids: Any, start: int, end: int) -> tuple[Any, ...]:
        items = super()._store_items(hashes, block_ids, start, end)
        unit = self.geometry.planner.units[1]
        at = end // unit * unit
        if end % unit and at and block_ids[1] and block_ids[1][-1]:
            ref = self.geometry.unit(1, at // unit - 1)
            items += (TransferItem(1, block_ids[1][-1], self.geometry.key(hashes, ref), at),)
        return items


@pytest.mark.mutation("MB-8")
def test_mb8_mamba_state_keyed_by_its_slot() -> None:
    """r0's first step [0, 4) cannot store its state at 4 (a 2-entry store is full); the
    second step [4, 5) leaves the state after 5 tokens in slot 2 and the mutant stores it under
    the key of 4 (a unit end, so MB-2 holds)."""
    found = caught("MB-8", two_token_blocks(store=2, connector_cls=StateKeyedBySlot), 3)
    assert found.trace == "arrive r0 | step | step"
    assert found.messages == (
        "store job 2 of step [4, 5) keys block 5 of mamba group 1 at 4; the step wrote states "
        "at [5]",
    )


@pytest.mark.mutation("SEC-1")
def test_sec1_cache_salt_ignored() -> None:
    """The block hashes leave the cache_salt out: tenant b loads what tenant a stored."""
    found = caught("SEC-1", salted(connector_cls=SaltBlind), 4)
    assert found.trace == "arrive r0 | arrive r1 | abort r0 | step"
    assert all("(salt 'tenant-b')" in m and "salt 'tenant-a'" in m for m in found.messages)


# ----------------------------------------------------------------- ST: the host store

_prepare_store = HostStore.prepare_store
_complete_store = HostStore.complete_store
_stats = HostStore.stats


def _prepare_store_over_capacity(
    self: HostStore, keys: Any, priority: StorePriority = StorePriority.NORMAL, bound: Any = ()
) -> PrepareStoreOutput:
    incoming = tuple(key for key in keys if key not in self._entries)
    for key in reversed(incoming):
        self._entries[key] = _Entry(EntryState.STORING, 0, priority)
        self._policy.on_insert(key)
    self._counters["reserved"] += len(incoming)
    return PrepareStoreOutput(incoming, ())


@pytest.mark.mutation("ST-1")
def test_st1_store_admits_past_its_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare_store reserves every incoming key and evicts nothing."""
    monkeypatch.setattr(HostStore, "prepare_store", _prepare_store_over_capacity)
    found = caught("ST-1", small_store(Start.EMPTY, 4), 3)
    assert found.trace == "arrive r0 | step | step"
    assert found.messages == ("5 entries exceed capacity 4",)


@pytest.mark.mutation("ST-2")
def test_st2_storing_entries_counted_evictable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The evictable count is every unpinned entry, STORING ones included."""
    monkeypatch.setattr(
        HostStore, "stats", lambda self: (s := _stats(self))._replace(evictable=s.used - s.pinned)
    )
    found = caught("ST-2", seeded(1), 3)
    assert found.trace == "step | step | step"
    assert found.messages == ("evictable is 2, entries recount 1",)


class _Tombstone(Enum):
    FAILED = "failed"


def _complete_store_leaving_tombstones(self: HostStore, keys: Any, success: bool) -> None:
    _complete_store(self, keys, success)
    if not success:
        for key in keys:
            self._entries[key] = _Entry(_Tombstone.FAILED, 0)  # type: ignore[arg-type]
            self._policy.on_insert(key)


@pytest.mark.mutation("ST-3")
def test_st3_failed_store_leaves_a_tombstone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed store leaves its entries in a third state instead of dropping them."""
    monkeypatch.setattr(HostStore, "complete_store", _complete_store_leaving_tombstones)
    found = caught("ST-3", seeded(1), 5)
    assert found.trace == "step | step | step | store job 2 of r0 fails | step"
    assert all("has unknown state 'failed'" in m for m in found.messages)


def _prepare_store_overwriting(
    self: HostStore, keys: Any, priority: StorePriority = StorePriority.NORMAL, bound: Any = ()
) -> Any:
    present = [k for k in keys if k in self._entries and self._entries[k].state is EntryState.READY]
    prepared = _prepare_store(self, keys, priority, bound)
    if not isinstance(prepared, PrepareStoreOutput):
        return prepared
    for key in present:
        self._entries[key] = _Entry(EntryState.STORING, self._entries[key].pins)
    return PrepareStoreOutput((*present, *prepared.keys_to_store), prepared.evicted_keys)


@pytest.mark.mutation("ST-4")
def test_st4_store_rewrites_an_entry_a_load_pins(monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare_store re-reserves keys the host already holds, pins and all: a load may read
    an entry while it is rewritten."""
    monkeypatch.setattr(HostStore, "prepare_store", _prepare_store_overwriting)
    found = caught("ST-4", seeded(), 3)
    assert found.trace == "step | step | step"
    assert all(m.startswith("STORING key") and m.endswith("holds 1 pins") for m in found.messages)


def _prepare_store_evicting_pinned(
    self: HostStore, keys: Any, priority: StorePriority = StorePriority.NORMAL, bound: Any = ()
) -> Any:
    pinned = {key: entry for key, entry in self._entries.items() if entry.pins}
    # The victim choice no longer sees the pins.
    self._entries.update({key: _Entry(e.state, 0, e.priority) for key, e in pinned.items()})
    prepared = _prepare_store(self, keys, priority, bound)
    self._entries.update({key: e for key, e in pinned.items() if key in self._entries})
    return prepared


@pytest.mark.mutation("ST-5")
def test_st5_pinned_entry_evicted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The victim choice does not look at pins: an entry a load is reading is evicted."""
    monkeypatch.setattr(HostStore, "prepare_store", _prepare_store_evicting_pinned)
    found = caught("ST-5", small_store(Start.SEEDED, 3), 3)
    assert found.trace == "step | step | step"
    assert found.messages == ("entries hold 1 pins but 2 loads are in flight",)


def _complete_store_uncounted(self: HostStore, keys: Any, success: bool) -> None:
    removed = self._counters["removed"]
    _complete_store(self, keys, success)
    self._counters["removed"] = removed


@pytest.mark.mutation("ST-6")
def test_st6_failed_store_not_counted_as_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(HostStore, "complete_store", _complete_store_uncounted)
    found = caught("ST-6", seeded(1), 5)
    assert found.trace == "step | step | step | store job 2 of r0 fails | step"
    assert found.messages == ("reserved 4 != stored+removed+storing 3",)


def _complete_store_keeping_the_policy(self: HostStore, keys: Any, success: bool) -> None:
    if success:
        _complete_store(self, keys, success)
        return
    for key in keys:
        del self._entries[key]  # the policy is not told
    self._events.append(StoreEvent(EventKind.REMOVED, tuple(keys)))
    self._counters["removed"] += len(keys)


@pytest.mark.mutation("ST-7")
def test_st7_failed_store_stays_in_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed store drops its entries but the eviction policy keeps tracking them."""
    monkeypatch.setattr(HostStore, "complete_store", _complete_store_keeping_the_policy)
    found = caught("ST-7", seeded(1), 5)
    assert found.trace == "step | step | step | store job 2 of r0 fails | step"
    assert found.ids == ("ST-7",)


def _insert_keeping_the_ghost(self: ARCPolicy, key: bytes) -> None:
    self._t1[key] = None


@pytest.mark.mutation("ST-8")
def test_st8_arc_ghost_kept_when_its_key_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    """ARC re-inserts an evicted key without forgetting its ghost: a key both resident and a
    ghost."""
    monkeypatch.setattr(ARCPolicy, "on_insert", _insert_keeping_the_ghost)
    found = caught("ST-8", arc_store(), 5)
    assert found.trace == "step | store job 1 of r0 completes | step | step | step"
    assert found.ids == ("ST-8",)


def _evict_without_an_event(self: HostStore, victims: tuple[bytes, ...]) -> None:
    if victims:
        self._policy.on_evict(victims)
        for key in victims:
            del self._entries[key]
        self._counters["evicted"] += len(victims)


@pytest.mark.mutation("ST-9")
def test_st9_eviction_counted_without_its_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """An eviction is counted but its EVICTED event is lost (vLLM's KV events consumers never
    hear of it)."""
    monkeypatch.setattr(HostStore, "_evict", _evict_without_an_event)
    # Seeded: r0's prompt units, stored NORMAL, evict the seeded prefix (a decode step's units
    # are LOW and may not evict it, so an empty start evicts nothing in reach).
    found = caught("ST-9", small_store(Start.SEEDED, 3), 4)
    assert found.trace == "step | load job 1 of r0 completes | step | step"
    assert found.messages == ("counter evicted is 1, events hold 0",)


def _complete_store_filing_first(self: HostStore, keys: Any, success: bool) -> None:
    pending = len(self._events)
    _complete_store(self, keys, success)
    if success and len(self._events) > pending:
        self._events.insert(0, self._events.pop())


@pytest.mark.mutation("ST-10")
def test_st10_stored_event_filed_before_older_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A STORED event goes to the front of the pending events: a key evicted (its load failed)
    and stored again reads as evicted while it is READY."""
    monkeypatch.setattr(HostStore, "complete_store", _complete_store_filing_first)
    found = caught("ST-10", seeded(), 6)
    assert (
        found.trace
        == "step | load job 1 of r0 fails | step | step | store job 2 of r0 completes | step"
    )
    assert all("last reported evicted but is ready" in m for m in found.messages)


# ----------------------------------------------------------------- TR, DATA: the system


@pytest.mark.mutation("TR-1")
def test_tr1_free_before_the_store_completes() -> None:
    """Store sources are not pinned: the mamba state a store still reads is freed when the
    next state is written."""
    found = caught("TR-1", empty(connector_cls=UnpinnedStores), 4)
    assert found.trace == "arrive r0 | step | step | step"
    assert found.messages == ("store job 2 of r0: block 5 (group 1) is free or the null block",)


@pytest.mark.mutation("TR-2")
def test_tr2_store_reads_before_the_forward_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM #39306: the store copy is not ordered behind the forward that writes its blocks."""
    monkeypatch.setattr(Engine, "_launch", StoreBeforeCompute._launch)
    found = caught("TR-2", empty(), 2)
    assert found.trace == "arrive r0 | step"


@pytest.mark.mutation("DATA-1")
def test_data1_attention_restored_without_the_state() -> None:
    """LMCache #2863/#2845 end to end: MB-1 names the load at once; two levels on, the
    promoted request's forward reads the state slot the load never wrote. The search goes on
    past MB-1's level to reach it."""
    found = caught("DATA-1", seeded(1, connector_cls=AttentionOnlyLoad), 4, every_level=True)
    assert found.trace == "step | load job 1 of r0 completes | step | step"
    assert found.messages == (
        "r0 read block 2 (group 1, the state after 1 tokens of [1]) holding garbage(unwritten)",
    )
