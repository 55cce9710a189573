"""The host store's accounting: entries, lifecycle, load pins, slots, capacity, events, counters.

The optimized twin of the reference model ``spec.store.HostStore`` (never imported here): the
same operations, refusals, errors (same ``field``), victims, events and ``snapshot()`` schema,
checked operation for operation by tests/differential/test_store_agreement.py and by every
ST-* invariant in tests/stateful/test_store_machine.py. Victims come from an
:class:`~hybridkv.store.policy.EvictionPolicy` (LRU or ARC); this module never orders keys.

What makes it fast (the reference recounts everything on every query):

- state lives in flat dicts: ``_state`` (key -> EntryState) and ``_pins`` (only pinned keys),
  and the counts ``used``/``storing``/``ready``/``pinned``/``evictable`` are kept
  incrementally, so :meth:`HostStore.stats` is O(1); ST-2/ST-5/ST-6 recount them;
- a store under pressure that cannot possibly make room (more victims needed than READY
  unpinned entries exist) is refused in O(1), before the policy walks anything;
- a call costs O(keys it names + victims + unevictable keys the policy walks past).

Contract shared with the reference (read its module docstring for the snapshot schema):

- Capacity counts entries (chunks); a key is non-empty ``bytes``. STORING entries are
  reserved and not loadable, READY ones are loadable; loads pin READY entries; only READY
  unpinned entries not named in the same call are evicted.
- Keys of one call are in prefix order, head first; the policy sees them tail first.
- An expected refusal is a returned :class:`Refusal` and changes nothing; a broken
  pre-condition raises :class:`HybridKVConfigError` before changing anything.

Beyond the reference: each entry owns a host slot in ``[0, capacity)`` from reservation until
it is evicted or its store fails (:meth:`HostStore.slots`), so the transfer engine knows where
its bytes live; a slot is reused only after its entry left, and an evicted entry was READY and
unpinned, so no transfer touches a reused slot. Slots are not part of ``snapshot()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

from hybridkv.errors import HybridKVConfigError
from hybridkv.store.capacity import HostCapacity
from hybridkv.store.policies import make_policy
from hybridkv.store.policy import Evictable, EvictionPolicy
from hybridkv.store.values import (
    COUNTER_NAMES,
    EntryState,
    EventKind,
    LookupOutcome,
    LookupResult,
    PrepareLoadOutput,
    PrepareStoreOutput,
    Refusal,
    StoreEvent,
    StoreStats,
)

__all__ = ["HostStore"]

_READY = EntryState.READY
_STORING = EntryState.STORING


class HostStore:
    """Entries of the CPU tier, their lifecycle, pins and slots; victims chosen by a policy."""

    def __init__(self, capacity: int, policy: str | EvictionPolicy = "lru") -> None:
        """A store of ``capacity`` entries evicting by ``policy`` (a name or an empty policy).

        Pre: ``capacity`` an int >= 1 (field ``num_chunks``); ``policy`` a name of
        :data:`~hybridkv.store.policies.POLICY_NAMES` or an empty policy built for the same
        capacity (field ``cache_policy``). Post: empty store, zero counters.
        """
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise HybridKVConfigError(
                "num_chunks", capacity, "must be an int >= 1", "give the tier at least one chunk"
            )
        self._capacity = capacity
        self._policy = _checked_policy(policy, capacity)
        self._state: dict[bytes, EntryState] = {}
        self._pins: dict[bytes, int] = {}  # only keys with pins >= 1
        self._storing = 0
        self._slots: dict[bytes, int] = {}
        self._recycled: list[int] = []  # slots freed by evictions and failed stores
        self._fresh = 0  # slots [_fresh, capacity) were never handed out
        self._counters = dict.fromkeys(COUNTER_NAMES, 0)
        self._events: list[StoreEvent] = []
        self._taken = {kind.value: 0 for kind in EventKind}

    @classmethod
    def from_bytes(
        cls, host_bytes: int, chunk_bytes: int, policy: str | EvictionPolicy = "lru"
    ) -> HostStore:
        """A store holding every whole chunk of ``chunk_bytes`` that fits in ``host_bytes``.

        Pre/errors: see :meth:`HostCapacity.from_budget` (fields ``host_bytes``,
        ``chunk_bytes``) and the constructor (``cache_policy``).
        """
        return cls(HostCapacity.from_budget(host_bytes, chunk_bytes).chunks, policy)

    @property
    def capacity(self) -> int:
        """Entries the store can hold."""
        return self._capacity

    # --- queries (frame: nothing changes) ---

    def status(self, key: bytes) -> LookupResult:
        """vLLM's per-key ``lookup``: HIT (READY), HIT_PENDING (STORING) or MISS (absent)."""
        # The hot path asks the dict first and checks the key only where it could be a wrong
        # one (a miss, or not exactly bytes): the same answers and refusals, fewer calls.
        try:
            state = self._state.get(key)
        except TypeError:  # unhashable: not a key (refused below)
            state = None
        if state is None or type(key) is not bytes:
            _checked_key("key", key)
        if state is None:
            return LookupResult.MISS
        return LookupResult.HIT if state is _READY else LookupResult.HIT_PENDING

    def lookup(self, keys: Sequence[bytes]) -> LookupOutcome:
        """The run of leading READY keys and what stopped it (see :class:`LookupOutcome`).

        Pre: a sequence of bytes keys (repeats allowed). Frame: nothing changes.
        """
        checked = _checked_keys(keys, distinct=False)
        state = self._state
        for index, key in enumerate(checked):
            found = state.get(key)
            if found is not _READY:
                stop = LookupResult.MISS if found is None else LookupResult.HIT_PENDING
                return LookupOutcome(index, stop)
        return LookupOutcome(len(checked), LookupResult.HIT)

    def slots(self, keys: Sequence[bytes]) -> tuple[int, ...]:
        """The host slot of each key (``[0, capacity)``, distinct among resident keys).

        Pre: every key has an entry (STORING or READY), else field ``keys``. Frame: nothing
        changes. A slot stays the key's until it is evicted or its store fails.
        """
        checked = _checked_keys(keys, distinct=False)
        try:
            return tuple(map(self._slots.__getitem__, checked))
        except KeyError as missing:  # the first key without an entry, in order
            key = missing.args[0]
            raise HybridKVConfigError(
                "keys", key, "has no entry", "ask only resident keys"
            ) from None

    # --- loads ---

    def prepare_load(self, keys: Sequence[bytes]) -> PrepareLoadOutput | Refusal:
        """Pin every key for a load.

        Pre: distinct bytes keys. Post: each key's pins grew by 1; ``loads_prepared`` grew by
        ``len(keys)``. Refusal: MISSING if a key is absent, else NOT_READY if one is STORING;
        a refused call changes nothing.
        """
        checked = _checked_keys(keys, distinct=True)
        state, pins = self._state, self._pins
        found = [state.get(key) for key in checked]
        if None in found:
            return Refusal.MISSING
        if _STORING in found:
            return Refusal.NOT_READY
        for key in checked:
            pins[key] = pins.get(key, 0) + 1
        self._counters["loads_prepared"] += len(checked)
        return PrepareLoadOutput(checked)

    def complete_load(self, keys: Sequence[bytes]) -> None:
        """Release one pin per key: the load finished (successfully or not).

        Pre: distinct keys, each pinned (field ``keys`` otherwise, nothing changed).
        Post: each key's pins fell by 1; ``loads_completed`` grew by ``len(keys)``.
        """
        checked = _checked_keys(keys, distinct=True)
        pins = self._pins
        for key in checked:
            if key not in pins:
                raise HybridKVConfigError("keys", key, "is not pinned by a load", "complete once")
        for key in checked:
            left = pins[key] - 1
            if left:
                pins[key] = left
            else:
                del pins[key]
        self._counters["loads_completed"] += len(checked)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Record a use of ``keys`` (head first) for the policy's recency.

        Pre: bytes keys (repeats allowed). Post: resident keys refreshed tail first, so
        ``keys[0]`` ends most recent; an absent key is a miss the policy may learn from.
        Frame: entries, pins, slots, counters and events never change.
        """
        state, policy = self._state, self._policy
        for key in reversed(_checked_keys(keys, distinct=False)):
            found = state.get(key)
            if found is None:
                policy.on_miss(key)
            else:
                policy.on_access(key, ready=found is _READY)

    # --- stores ---

    def prepare_store(self, keys: Sequence[bytes]) -> PrepareStoreOutput | Refusal:
        """Reserve STORING entries (and slots) for the absent ``keys``, evicting to make room.

        Pre: distinct bytes keys. Post: every absent key is STORING (``keys_to_store``, given
        order); present keys are skipped and untouched; if free slots fall short, the policy's
        victims among READY unpinned entries not named in ``keys`` were evicted
        (``evicted_keys``, one EVICTED event). Refusal NO_SPACE when that cannot make room;
        a refused call changes nothing, the policy included.
        """
        checked = _checked_keys(keys, distinct=True)
        state = self._state
        incoming = tuple(key for key in checked if key not in state)
        if not incoming:
            return PrepareStoreOutput((), ())
        tail_first = incoming[::-1]
        shortfall = len(incoming) - (self._capacity - len(state))
        victims: tuple[bytes, ...] = ()
        if shortfall > 0:
            # Upper bound on victims; refusing here spares the policy's walk.
            if shortfall > len(state) - self._storing - len(self._pins):
                return Refusal.NO_SPACE
            offered = frozenset(key for key in checked if key in state)
            victims = self._policy.victims(shortfall, self._evictable(offered), tail_first)
            if len(victims) < shortfall:
                return Refusal.NO_SPACE
        policy = self._policy
        for key in tail_first:
            policy.on_miss(key)
        self._evict(victims)
        for key in tail_first:
            state[key] = _STORING
            policy.on_insert(key)
        for key in incoming:
            self._slots[key] = self._take_slot()
        self._storing += len(incoming)
        self._counters["reserved"] += len(incoming)
        return PrepareStoreOutput(incoming, victims)

    def complete_store(self, keys: Sequence[bytes], success: bool) -> None:
        """Finish the stores of ``keys``: READY on success, dropped on failure.

        Pre: ``success`` a bool (field ``success``), then distinct keys, each STORING (field
        ``keys``); otherwise nothing changed. Post on success: each key READY with 0 pins, one
        STORED event, ``stored`` grew. On failure: the entries and their slots are gone (no
        ghost), one REMOVED event, ``removed`` grew. Empty ``keys``: nothing changes.
        """
        if not isinstance(success, bool):
            raise HybridKVConfigError("success", success, "must be a bool", "pass True or False")
        checked = _checked_keys(keys, distinct=True)
        state = self._state
        for key in checked:
            if state.get(key) is not _STORING:
                raise HybridKVConfigError("keys", key, "has no store in flight", "complete once")
        if not checked:
            return
        if success:
            for key in checked:
                state[key] = _READY
        else:
            for key in checked:
                del state[key]
                self._policy.on_remove(key)
                self._recycled.append(self._slots.pop(key))
        self._storing -= len(checked)
        kind = EventKind.STORED if success else EventKind.REMOVED
        self._events.append(StoreEvent(kind, checked))
        self._counters[kind.value] += len(checked)

    def evict(self, keys: Sequence[bytes]) -> tuple[bytes, ...]:
        """Evict those of ``keys`` that are READY and unpinned: the caller found their data bad.

        ``spec.store.HostStore.evict``'s twin: a connector whose load of a key failed drops the
        entry so the chunk is stored again; the policy forgets the keys without a ghost.

        Pre: distinct bytes keys (field ``keys``, nothing changed). Post: the returned keys (in
        the given order) were READY with 0 pins and are gone with their slots, in one EVICTED
        event, ``evicted`` grew; keys absent, STORING or pinned are left as they are. Frame:
        nothing else changes (no event when nothing is evicted).
        """
        state, pins = self._state, self._pins
        victims = tuple(
            key
            for key in _checked_keys(keys, distinct=True)
            if state.get(key) is _READY and key not in pins
        )
        if not victims:
            return ()
        for key in victims:
            del state[key]
            self._policy.on_remove(key)
            self._recycled.append(self._slots.pop(key))
        self._events.append(StoreEvent(EventKind.EVICTED, victims))
        self._counters["evicted"] += len(victims)
        return victims

    # --- events, stats, snapshot ---

    def take_events(self) -> tuple[StoreEvent, ...]:
        """Every event since the last call, oldest first.

        Post: no event is pending; ``taken`` counts their keys. Frame: nothing else changes.
        """
        events, self._events = tuple(self._events), []
        for event in events:
            self._taken[event.kind.value] += len(event.keys)
        return events

    def status_counts(self) -> tuple[int, int, int, int]:
        """``(reserved, stored, removed, evicted)`` of :meth:`stats`, without building it: every
        change of a key's status moves one of them (the connector's memos key on these).
        O(1). Frame: nothing changes."""
        counters = self._counters
        return (
            counters["reserved"],
            counters["stored"],
            counters["removed"],
            counters["evicted"],
        )

    def stats(self) -> StoreStats:
        """Counts of entries now and of keys since creation, in O(1). Frame: nothing changes."""
        used = len(self._state)
        ready = used - self._storing
        pinned = len(self._pins)
        counters = self._counters
        return StoreStats(
            self._capacity,
            used,
            self._storing,
            ready,
            pinned,
            ready - pinned,
            *map(counters.__getitem__, COUNTER_NAMES),
        )

    def snapshot(self) -> dict[str, Any]:
        """The reference's plain snapshot (``spec.store`` schema). Frame: nothing changes."""
        stats = self.stats()
        pins = self._pins
        return {
            "capacity": self._capacity,
            "used": stats.used,
            "storing": stats.storing,
            "evictable": stats.evictable,
            "entries": tuple(
                sorted((key.hex(), s.value, pins.get(key, 0)) for key, s in self._state.items())
            ),
            "policy": self._policy.snapshot(),
            "counters": dict(self._counters),
            "events": tuple((e.kind.value, tuple(k.hex() for k in e.keys)) for e in self._events),
            "taken": dict(self._taken),
        }

    def copy(self) -> HostStore:
        """An independent copy (same class): mutating one never changes the other."""
        twin = type(self).__new__(type(self))
        twin._capacity = self._capacity
        twin._policy = self._policy.copy()
        # Keys, states and events are immutable values: copying the containers is enough.
        twin._state, twin._pins = dict(self._state), dict(self._pins)
        twin._storing = self._storing
        twin._slots, twin._recycled = dict(self._slots), list(self._recycled)
        twin._fresh = self._fresh
        twin._counters, twin._taken = dict(self._counters), dict(self._taken)
        twin._events = list(self._events)
        return twin

    # --- internals ---

    def _evictable(self, offered: frozenset[bytes]) -> Evictable:
        state, pins = self._state, self._pins
        if not offered:
            return lambda key: state[key] is _READY and key not in pins
        return lambda key: state[key] is _READY and key not in pins and key not in offered

    def _evict(self, victims: tuple[bytes, ...]) -> None:
        if not victims:
            return
        self._policy.on_evict(victims)
        for key in victims:
            del self._state[key]
            self._recycled.append(self._slots.pop(key))
        self._events.append(StoreEvent(EventKind.EVICTED, victims))
        self._counters["evicted"] += len(victims)

    def _take_slot(self) -> int:
        # Capacity bounds the entries, so a slot is always free here.
        if self._recycled:
            return self._recycled.pop()
        self._fresh += 1
        return self._fresh - 1


def _checked_policy(policy: str | EvictionPolicy, capacity: int) -> EvictionPolicy:
    if isinstance(policy, str):
        return make_policy(policy, capacity)
    if not isinstance(policy, EvictionPolicy) or policy.capacity != capacity:
        raise HybridKVConfigError(
            "cache_policy", policy, "is not a policy for this capacity", "pass a policy name"
        )
    if policy.resident() or policy.ghosts():
        raise HybridKVConfigError("cache_policy", policy, "is not empty", "pass a fresh policy")
    return policy


_BYTES = {bytes}
_SEQUENCES = (list, tuple)  # the common containers, known iterable


def _checked_key(field: str, key: object) -> bytes:
    if not isinstance(key, bytes) or not key:
        raise HybridKVConfigError(field, key, "an offload key is non-empty bytes", "pass bytes")
    return key


def _checked_keys(keys: object, *, distinct: bool) -> tuple[bytes, ...]:
    if type(keys) not in _SEQUENCES and (
        isinstance(keys, (bytes, str)) or not isinstance(keys, Iterable)
    ):
        raise HybridKVConfigError("keys", keys, "is not a sequence of keys", "pass a list of keys")
    checked: tuple[bytes, ...] = tuple(cast("Iterable[bytes]", keys))
    # One pass in C when every key is non-empty bytes (the usual case); the per-key check,
    # which names the first bad key, otherwise.
    if not (set(map(type, checked)) <= _BYTES and all(checked)):
        for key in checked:
            _checked_key("keys", key)
    if distinct and len(set(checked)) != len(checked):
        raise HybridKVConfigError("keys", keys, "repeats a key", "pass each key once")
    return checked
