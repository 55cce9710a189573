"""Unit tests of the optimized host store (hybridkv.store): hand-worked scenarios and bad input.

Expected values are worked out by hand from the contract (keys of one call reach the policy
tail first; victims are READY, unpinned, not offered; ARC picks from T1 while |T1| >=
floor(p)); each step says why. Bad input must raise HybridKVConfigError naming the field,
and leave the store exactly as it was (its snapshot unchanged).
"""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.errors import HybridKVConfigError
from hybridkv.store import (
    ARCPolicy,
    EventKind,
    HostCapacity,
    HostStore,
    LookupOutcome,
    LookupResult,
    LRUPolicy,
    PrepareStoreOutput,
    Refusal,
    StoreEvent,
)
from spec.invariants import check_all

A, B, C, D, E, F = (name.encode() for name in "abcdef")


def _stored(store: HostStore, keys: list[bytes]) -> PrepareStoreOutput:
    out = store.prepare_store(keys)
    assert isinstance(out, PrepareStoreOutput)
    store.complete_store(out.keys_to_store, success=True)
    assert check_all("store", store.snapshot()) == {}
    return out


def _hex(*keys: bytes) -> tuple[str, ...]:
    return tuple(key.hex() for key in keys)


# --- behaviour, by hand ---


def test_lru_sequence_by_hand() -> None:
    store = HostStore(3, "lru")
    _stored(store, [A, B, C])  # policy sees c, b, a: order (least recent first) c, b, a
    assert store.snapshot()["policy"]["resident"] == _hex(C, B, A)
    assert _stored(store, [D]).evicted_keys == (C,)  # c least recent -> b, a, d
    store.touch([B])  # b most recent -> a, d, b
    assert _stored(store, [E, F]).evicted_keys == (A, D)  # two least recent; then b, f, e
    assert store.snapshot()["policy"]["resident"] == _hex(B, F, E)
    kinds = [(event.kind, event.keys) for event in store.take_events()]
    assert kinds == [
        (EventKind.STORED, (A, B, C)),
        (EventKind.EVICTED, (C,)),
        (EventKind.STORED, (D,)),
        (EventKind.EVICTED, (A, D)),
        (EventKind.STORED, (E, F)),
    ]
    assert store.take_events() == ()


def _bound(store: HostStore, keys: list[bytes], bound: list[bytes]) -> PrepareStoreOutput:
    out = store.prepare_store(keys, bound=bound)
    assert isinstance(out, PrepareStoreOutput)
    store.complete_store(out.keys_to_store, success=True)
    assert check_all("store", store.snapshot()) == {}
    return out


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_dead_weight_goes_before_the_policys_choice(policy: str) -> None:
    # Unit ab: a plays the full-attention chunk, b a mamba state bound to it.
    store = HostStore(4, policy)
    _bound(store, [A, B], [B])
    _stored(store, [C])
    _stored(store, [D])
    store.touch([B])  # b most recent (ARC: T2): the policy's order a, c, d, b
    assert _stored(store, [E]).evicted_keys == (A,)  # the policy's first: b is dead weight now
    # The policy's next is c; b, most recent but unreadable without a, goes first.
    assert _stored(store, [F]).evicted_keys == (B,)
    assert sorted(row[0] for row in store.snapshot()["entries"]) == sorted(_hex(C, D, E, F))


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_victims_bound_mates_follow_it_and_an_unbound_key_stays(policy: str) -> None:
    store = HostStore(4, policy)
    _bound(store, [A, B], [B])
    _stored(store, [C])
    _stored(store, [D])
    store.touch([B])  # a, c, d, b
    assert _stored(store, [E, F]).evicted_keys == (A, B)  # b follows a, before c
    store = HostStore(4, policy)
    _bound(store, [A, B], [B])
    _stored(store, [C])
    _stored(store, [D])  # b, a, c, d
    assert _stored(store, [E]).evicted_keys == (B,)
    store.touch([A])  # c, d, e, a: a, the unbound full chunk, still serves longer claims
    assert _stored(store, [F]).evicted_keys == (C,)


def test_bound_keys_must_be_keys_of_the_call() -> None:
    store = HostStore(2, "lru")
    before = store.snapshot()
    with pytest.raises(HybridKVConfigError) as bad:
        store.prepare_store([A], bound=[B])
    assert bad.value.field == "bound"
    assert store.snapshot() == before


def test_arc_ghost_hit_raises_p_and_the_t1_boundary_is_inclusive() -> None:
    store = HostStore(2, "arc")
    _stored(store, [A])
    _stored(store, [B])  # T1 = a, b
    store.touch([A])  # a READY and used again: T1 = b, T2 = a
    assert _stored(store, [C]).evicted_keys == (B,)  # p = 0, |T1| = 1 >= 0: T1's LRU; B1 = b
    # b returns: a B1 ghost hit raises p by max(1, |B2|/|B1|) = 1. Now |T1| = 1 >= floor(p) = 1,
    # so the victim is T1's c (a strict > would take T2's a instead).
    assert _stored(store, [B]).evicted_keys == (C,)
    extra = store.snapshot()["policy"]["extra"]
    assert (extra["t1"], extra["t2"], extra["b1"], extra["b2"]) == (_hex(B), _hex(A), _hex(C), ())
    assert extra["target"] == (1, 1)


def test_pins_block_eviction_until_the_load_completes() -> None:
    store = HostStore(1)
    _stored(store, [A])
    assert store.prepare_load([A]) is not Refusal.MISSING
    before = store.snapshot()
    assert store.prepare_store([B]) is Refusal.NO_SPACE  # a is the only entry, and pinned
    assert store.snapshot() == before
    store.complete_load([A])
    assert _stored(store, [B]).evicted_keys == (A,)


def test_present_keys_are_skipped_and_never_evicted_for_their_own_call() -> None:
    store = HostStore(2)
    _stored(store, [A, B])  # order b, a
    # c needs one slot; b is the LRU but is named in the call, so a goes.
    out = store.prepare_store([B, C])
    assert out == PrepareStoreOutput((C,), (A,))


def test_lookup_status_and_refusals() -> None:
    store = HostStore(3)
    _stored(store, [A])
    store.prepare_store([B])  # b STORING
    assert store.lookup([A, B, C]) == LookupOutcome(1, LookupResult.HIT_PENDING)
    assert store.lookup([A, C]) == LookupOutcome(1, LookupResult.MISS)
    assert store.lookup([]) == LookupOutcome(0, LookupResult.HIT)
    assert store.status(B) is LookupResult.HIT_PENDING
    assert store.prepare_load([A, C]) is Refusal.MISSING
    assert store.prepare_load([A, B]) is Refusal.NOT_READY


def test_failed_store_drops_the_entry_and_its_slot() -> None:
    store = HostStore(2)
    store.prepare_store([A, B])  # slots in call order: a 0, b 1
    assert store.slots([A, B]) == (0, 1)
    store.complete_store([A], success=False)
    assert store.status(A) is LookupResult.MISS
    assert store.take_events() == (StoreEvent(EventKind.REMOVED, (A,)),)
    store.prepare_store([C])  # a's slot is free again
    assert store.slots([C]) == (0,)
    stats = store.stats()
    assert (stats.used, stats.storing, stats.reserved, stats.removed) == (2, 2, 3, 1)


def test_evicted_slots_are_reused_and_stay_within_capacity() -> None:
    store = HostStore(2)
    _stored(store, [A, B])  # a 0, b 1; order b, a
    _stored(store, [C])  # evicts b (least recent): c takes slot 1
    assert store.slots([A, C]) == (0, 1)


def test_capacity_from_a_byte_budget() -> None:
    # 10 whole chunks of 4096 bytes fit in 10 * 4096 + 100; the 100 left over are not used.
    store = HostStore.from_bytes(10 * 4096 + 100, 4096, "arc")
    assert store.capacity == 10
    capacity = HostCapacity.from_budget(10 * 4096 + 100, 4096)
    assert (capacity.chunks, capacity.total_bytes) == (10, 40960)
    assert capacity.slot_offset(3) == 3 * 4096
    assert HostStore.from_bytes(4096, 4096).capacity == 1


def test_copy_is_independent() -> None:
    store = HostStore(2, "arc")
    _stored(store, [A])
    twin = store.copy()
    _stored(twin, [B, C])
    assert store.snapshot()["entries"] == ((A.hex(), "ready", 0),)
    assert twin.snapshot() != store.snapshot()


# --- bad input: a named error, nothing corrupted ---


@pytest.mark.parametrize("capacity", [0, -1, True, 1.5, "3", None])
def test_capacity_must_be_a_positive_int(capacity: Any) -> None:
    with pytest.raises(HybridKVConfigError) as caught:
        HostStore(capacity)
    assert caught.value.field == "num_chunks"


@pytest.mark.parametrize(
    ("host_bytes", "chunk_bytes", "field"),
    [
        (4095, 4096, "host_bytes"),  # smaller than one chunk
        (0, 4096, "host_bytes"),
        (-8192, 4096, "host_bytes"),
        (True, 1, "host_bytes"),
        (8192.0, 4096, "host_bytes"),
        ("8GB", 4096, "host_bytes"),
        (8192, 0, "chunk_bytes"),
        (8192, -4096, "chunk_bytes"),
        (8192, True, "chunk_bytes"),
        (8192, None, "chunk_bytes"),
    ],
)
def test_impossible_byte_budgets_are_named(host_bytes: Any, chunk_bytes: Any, field: str) -> None:
    with pytest.raises(HybridKVConfigError) as caught:
        HostStore.from_bytes(host_bytes, chunk_bytes)
    assert caught.value.field == field


def test_a_budget_below_one_chunk_says_how_big_a_chunk_is() -> None:
    with pytest.raises(HybridKVConfigError) as caught:
        HostCapacity.from_budget(1000, 4096)
    assert "4096" in caught.value.problem
    assert "4096" in caught.value.fix


@pytest.mark.parametrize(("chunks", "chunk_bytes"), [(0, 4096), (2, 0), (True, 4096)])
def test_host_capacity_values_are_checked(chunks: Any, chunk_bytes: Any) -> None:
    with pytest.raises(HybridKVConfigError):
        HostCapacity(chunks, chunk_bytes)


@pytest.mark.parametrize("policy", ["fifo", "LRU", "", LRUPolicy(4), ARCPolicy(3), object(), 3])
def test_policy_must_be_known_and_fit_the_capacity(policy: Any) -> None:
    # LRUPolicy(4) and ARCPolicy(3) are built for other capacities than the store's 2.
    with pytest.raises(HybridKVConfigError) as caught:
        HostStore(2, policy)
    assert caught.value.field == "cache_policy"


def test_a_used_policy_is_refused_and_a_fresh_one_accepted() -> None:
    used = LRUPolicy(2)
    used.on_insert(A)
    with pytest.raises(HybridKVConfigError) as caught:
        HostStore(2, used)
    assert caught.value.field == "cache_policy"
    assert HostStore(2, ARCPolicy(2)).snapshot()["policy"]["name"] == "arc"


def _populated() -> HostStore:
    store = HostStore(3, "arc")
    _stored(store, [A, B])
    store.prepare_load([A])  # a READY pinned, b READY, c STORING
    store.prepare_store([C])
    return store


@pytest.mark.parametrize(
    ("call", "args", "kwargs", "field"),
    [
        ("complete_store", ([D],), {"success": True}, "keys"),  # unknown key
        ("complete_store", ([C, B],), {"success": True}, "keys"),  # b is READY, not STORING
        ("complete_store", ([C],), {"success": 1}, "success"),
        ("complete_load", ([B],), {}, "keys"),  # b is not pinned
        ("complete_load", ([C],), {}, "keys"),  # c is STORING
        ("complete_load", ([D],), {}, "keys"),
        ("complete_load", ([A, A],), {}, "keys"),
        ("prepare_store", ([D, "e"],), {}, "keys"),
        ("prepare_store", (b"de",), {}, "keys"),  # bytes, not a list of keys
        ("prepare_load", ([A, b""],), {}, "keys"),
        ("prepare_load", ([bytearray(b"a")],), {}, "keys"),
        ("touch", ([A, 3],), {}, "keys"),
        ("lookup", ("ab",), {}, "keys"),
        ("lookup", (None,), {}, "keys"),
        ("status", ("a",), {}, "key"),
        ("slots", ([D],), {}, "keys"),  # no entry, no slot
    ],
)
def test_contract_breaches_are_named_and_change_nothing(
    call: str, args: tuple[Any, ...], kwargs: dict[str, Any], field: str
) -> None:
    store = _populated()
    before = store.snapshot()
    with pytest.raises(HybridKVConfigError) as caught:
        getattr(store, call)(*args, **kwargs)
    assert caught.value.field == field
    assert store.snapshot() == before
    assert store.slots([A, B, C]) == (0, 1, 2)


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
    out = store.prepare_store([E])
    assert isinstance(out, PrepareStoreOutput)
    assert out.evicted_keys == (D,)


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
