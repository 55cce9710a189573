"""The host store's accounting: entries, lifecycle, load pins, slots, capacity, events, counters.

The library's host store, built for speed from the store contract (docs/explanation/host-store.md;
the reference model ``spec.store`` states the same contract and is never imported here).
tests/differential/test_store_agreement.py runs both side by side and compares every answer,
refusal, error field, victim, event and ``snapshot()``; tests/stateful/test_store_machine.py
checks every ST-* predicate on this store's snapshots. Which resident key to evict is the
:class:`~hybridkv.store.policy.EvictionPolicy`'s business (LRU or ARC): nothing here orders keys.

The contract in brief:

- one entry per chunk, ``capacity`` entries at most; keys are non-empty ``bytes``, a call's
  keys in prefix order (head first), handed to the policy tail first;
- STORING (reserved, being written) then READY (loadable); a load pins READY entries; an
  eviction takes READY entries with no pin that the same call does not name;
- admission (issue 18): ``prepare_store`` takes a :class:`StorePriority`, and each entry keeps
  the one it was reserved with. A LOW call (the connector's continuation units and far
  sliding-window units) takes free slots only and displaces nothing, so a full host keeps
  what it holds and a LOW unit is stored where there is room;
- a store that reserves keys refreshes its keys already present with them (issue 28;
  recency only, a store is not a read): a unit's chunks of every group stay equally recent,
  so an eviction does not split the unit just completed;
- dead weight first (issue 28): a store call may bind some of its keys to its unit
  (``bound``: the connector binds a unit's mamba states). A bound key whose unit lost a key
  is dead, and victims are taken one at a time, the key that died first, else the policy's
  next; so the rest of a split unit leaves before the policy's choice splits another;
- a refusal is a :class:`Refusal` value and leaves everything as it was; a call with bad
  arguments raises :class:`HybridKVConfigError` before touching anything.

Where the speed comes from:

- plain dicts and sets: ``_state`` (key -> EntryState), ``_pins`` (pinned keys only),
  ``_low`` (LOW keys only), and running counts of STORING entries, so
  :meth:`HostStore.stats` costs O(1) (ST-2, ST-5 and ST-6 recount them);
- a store that could not make room even by evicting every candidate is refused in O(1), before
  the policy walks anything;
- every call costs O(its keys + victims + the unevictable keys the policy walks past), with
  bound keys O(unit) more per key bound or leaving: who watches whom is indexed
  (``_watch``), and the dead wait in the order they died (``_dead``), so no walk of the
  resident keys looks for them.

Host slots (not in the snapshot): from reservation until it leaves, an entry owns a slot in
``[0, capacity)`` (:meth:`HostStore.slots`) where the transfer engine puts its bytes. A slot is
handed out again only after its entry left, and an entry leaves only READY and unpinned (or as
a failed store), so no copy in flight ever reads or writes a reused slot.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
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
    StorePriority,
    StoreStats,
)

__all__ = ["HostStore"]

_READY = EntryState.READY
_STORING = EntryState.STORING
_LOW = StorePriority.LOW
_NOTHING_STORED = PrepareStoreOutput((), ())


class HostStore:
    """The CPU tier's entries (state, pins, priority, slot); a policy picks the victims."""

    def __init__(self, capacity: int, policy: str | EvictionPolicy = "lru") -> None:
        """An empty store of ``capacity`` entries whose victims ``policy`` chooses.

        ``capacity``: int >= 1, else field ``num_chunks``. ``policy``: one of
        :data:`~hybridkv.store.policies.POLICY_NAMES`, or a fresh policy object of the same
        capacity, else field ``cache_policy``. Counters start at zero.
        """
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise HybridKVConfigError(
                "num_chunks", capacity, "must be an int >= 1", "give the tier at least one chunk"
            )
        self._capacity = capacity
        self._policy = _fresh_policy(policy, capacity)
        self._state: dict[bytes, EntryState] = {}
        self._pins: dict[bytes, int] = {}  # pinned keys only (count >= 1)
        self._low: set[bytes] = set()  # resident keys reserved LOW
        # Bound resident keys only: the keys of the last call that reserved and bound them.
        self._unit: dict[bytes, tuple[bytes, ...]] = {}
        # A resident key -> the bound keys whose unit holds it, in the order they were bound:
        # the keys its departure kills.
        self._watch: dict[bytes, dict[bytes, None]] = {}
        self._dead: dict[bytes, None] = {}  # bound keys whose unit lost a key, as they died
        self._storing = 0
        self._slots: dict[bytes, int] = {}
        self._recycled: list[int] = []  # slots given back by departed entries
        self._fresh = 0  # slots from here to capacity were never handed out
        self._counters = dict.fromkeys(COUNTER_NAMES, 0)
        self._events: list[StoreEvent] = []
        self._taken = {kind.value: 0 for kind in EventKind}

    @classmethod
    def from_bytes(
        cls, host_bytes: int, chunk_bytes: int, policy: str | EvictionPolicy = "lru"
    ) -> HostStore:
        """As many whole ``chunk_bytes`` chunks as ``host_bytes`` holds.

        Raises as :meth:`HostCapacity.from_budget` does (fields ``host_bytes`` and
        ``chunk_bytes``) and as the constructor does (``cache_policy``).
        """
        return cls(HostCapacity.from_budget(host_bytes, chunk_bytes).chunks, policy)

    @property
    def capacity(self) -> int:
        """How many entries fit."""
        return self._capacity

    # --- read-only questions ---

    def status(self, key: bytes) -> LookupResult:
        """One key's ``lookup``: HIT when READY, HIT_PENDING when STORING, MISS when absent."""
        # Look the key up first; validate it only when the answer could hide a bad key (a miss,
        # or a key that is not exactly bytes): the same results and errors for fewer calls.
        try:
            found = self._state.get(key)
        except TypeError:  # unhashable, so not a key: refused just below
            found = None
        if found is None or type(key) is not bytes:
            _valid_key("key", key)
        if found is _READY:
            return LookupResult.HIT
        return LookupResult.MISS if found is None else LookupResult.HIT_PENDING

    def entry_states(self, keys: Sequence[bytes]) -> tuple[EntryState | None, ...]:
        """Each key's entry state, None when it has no entry, in order (repeats allowed): what
        :meth:`status` reads, in C-level passes. A memo of answers that read these keys keeps
        them while this tuple is unchanged (the states are compared by identity, so no enum
        is hashed). Changes nothing."""
        return tuple(map(self._state.get, _valid_keys(keys, distinct=False)))

    def lookup(self, keys: Sequence[bytes]) -> LookupOutcome:
        """How many keys from the head are READY, and the status of the first that is not.

        Repeated keys are allowed. Changes nothing.
        """
        state = self._state
        valid = _valid_keys(keys, distinct=False)
        for position, key in enumerate(valid):
            found = state.get(key)
            if found is not _READY:
                return LookupOutcome(
                    position, LookupResult.MISS if found is None else LookupResult.HIT_PENDING
                )
        return LookupOutcome(len(valid), LookupResult.HIT)

    def slots(self, keys: Sequence[bytes]) -> tuple[int, ...]:
        """Each key's host slot, in ``[0, capacity)`` and distinct among resident keys.

        Every key must be resident (STORING or READY), else field ``keys``. Changes nothing.
        """
        valid = _valid_keys(keys, distinct=False)
        try:
            return tuple(map(self._slots.__getitem__, valid))
        except KeyError as absent:  # the first key in order without an entry
            raise HybridKVConfigError(
                "keys", absent.args[0], "has no entry", "ask only resident keys"
            ) from None

    # --- loads ---

    def prepare_load(self, keys: Sequence[bytes]) -> PrepareLoadOutput | Refusal:
        """Add one pin to each of ``keys`` (distinct) for a load.

        Refused with MISSING when some key is absent, otherwise NOT_READY when some key is
        still STORING; a refusal pins nothing. Accepted, ``loads_prepared`` counts the keys.
        """
        valid = _valid_keys(keys, distinct=True)
        states = [self._state.get(key) for key in valid]
        if None in states:
            return Refusal.MISSING
        if _STORING in states:
            return Refusal.NOT_READY
        pins = self._pins
        for key in valid:
            pins[key] = pins.get(key, 0) + 1
        self._counters["loads_prepared"] += len(valid)
        return PrepareLoadOutput(valid)

    def complete_load(self, keys: Sequence[bytes]) -> None:
        """Take one pin off each of ``keys`` (distinct), whatever the load's outcome.

        A key holding no pin raises (field ``keys``) before any pin is taken off.
        ``loads_completed`` counts the keys.
        """
        valid = _valid_keys(keys, distinct=True)
        pins = self._pins
        unpinned = next((key for key in valid if key not in pins), None)
        if unpinned is not None:
            raise HybridKVConfigError("keys", unpinned, "is not pinned by a load", "complete once")
        for key in valid:
            if pins[key] == 1:
                del pins[key]
            else:
                pins[key] -= 1
        self._counters["loads_completed"] += len(valid)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Tell the policy ``keys`` (head first, repeats allowed) were just used.

        The policy sees them tail first, so ``keys[0]`` ends the most recent; an absent key
        reaches it as a miss (ARC's ghosts learn from those). Only the policy changes.
        """
        state, policy = self._state, self._policy
        for key in reversed(_valid_keys(keys, distinct=False)):
            found = state.get(key)
            if found is None:
                policy.on_miss(key)
            else:
                policy.on_access(key, ready=found is _READY)

    def refresh(self, keys: Sequence[bytes]) -> None:
        """Recency only for the present ones of ``keys`` (head first, repeats allowed): the
        policy sees them tail first as accesses of chunks not loadable, so ``keys[0]`` ends the
        most recent and ARC promotes none to T2; absent keys are skipped (no ghost learns from
        them). A finished request's chunks, head most recent: the next victims are the tails
        of the least recent requests, which shortens a prefix instead of breaking it. Only the
        policy changes."""
        state = self._state
        present = [key for key in reversed(_valid_keys(keys, distinct=False)) if key in state]
        self._policy.on_access_many(present, ready=False)

    # --- stores ---

    def prepare_store(
        self,
        keys: Sequence[bytes],
        priority: StorePriority = StorePriority.NORMAL,
        bound: Collection[bytes] = (),
    ) -> PrepareStoreOutput | Refusal:
        """Reserve a STORING entry and a slot for each absent key, evicting if the host is full.

        ``keys``: distinct; present ones keep their entry (state, pins, priority); when the
        call reserves any key, the policy sees its present keys accessed as not loadable
        (``on_access(ready=False)``: recency, no ARC promotion), in one tail-first walk with
        the inserts (the comment there says why).
        ``priority`` (field ``priority``): the class the new entries keep; a LOW call
        evicts nothing (free slots only). The victims, chosen by the policy among READY
        unpinned entries the call does not name, leave in one EVICTED event
        (``evicted_keys``); ``keys_to_store`` lists the reserved keys in the given order.
        NO_SPACE when no such victims make room; then nothing changes, the policy included.
        ``bound`` (field ``bound``): keys of ``keys`` useless once another key of the call is
        gone (a mamba state without its unit's other chunks). When the call reserves, each
        becomes bound to the call's keys (alive again if it was dead). A bound key dies when
        a key of its unit leaves (one departure kills in binding order); a dead key is
        evicted before any other, the first to die first (:meth:`_dead_first`).
        """
        if not isinstance(priority, StorePriority):
            raise HybridKVConfigError(
                "priority", priority, "is not a StorePriority", "pass StorePriority.NORMAL"
            )
        valid = _valid_keys(keys, distinct=True)
        _check_bound(bound, valid)
        state = self._state
        new = tuple(key for key in valid if key not in state)
        if not new:
            return _NOTHING_STORED
        victims = self._victims_for(valid, new, priority)
        if victims is None:
            return Refusal.NO_SPACE
        policy = self._policy
        for key in new[::-1]:
            policy.on_miss(key)
        self._leave(victims, EventKind.EVICTED)
        if len(new) == len(valid):
            for key in new[::-1]:
                state[key] = _STORING
                policy.on_insert(key)
        else:
            # The call's present keys are refreshed in the same tail-first walk as the
            # inserts (issue 28). A call names the chunks of one unit, every group's; a unit
            # is claimed only whole. Left at their old recency, the chunks already here are
            # the next victims, and evicting them splits the unit again: the chunks this call
            # adds could never be claimed. A store is not a read (its request recomputed the
            # chunks), so the refresh is an access as of a chunk not yet loadable: recency
            # only, never ARC's promotion to T2, which would part the unit across T1 and T2.
            # A call that adds nothing repairs no unit and changes nothing.
            for key in valid[::-1]:
                if key in state:
                    policy.on_access(key, ready=False)
                else:
                    state[key] = _STORING
                    policy.on_insert(key)
        if priority is _LOW:
            self._low.update(new)
        self._bind(bound, valid)
        slots = self._slots
        for key in new:
            slots[key] = self._free_slot()
        self._storing += len(new)
        self._counters["reserved"] += len(new)
        return PrepareStoreOutput(new, victims)

    def complete_store(self, keys: Sequence[bytes], success: bool) -> None:
        """End the stores of ``keys`` (distinct, each STORING): READY, or gone when they failed.

        ``success`` must be a bool (field ``success``) and each key STORING (field ``keys``);
        both are checked before anything changes. Success: READY with no pin, one STORED event.
        Failure: the entries and slots are released with no ghost left, one REMOVED event.
        The matching counter grows; no keys, no change.
        """
        if not isinstance(success, bool):
            raise HybridKVConfigError("success", success, "must be a bool", "pass True or False")
        valid = _valid_keys(keys, distinct=True)
        state = self._state
        idle = next((key for key in valid if state.get(key) is not _STORING), None)
        if idle is not None:
            raise HybridKVConfigError("keys", idle, "has no store in flight", "complete once")
        if not valid:
            return
        self._storing -= len(valid)
        if success:
            for key in valid:
                state[key] = _READY
            self._events.append(StoreEvent(EventKind.STORED, valid))
            self._counters["stored"] += len(valid)
        else:
            self._leave(valid, EventKind.REMOVED)

    def evict(self, keys: Sequence[bytes]) -> tuple[bytes, ...]:
        """Drop the READY unpinned ones among ``keys`` (distinct): their data turned out bad.

        A connector whose load failed calls this so the chunk is stored afresh; the policy
        keeps no ghost of them. Returns the dropped keys in the given order (one EVICTED event,
        ``evicted`` grows); absent, STORING and pinned keys stay. Nothing dropped, no event.
        """
        state, pins = self._state, self._pins
        bad = tuple(
            key
            for key in _valid_keys(keys, distinct=True)
            if state.get(key) is _READY and key not in pins
        )
        if bad:
            self._leave(bad, EventKind.EVICTED, ghost=False)
        return bad

    # --- events, counts, views ---

    def take_events(self) -> tuple[StoreEvent, ...]:
        """Hand over the pending events, oldest first, and count their keys as taken."""
        handed, self._events = tuple(self._events), []
        taken = self._taken
        for event in handed:
            taken[event.kind.value] += len(event.keys)
        return handed

    def status_counts(self) -> tuple[int, int, int, int]:
        """``(reserved, stored, removed, evicted)``: every status change of a key moves one of
        them, so the connector keys its memos on this tuple. O(1), changes nothing."""
        count = self._counters
        return (count["reserved"], count["stored"], count["removed"], count["evicted"])

    def stats(self) -> StoreStats:
        """Entries now and keys counted since creation, in O(1). Changes nothing."""
        used = len(self._state)
        ready = used - self._storing
        pinned = len(self._pins)
        count = self._counters
        return StoreStats(
            self._capacity,
            used,
            self._storing,
            ready,
            pinned,
            ready - pinned,
            *map(count.__getitem__, COUNTER_NAMES),
        )

    def snapshot(self) -> dict[str, Any]:
        """The plain dict of the store contract's snapshot schema. Changes nothing."""
        stats, pins = self.stats(), self._pins
        rows = [(key.hex(), state.value, pins.get(key, 0)) for key, state in self._state.items()]
        return {
            "capacity": self._capacity,
            "used": stats.used,
            "storing": stats.storing,
            "evictable": stats.evictable,
            "entries": tuple(sorted(rows)),
            "low": tuple(sorted(key.hex() for key in self._low)),
            "policy": self._policy.snapshot(),
            "counters": dict(self._counters),
            "events": tuple((e.kind.value, tuple(k.hex() for k in e.keys)) for e in self._events),
            "taken": dict(self._taken),
        }

    def copy(self) -> HostStore:
        """A twin sharing no mutable state with this store."""
        twin = type(self).__new__(type(self))
        # Keys, states, slots and events are immutable: shallow copies of the containers do.
        twin.__dict__.update(
            _capacity=self._capacity,
            _policy=self._policy.copy(),
            _state=dict(self._state),
            _pins=dict(self._pins),
            _low=set(self._low),
            _unit=dict(self._unit),
            _watch={key: dict(keys) for key, keys in self._watch.items()},
            _dead=dict(self._dead),
            _storing=self._storing,
            _slots=dict(self._slots),
            _recycled=list(self._recycled),
            _fresh=self._fresh,
            _counters=dict(self._counters),
            _events=list(self._events),
            _taken=dict(self._taken),
        )
        return twin

    # --- internals ---

    def _victims_for(
        self, valid: tuple[bytes, ...], new: tuple[bytes, ...], priority: StorePriority
    ) -> tuple[bytes, ...] | None:
        """The policy's victims that make room for ``new``; None when there are too few."""
        missing = len(new) - (self._capacity - len(self._state))
        if missing <= 0:
            return ()
        # A LOW unit takes free slots only: trading one unlikely claim for another churns the
        # host and, in a loop larger than the host, evicts the one claimed sooner.
        if priority is _LOW:
            return None
        # Cheap upper bound on the candidates: refuse before the policy walks anything.
        if missing > len(self._state) - self._storing - len(self._pins):
            return None
        named = frozenset(valid) if len(new) != len(valid) else frozenset()
        evictable = self._candidate(named)
        if not self._unit:  # nothing bound: the policy's choice as it is
            chosen = self._policy.victims(missing, evictable, new[::-1])
            return chosen if len(chosen) == missing else None
        return self._dead_first(missing, evictable, new[::-1])

    def _dead_first(
        self, missing: int, evictable: Evictable, incoming: tuple[bytes, ...]
    ) -> tuple[bytes, ...] | None:
        """``missing`` victims, one at a time: the evictable dead key that died first (those
        dead before the call, then those its victims kill), else the policy's first key not
        chosen; None when the evictable keys are too few. A dead key serves no claim, and
        the bound mates of a victim leave before the policy splits another unit."""
        watch, dead = self._watch, self._dead
        picked: list[bytes] = []
        chosen: set[bytes] = set()
        killed: dict[bytes, None] = {}  # alive before the call, killed by its victims
        older = (key for key in dead if evictable(key))
        ranked: tuple[bytes, ...] = ()
        at = 0
        while len(picked) < missing:
            pick = next(older, None)
            if pick is None:
                pick = next((k for k in killed if k not in chosen and evictable(k)), None)
            while pick is None:
                if at == len(ranked):  # victims(n) is a prefix of victims(n + m)
                    ranked = self._policy.victims(at + missing, evictable, incoming)
                    if at == len(ranked):
                        return None
                key = ranked[at]
                at += 1
                if key not in chosen:
                    pick = key
            picked.append(pick)
            chosen.add(pick)
            for key in watch.get(pick, ()):
                if key not in dead and key not in chosen:
                    killed[key] = None
        return tuple(picked)

    def _bind(self, bound: Collection[bytes], keys: tuple[bytes, ...]) -> None:
        """Bind each of ``bound`` (in order) to the call's ``keys``: alive, watching them."""
        unit, watch, dead = self._unit, self._watch, self._dead
        for key in dict.fromkeys(bound):
            self._unwatch(key, unit.get(key, ()))
            unit[key] = keys
            dead.pop(key, None)
            for mate in keys:
                if mate != key:
                    watch.setdefault(mate, {})[key] = None

    def _unwatch(self, key: bytes, mates: tuple[bytes, ...]) -> None:
        watch = self._watch
        for mate in mates:
            watchers = watch.get(mate)
            if watchers is not None and watchers.pop(key, 0) is None and not watchers:
                del watch[mate]

    def _candidate(self, named: frozenset[bytes]) -> Evictable:
        """The evictability test handed to the policy (``named``: resident keys of the call)."""
        state, pins = self._state, self._pins
        if named:
            return lambda key: state[key] is _READY and key not in pins and key not in named
        return lambda key: state[key] is _READY and key not in pins

    def _leave(self, keys: tuple[bytes, ...], kind: EventKind, *, ghost: bool = True) -> None:
        """``keys`` leave with their slots, in one ``kind`` event. An eviction for room
        (``ghost``) tells the policy ``on_evict``; a failed store or a bad entry, ``on_remove``."""
        if not keys:
            return
        policy, state, slots = self._policy, self._state, self._slots
        if kind is EventKind.EVICTED and ghost:
            policy.on_evict(keys)
        else:
            for key in keys:
                policy.on_remove(key)
        for key in keys:
            del state[key]
            self._recycled.append(slots.pop(key))
        self._low.difference_update(keys)
        if self._unit:
            self._bury(keys)
        self._events.append(StoreEvent(kind, keys))
        self._counters[kind.value] += len(keys)

    def _bury(self, keys: tuple[bytes, ...]) -> None:
        """After ``keys`` left: they watch nothing, and the bound keys watching them die, each
        departure's in binding order."""
        unit, watch, dead = self._unit, self._watch, self._dead
        for key in keys:
            dead.pop(key, None)
            self._unwatch(key, unit.pop(key, ()))
        for key in keys:
            for mate in watch.pop(key, ()):
                dead.setdefault(mate, None)

    def _free_slot(self) -> int:
        # Entries never outnumber slots, so one is always free here.
        if self._recycled:
            return self._recycled.pop()
        self._fresh += 1
        return self._fresh - 1


def _fresh_policy(policy: str | EvictionPolicy, capacity: int) -> EvictionPolicy:
    """The policy named, or the one given once it is known to be empty and of this size."""
    if isinstance(policy, str):
        return make_policy(policy, capacity)
    if not isinstance(policy, EvictionPolicy) or policy.capacity != capacity:
        raise HybridKVConfigError(
            "cache_policy", policy, "is not a policy for this capacity", "pass a policy name"
        )
    if policy.resident() or policy.ghosts():
        raise HybridKVConfigError("cache_policy", policy, "is not empty", "pass a fresh policy")
    return policy


_LISTS = (list, tuple)  # containers that are surely key sequences, checked without isinstance
_BYTES_ONLY = frozenset({bytes})


def _check_bound(bound: Collection[bytes], valid: tuple[bytes, ...]) -> None:
    if bound and not set(bound) <= set(valid):
        raise HybridKVConfigError(
            "bound", bound, "names a key the call does not", "bind only keys of the call"
        )


def _valid_key(field: str, key: object) -> bytes:
    if not isinstance(key, bytes) or not key:
        raise HybridKVConfigError(field, key, "an offload key is non-empty bytes", "pass bytes")
    return key


def _valid_keys(keys: object, *, distinct: bool) -> tuple[bytes, ...]:
    if type(keys) not in _LISTS and (
        isinstance(keys, (bytes, str)) or not isinstance(keys, Iterable)
    ):
        raise HybridKVConfigError("keys", keys, "is not a sequence of keys", "pass a list of keys")
    valid: tuple[bytes, ...] = tuple(cast("Iterable[bytes]", keys))
    # The common case (all non-empty bytes) is two C-level passes (the key types as a set,
    # then truthiness: an empty bytes is false); otherwise the key-by-key check finds the
    # first bad key to name.
    if not ({*map(type, valid)} <= _BYTES_ONLY and all(valid)):
        for key in valid:
            _valid_key("keys", key)
    if distinct and len(set(valid)) != len(valid):
        raise HybridKVConfigError("keys", keys, "repeats a key", "pass each key once")
    return valid
