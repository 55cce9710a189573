"""Mutation evidence for MB-* and SEC-*: each broken connector is caught, naming its id.

Each test runs one deliberately broken variant (a subclass overriding one step) through a short
scenario and asserts the connector snapshot fails exactly the expected invariant id, while the
correct connector on the same scenario fails none. Geometry: FULL block 2 + MAMBA block 2,
hash block 2, chunk 2.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
from connector_harness import Harness, key, make, view

from spec.connector import ReferenceConnector
from spec.connector.checkpoints import NONE, CheckpointRule
from spec.connector.stores import store_items
from spec.connector_api import (
    BlockTable,
    Claim,
    ClaimKind,
    RequestView,
    TransferItem,
    TransferJob,
    TransferKind,
)
from spec.hashing import request_block_hashes
from spec.invariants import ALL_INVARIANTS, check_all
from spec.kinds import GroupKind
from spec.store import EventKind, LookupResult, PrepareStoreOutput

A6 = (1, 2, 3, 4, 5, 6)
A8 = (1, 2, 3, 4, 5, 6, 7, 8)
A_ROW = (view("A", A6), ((1, 2), (0, 3)), 0, 4)  # stores attention 2, 4 and the state at 4


def _failing(h: Harness) -> dict[str, list[str]]:
    return check_all("connector", h.connector.snapshot())


def _claim_and_load(h: Harness, b: RequestView, table: BlockTable) -> None:
    claim = h.connector.get_num_new_matched_tokens(b, 0)
    h.connector.update_state_after_alloc(b, table, claim.num_tokens)
    h.step()


def _load_scenario(cls: type[ReferenceConnector], salt_b: str | None = None) -> Harness:
    h = Harness(*make(cls=cls))
    h.store_all([(view("A", A6, salt="a" if salt_b else None), ((1, 2), (0, 3)), 0, 4)])
    _claim_and_load(h, view("B", A6, salt=salt_b), ((11, 12), (0, 14)))
    return h


# ----------------------------------------------------------------- MB-1


class AttentionOnlyLoad(ReferenceConnector):
    """LMCache #2863: restores attention KV and leaves the mamba state behind."""

    def _load_items(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        items = super()._load_items(*args, **kwargs)
        return tuple(i for i in items if self.geometry.kinds[i.group_idx] is not GroupKind.MAMBA)


def test_mb1_attention_loaded_without_mamba_state() -> None:
    assert _failing(_load_scenario(ReferenceConnector)) == {}
    assert set(_failing(_load_scenario(AttentionOnlyLoad))) == {"MB-1"}


# ----------------------------------------------------------------- MB-2


class StateAtStepEnd(ReferenceConnector):
    """Stores the latest state block under the last boundary key, wherever the step ended."""

    def _store_items(self, hashes, block_ids, start, end):  # type: ignore[no-untyped-def]
        items = super()._store_items(hashes, block_ids, start, end)
        if end % 2 and block_ids[1][-1]:
            boundary = store_items(self.geometry, hashes, ((1,) * 8, (1,) * 8), 0, end - 1)
            last_key = [i.key for i in boundary if i.group_idx == 1][-1]
            items += (TransferItem(1, block_ids[1][-1], last_key, end),)
        return items


def _odd_step(cls: type[ReferenceConnector]) -> Harness:
    h = Harness(*make(cls=cls))
    # Prefill [0, 3): the state block holds the state after 3 tokens, not after 2.
    h.step([(view("A", (1, 2, 3)), ((1, 2), (0, 3)), 0, 3)])
    return h


def test_mb2_mamba_state_stored_off_its_boundary() -> None:
    assert _failing(_odd_step(ReferenceConnector)) == {}
    assert set(_failing(_odd_step(StateAtStepEnd))) == {"MB-2"}


# ----------------------------------------------------------------- MB-3


class OneTokenMore(ReferenceConnector):
    """Claims one token past the aligned claim (an unaligned claim)."""

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> Claim:
        claim = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if claim.kind is ClaimKind.ASYNC:
            return Claim(ClaimKind.ASYNC, claim.num_tokens + 1)
        return claim


def test_mb3_unaligned_claim() -> None:
    assert _failing(_load_scenario(ReferenceConnector)) == {}
    assert "MB-3" in _failing(_load_scenario(OneTokenMore))


# ----------------------------------------------------------------- MB-4


class NeverUnpins(ReferenceConnector):
    """Forgets complete_load: finished loads keep their host entries pinned forever."""

    def _load_reported(self, job: TransferJob, keys: tuple[bytes, ...], success: bool) -> None:
        record = self._loads[job.request_id]
        self._loads[job.request_id] = record.with_result(job.job_id, job.items, success=success)


def _completed_load(cls: type[ReferenceConnector]) -> Harness:
    h = _load_scenario(cls)
    h.step(results=[(j.job_id, True) for j in h.meta.load_jobs])
    return h


def test_mb4_pins_outlive_the_load() -> None:
    assert _failing(_completed_load(ReferenceConnector)) == {}
    assert set(_failing(_completed_load(NeverUnpins))) == {"MB-4"}


# ----------------------------------------------------------------- MB-5


class ForgetsFailures(ReferenceConnector):
    """Ignores the failure memory: the re-ask claims the failing prefix again."""

    def _remembered_failures(self) -> Mapping[bytes, int]:
        return {}


def _fail_then_reask(cls: type[ReferenceConnector]) -> tuple[Harness, int]:
    """B and C load A's 6-token prefix at once; B's last segment fails while C's load still
    pins its keys, so the failed entries cannot be evicted yet: B's re-ask must avoid them."""
    h = Harness(*make(cls=cls))
    a = view("A", A8)
    for start, table in ((0, ((1,), (2,))), (2, ((1, 3), (0, 4))), (4, ((1, 3, 5), (0, 0, 6)))):
        h.store_all([(a, table, start, 2)])
    b, c = view("B", A8), view("C", A8)
    for request, first in ((b, 11), (c, 41)):
        claim = h.connector.get_num_new_matched_tokens(request, 0)
        table = ((first, first + 1, first + 2), (0, 0, first + 3))
        h.connector.update_state_after_alloc(request, table, claim.num_tokens)
    h.step()  # both loads are in flight
    b_jobs = [j for j in h.meta.load_jobs if j.request_id == "B"]
    c_jobs = [j.job_id for j in h.meta.load_jobs if j.request_id == "C"]
    h.step(results=[(j.job_id, j.job_id != b_jobs[-1].job_id) for j in b_jobs])
    claim = h.connector.get_num_new_matched_tokens(b, 0)
    blocks = claim.num_tokens // 2  # the scheduler's tables: attention blocks, one state block
    table = (tuple(range(21, 21 + blocks)), (0,) * (blocks - 1) + (30,))
    h.connector.update_state_after_alloc(b, table, claim.num_tokens)
    h.step()
    h.step(results=[(j, True) for j in c_jobs])
    return h, claim.num_tokens


def test_mb5_failed_prefix_claimed_again() -> None:
    h, claimed = _fail_then_reask(ReferenceConnector)
    assert (claimed, _failing(h)) == (4, {})
    h, claimed = _fail_then_reask(ForgetsFailures)
    assert (claimed, set(_failing(h))) == (6, {"MB-5"})


def test_a_failed_entry_is_evicted_once_no_load_pins_it() -> None:
    """The failed segment's keys stay (C still pins them) until C's load reports; then they
    leave the host, so the next computation of that chunk stores it again."""
    h, _ = _fail_then_reask(ReferenceConnector)
    gone = [key(A8, 6, 0), key(A8, 6, 1)]  # the segment at 6: attention and state
    statuses = [h.connector.store.status(k) for k in gone]
    assert statuses == [LookupResult.MISS, LookupResult.MISS]
    evicted = [e for e in h.connector.store.take_events() if e.kind is EventKind.EVICTED]
    assert [set(e.keys) for e in evicted] == [set(gone)]


# ----------------------------------------------------------------- MB-6


class StoresOverPresentKeys(ReferenceConnector):
    """Writes every completed unit, even those the host already holds (skipped by prepare)."""

    def _store_job(self, request, block_ids, start, end, *, limit=None):  # type: ignore[no-untyped-def]
        items = self._store_items(self._hashes(request), block_ids, start, end)
        if limit is not None:  # ScheduledRequest.store_limit, as the model applies it
            items = tuple(item for item in items if item.end_token <= limit)
        prepared = self.store.prepare_store([i.key for i in items])
        if not isinstance(prepared, PrepareStoreOutput) or not items:
            return None
        job = TransferJob(self._new_job_id(), TransferKind.STORE, request.request_id, items)
        self._jobs[job.job_id] = (job, request.cache_salt)
        self._store_spans[job.job_id] = (start, end)  # MB-8's record, kept as the model does
        return job


def _second_writer(cls: type[ReferenceConnector]) -> Harness:
    h = Harness(*make(cls=cls))
    h.store_all([A_ROW])
    h.step([(view("A2", A6), ((5, 6), (0, 7)), 0, 4)])
    return h


def test_mb6_store_job_over_ready_keys() -> None:
    assert _failing(_second_writer(ReferenceConnector)) == {}
    assert set(_failing(_second_writer(StoresOverPresentKeys))) == {"MB-6"}


# ----------------------------------------------------------------- MB-8


class EagleCheckpoints(ReferenceConnector):
    """The mamba group exports vLLM's prefill checkpoint with EAGLE's block drop (grid 2)."""

    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        rule = CheckpointRule(1, 2, 2, True, 0)
        super().__init__(*args, **kwargs, checkpoints=(NONE, rule))


class CheckpointKeyedBySlot(EagleCheckpoints):
    """Keys every real mamba slot by the slot's own end (the rule before MB-8)."""

    def _store_items(self, hashes, block_ids, start, end):  # type: ignore[no-untyped-def]
        g = self.geometry
        return tuple(
            TransferItem(ref.group_idx, table[ref.block_index], g.key(hashes, ref), ref.end)
            for ref, table in (
                (ref, block_ids[gi])
                for gi in range(g.num_groups)
                for ref in g.units_ending_in(gi, start, end)
            )
            if ref.block_index < len(table) and table[ref.block_index]
        )


def _checkpoint_step(cls: type[ReferenceConnector]) -> Harness:
    h = Harness(*make(cls=cls))
    # Prefill [0, 7): the checkpoint is floor(7 / 2) * 2 - 2 = 4, in slot ceil(7 / 2) - 2 = 2,
    # whose own end is 6; the running state after 7 sits in slot 3.
    h.step([(view("A", (1, 2, 3, 4, 5, 6, 7, 8)), ((1, 2, 3, 4), (0, 0, 13, 14)), 0, 7)])
    return h


def test_mb8_checkpoint_keyed_by_its_slot() -> None:
    correct = _checkpoint_step(EagleCheckpoints)
    assert _failing(correct) == {}
    [job] = correct.meta.store_jobs
    assert [(i.block_id, i.end_token) for i in job.items if i.group_idx == 1] == [(13, 4)]
    assert set(_failing(_checkpoint_step(CheckpointKeyedBySlot))) == {"MB-8"}


# ----------------------------------------------------------------- MB-7


class AlwaysDelays(ReferenceConnector):
    """Delays every free, stores or not (the request's blocks wait on nothing)."""

    def request_finished_all_groups(self, request: RequestView, block_ids: BlockTable) -> bool:
        super().request_finished_all_groups(request, block_ids)
        self._delayed.add(request.request_id)
        return True


def _finish_after_stores(cls: type[ReferenceConnector]) -> Harness:
    h = Harness(*make(cls=cls))
    h.store_all([A_ROW])
    h.connector.request_finished_all_groups(A_ROW[0], A_ROW[1])
    return h


def test_mb7_free_delayed_without_a_store() -> None:
    assert _failing(_finish_after_stores(ReferenceConnector)) == {}
    assert set(_failing(_finish_after_stores(AlwaysDelays))) == {"MB-7"}


# ----------------------------------------------------------------- SEC-1


class SaltBlind(ReferenceConnector):
    """Hashes without the cache_salt: tenants share keys."""

    def _hashes(self, request: RequestView) -> list[bytes]:
        return request_block_hashes(request.token_ids, self.geometry.planner.hash_block_size)


def test_sec1_hit_across_salts() -> None:
    h = _load_scenario(ReferenceConnector, salt_b="b")
    assert h.meta.load_jobs == ()
    assert _failing(h) == {}
    h = _load_scenario(SaltBlind, salt_b="b")
    assert h.meta.load_jobs != ()
    assert set(_failing(h)) == {"SEC-1"}


# ----------------------------------------------------------------- coverage of ids


@pytest.mark.parametrize(
    "inv_id", sorted(i for i in ALL_INVARIANTS if i.split("-")[0] in ("MB", "SEC"))
)
def test_every_connector_id_has_a_mutation_test(inv_id: str) -> None:
    family, number = inv_id.split("-")
    names: Sequence[str] = list(globals())
    assert any(name.startswith(f"test_{family.lower()}{number}_") for name in names)
