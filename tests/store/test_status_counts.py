"""``HostStore.status_counts``: the four counters of ``stats()`` every status change moves,
read without building ``StoreStats`` (the connector's claim memo and failure memory read them
every step). They must equal ``stats()``'s after every kind of change."""

from __future__ import annotations

import random

from hybridkv.errors import HybridKVConfigError
from hybridkv.store import EntryState, HostStore, LookupResult, PrepareStoreOutput


def _key(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\x00\x00\x00\x00"


def test_status_counts_equal_the_stats_counters_through_every_change() -> None:
    store = HostStore(6)
    rng = random.Random(5)
    storing: list[bytes] = []
    for _ in range(400):
        roll = rng.random()
        if roll < 0.4:
            prepared = store.prepare_store([_key(i) for i in rng.sample(range(20), 2)])
            if isinstance(prepared, PrepareStoreOutput):
                storing.extend(prepared.keys_to_store)
        elif roll < 0.75 and storing:
            done, storing = storing[:1], storing[1:]
            store.complete_store(done, success=rng.random() < 0.8)
        elif roll < 0.9:
            ready = [k for k in map(_key, range(20)) if store.status(k) is LookupResult.HIT]
            if ready:
                store.evict(ready[:1])
        stats = store.stats()
        assert store.status_counts() == (stats.reserved, stats.stored, stats.removed, stats.evicted)
    assert min(store.status_counts()) > 0  # every counter moved


def test_entry_states_give_status_key_by_key_through_every_change() -> None:
    """``HostStore.entry_states``: the claim memo's check, each key's entry state in one pass;
    ``status`` is a function of it (no entry: MISS; READY: HIT; STORING: HIT_PENDING)."""
    store = HostStore(6)
    rng = random.Random(7)
    storing: list[bytes] = []
    keys = [_key(i) for i in range(12)]
    of_state = {None: LookupResult.MISS, EntryState.READY: LookupResult.HIT}
    of_state[EntryState.STORING] = LookupResult.HIT_PENDING
    seen = set()
    for _ in range(300):
        roll = rng.random()
        if roll < 0.45:
            prepared = store.prepare_store([_key(i) for i in rng.sample(range(12), 2)])
            if isinstance(prepared, PrepareStoreOutput):
                storing.extend(prepared.keys_to_store)
        elif storing:
            done, storing = storing[:1], storing[1:]
            store.complete_store(done, success=rng.random() < 0.8)
        asked = [*keys, keys[0]]  # a repeat is answered twice
        states = store.entry_states(asked)
        assert tuple(of_state[s] for s in states) == tuple(store.status(k) for k in asked)
        seen.update(states)
    assert seen == {None, *EntryState}  # absent, STORING and READY all met


def test_entry_states_refuse_what_status_refuses() -> None:
    store = HostStore(2)
    for bad in ([b""], ["text"], b"one key"):
        try:
            store.entry_states(bad)  # type: ignore[arg-type]
        except HybridKVConfigError as error:
            assert error.field == "keys"
        else:
            raise AssertionError(f"{bad!r} accepted")
    assert store.entry_states([]) == ()
