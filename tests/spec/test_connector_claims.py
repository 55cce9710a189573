"""The reference connector's claim rule on hand-computed geometries.

Geometry unless said otherwise: FULL block 2 + MAMBA block 2, hash block 2, chunk 2, so every
offload unit is 2 tokens, the claim unit is 2 and a claim from 0 on an n-token prompt may end at
most at the largest even number <= n - 1.
"""

from __future__ import annotations

import pytest
from connector_harness import FULL, SLIDING, Harness, key, make, view

from spec.connector_api import Claim, ClaimKind
from spec.errors import ConfigError
from spec.invariants import check_all
from spec.store import PrepareStoreOutput

A6 = (1, 2, 3, 4, 5, 6)
# A computes [0, 4): full attention in blocks 1, 2; mamba state after 4 tokens in block 3.
A_FIRST_STEP = ((view("A", A6), ((1, 2), (0, 3)), 0, 4),)


def _stored_a() -> Harness:
    h = Harness(*make())
    h.store_all(A_FIRST_STEP)
    return h


def test_a_step_stores_attention_units_and_the_state_at_its_end() -> None:
    h = Harness(*make())
    h.step(A_FIRST_STEP)
    (job,) = h.meta.store_jobs
    # Units ending in (0, 4]: attention at 2 and 4; the mamba slot for 2 is null (the forward
    # writes the state at its end only), the slot for 4 holds block 3.
    got = [(i.group_idx, i.block_id, i.key, i.end_token) for i in job.items]
    assert got == [
        (0, 1, key(A6, 2, 0), 2),
        (0, 2, key(A6, 4, 0), 4),
        (1, 3, key(A6, 4, 1), 4),
    ]


def test_same_prompt_claims_up_to_the_stored_mamba_state() -> None:
    h = _stored_a()
    # claimable(6) = 4; at 4 every group is READY (attention units 2 and 4, state at 4).
    assert h.connector.get_num_new_matched_tokens(view("B", A6), 0) == Claim(ClaimKind.ASYNC, 4)


def test_claim_starts_after_the_local_hit() -> None:
    h = _stored_a()
    # From a local hit of 2 tokens only the unit ending at 4 and the state at 4 are needed.
    assert h.connector.get_num_new_matched_tokens(view("B", A6), 2) == Claim(ClaimKind.ASYNC, 2)
    assert h.connector.get_num_new_matched_tokens(view("B", A6), 4).kind is ClaimKind.NONE


def test_no_claim_without_the_mamba_state_at_the_end() -> None:
    h = _stored_a()
    # A 4-token prompt may claim only 2 tokens, and no state after 2 tokens was stored.
    assert h.connector.get_num_new_matched_tokens(view("B", A6[:4]), 0).kind is ClaimKind.NONE


def test_last_prompt_token_is_never_claimed() -> None:
    h = _stored_a()
    # 5 tokens: claimable prefix 4 (the 5th is computed); still claims 4.
    assert h.connector.get_num_new_matched_tokens(view("B", A6[:5]), 0).num_tokens == 4


def test_different_salt_never_hits() -> None:
    h = _stored_a()
    claim = h.connector.get_num_new_matched_tokens(view("B", A6, salt="tenant-b"), 0)
    assert claim.kind is ClaimKind.NONE


def test_storing_keys_defer_the_claim() -> None:
    h = Harness(*make())
    h.step(A_FIRST_STEP)  # stores reserved, not completed
    assert h.connector.get_num_new_matched_tokens(view("B", A6), 0).kind is ClaimKind.DEFER


def test_defer_only_when_waiting_could_lengthen_the_claim() -> None:
    connector, _ = make()
    store = connector.store
    ready = [key(A6, 2, 0), key(A6, 2, 1)]
    prepared = store.prepare_store(ready)
    assert isinstance(prepared, PrepareStoreOutput)
    store.complete_store(prepared.keys_to_store, success=True)
    store.prepare_store([key(A6, 4, 0)])  # attention unit at 4 STORING, no state at 4 at all
    assert connector.get_num_new_matched_tokens(view("B", A6), 0) == Claim(ClaimKind.ASYNC, 2)
    store.prepare_store([key(A6, 4, 1)])  # now the state at 4 is STORING too: 4 may come
    assert connector.get_num_new_matched_tokens(view("B", A6), 0).kind is ClaimKind.DEFER


def test_unaligned_computed_count_is_refused() -> None:
    connector, _ = make()
    with pytest.raises(ConfigError) as err:
        connector.get_num_new_matched_tokens(view("B", A6), 3)
    assert err.value.field == "num_computed_tokens"


def test_asking_with_no_claim_changes_no_observable_state() -> None:
    h = _stored_a()
    before = (h.connector.freeze(), h.connector.snapshot())
    # Nothing of this prompt is on the host: NONE, and nothing moves.
    claim = h.connector.get_num_new_matched_tokens(view("C", (9, 8, 7, 6, 5, 4)), 0)
    assert claim.kind is ClaimKind.NONE
    assert (h.connector.freeze(), h.connector.snapshot()) == before


def _without_policy(snapshot: dict[str, object]) -> dict[str, object]:
    store = dict(snapshot["store"])  # type: ignore[call-overload]
    store.pop("policy")
    return {**snapshot, "store": store}


def test_a_claim_makes_the_keys_its_load_reads_the_most_recent_and_moves_nothing_else() -> None:
    h = _stored_a()
    other = (11, 12, 13, 14)
    prepared = h.connector.store.prepare_store([key(other, 2, 0)])
    assert isinstance(prepared, PrepareStoreOutput)
    h.connector.store.complete_store(prepared.keys_to_store, success=True)
    before = h.connector.snapshot()
    assert before["store"]["policy"]["resident"][-1] == key(other, 2, 0).hex()
    claim = h.connector.get_num_new_matched_tokens(view("B", A6), 0)
    assert claim == Claim(ClaimKind.ASYNC, 4)
    after = h.connector.snapshot()
    assert _without_policy(after) == _without_policy(before)
    # Least recent first: the other key, then the claim's keys tail first, its head last.
    assert after["store"]["policy"]["resident"] == (
        key(other, 2, 0).hex(),
        key(A6, 4, 1).hex(),
        key(A6, 4, 0).hex(),
        key(A6, 2, 0).hex(),
    )


def _seed_sliding(windows: tuple[int, ...], sliding_end: int) -> Harness:
    """FULL + SLIDING (window 2, reach 1): A's attention units 2, 4, 6 and one sliding unit."""
    h = Harness(*make((FULL, SLIDING), windows=windows))
    assert h.connector.seed(view("A", A6), 6, groups=[0]) == 3
    prepared = h.connector.store.prepare_store([key(A6, sliding_end, 1)])
    assert isinstance(prepared, PrepareStoreOutput)
    h.connector.store.complete_store(prepared.keys_to_store, success=True)
    return h


def test_sliding_window_needs_only_its_window() -> None:
    h = _seed_sliding((0, 1), 6)
    b7 = view("B", (*A6, 7))
    # claimable(7) = 6; the window reads token 5 only, so the sliding unit [4, 6) suffices.
    assert h.connector.get_num_new_matched_tokens(b7, 0) == Claim(ClaimKind.ASYNC, 6)
    # Unknown window: a sliding group needs every unit, and units 2 and 4 are absent.
    h2 = _seed_sliding((), 6)
    assert h2.connector.get_num_new_matched_tokens(b7, 0).kind is ClaimKind.NONE


def test_sliding_claim_shrinks_to_the_stored_window() -> None:
    h = _seed_sliding((0, 1), 4)
    # The sliding unit at 6 is missing; at 4 the window reads token 3, unit [2, 4): stored.
    assert h.connector.get_num_new_matched_tokens(view("B", (*A6, 7)), 0).num_tokens == 4


def test_sliding_load_fills_only_the_window_blocks() -> None:
    h = _seed_sliding((0, 1), 6)
    b7 = view("B", (*A6, 7))
    h.connector.get_num_new_matched_tokens(b7, 0)
    # Window-only allocation: skipped = 6 - 2 + 1 = 5 tokens -> 2 null blocks, then block 4.
    h.connector.update_state_after_alloc(b7, ((1, 2, 3), (0, 0, 4)), 6)
    h.step()
    items = [(i.group_idx, i.block_id, i.end_token) for j in h.meta.load_jobs for i in j.items]
    assert items == [(0, 1, 2), (0, 2, 4), (0, 3, 6), (1, 4, 6)]
    assert check_all("connector", h.connector.snapshot()) == {}


def test_from_groups_reads_the_window_reach() -> None:
    from spec.connector import ReferenceConnector
    from spec.managers.group_spec import GroupSpec
    from spec.planner import HybridOffloadPlanner
    from spec.store import HostStore

    groups = (GroupSpec(FULL, 2), GroupSpec(SLIDING, 2, sliding_window=2, extra_retained_tokens=1))
    planner = HybridOffloadPlanner(tuple((g.kind, g.block_size) for g in groups), 2, 2, 64)
    connector = ReferenceConnector.from_groups(planner, HostStore(8), groups)
    # reach = sliding_window - 1 + extra_retained_tokens = 2 (full attention: unused 0)
    assert connector.geometry.reaches == (0, 2)
