"""Direct contract tests of :class:`hybridkv.store.HostStore`'s bookkeeping through its public API.

Each test pins one rule the store contract states (docs/explanation/host-store.md) that the
scenario tests exercise only in passing: pins are counted per load, counters and taken-event
tallies add up over calls, ``stats()`` gauges are exact, ``evict`` drops only READY unpinned
keys and leaves no ghost, a failed store leaves no ghost, a refused store changes nothing, a
ghost touched again reaches the policy by its own key. Expected values are worked out by hand
in each test.
"""

from __future__ import annotations

from hybridkv.store import (
    EventKind,
    HostStore,
    LookupResult,
    PrepareLoadOutput,
    PrepareStoreOutput,
    Refusal,
    StoreEvent,
)
from hybridkv.store.values import StoreStats

A, B, C, D = (name.encode() for name in "abcd")


def _ready(store: HostStore, keys: list[bytes]) -> None:
    out = store.prepare_store(keys)
    assert isinstance(out, PrepareStoreOutput)
    store.complete_store(out.keys_to_store, success=True)


def _pins(store: HostStore) -> dict[bytes, int]:
    """Each entry's pin count, read from the snapshot rows (hex key, state, pins)."""
    return {bytes.fromhex(key): pins for key, _, pins in store.snapshot()["entries"]}


def test_pins_are_counted_per_load_and_released_one_per_completion() -> None:
    store = HostStore(2)
    _ready(store, [A, B])
    assert store.prepare_load([A]) == PrepareLoadOutput((A,))
    assert store.prepare_load([A, B]) == PrepareLoadOutput((A, B))
    assert store.prepare_load([A]) == PrepareLoadOutput((A,))
    assert _pins(store) == {A: 3, B: 1}
    store.complete_load([A])  # three loads of A, one done: two pins stay
    assert _pins(store) == {A: 2, B: 1}
    assert store.stats().pinned == 2
    store.complete_load([A, B])  # B's only pin goes, A keeps one
    assert _pins(store) == {A: 1, B: 0}
    assert store.stats().pinned == 1
    store.complete_load([A])
    assert _pins(store) == {A: 0, B: 0}
    assert store.stats().pinned == 0
    # Both unpinned now: a NORMAL store can evict them both.
    out = store.prepare_store([C, D])
    assert isinstance(out, PrepareStoreOutput)
    assert sorted(out.evicted_keys) == [A, B]


def test_load_counters_add_up_over_calls() -> None:
    store = HostStore(3)
    _ready(store, [A, B, C])
    store.prepare_load([A, B])
    store.prepare_load([C])
    store.prepare_load([A])
    assert store.stats().loads_prepared == 4
    store.complete_load([A, B])
    store.complete_load([C])
    assert store.stats().loads_completed == 3
    assert store.snapshot()["counters"]["loads_completed"] == 3


def test_stats_gauges_are_exact() -> None:
    store = HostStore(4)
    _ready(store, [A, B])
    assert isinstance(store.prepare_store([C]), PrepareStoreOutput)  # C stays STORING
    store.prepare_load([A])
    # capacity 4; used A, B, C; storing C; ready A, B; pinned A; evictable B.
    assert store.stats() == StoreStats(4, 3, 1, 2, 1, 1, 3, 2, 0, 0, 1, 0)
    snap = store.snapshot()
    assert (snap["capacity"], snap["used"], snap["storing"], snap["evictable"]) == (4, 3, 1, 1)


def test_taken_counts_sum_every_event_of_each_kind() -> None:
    store = HostStore(2)
    _ready(store, [A])
    _ready(store, [B])
    out = store.prepare_store([C])  # evicts one READY entry for room
    assert isinstance(out, PrepareStoreOutput)
    store.complete_store([C], success=False)  # one REMOVED event
    events = store.take_events()
    assert [event.kind for event in events] == [
        EventKind.STORED,
        EventKind.STORED,
        EventKind.EVICTED,
        EventKind.REMOVED,
    ]
    assert store.snapshot()["taken"] == {"stored": 2, "evicted": 1, "removed": 1}
    _ready(store, [D])
    store.take_events()
    assert store.snapshot()["taken"] == {"stored": 3, "evicted": 1, "removed": 1}


def test_evict_drops_only_ready_unpinned_keys() -> None:
    store = HostStore(4)
    _ready(store, [A, B])
    assert isinstance(store.prepare_store([C]), PrepareStoreOutput)  # C is STORING
    store.prepare_load([B])  # B is pinned
    store.take_events()
    # D is absent, C STORING, B pinned: only A is dropped.
    assert store.evict([A, B, C, D]) == (A,)
    assert store.status(A) is LookupResult.MISS
    assert store.status(B) is LookupResult.HIT
    assert store.status(C) is LookupResult.HIT_PENDING
    assert store.take_events() == (StoreEvent(EventKind.EVICTED, (A,)),)
    assert store.stats().evicted == 1
    assert store.evict([B, C, D]) == ()
    assert store.take_events() == ()


def test_evict_leaves_no_ghost() -> None:
    store = HostStore(2, "arc")
    _ready(store, [A, B])
    assert store.evict([A]) == (A,)
    assert store.snapshot()["policy"]["ghosts"] == ()


def test_a_failed_store_leaves_no_ghost() -> None:
    store = HostStore(2, "arc")
    assert isinstance(store.prepare_store([A]), PrepareStoreOutput)
    store.complete_store([A], success=False)
    assert store.snapshot()["policy"]["ghosts"] == ()
    assert store.snapshot()["policy"]["resident"] == ()


def test_an_eviction_for_room_leaves_a_ghost() -> None:
    store = HostStore(1, "arc")
    _ready(store, [A])
    out = store.prepare_store([B])
    assert isinstance(out, PrepareStoreOutput)
    assert out.evicted_keys == (A,)
    assert store.snapshot()["policy"]["ghosts"] == (A.hex(),)


def test_touching_a_ghost_adapts_arc_by_its_key() -> None:
    store = HostStore(1, "arc")
    _ready(store, [A])
    _ready(store, [B])  # A leaves for room: a B1 ghost
    assert store.snapshot()["policy"]["extra"]["target"] == (0, 1)
    store.touch([A])  # a miss on the ghost A: p rises by max(1, |B2|/|B1|) = 1
    assert store.snapshot()["policy"]["extra"]["target"] == (1, 1)


def test_store_refused_when_named_resident_keys_leave_too_few_victims() -> None:
    store = HostStore(2)
    _ready(store, [A, B])
    before = store.snapshot()
    # Two new keys need two victims; A is named by the call, so only B may go: refused.
    assert store.prepare_store([A, C, D]) is Refusal.NO_SPACE
    assert store.snapshot() == before


def test_arc_victims_see_the_new_keys_tail_first() -> None:
    """The victims are chosen with ``p`` adapted to the call's new keys in the order the
    policy then sees them (tail first), every one of them: ``p`` is clamped to [0, capacity],
    so another order, or skipping a key, moves it elsewhere and picks other victims."""
    store = HostStore(3, "arc")
    e, f, g = (name.encode() for name in "efg")
    _ready(store, [g, f])
    _ready(store, [A])
    store.touch([g, B])
    # g kept through the next call by a load's pin, not by naming it: a store accesses the
    # present keys it names (issue 28), which would move g in T2 and change the state below.
    assert isinstance(store.prepare_load([g]), PrepareLoadOutput)
    _ready(store, [D, B])
    store.complete_load([g])
    _ready(store, [f, C, e])  # f is a B1 ghost here, not present
    store.touch([B])
    store.touch([e, D])
    extra = store.snapshot()["policy"]["extra"]
    assert (extra["t1"], extra["t2"]) == ((C.hex(), f.hex()), (e.hex(),))
    assert (extra["b1"], extra["b2"], extra["target"]) == ((B.hex(), D.hex()), (g.hex(),), (3, 1))
    # New keys (D, g), seen tail first: g is a B2 ghost, p = 3 - max(1, |B1|/|B2|) = 1; then
    # D is a B1 ghost, p = 1 + max(1, |B2|/|B1|) = 2. Two victims: T1 holds 2 >= floor(p),
    # so C; T1 then holds 1 < 2, so T2's e. (Head first, D would first push p to 3, clamped,
    # then g to 1; g alone also gives 1: either way T1's C and f would go.)
    out = store.prepare_store([D, g])
    assert isinstance(out, PrepareStoreOutput)
    assert out.evicted_keys == (C, e)
    assert store.snapshot()["policy"]["extra"]["target"] == (2, 1)
