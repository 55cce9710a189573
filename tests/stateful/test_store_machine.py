"""A hypothesis state machine over the optimized host store (hybridkv.store).

After every step the ``@invariant`` checks every ST-* predicate of the reference model on
``snapshot()`` (subject ``"store"``) and compares the store with a plain model kept here from
the contract alone: a dict ``key -> [state, pins]``, the counters, the pending events and,
for LRU, the recency list. Victims are checked against the contract (READY, unpinned, not
offered, and LOW for a LOW store; as many as the shortfall; LRU: the least recent evictable
ones), and a NO_SPACE
refusal is checked to be forced (fewer evictable entries than the shortfall). ARC's victim
order is the differential test's business (tests/differential/test_store_agreement.py).
Host slots are checked too: distinct, within capacity, one per resident key.

Runs: the profile's max_examples machines (ci: 200) of 50 steps each.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hybridkv.errors import HybridKVConfigError
from hybridkv.store import (
    HostStore,
    LookupOutcome,
    LookupResult,
    PrepareLoadOutput,
    PrepareStoreOutput,
    Refusal,
    StorePriority,
)
from spec.invariants import check_all, invariants_for

KEYS = tuple(f"key{i}".encode() for i in range(7))
STORING, READY = "storing", "ready"


def _some(keys: list[bytes], *, distinct: bool = True, max_size: int = 4) -> Any:
    if not keys:
        return st.just([])
    return st.lists(st.sampled_from(sorted(keys)), max_size=max_size, unique=distinct)


class StoreMachine(RuleBasedStateMachine):
    """The optimized store beside a plain model of its contract."""

    def __init__(self) -> None:
        super().__init__()
        self.store = HostStore(1)
        self.policy = "lru"
        self.entries: dict[bytes, list[Any]] = {}  # key -> [state, pins]
        self.recency: list[bytes] = []  # LRU model: least recent first
        self.low: set[bytes] = set()  # entries reserved LOW
        self.counters = dict.fromkeys(
            ("reserved", "stored", "removed", "evicted", "loads_prepared", "loads_completed"), 0
        )
        self.pending: list[tuple[str, tuple[bytes, ...]]] = []

    @initialize(capacity=st.integers(1, 5), policy=st.sampled_from(["lru", "arc"]))
    def build(self, capacity: int, policy: str) -> None:
        self.store, self.policy = HostStore(capacity, policy), policy

    def _in(self, state: str, *, pinned: bool = False) -> list[bytes]:
        return [k for k, (s, pins) in self.entries.items() if s == state and (pins or not pinned)]

    # --- stores ---

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4, unique=True), low=st.booleans())
    def prepare_store(self, keys: list[bytes], low: bool) -> None:
        incoming = [key for key in keys if key not in self.entries]
        shortfall = len(incoming) - (self.store.capacity - len(self.entries))
        # Admission: a LOW store evicts nothing (free slots only).
        evictable = [
            key
            for key, (state, pins) in self.entries.items()
            if state == READY and pins == 0 and key not in keys and not low
        ]
        out = self.store.prepare_store(keys, StorePriority.LOW if low else StorePriority.NORMAL)
        if out is Refusal.NO_SPACE:
            # Forced: fewer evictable entries than needed; the invariants see nothing changed.
            assert incoming
            assert len(evictable) < shortfall
            return
        assert isinstance(out, PrepareStoreOutput)
        assert list(out.keys_to_store) == incoming
        victims = list(out.evicted_keys)
        assert len(victims) == (max(0, shortfall) if incoming else 0)
        assert len(set(victims)) == len(victims)
        assert set(victims) <= set(evictable)
        if self.policy == "lru":
            assert victims == [key for key in self.recency if key in evictable][: len(victims)]
        for key in victims:
            del self.entries[key]
            self.recency.remove(key)
            self.low.discard(key)
        if victims:
            self.pending.append(("evicted", tuple(victims)))
            self.counters["evicted"] += len(victims)
        # The tail reaches the policy first; when the call reserves any key, a named key
        # already present is accessed in the same walk (issue 28: a unit's chunks stay
        # equally recent).
        for key in reversed(keys if incoming else []):
            if key in incoming:
                self.entries[key] = [STORING, 0]
            else:
                self.recency.remove(key)
            self.recency.append(key)
        if low:
            self.low.update(incoming)
        self.counters["reserved"] += len(incoming)

    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        keys = data.draw(_some(self._in(STORING)))
        self.store.complete_store(keys, success=success)
        if not keys:
            return
        for key in keys:
            if success:
                self.entries[key][0] = READY
            else:
                del self.entries[key]
                self.recency.remove(key)
                self.low.discard(key)
        kind = "stored" if success else "removed"
        self.pending.append((kind, tuple(keys)))
        self.counters[kind] += len(keys)

    # --- loads ---

    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        pool = self._in(READY) if data.draw(st.booleans()) else list(KEYS)
        keys = data.draw(_some(pool))
        out = self.store.prepare_load(keys)
        if any(key not in self.entries for key in keys):
            assert out is Refusal.MISSING
        elif any(self.entries[key][0] == STORING for key in keys):
            assert out is Refusal.NOT_READY
        else:
            assert out == PrepareLoadOutput(tuple(keys))
            for key in keys:
                self.entries[key][1] += 1
            self.counters["loads_prepared"] += len(keys)

    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        keys = data.draw(_some(self._in(READY, pinned=True)))
        self.store.complete_load(keys)
        for key in keys:
            self.entries[key][1] -= 1
        self.counters["loads_completed"] += len(keys)

    # --- queries and recency ---

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=5))
    def touch(self, keys: list[bytes]) -> None:
        self.store.touch(keys)
        for key in reversed(keys):
            if key in self.entries:
                self.recency.remove(key)
                self.recency.append(key)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4, unique=True))
    def evict(self, keys: list[bytes]) -> None:
        """A connector drops entries whose load failed: only READY unpinned ones go."""
        expected = [
            key
            for key in keys
            if key in self.entries and self.entries[key][0] == READY and not self.entries[key][1]
        ]
        assert list(self.store.evict(keys)) == expected
        for key in expected:
            del self.entries[key]
            self.recency.remove(key)
            self.low.discard(key)
        if expected:
            self.pending.append(("evicted", tuple(expected)))
            self.counters["evicted"] += len(expected)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=5))
    def lookup(self, keys: list[bytes]) -> None:
        expected = LookupOutcome(len(keys), LookupResult.HIT)
        for index, key in enumerate(keys):
            if key not in self.entries:
                expected = LookupOutcome(index, LookupResult.MISS)
                break
            if self.entries[key][0] == STORING:
                expected = LookupOutcome(index, LookupResult.HIT_PENDING)
                break
        assert self.store.lookup(keys) == expected

    @rule()
    def take_events(self) -> None:
        taken = [(e.kind.value, e.keys) for e in self.store.take_events()]
        assert taken == self.pending
        self.pending = []

    # --- bad input: a named error, nothing changed ---

    @rule(
        call=st.sampled_from(
            ["prepare_store", "prepare_load", "complete_load", "lookup", "touch", "evict"]
        ),
        bad=st.sampled_from([b"", "key0", 3, None, bytearray(b"key0"), False]),
    )
    def non_bytes_key(self, call: str, bad: object) -> None:
        self._refused(call, ([KEYS[0], bad],), {}, "keys")

    @rule(data=st.data(), success=st.booleans())
    def complete_store_without_a_store(self, data: st.DataObject, success: bool) -> None:
        pool = [key for key in KEYS if key not in self._in(STORING)]
        keys = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))
        self._refused("complete_store", (keys,), {"success": success}, "keys")

    @rule(data=st.data())
    def complete_load_without_a_load(self, data: st.DataObject) -> None:
        pool = [key for key in KEYS if key not in self._in(READY, pinned=True)]
        keys = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))
        self._refused("complete_load", (keys,), {}, "keys")

    @rule(call=st.sampled_from(["prepare_store", "prepare_load", "complete_load", "evict"]))
    def repeated_key(self, call: str) -> None:
        self._refused(call, ([KEYS[2], KEYS[2]],), {}, "keys")

    @rule(success=st.sampled_from([0, 1, None, "true"]))
    def non_bool_success(self, success: object) -> None:
        self._refused("complete_store", (self._in(STORING),), {"success": success}, "success")

    def _refused(self, call: str, args: tuple[Any, ...], kwargs: dict, field: str) -> None:
        before = self.store.snapshot()
        with pytest.raises(HybridKVConfigError) as caught:
            getattr(self.store, call)(*args, **kwargs)
        assert caught.value.field == field
        assert self.store.snapshot() == before

    # --- after every step ---

    @invariant()
    def every_store_invariant_holds(self) -> None:
        assert check_all("store", self.store.snapshot()) == {}

    @invariant()
    def store_matches_the_model(self) -> None:
        snap = self.store.snapshot()
        model = tuple(sorted((k.hex(), s, pins) for k, (s, pins) in self.entries.items()))
        assert snap["entries"] == model
        assert snap["low"] == tuple(sorted(key.hex() for key in self.low))
        assert snap["counters"] == self.counters
        assert snap["events"] == tuple(
            (kind, tuple(k.hex() for k in keys)) for kind, keys in self.pending
        )
        stats = self.store.stats()
        ready = [pins for state, pins in self.entries.values() if state == READY]
        assert (stats.used, stats.storing, stats.ready) == (
            len(self.entries),
            len(self.entries) - len(ready),
            len(ready),
        )
        assert stats.pinned == sum(1 for pins in ready if pins)
        assert stats.evictable == sum(1 for pins in ready if not pins)
        if self.policy == "lru":
            assert snap["policy"]["resident"] == tuple(key.hex() for key in self.recency)

    @invariant()
    def slots_are_distinct_and_within_capacity(self) -> None:
        keys = sorted(self.entries)
        slots = self.store.slots(keys)
        assert len(set(slots)) == len(slots)
        assert all(0 <= slot < self.store.capacity for slot in slots)


StoreMachine.TestCase.settings = settings(settings(), stateful_step_count=50)
test_store_machine = StoreMachine.TestCase


def test_the_machine_checks_every_store_invariant() -> None:
    """The subject name is right: the invariant above really runs the ST-* family."""
    ids = [inv.id for inv in invariants_for("store")]
    assert ids == [f"ST-{n}" for n in range(1, len(ids) + 1)]
    assert len(ids) >= 10
