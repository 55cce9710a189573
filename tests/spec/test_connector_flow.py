"""The reference connector and worker through whole flows, in vLLM's call order.

Loads per alignment segment, completion and failure, failure memory and its expiry, decode
stores and a follow-up turn, delayed frees, the sync path, refusals, clones. Geometry: FULL
block 2 (+ MAMBA block 2), hash block 2, chunk 2; every unit is 2 tokens. Every scenario
also checks that all MB-* and SEC-* invariants hold after each step.
"""

from __future__ import annotations

import pytest
from connector_harness import FULL, MAMBA, Harness, key, make, view

from spec.connector import LoadMode
from spec.connector_api import Claim, ClaimKind, JobId, JobResult, RequestId, TransferKind
from spec.errors import ConfigError
from spec.invariants import check_all
from spec.store import LookupResult

A6 = (1, 2, 3, 4, 5, 6)
A8 = (1, 2, 3, 4, 5, 6, 7, 8)


def _ok(h: Harness) -> None:
    assert check_all("connector", h.connector.snapshot()) == {}


def _stored(kinds: tuple = (FULL, MAMBA), capacity: int = 32) -> Harness:
    """A (8 tokens) computes [0,2), [2,4), [4,6): every unit and state at 2, 4, 6 stored."""
    h = Harness(*make(kinds, capacity=capacity))
    a = view("A", A8)
    mamba = len(kinds) > 1
    tables = [((1,), (2,)), ((1, 3), (0, 4)), ((1, 3, 5), (0, 0, 6))]
    for start, table in zip((0, 2, 4), tables, strict=True):
        h.store_all([(a, table if mamba else table[:1], start, 2)])
        _ok(h)
    return h


def _load(h: Harness, rid: str, tokens: tuple[int, ...], table: tuple) -> Claim:
    b = view(rid, tokens)
    claim = h.connector.get_num_new_matched_tokens(b, 0)
    h.connector.update_state_after_alloc(b, table, claim.num_tokens)
    h.step()
    _ok(h)
    return claim


def test_load_jobs_one_per_segment_and_pins_until_reported() -> None:
    h = _stored()
    claim = _load(h, "B", A8, ((11, 12, 13), (0, 0, 14)))
    assert claim == Claim(ClaimKind.ASYNC, 6)
    jobs = [[(i.group_idx, i.block_id, i.end_token) for i in j.items] for j in h.meta.load_jobs]
    assert jobs == [[(0, 11, 2)], [(0, 12, 4)], [(0, 13, 6), (1, 14, 6)]]
    assert all(j.kind is TransferKind.LOAD and not j.sync for j in h.meta.load_jobs)
    assert h.connector.store.stats().pinned == 4
    assert h.connector.get_num_new_matched_tokens(view("B", A8), 0).kind is ClaimKind.DEFER
    ids = [j.job_id for j in h.meta.load_jobs]
    out = h.step(results=[(ids[0], True), (ids[1], True)])
    assert out.finished_recving == frozenset()  # one job still in flight
    out = h.step(results=[(ids[2], True)])
    assert out.finished_recving == {"B"}
    assert out.failed_recving == frozenset()
    assert h.connector.store.stats().pinned == 0
    assert h.connector.first_invalid_token(view("B", A8)) == 6
    _ok(h)


def test_failed_segment_is_remembered_and_the_reask_claims_before_it() -> None:
    h = _stored()
    _load(h, "B", A8, ((11, 12, 13), (0, 0, 14)))
    ids = [j.job_id for j in h.meta.load_jobs]
    out = h.step(results=[(ids[0], True), (ids[1], True), (ids[2], False)])
    assert out.finished_recving == {"B"}
    assert out.failed_recving == {"B"}
    assert h.connector.failed_keys() == {key(A8, 6, 0), key(A8, 6, 1)}
    assert h.connector.invalid_blocks(RequestId("B")) == {13, 14}
    # Only the segment at 6 carried a mamba state: no earlier point restores every group.
    assert h.connector.first_invalid_token(view("B", A8)) == 0
    # The re-ask avoids the failed keys: attention to 4 and the state at 4 are READY.
    assert h.connector.get_num_new_matched_tokens(view("B", A8), 0) == Claim(ClaimKind.ASYNC, 4)
    _ok(h)


def test_worker_hands_out_the_failed_jobs_blocks_once_when_the_load_finishes() -> None:
    h = _stored()
    _load(h, "B", A8, ((11, 12, 13), (0, 0, 14)))
    ids = [j.job_id for j in h.meta.load_jobs]
    # The segment [2, 4) fails first; the load is not finished, so nothing is handed out yet.
    out = h.step(results=[(ids[1], False)])
    assert out.failed_recving == frozenset()
    assert h.worker.get_block_ids_with_load_errors() == {}
    assert h.worker.snapshot()["invalid_blocks"] == (("B", (12,)),)
    # The other two segments succeed: B finished and failed; its one bad block (12, the
    # attention block of tokens 2..3) is handed out once.
    out = h.step(results=[(ids[0], True), (ids[2], True)])
    assert out.failed_recving == {"B"}
    assert h.worker.snapshot()["load_errors"] == (("B", (12,)),)
    assert h.worker.get_block_ids_with_load_errors() == {"B": frozenset({12})}
    assert h.worker.get_block_ids_with_load_errors() == {}
    assert h.worker.snapshot()["invalid_blocks"] == ()


def test_worker_reports_no_block_of_a_load_that_succeeded() -> None:
    h = _stored()
    _load(h, "B", A8, ((11, 12, 13), (0, 0, 14)))
    out = h.step(results=[(j.job_id, True) for j in h.meta.load_jobs])
    assert out.finished_recving == {"B"}
    assert h.worker.get_block_ids_with_load_errors() == {}


def test_full_attention_only_resumes_at_the_failed_segment() -> None:
    h = _stored((FULL,))
    _load(h, "B", A8, ((11, 12, 13),))
    ids = [j.job_id for j in h.meta.load_jobs]
    h.step(results=[(ids[0], True), (ids[1], True), (ids[2], False)])
    assert h.connector.first_invalid_token(view("B", A8)) == 4
    assert h.connector.invalid_blocks(RequestId("B")) == {13}


def test_failure_memory_expires_when_the_host_drops_the_key() -> None:
    h = _stored((FULL,), capacity=3)  # exactly A's three units
    _load(h, "B", A8, ((11, 12, 13),))
    ids = [j.job_id for j in h.meta.load_jobs]
    h.step(results=[(ids[0], True), (ids[1], True), (ids[2], False)])
    assert h.connector.failed_keys() == {key(A8, 6, 0)}
    # C stores one unit; LRU evicts A's least recent unit, the one at 6 (loads touch head
    # first). The failure memory forgets it: a fresh copy may now be stored.
    c = view("C", (50, 51, 52))
    h.step([(c, ((21, 22),), 0, 3)])
    assert h.connector.store.status(key(A8, 6, 0)) is LookupResult.MISS
    assert h.connector.failed_keys() == frozenset()
    _ok(h)


def test_decode_tokens_are_stored_and_a_follow_up_turn_hits() -> None:
    h = Harness(*make())
    a = view("A", (1, 2, 3))
    # Prefill [0, 3): attention unit at 2; the state slot for 2 is null (state is at 3).
    h.store_all([(a, ((1, 2), (0, 3)), 0, 3)])
    # Decode: token 9 sampled, [3, 4) computed; block 3 now holds the state after 4 tokens.
    a2 = view("A", (1, 2, 3, 9))
    h.step([(a2, ((1, 2), (0, 3)), 3, 1)])
    got = [(i.group_idx, i.block_id, i.end_token) for i in h.meta.store_jobs[0].items]
    assert got == [(0, 2, 4), (1, 3, 4)]
    h.step(results=[(h.meta.store_jobs[0].job_id, True)])
    follow_up = view("C", (1, 2, 3, 9, 5, 6))
    claim = h.connector.get_num_new_matched_tokens(follow_up, 0)
    assert claim == Claim(ClaimKind.ASYNC, 4)
    _ok(h)


def test_finished_request_waits_for_its_stores() -> None:
    h = Harness(*make())
    a = view("A", A6)
    h.step([(a, ((1, 2), (0, 3)), 0, 4)])
    store_job = h.meta.store_jobs[0].job_id
    assert h.connector.request_finished_all_groups(a, ((1, 2), (0, 3))) is True
    out = h.step()
    assert h.meta.delayed_free_ids == {"A"}
    assert out.finished_sending == frozenset()
    _ok(h)
    out = h.step(results=[(store_job, True)])
    assert out.finished_sending == {"A"}
    assert h.connector.snapshot()["delayed"] == ()
    _ok(h)


def test_finished_request_without_stores_is_freed_at_once() -> None:
    h = Harness(*make())
    a = view("A", A6)
    h.store_all([(a, ((1, 2), (0, 3)), 0, 4)])
    assert h.connector.request_finished_all_groups(a, ((1, 2), (0, 3))) is False
    assert h.step().finished_sending == frozenset()


def test_sync_load_reports_through_completed_jobs_only() -> None:
    h = Harness(*make(mode=LoadMode.SYNC))
    h.store_all([(view("A", A6), ((1, 2), (0, 3)), 0, 4)])
    claim = _load(h, "B", A6, ((11, 12), (0, 14)))
    assert claim == Claim(ClaimKind.SYNC, 4)
    assert all(j.sync for j in h.meta.load_jobs)
    out = h.step(results=[(j.job_id, True) for j in h.meta.load_jobs])
    assert out.finished_recving == frozenset()
    assert len(out.completed_jobs) == 2
    assert h.connector.store.stats().pinned == 0
    _ok(h)


def test_store_refusal_keeps_a_prefix() -> None:
    h = Harness(*make(capacity=2))
    h.step([(view("A", A6), ((1, 2), (0, 3)), 0, 4)])
    # Unit end 2 fits; end 4 needs two entries, one slot is left and nothing is evictable.
    (job,) = h.meta.store_jobs
    assert [(i.group_idx, i.end_token) for i in job.items] == [(0, 2)]
    _ok(h)


def test_salted_requests_store_under_their_own_keys() -> None:
    h = Harness(*make())
    h.store_all([(view("A", A6, salt="t1"), ((1, 2), (0, 3)), 0, 4)])
    assert h.connector.store.status(key(A6, 4, 1, salt="t1")) is LookupResult.HIT
    assert h.connector.store.status(key(A6, 4, 1)) is LookupResult.MISS
    claim = h.connector.get_num_new_matched_tokens(view("B", A6, salt="t1"), 0)
    assert claim.num_tokens == 4


def test_update_state_after_alloc_without_a_claim_is_refused() -> None:
    connector, _ = make()
    with pytest.raises(ConfigError) as err:
        connector.update_state_after_alloc(view("B", A6), ((1, 2), (0, 3)), 4)
    assert err.value.field == "num_external_tokens"
    connector.update_state_after_alloc(view("B", A6), ((1, 2), (0, 3)), 0)  # 0: nothing
    assert connector.snapshot()["jobs"] == ()


def test_worker_refuses_unknown_or_repeated_results() -> None:
    _, worker = make()
    with pytest.raises(ConfigError):
        worker.get_transfer_results((JobResult(JobId(7), True),))
    assert worker.snapshot()["jobs"] == ()


def test_clone_is_independent_and_freeze_tracks_state() -> None:
    h = _stored()
    twin = h.connector.clone()
    assert twin.freeze() == h.connector.freeze()
    b = view("B", A8)
    twin.get_num_new_matched_tokens(b, 0)
    twin.update_state_after_alloc(b, ((11, 12, 13), (0, 0, 14)), 6)
    assert twin.freeze() != h.connector.freeze()
    assert h.connector.store.stats().pinned == 0
    assert twin.store.stats().pinned == 4
    worker_twin = h.worker.clone()
    assert worker_twin.freeze() == h.worker.freeze()


def test_a_request_finished_during_its_load_is_not_delayed_for_its_stores() -> None:
    """vLLM holds such a request until its load reports and deletes it at the first report, so
    a delayed free on top would bring a ``finished_sending`` for a request vLLM deleted (issue
    17, 2j). The store still runs and reports by job; its sources stay pinned until then."""
    h = _stored()
    b = view("B", A8)
    table = ((11, 12, 13, 15), (0, 0, 14, 16))
    claim = h.connector.get_num_new_matched_tokens(b, 0)
    h.connector.update_state_after_alloc(b, table, claim.num_tokens)
    h.step([(b, table, 6, 2)])  # B's load, and a store of its unit ending at 8
    assert h.meta.load_jobs
    assert h.meta.store_jobs
    jobs = [j.job_id for j in (*h.meta.load_jobs, *h.meta.store_jobs)]
    assert h.connector.request_finished_all_groups(b, table) is False
    out = h.step()
    assert h.meta.delayed_free_ids == frozenset()
    _ok(h)
    out = h.step(results=[(j, True) for j in jobs])
    assert out.finished_recving == {"B"}
    assert out.finished_sending == frozenset()
    assert h.connector.snapshot()["delayed"] == ()
    _ok(h)
