"""Unit tests of the host store model and its ST-* invariants.

Expected values are worked out by hand from the contract in spec/store.py (keys of one call
reach the policy tail first; victims are READY, unpinned, not offered) and the policy rules;
each step says why. Every ST invariant has a test that breaks it on purpose.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spec.errors import ConfigError
from spec.invariants import ALL_INVARIANTS, check_all, invariants_for
from spec.policies import Evictable, LRUPolicy
from spec.store import (
    EventKind,
    HostStore,
    LookupOutcome,
    LookupResult,
    PrepareLoadOutput,
    PrepareStoreOutput,
    Refusal,
    StoreEvent,
)

A, B, C, D, E, F = (name.encode() for name in "abcdef")


def _ok(store: HostStore) -> None:
    assert check_all("store", store.snapshot()) == {}


def _stored(store: HostStore, keys: Sequence[bytes]) -> PrepareStoreOutput:
    out = store.prepare_store(keys)
    assert isinstance(out, PrepareStoreOutput)
    store.complete_store(out.keys_to_store, success=True)
    _ok(store)
    return out


def _entries(store: HostStore) -> dict[str, tuple[str, int]]:
    return {key: (state, pins) for key, state, pins in store.snapshot()["entries"]}


# --- behaviour ---


def test_lookup_counts_leading_ready_keys_and_says_what_stopped_it() -> None:
    store = HostStore(4)
    _stored(store, [A])
    assert isinstance(store.prepare_store([B]), PrepareStoreOutput)  # b STORING
    assert store.lookup([A, B, C]) == LookupOutcome(1, LookupResult.HIT_PENDING)  # retry later
    assert store.lookup([A, C, B]) == LookupOutcome(1, LookupResult.MISS)
    assert store.lookup([A]) == LookupOutcome(1, LookupResult.HIT)
    assert store.lookup([]) == LookupOutcome(0, LookupResult.HIT)
    assert store.lookup([B]) == LookupOutcome(0, LookupResult.HIT_PENDING)
    assert [store.status(k) for k in (A, B, C)] == [
        LookupResult.HIT,
        LookupResult.HIT_PENDING,
        LookupResult.MISS,
    ]


def test_lru_sequence_by_hand() -> None:
    store = HostStore(3, "lru")
    # Inserted tail first (c, b, a): order least recent first is c, b, a.
    assert _stored(store, [A, B, C]) == PrepareStoreOutput((A, B, C), ())
    assert store.snapshot()["policy"]["resident"] == (C.hex(), B.hex(), A.hex())
    # Full: d evicts the least recent, c (the tail of the first prefix).
    assert store.prepare_store([D]) == PrepareStoreOutput((D,), (C,))  # d stays STORING
    store.touch([B])  # order a, d, b
    assert isinstance(store.prepare_load([A]), PrepareLoadOutput)  # a pinned
    # e: a is least recent but pinned, d is STORING, so b goes.
    assert store.prepare_store([E]) == PrepareStoreOutput((E,), (B,))
    _ok(store)
    # f: a pinned, d and e STORING: nothing can go.
    assert store.prepare_store([F]) is Refusal.NO_SPACE
    store.complete_load([A])
    assert store.prepare_store([F]) == PrepareStoreOutput((F,), (A,))
    assert _entries(store) == {
        D.hex(): ("storing", 0),
        E.hex(): ("storing", 0),
        F.hex(): ("storing", 0),
    }
    _ok(store)


def test_arc_sequence_with_ghost_hits_by_hand() -> None:
    store = HostStore(2, "arc")

    def lists() -> tuple[Any, ...]:
        extra = store.snapshot()["policy"]["extra"]
        names = ("t1", "t2", "b1", "b2")
        keys = (tuple(bytes.fromhex(k) for k in extra[name]) for name in names)
        return (*keys, extra["target"])

    _stored(store, [A])
    _stored(store, [B])  # T1 = [a, b]
    store.touch([A])  # a READY in T1 -> T2: T1 = [b], T2 = [a]
    # c: |T1| = 1 >= floor(p = 0): evict b from T1 into B1.
    assert _stored(store, [C]).evicted_keys == (B,)
    assert lists() == ((C,), (A,), (B,), (), (0, 1))
    # b again (B1 hit): p = 0 + max(1, 0/1) = 1; |T1| = 1 >= 1: evict c into B1;
    # b's insert takes it out of B1.
    assert _stored(store, [B]).evicted_keys == (C,)
    assert lists() == ((B,), (A,), (C,), (), (1, 1))
    store.touch([B])  # T1 = [], T2 = [a, b]
    # d: |T1| = 0 < 1: evict T2's least recent, a, into B2.
    assert _stored(store, [D]).evicted_keys == (A,)
    assert lists() == ((D,), (B,), (C,), (A,), (1, 1))
    # a again (B2 hit): p = 1 - max(1, 1/1) = 0; |T1| = 1 >= 0: evict d into B1.
    assert _stored(store, [A]).evicted_keys == (D,)
    assert lists() == ((A,), (B,), (C, D), (), (0, 1))


def test_arc_ghost_lists_stay_within_capacity_and_failed_stores_leave_no_ghost() -> None:
    store = HostStore(1, "arc")
    _stored(store, [A])
    _stored(store, [B])  # a -> B1
    _stored(store, [C])  # b -> B1 = [a, b], cut to [b]
    assert store.snapshot()["policy"]["ghosts"] == (B.hex(),)
    store2 = HostStore(1, "arc")
    assert isinstance(store2.prepare_store([A]), PrepareStoreOutput)
    store2.complete_store([A], success=False)
    assert store2.snapshot()["policy"]["ghosts"] == ()
    _ok(store2)


def test_tail_of_a_prefix_is_evicted_before_its_head() -> None:
    store = HostStore(2)
    _stored(store, [A, B])  # a head, b tail
    assert store.prepare_store([C]).evicted_keys == (B,)  # type: ignore[union-attr]


def test_present_keys_are_skipped_and_protected_from_eviction() -> None:
    store = HostStore(2)
    _stored(store, [A, B])  # order b, a
    store.touch([B])  # order a, b: a least recent
    # a is offered again: skipped, and not evictable in this call, so b goes.
    assert store.prepare_store([A, C]) == PrepareStoreOutput((C,), (B,))
    assert store.prepare_store([A, C]) == PrepareStoreOutput((), ())  # all present
    _ok(store)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_bound_key_whose_unit_lost_a_key_is_evicted_first(policy: str) -> None:
    # a stands for a unit's full-attention chunk, b for its mamba state: b is bound to ab.
    store = HostStore(4, policy)
    out = store.prepare_store([A, B], bound=[B])
    assert isinstance(out, PrepareStoreOutput)
    store.complete_store([A, B], success=True)
    _stored(store, [C])
    _stored(store, [D])
    store.touch([B])  # order a, c, d, b (ARC: b into T2)
    # Two victims: a, the policy's first; then b, dead without a, before c.
    assert _stored(store, [E, F]).evicted_keys == (A, B)
    _stored(store, [A])  # order c, d, f, e, a; nothing bound is left
    store.touch([C])
    assert _stored(store, [B]).evicted_keys == (D,)  # the policy's order again
    with pytest.raises(ConfigError) as bad:
        store.prepare_store([C], bound=[D])
    assert bad.value.field == "bound"
    _ok(store)


def test_pins_block_eviction_until_the_load_completes() -> None:
    store = HostStore(2)
    _stored(store, [A, B])
    assert store.prepare_load([A, B]) == PrepareLoadOutput((A, B))
    assert store.prepare_load([A]) == PrepareLoadOutput((A,))  # two loads of a
    assert _entries(store) == {A.hex(): ("ready", 2), B.hex(): ("ready", 1)}
    assert store.prepare_store([C]) is Refusal.NO_SPACE
    store.complete_load([A, B])
    assert store.prepare_store([C]).evicted_keys == (B,)  # type: ignore[union-attr]
    assert _entries(store)[A.hex()] == ("ready", 1)  # a still pinned once
    _ok(store)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_refused_calls_change_nothing(policy: str) -> None:
    store = HostStore(2, policy)
    _stored(store, [A])
    _stored(store, [B])
    _stored(store, [C])  # a evicted (ARC: into B1, a ghost)
    assert isinstance(store.prepare_store([D]), PrepareStoreOutput)  # c or b evicted, d STORING
    remaining = next(k for k in (B, C) if store.status(k) is LookupResult.HIT)
    assert isinstance(store.prepare_load([remaining]), PrepareLoadOutput)
    before = store.snapshot()
    assert store.prepare_store([A, E]) is Refusal.NO_SPACE  # a is an ARC ghost hit: no adapt
    assert store.prepare_store([E]) is Refusal.NO_SPACE
    assert store.prepare_load([remaining, D]) is Refusal.NOT_READY
    assert store.prepare_load([remaining, A]) is Refusal.MISSING
    assert store.snapshot() == before


def test_store_larger_than_capacity_is_refused() -> None:
    store = HostStore(2)
    before = store.snapshot()
    assert store.prepare_store([A, B, C]) is Refusal.NO_SPACE
    assert store.snapshot() == before


def test_failed_store_drops_the_reserved_entries() -> None:
    store = HostStore(3)
    _stored(store, [A])
    assert store.prepare_store([B, C]) == PrepareStoreOutput((B, C), ())
    store.complete_store([B, C], success=False)
    assert store.lookup([A, B]) == LookupOutcome(1, LookupResult.MISS)
    assert _entries(store) == {A.hex(): ("ready", 0)}
    assert store.stats().removed == 2
    assert store.take_events()[-1] == StoreEvent(EventKind.REMOVED, (B, C))
    _ok(store)


def test_events_come_out_in_order_once() -> None:
    store = HostStore(1)
    _stored(store, [A])
    assert isinstance(store.prepare_store([B]), PrepareStoreOutput)  # evicts a
    store.complete_store([B], success=False)
    _stored(store, [C])
    assert store.take_events() == (
        StoreEvent(EventKind.STORED, (A,)),
        StoreEvent(EventKind.EVICTED, (A,)),
        StoreEvent(EventKind.REMOVED, (B,)),
        StoreEvent(EventKind.STORED, (C,)),
    )
    assert store.take_events() == ()
    assert store.snapshot()["taken"] == {"stored": 2, "evicted": 1, "removed": 1}
    _ok(store)


def test_stats_count_entries_and_keys() -> None:
    store = HostStore(4)
    _stored(store, [A, B])
    assert isinstance(store.prepare_store([C]), PrepareStoreOutput)
    assert isinstance(store.prepare_load([A]), PrepareLoadOutput)
    stats = store.stats()
    assert (stats.capacity, stats.used, stats.storing, stats.ready) == (4, 3, 1, 2)
    assert (stats.pinned, stats.evictable) == (1, 1)
    assert (stats.reserved, stats.stored, stats.loads_prepared) == (3, 2, 1)


def test_touch_changes_only_the_policy_order() -> None:
    store = HostStore(3)
    _stored(store, [A, B, C])  # order c, b, a
    before = store.snapshot()
    store.touch([C, B])  # tail first: b then c, so c ends most recent: a, b, c
    after = store.snapshot()
    assert after["policy"]["resident"] == (A.hex(), B.hex(), C.hex())
    assert {k: v for k, v in after.items() if k != "policy"} == {
        k: v for k, v in before.items() if k != "policy"
    }


def test_copy_is_independent() -> None:
    store = HostStore(2, "arc")
    _stored(store, [A])
    twin = store.copy()
    _stored(twin, [B])
    assert store.lookup([A, B]) == LookupOutcome(1, LookupResult.MISS)
    assert twin.lookup([A, B]) == LookupOutcome(2, LookupResult.HIT)


# --- bad input: ConfigError naming the field, nothing changed ---


@pytest.mark.parametrize("capacity", [0, -1, True, 2.0, "2"])
def test_capacity_must_be_a_positive_int(capacity: Any) -> None:
    with pytest.raises(ConfigError) as err:
        HostStore(capacity)
    assert err.value.field == "num_chunks"


def test_policy_must_be_known_or_fresh() -> None:
    with pytest.raises(ConfigError) as err:
        HostStore(2, "mru")
    assert err.value.field == "cache_policy"
    used = LRUPolicy(2)
    used.on_insert(A)
    with pytest.raises(ConfigError):
        HostStore(2, used)
    with pytest.raises(ConfigError):
        HostStore(3, LRUPolicy(2))


def test_contract_breaches_raise_and_change_nothing() -> None:
    store = HostStore(3)
    _stored(store, [A])
    assert isinstance(store.prepare_store([B]), PrepareStoreOutput)
    before = store.snapshot()
    breaches = [
        lambda: store.complete_load([A]),  # not pinned
        lambda: store.complete_store([A], success=True),  # already READY
        lambda: store.complete_store([B, C], success=True),  # c has no store in flight
        lambda: store.complete_store([B], success=1),  # not a bool
        lambda: store.prepare_store([C, C]),  # duplicate
        lambda: store.prepare_load([A, A]),
        lambda: store.lookup(A),  # one key, not a sequence
        lambda: store.touch(["a"]),  # not bytes
        lambda: store.lookup([b""]),  # empty key
    ]
    for breach in breaches:
        with pytest.raises(ConfigError):
            breach()
    assert store.snapshot() == before


# --- every ST invariant caught on purpose ---


def _busy_store(policy: str = "arc") -> HostStore:
    """Ready, pinned, STORING entries, ghosts, pending and taken events."""
    store = HostStore(3, policy)
    _stored(store, [A, B, C])
    store.take_events()
    _stored(store, [D])  # evicts c (the tail)
    assert isinstance(store.prepare_load([A]), PrepareLoadOutput)
    assert isinstance(store.prepare_store([E]), PrepareStoreOutput)  # evicts b; e STORING
    _ok(store)
    return store


def _failing(snap: dict[str, Any]) -> set[str]:
    return set(check_all("store", snap))


def test_store_invariants_are_registered_with_statements() -> None:
    ids = [inv.id for inv in invariants_for("store")]
    assert ids == [f"ST-{n}" for n in range(1, 11)]
    assert all(ALL_INVARIANTS[i].statement for i in ids)


def test_st1_over_capacity_is_caught() -> None:
    snap = _busy_store().snapshot()
    assert _failing({**snap, "capacity": 2}) >= {"ST-1"}
    assert "ST-1" in _failing({**snap, "capacity": True})


def test_st2_miscounted_slots_are_caught() -> None:
    snap = _busy_store().snapshot()
    assert _failing({**snap, "used": snap["used"] + 1}) == {"ST-2"}
    assert _failing({**snap, "evictable": 0}) == {"ST-2"}
    assert _failing({**snap, "storing": 0}) == {"ST-2"}


def test_st3_malformed_entries_are_caught() -> None:
    snap = _busy_store().snapshot()
    first = snap["entries"][0]
    assert "ST-3" in _failing({**snap, "entries": (first, *snap["entries"])})
    bad_state = ((first[0], "loading", first[2]), *snap["entries"][1:])
    assert "ST-3" in _failing({**snap, "entries": bad_state})
    bad_pins = ((first[0], first[1], -1), *snap["entries"][1:])
    assert "ST-3" in _failing({**snap, "entries": bad_pins})
    # The low keys (entries reserved StorePriority.LOW) must be entries, each listed once.
    assert _failing({**snap, "low": (first[0], first[0])}) == {"ST-3"}
    assert _failing({**snap, "low": ("ab" * 8,)}) == {"ST-3"}
    assert _failing({**snap, "low": (first[0],)}) == set()


def test_st4_pinned_storing_entry_is_caught() -> None:
    snap = _busy_store().snapshot()
    entries = tuple((k, s, 1 if s == "storing" else p) for k, s, p in snap["entries"])
    counters = {**snap["counters"], "loads_prepared": snap["counters"]["loads_prepared"] + 1}
    # Loads balanced so that only the state rule breaks.
    assert _failing({**snap, "entries": entries, "counters": counters}) == {"ST-4"}


class _PinBlindLRU(LRUPolicy):
    """A broken policy: ignores the store's evictability verdict."""

    def victims(self, n: int, evictable: Evictable, incoming: Sequence[bytes]) -> tuple[bytes, ...]:
        return super().victims(n, lambda _key: True, incoming)


def test_st5_store_that_evicts_a_pinned_entry_is_caught() -> None:
    store = HostStore(2, _PinBlindLRU(2))
    _stored(store, [A])
    _stored(store, [B])  # order a, b
    assert isinstance(store.prepare_load([A]), PrepareLoadOutput)
    assert isinstance(store.prepare_store([C]), PrepareStoreOutput)  # evicts pinned a
    assert "ST-5" in _failing(store.snapshot())


def test_st6_store_that_evicts_a_storing_entry_is_caught() -> None:
    store = HostStore(1, _PinBlindLRU(1))
    assert isinstance(store.prepare_store([A]), PrepareStoreOutput)  # a STORING
    assert isinstance(store.prepare_store([B]), PrepareStoreOutput)  # evicts STORING a
    assert "ST-6" in _failing(store.snapshot())


def test_st6_counter_out_of_balance_is_caught() -> None:
    snap = _busy_store().snapshot()
    counters = {**snap["counters"], "reserved": snap["counters"]["reserved"] + 1}
    assert _failing({**snap, "counters": counters}) == {"ST-6"}


def test_st7_policy_losing_or_inventing_a_key_is_caught() -> None:
    snap = _busy_store("lru").snapshot()
    policy = snap["policy"]
    assert _failing({**snap, "policy": {**policy, "resident": policy["resident"][1:]}}) == {"ST-7"}
    extra_key = (*policy["resident"], F.hex())
    assert _failing({**snap, "policy": {**policy, "resident": extra_key}}) == {"ST-7"}


def test_st8_bad_policy_history_is_caught() -> None:
    snap = _busy_store("arc").snapshot()
    policy = snap["policy"]
    resident_ghost = {**policy, "ghosts": (*policy["ghosts"], policy["resident"][0])}
    assert "ST-8" in _failing({**snap, "policy": resident_ghost})
    wild_target = {**policy, "extra": {**policy["extra"], "target": (7, 2)}}
    assert _failing({**snap, "policy": wild_target}) == {"ST-8"}
    long_b1 = ("f0", "f1", "f2", "f3")
    ghosts = (*long_b1, *policy["extra"]["b2"])
    too_long = {**policy, "ghosts": ghosts, "extra": {**policy["extra"], "b1": long_b1}}
    assert _failing({**snap, "policy": too_long}) == {"ST-8"}


def test_st9_event_lost_or_double_counted_is_caught() -> None:
    snap = _busy_store().snapshot()
    assert _failing({**snap, "events": snap["events"][1:]}) >= {"ST-9"}
    taken = {**snap["taken"], "evicted": snap["taken"]["evicted"] + 1}
    assert _failing({**snap, "taken": taken}) == {"ST-9"}


def test_st10_events_out_of_order_are_caught() -> None:
    store = HostStore(1)
    _stored(store, [A])
    _stored(store, [B])  # events: stored a, evicted a, stored b
    snap = store.snapshot()
    stored_a, evicted_a, stored_b = snap["events"]
    swapped = (evicted_a, stored_a, stored_b)  # says a is READY, but a is gone
    assert _failing({**snap, "events": swapped}) == {"ST-10"}


# --- random operation sequences keep every invariant ---

_KEYS = [bytes([n]) for n in range(1, 7)]
_key_lists = st.lists(st.sampled_from(_KEYS), max_size=3, unique=True)
_ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "done", "fail", "load", "unload", "touch", "take"]), _key_lists
    ),
    max_size=25,
)


def _apply(store: HostStore, op: str, keys: list[bytes]) -> None:
    snap = store.snapshot()
    states = {bytes.fromhex(k): (s, p) for k, s, p in snap["entries"]}
    if op == "store":
        out = store.prepare_store(keys)
        if out is Refusal.NO_SPACE:
            assert store.snapshot() == snap
    elif op in ("done", "fail"):
        storing = [k for k in keys if states.get(k, ("", 0))[0] == "storing"]
        store.complete_store(storing, success=op == "done")
    elif op == "load":
        if store.prepare_load(keys) in (Refusal.MISSING, Refusal.NOT_READY):
            assert store.snapshot() == snap
    elif op == "unload":
        store.complete_load([k for k in keys if states.get(k, ("", 0))[1] > 0])
    elif op == "touch":
        store.touch(keys)
    else:
        store.take_events()


@pytest.mark.parametrize("policy", ["lru", "arc"])
@given(capacity=st.integers(1, 4), ops=_ops)
def test_random_operations_keep_every_store_invariant(
    policy: str, capacity: int, ops: list[tuple[str, list[bytes]]]
) -> None:
    store = HostStore(capacity, policy)
    for op, keys in ops:
        _apply(store, op, keys)
        assert check_all("store", store.snapshot()) == {}, (op, keys)


def _split_unit(policy: str) -> HostStore:
    """Units (a, b) and (c, d) stored; a dropped (bad data: no ghost), so (a, b) is split."""
    store = HostStore(4, policy)
    _stored(store, [A, B])  # tail first: b, then a
    _stored(store, [C, D])
    assert store.evict([A]) == (A,)
    return store


def test_a_store_completing_a_split_unit_refreshes_its_present_chunks() -> None:
    """Issue 28: re-storing a, b stays present and is refreshed in the same tail-first walk,
    so the unit is the most recent; left behind, b was the next victim and split it again."""
    store = _split_unit("lru")
    assert store.snapshot()["policy"]["resident"] == (B.hex(), D.hex(), C.hex())
    _stored(store, [A, B])  # reserves a only
    assert store.snapshot()["policy"]["resident"] == (D.hex(), C.hex(), B.hex(), A.hex())
    assert store.prepare_store([E]) == PrepareStoreOutput((E,), (D,))


def test_the_refresh_is_recency_only_and_a_call_that_reserves_nothing_changes_nothing() -> None:
    """A store is not a read: ARC keeps the refreshed READY b in T1 (its MRU end, before the
    new a), never promotes it to T2. A call whose keys are all present changes nothing."""
    store = _split_unit("arc")
    _stored(store, [A, B])
    extra = store.snapshot()["policy"]["extra"]
    assert (extra["t1"], extra["t2"]) == ((D.hex(), C.hex(), B.hex(), A.hex()), ())
    before = store.snapshot()
    assert store.prepare_store([C, D]) == PrepareStoreOutput((), ())
    assert store.snapshot() == before
