"""``hybridkv.store.belady``: MIN's victims under the store's contract, on hand-checked cases."""

from __future__ import annotations

import pytest

from hybridkv.errors import HybridKVConfigError
from hybridkv.store import HostStore, PrepareStoreOutput, Refusal
from hybridkv.store.belady import NEVER, BeladyPolicy, FutureUses

A, B, C, D = b"a", b"b", b"c", b"d"


def _ready(store: HostStore, *keys: bytes) -> None:
    prepared = store.prepare_store(list(keys))
    assert isinstance(prepared, PrepareStoreOutput)
    store.complete_store(prepared.keys_to_store, success=True)


def test_next_use_follows_the_clock() -> None:
    future = FutureUses([(7, A), (2, A), (4, B)])
    assert (future.next_use(A), future.next_use(B), future.next_use(C)) == (2, 4, NEVER)
    future.advance(3)
    assert (future.next_use(A), future.next_use(B)) == (7, 4)
    future.advance(5)
    assert (future.next_use(A), future.next_use(B)) == (7, NEVER)


def test_future_uses_refuse_bad_positions_and_a_clock_going_back() -> None:
    with pytest.raises(HybridKVConfigError) as bad:
        FutureUses([(-1, A)])
    assert bad.value.field == "uses"
    future = FutureUses([(1, A)])
    future.advance(2)
    with pytest.raises(HybridKVConfigError) as back:
        future.advance(1)
    assert back.value.field == "position"


def test_min_evicts_the_key_used_furthest_ahead_and_never_used_keys_first() -> None:
    # Uses from position 1: A at 5, B at 3, C never. A full store of 3 admits D: C goes
    # (never used), then A (used after B).
    future = FutureUses([(5, A), (3, B)])
    store = HostStore(3, BeladyPolicy(3, future))
    _ready(store, A, B, C)
    future.advance(1)
    first = store.prepare_store([D])
    assert isinstance(first, PrepareStoreOutput)
    assert first.evicted_keys == (C,)
    store.complete_store([D], success=True)
    second = store.prepare_store([C])
    assert isinstance(second, PrepareStoreOutput)
    assert second.evicted_keys == (D,)  # D is never used either: ties go to the earlier insert
    store.complete_store([C], success=True)
    third = store.prepare_store([D])
    assert isinstance(third, PrepareStoreOutput)
    assert third.evicted_keys == (C,)


def test_min_never_evicts_pinned_storing_or_offered_keys() -> None:
    future = FutureUses([(9, A)])  # B and C are never used: MIN's first choices
    store = HostStore(3, BeladyPolicy(3, future))
    _ready(store, A, B)
    assert store.prepare_store([C]) == PrepareStoreOutput((C,), ())  # C STORING
    store.prepare_load([B])  # B pinned
    out = store.prepare_store([D])
    assert isinstance(out, PrepareStoreOutput)
    assert out.evicted_keys == (A,)  # the only READY unpinned key, though used at 9
    store.complete_load([B])
    store.complete_store([D], success=False)  # a failed store leaves the policy too
    store.touch([B])  # MIN ignores the past
    assert set(store.snapshot()["policy"]["resident"]) == {B.hex(), C.hex()}


def test_min_refuses_when_only_unevictable_keys_are_left() -> None:
    future = FutureUses([])
    store = HostStore(2, BeladyPolicy(2, future))
    _ready(store, A)
    assert store.prepare_store([B]) == PrepareStoreOutput((B,), ())  # STORING
    store.prepare_load([A])
    assert store.prepare_store([C]) is Refusal.NO_SPACE
    policy = BeladyPolicy(2, future)
    assert policy.victims(0, lambda key: True, ()) == ()
    twin = policy.copy()
    twin.on_insert(A)
    assert (policy.resident(), twin.resident(), twin.ghosts()) == ((), (A,), ())


@pytest.mark.parametrize("position", [-1, True, 2.0, "3"])
def test_a_use_that_is_not_a_position_is_refused_whole(position: object) -> None:
    with pytest.raises(HybridKVConfigError) as bad:
        FutureUses([(0, A), (position, B)])  # type: ignore[list-item]
    error = bad.value
    assert (error.field, error.value) == ("uses", position)
    assert (error.problem, error.fix) == ("a position is an int >= 0", "number reads from 0")
    assert str(error) == f"uses={position!r}: a position is an int >= 0; number reads from 0"


def test_position_0_is_a_use_and_the_clock_starts_there() -> None:
    future = FutureUses([(0, A), (0, B), (3, B)])
    assert (future.now, future.next_use(A), future.next_use(B)) == (0, 0, 0)
    future.advance(0)  # staying put is not going back
    assert future.next_use(A) == 0
    future.advance(1)
    assert (future.next_use(A), future.next_use(B)) == (NEVER, 3)


def test_a_clock_going_back_is_refused_whole_and_stays_where_it_was() -> None:
    future = FutureUses([(5, A)])
    future.advance(4)
    with pytest.raises(HybridKVConfigError) as back:
        future.advance(3)
    error = back.value
    assert (error.field, error.value) == ("position", 3)
    assert (error.problem, error.fix) == ("is before the clock 4", "replay in order")
    assert str(error) == "position=3: is before the clock 4; replay in order"
    assert (future.now, future.next_use(A)) == (4, 5)


def test_a_copy_keeps_capacity_oracle_and_order_and_shares_no_order() -> None:
    future = FutureUses([(2, A), (1, B)])
    policy = BeladyPolicy(3, future)
    policy.on_insert(A)
    policy.on_insert(B)
    twin = policy.copy()
    assert (twin.capacity, twin.future, twin.resident()) == (3, future, (A, B))
    assert twin.victims(1, lambda key: True, ()) == (A,)  # A is read later than B
    twin.on_remove(A)
    assert (policy.resident(), twin.resident()) == ((A, B), (B,))
