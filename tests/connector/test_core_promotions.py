"""The core's remote-tier entry (issue 12): ``chunk_members``, ``reserve_promotion``,
``complete_promotion``, ``job_kind``.

A promotion's keys enter the store STORING through the core, so the claim DEFERs on them like
on any STORING key, and leave READY (then claimable) or removed (the claim ends before them).
Nothing here changes the core's behaviour when no promotion is reserved (the differential
tests against spec/connector run without these calls).
"""

from __future__ import annotations

import pytest
from small_core import mamba_full_core

from hybridkv.connector import (
    ClaimKind,
    ConnectorCore,
    JobId,
    RequestId,
    RequestView,
    StepView,
    TransferKind,
)
from hybridkv.errors import HybridKVConfigError
from hybridkv.kinds import GroupKind
from hybridkv.planner import HybridOffloadPlanner
from hybridkv.store import HostStore, LookupResult

FULL, MAMBA = GroupKind.FULL, GroupKind.MAMBA
TOKENS = tuple(range(1, 34))  # 33 tokens: 32 claimable, 8 units of 4


def _core(capacity: int = 1024) -> ConnectorCore:
    return mamba_full_core(capacity)


def _view(rid: str, salt: str | None = None) -> RequestView:
    return RequestView(RequestId(rid), TOKENS, len(TOKENS), salt)


def test_chunk_members_are_every_group_ending_there_and_salted() -> None:
    core = _core()
    whole = core.chunk_members(_view("A"), 8)
    attention = core.chunk_members(_view("A"), 8, recurrent=False)
    assert len(whole) == 2
    assert attention == whole[:1]  # group order: the full group first, the mamba state second
    assert core.chunk_members(_view("B"), 8) == whole  # content-addressed: same tokens
    assert core.chunk_members(_view("A"), 7) == ()  # no unit ends at 7
    assert core.chunk_members(_view("A"), 0) == ()
    salted = core.chunk_members(_view("C", "tenant"), 8)
    assert not set(salted) & set(whole)


def _promote_first_chunks(core: ConnectorCore, ends: range) -> list[tuple[bytes, ...]]:
    chunks = [core.chunk_members(_view("A"), end) for end in ends]
    for members in chunks:
        slots = core.reserve_promotion(members, None)
        assert slots is not None
        assert len(slots) == len(members) == len(set(slots))
    return chunks


def test_claim_defers_on_a_promotion_then_claims_what_it_promoted() -> None:
    core = _core()
    view = _view("A")
    chunks = _promote_first_chunks(core, range(4, 33, 4))
    assert core.promotions_in_flight() == 16
    assert all(core.store.status(k) is LookupResult.HIT_PENDING for c in chunks for k in c)
    assert core.get_num_new_matched_tokens(view, 0).kind is ClaimKind.DEFER
    for members in chunks:
        core.complete_promotion(members, True)
    assert core.promotions_in_flight() == 0
    claim = core.get_num_new_matched_tokens(view, 0)
    assert (claim.kind, claim.num_tokens) == (ClaimKind.ASYNC, 32)


def test_a_failed_promotion_ends_the_claim_before_it() -> None:
    core = _core()
    view = _view("A")
    chunks = _promote_first_chunks(core, range(4, 33, 4))
    for i, members in enumerate(chunks):
        core.complete_promotion(members, i != 3)  # the chunk ending at 16 fails
    assert all(core.store.status(k) is LookupResult.MISS for k in chunks[3])
    claim = core.get_num_new_matched_tokens(view, 0)
    assert (claim.kind, claim.num_tokens) == (ClaimKind.ASYNC, 12)
    assert core.store.stats().removed == 2


def test_reserve_refuses_present_keys_and_a_full_host() -> None:
    core = _core()
    members = core.chunk_members(_view("A"), 4)
    assert core.reserve_promotion(members, None) is not None
    assert core.reserve_promotion(members, None) is None  # STORING: another operation's
    assert core.reserve_promotion((), None) is None
    full = _core(capacity=1)
    assert full.reserve_promotion(full.chunk_members(_view("A"), 4), None) is None
    assert full.store.stats().reserved == 0


def test_reserve_evicts_ready_entries_like_a_store() -> None:
    core = _core(capacity=2)
    core.seed(_view("S"), 4)  # 2 entries READY, unpinned
    fresh = core.chunk_members(_view("A", "other"), 4)
    assert core.reserve_promotion(fresh, "other") is not None
    assert core.store.stats().evicted == 2


def test_complete_refuses_what_was_not_reserved() -> None:
    core = _core()
    members = core.chunk_members(_view("A"), 4)
    with pytest.raises(HybridKVConfigError, match="keys"):
        core.complete_promotion(members, True)
    core.reserve_promotion(members, None)
    core.complete_promotion(members, True)
    with pytest.raises(HybridKVConfigError, match="keys"):
        core.complete_promotion(members, True)  # once
    with pytest.raises(HybridKVConfigError, match="keys"):
        core.complete_promotion((), True)


def test_job_kind_names_jobs_in_flight_only() -> None:
    core = _core()
    core.seed(_view("S"), 32)
    view = _view("B")
    claim = core.get_num_new_matched_tokens(view, 0)
    table = tuple(tuple(1 + g * 1000 + i for i in range(9)) for g in range(2))
    core.update_state_after_alloc(view, table, claim.num_tokens)
    meta = core.build_connector_meta(StepView(1, ()))
    job = meta.load_jobs[0]
    assert core.job_kind(job.job_id) is TransferKind.LOAD
    assert core.job_kind(JobId(10_000)) is None


def test_a_chunk_of_one_token_units_ends_at_token_1() -> None:
    """With 1-token units (the layout ``hybridkv check`` explores) the first chunk ends at
    token 1: every group's unit ends there."""
    planner = HybridOffloadPlanner(((FULL, 1), (MAMBA, 1)), 1, 1, 1 << 14)
    core = ConnectorCore(planner, HostStore(16), (FULL, MAMBA), 1, 1)
    view = _view("A")
    first = core.chunk_members(view, 1)
    assert len(first) == 2
    assert core.chunk_members(view, 1, recurrent=False) == first[:1]
    assert core.chunk_members(view, 2) != first
    assert core.chunk_members(view, 0) == ()
