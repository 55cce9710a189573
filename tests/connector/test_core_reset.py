"""The core's reset (issue 17): ``reset_cache`` and ``release_store_pins``, without vLLM.

After a reset nothing the host held or was receiving is ever claimed: READY entries go at once,
stores and promotions in flight complete dropped whatever they report, keys a load pins are
remembered failed and evicted when the load reports. ``release_store_pins`` gives back every
pool reference once (none again at the report) and drops those stores.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from small_core import mamba_full_core

from hybridkv.connector import (
    ClaimKind,
    ConnectorCore,
    JobResult,
    KVConnectorOutput,
    RequestId,
    RequestView,
    ScheduledRequest,
    StepView,
)
from hybridkv.store import LookupResult

TOKENS = tuple(range(1, 34))  # 33 tokens: 32 claimable, 8 units of 4 per group
TABLE = tuple(tuple(1 + g * 100 + i for i in range(9)) for g in range(2))
# One step computing the 32 claimable tokens stores 8 full-attention units and the one mamba
# state it writes, at its end (MB-8: a state is stored only at the position its step wrote).
STORED = 8 + 1


class Pool:
    """Counts the references the core takes and gives back."""

    def __init__(self) -> None:
        self.refs: Counter[int] = Counter()

    def touch(self, blocks: Iterable[int]) -> None:
        self.refs.update(blocks)

    def free_blocks(self, ordered_blocks: Iterable[int]) -> None:
        self.refs.subtract(ordered_blocks)
        assert min(self.refs.values(), default=0) >= 0, "freed a block the core never touched"


def _view(rid: str, first: int = 1) -> RequestView:
    tokens = tuple(range(first, first + len(TOKENS)))
    return RequestView(RequestId(rid), tokens, len(tokens))


def _store(core: ConnectorCore, rid: str, first: int = 1) -> int:
    """One step computing the claimable prefix: its store job's id (not reported)."""
    scheduled = ScheduledRequest(_view(rid, first), TABLE, 0, 32)
    meta = core.build_connector_meta(StepView(1, (scheduled,)))
    (job,) = meta.store_jobs
    return int(job.job_id)


def _report(core: ConnectorCore, job: int, success: bool = True) -> None:
    core.update_connector_output(KVConnectorOutput(completed_jobs=(JobResult(job, success),)))


def _claim(core: ConnectorCore, rid: str) -> ClaimKind:
    return core.get_num_new_matched_tokens(_view(rid), 0).kind


def test_ready_entries_are_evicted_and_never_claimed() -> None:
    core = mamba_full_core(64)
    _report(core, _store(core, "a"))
    assert _claim(core, "b") is ClaimKind.ASYNC
    assert core.reset_cache() == STORED
    assert core.store.stats().used == 0
    assert _claim(core, "c") is ClaimKind.NONE
    assert core.resets == 1


def test_a_store_in_flight_at_a_reset_completes_dropped() -> None:
    core = mamba_full_core(64)
    pool = Pool()
    core.bind_gpu_block_pool(pool)
    job = _store(core, "a")
    core.reset_cache()
    assert core.store.stats().storing == STORED  # still being written: its slots stay reserved
    assert _claim(core, "b") is ClaimKind.DEFER
    _report(core, job, success=True)
    assert core.store.stats().used == 0
    assert core.stats().store_jobs_failed == 0
    assert _claim(core, "b") is ClaimKind.NONE
    assert +pool.refs == Counter()  # its pins went back at the report, once


def test_keys_a_load_pins_are_never_claimed_and_leave_with_the_load() -> None:
    core = mamba_full_core(64)
    _report(core, _store(core, "a"))
    view = _view("b")
    claim = core.get_num_new_matched_tokens(view, 0)
    core.update_state_after_alloc(view, TABLE, claim.num_tokens)
    loads = core.build_connector_meta(StepView(2, ())).load_jobs
    assert loads
    pinned = core.store.stats().pinned
    assert pinned > 0
    assert core.reset_cache() == STORED - pinned  # the entries the load does not pin
    assert core.store.stats().used == pinned
    assert _claim(core, "c") is ClaimKind.NONE
    for job in loads:
        _report(core, int(job.job_id))
    assert core.store.stats().used == 0
    assert _claim(core, "c") is ClaimKind.NONE


def test_a_promotion_in_flight_at_a_reset_completes_dropped() -> None:
    core = mamba_full_core(64)
    members = core.chunk_members(_view("a"), 4)
    assert core.reserve_promotion(members, None) is not None
    core.reset_cache()
    core.complete_promotion(members, True)
    assert all(core.store.status(k) is LookupResult.MISS for k in members)
    assert core.promotions_in_flight() == 0


def test_released_store_pins_go_back_once_and_their_stores_are_dropped() -> None:
    core = mamba_full_core(64)
    pool = Pool()
    core.bind_gpu_block_pool(pool)
    first, second = _store(core, "a"), _store(core, "b", first=100)
    assert core.held_blocks()
    held = Counter(core.held_blocks())
    assert held == +pool.refs
    assert Counter(core.release_store_pins()) == held
    assert core.held_blocks() == ()
    assert core.stats().held_blocks == 0
    assert +pool.refs == Counter()
    _report(core, first)
    _report(core, second)
    assert +pool.refs == Counter()  # not freed a second time (Pool asserts no negative count)
    assert core.store.stats().used == 0  # dropped, though they reported success
    assert core.release_store_pins() == ()
