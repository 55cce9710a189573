"""The host store: the CPU tier that holds offloaded KV chunks (vLLM 0.33's OffloadingManager).

The store does the accounting (entries, their lifecycle, load pins, capacity, events, counters);
an :class:`~spec.policies.EvictionPolicy` only orders resident keys and picks victims.

- Capacity counts entries (chunks). A key is opaque ``bytes`` (vLLM: ``block_hash`` followed by
  the 4-byte big-endian group index).
- An entry is STORING (space reserved, data being written, not loadable) or READY (loadable).
  Loads pin READY entries (``pins`` = loads in flight). Only READY unpinned entries are evicted.
- Keys passed in one call are in prefix order, head first. The store feeds them to the policy
  tail first, so the head of a prefix ends most recently used and tails are evicted first (as
  vLLM's request-ordered ranks do).
- A store request that reserves keys also refreshes the keys it names that are already
  present (issue 28; recency only, as of a chunk not yet loadable: a store is not a read):
  they are chunks of the unit its request just computed, as recent as the chunks it adds.
  Otherwise the next eviction takes the older part first and splits the unit, and a split
  unit is never claimed (a claim needs every group's chunk of a unit).
- Dead weight first (issue 28): a store request may bind some of its keys to its unit
  (``bound``): keys no claim can read once another key of the request is gone (the connector
  binds a unit's mamba states, which serve only a claim ending at the unit, to the unit's
  other chunks). A bound key whose unit lost a key is dead; victims are taken one at a time,
  the key that died first, else the policy's next, so the rest of a split unit leaves before
  the policy splits another.
- Admission (issue 18): a store request carries a :class:`StorePriority`, and an entry keeps
  the priority it was reserved with. NORMAL, the default, evicts as before (any class). LOW is
  for units less likely to be claimed than a prompt's prefix (the connector sends continuation
  units, past the prompt, and sliding-window units too far before the prompt's end to serve a
  claim there): a LOW request evicts nothing, and where the free slots fall short it is
  refused. So a LOW unit never displaces another entry, and is stored whenever there is room.
- An expected refusal (no space, not ready) is a returned :class:`Refusal` and changes nothing.
  A call that breaks its pre-condition (unknown key, duplicate keys, not bytes) raises
  :class:`~spec.errors.ConfigError` before changing anything.

Snapshot schema (``snapshot()``; the optimized store exports the same plain dict)::

    capacity:  int                   entries the store can hold
    used:      int                   hand-kept count of entries (STORING + READY)
    storing:   int                   hand-kept count of STORING entries
    evictable: int                   hand-kept count of READY entries with 0 pins
    entries:   tuple[(key_hex, state, pins), ...] sorted by key_hex;
               state is "storing" | "ready", pins an int >= 0
    low:       tuple[key_hex, ...]   sorted: the entries reserved LOW
    policy:    {"name": str, "resident": (key_hex, ...), "ghosts": (key_hex, ...),
                "extra": {...}}      see EvictionPolicy.snapshot (ARC: t1/t2/b1/b2/target)
    counters:  {"reserved", "stored", "removed", "evicted", "loads_prepared",
                "loads_completed": int}   keys counted since creation
    events:    tuple[(kind, (key_hex, ...)), ...]  pending (not yet taken), oldest first;
               kind is "stored" | "evicted" | "removed"
    taken:     {"stored", "evicted", "removed": int}  keys in events already taken

The ST-* predicates (:mod:`spec.invariants.store`) read exactly this.

Deviations from vLLM 0.33's ``CPUOffloadingManager`` (each keeps the model small or the frame
exact): no request contexts (recency comes from :meth:`HostStore.touch` and from the present
keys a store names, at the call; vLLM commits it at request finish), no admission threshold
(the priority classes above are this project's own), no chunk ids, no ``reset_cache``; a
refused ``prepare_store`` adapts nothing (vLLM's ARC learns from the offer's ghost hits even
then); ``take_events`` returns every event as it happened (vLLM filters a ``removed`` key that
a retry re-reserved before the drain).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, NamedTuple

from spec.errors import ConfigError
from spec.policies import EvictionPolicy, make_policy

__all__ = [
    "COUNTER_NAMES",
    "EntryState",
    "EventKind",
    "HostStore",
    "LookupOutcome",
    "LookupResult",
    "PrepareLoadOutput",
    "PrepareStoreOutput",
    "Refusal",
    "StoreEvent",
    "StorePriority",
    "StoreStats",
]

COUNTER_NAMES = ("reserved", "stored", "removed", "evicted", "loads_prepared", "loads_completed")


class EntryState(Enum):
    """Lifecycle of an entry: STORING (reserved, being written) -> READY (loadable)."""

    STORING = "storing"
    READY = "ready"


class LookupResult(Enum):
    """vLLM's per-key lookup verdict (its RETRY belongs to tiered stores, not modelled here)."""

    HIT = "hit"
    MISS = "miss"
    HIT_PENDING = "hit_pending"


class LookupOutcome(NamedTuple):
    """How many leading keys are READY, and what stopped the run.

    ``stop`` is HIT when every key hit, MISS when ``keys[hits]`` is absent (final answer),
    HIT_PENDING when ``keys[hits]`` is STORING: retry later, the hit may grow (vLLM's scheduler
    defers the request on HIT_PENDING).
    """

    hits: int
    stop: LookupResult


class Refusal(Enum):
    """An expected refusal; the refused call changed nothing."""

    NO_SPACE = "no_space"
    MISSING = "missing"
    NOT_READY = "not_ready"


class StorePriority(Enum):
    """The class of a store request (module docstring, admission): what its entries may evict."""

    NORMAL = "normal"
    LOW = "low"


class EventKind(Enum):
    """What an event reports: data became READY, was evicted, or a failed store was dropped."""

    STORED = "stored"
    EVICTED = "evicted"
    REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class StoreEvent:
    """One event: ``kind`` happened to ``keys`` (in the order the call handled them)."""

    kind: EventKind
    keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class PrepareStoreOutput:
    """Accepted store: ``keys_to_store`` are now STORING; ``evicted_keys`` made room for them."""

    keys_to_store: tuple[bytes, ...]
    evicted_keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class PrepareLoadOutput:
    """Accepted load: each of ``keys`` holds one more pin until :meth:`HostStore.complete_load`."""

    keys: tuple[bytes, ...]


class StoreStats(NamedTuple):
    """Counts at one moment (entries) and since creation (keys)."""

    capacity: int
    used: int
    storing: int
    ready: int
    pinned: int
    evictable: int
    reserved: int
    stored: int
    removed: int
    evicted: int
    loads_prepared: int
    loads_completed: int


@dataclass(frozen=True, slots=True)
class _Entry:
    state: EntryState
    pins: int
    priority: StorePriority = StorePriority.NORMAL
    # A bound key's unit: the keys of the call that last reserved and bound it, in the call's
    # order (empty: free); when it was bound (the store's binding count then); and when it
    # died, a key of its unit having left (the store's death count then; None: alive).
    unit: tuple[bytes, ...] = ()
    bound_at: int = 0
    died_at: int | None = None


class HostStore:
    """Entries of the CPU tier, their lifecycle and pins; victims chosen by a policy."""

    def __init__(self, capacity: int, policy: str | EvictionPolicy = "lru") -> None:
        """A store of ``capacity`` entries evicting by ``policy`` (a name or an empty policy).

        Pre: ``capacity`` an int >= 1 (``ConfigError`` field ``num_chunks`` otherwise);
        ``policy`` a name of :data:`spec.policies.POLICY_NAMES` or an empty policy built for
        the same capacity (field ``cache_policy``). Post: empty store, zero counters.
        """
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(
                "num_chunks", capacity, "must be an int >= 1", "give the tier at least one chunk"
            )
        self._capacity = capacity
        self._policy = _checked_policy(policy, capacity)
        self._entries: dict[bytes, _Entry] = {}
        self._bindings = 0  # bound keys so far: orders the keys one departure kills
        self._deaths = 0  # deaths so far: orders the dead keys for eviction
        self._counters = dict.fromkeys(COUNTER_NAMES, 0)
        self._events: list[StoreEvent] = []
        self._taken = {kind.value: 0 for kind in EventKind}

    @property
    def capacity(self) -> int:
        """Entries the store can hold."""
        return self._capacity

    # --- queries (frame: nothing changes) ---

    def status(self, key: bytes) -> LookupResult:
        """vLLM's per-key ``lookup``: HIT (READY), HIT_PENDING (STORING) or MISS (absent).

        Pure. Pre: ``key`` is non-empty bytes (:class:`ConfigError`, field ``key``, otherwise).
        """
        entry = self._entries.get(_checked_key("key", key))
        if entry is None:
            return LookupResult.MISS
        return LookupResult.HIT if entry.state is EntryState.READY else LookupResult.HIT_PENDING

    def lookup(self, keys: Sequence[bytes]) -> LookupOutcome:
        """The run of leading READY keys and what stopped it (see :class:`LookupOutcome`).

        Pre: ``keys`` is a sequence of bytes keys. Post/frame: nothing changes.
        """
        checked = _checked_keys(keys, distinct=False)
        for index, key in enumerate(checked):
            result = self.status(key)
            if result is not LookupResult.HIT:
                return LookupOutcome(index, result)
        return LookupOutcome(len(checked), LookupResult.HIT)

    # --- loads ---

    def prepare_load(self, keys: Sequence[bytes]) -> PrepareLoadOutput | Refusal:
        """Pin every key for a load.

        Pre: distinct bytes keys. Post: each key's pins grew by 1; ``loads_prepared`` grew by
        ``len(keys)``. Refusal: MISSING if a key is absent, else NOT_READY if one is STORING;
        a refused call changes nothing.
        """
        checked = _checked_keys(keys, distinct=True)
        if any(key not in self._entries for key in checked):
            return Refusal.MISSING
        if any(self._entries[key].state is not EntryState.READY for key in checked):
            return Refusal.NOT_READY
        for key in checked:
            entry = self._entries[key]
            self._entries[key] = replace(entry, pins=entry.pins + 1)
        self._counters["loads_prepared"] += len(checked)
        return PrepareLoadOutput(checked)

    def complete_load(self, keys: Sequence[bytes]) -> None:
        """Release one pin per key: the load finished (successfully or not).

        Pre: distinct keys, each READY with ``pins >= 1`` (``ConfigError`` field ``keys``
        otherwise, nothing changed). Post: each key's pins fell by 1; ``loads_completed``
        grew by ``len(keys)``.
        """
        checked = _checked_keys(keys, distinct=True)
        for key in checked:
            entry = self._entries.get(key)
            if entry is None or entry.pins == 0:
                raise ConfigError("keys", key, "is not pinned by a load", "complete loads once")
        for key in checked:
            entry = self._entries[key]
            self._entries[key] = replace(entry, pins=entry.pins - 1)
        self._counters["loads_completed"] += len(checked)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Record a use of ``keys`` (head first) for the policy's recency.

        Pre: bytes keys (repeats allowed). Post: resident keys are refreshed tail first, so
        ``keys[0]`` ends most recent; an absent key is a miss the policy may learn from (ARC
        ghost hit). Frame: entries, pins, counters and events never change.
        """
        for key in reversed(_checked_keys(keys, distinct=False)):
            entry = self._entries.get(key)
            if entry is None:
                self._policy.on_miss(key)
            else:
                self._policy.on_access(key, ready=entry.state is EntryState.READY)

    # --- stores ---

    def prepare_store(
        self,
        keys: Sequence[bytes],
        priority: StorePriority = StorePriority.NORMAL,
        bound: Sequence[bytes] = (),
    ) -> PrepareStoreOutput | Refusal:
        """Reserve STORING entries for the absent ``keys``, evicting to make room.

        Pre: distinct bytes keys; ``priority`` a :class:`StorePriority` (field ``priority``).
        Post: every absent key is STORING with ``priority`` (``keys_to_store``, in the given
        order); keys already present keep their entry (state, pins, priority), and when some
        key is reserved they are accessed as not loadable (``on_access(ready=False)``: recency,
        no ARC promotion) in the same tail-first walk as the inserts, so the whole call ends
        in prefix order with its head most recent (a call that reserves nothing changes
        nothing); if the free slots fall short, the policy's
        victims among READY, unpinned entries that are not in ``keys`` were evicted first
        (``evicted_keys``, one EVICTED event); a LOW request evicts nothing. Refusal NO_SPACE
        when that cannot make room; a refused call changes nothing, the policy included.

        Why present keys are accessed: a call names the chunks of one unit, every group's,
        that its request just computed. Left at their old recency, the chunks already present
        are the next victims, and evicting them splits the unit again, so the chunks this
        call adds are never claimable (a claim needs every group's chunk of a unit). A store
        is not a read (its request recomputed the chunks), so ARC does not promote them to
        T2, which would part the unit across T1 and T2; a call that adds nothing repairs no
        unit and changes nothing.

        ``bound``: keys of ``keys`` (field ``bound`` otherwise) that no claim can read once
        another key of the call is gone (the connector binds a unit's mamba states). A
        reserving call binds each, in the given order, to the call's keys (alive again if it
        was dead). A bound key dies when a key of its unit leaves (the keys one departure
        kills die in the order they were bound). Victims are taken one at a time: the dead
        evictable key that died first (a victim chosen earlier in the same call kills as a
        departure does), else the policy's first key not chosen.
        """
        if not isinstance(priority, StorePriority):
            raise ConfigError(
                "priority", priority, "is not a StorePriority", "pass StorePriority.NORMAL"
            )
        checked = _checked_keys(keys, distinct=True)
        binding = frozenset(bound)
        if not binding <= set(checked):
            raise ConfigError(
                "bound", bound, "names a key the call does not", "bind only keys of the call"
            )
        incoming = tuple(key for key in checked if key not in self._entries)
        if not incoming:
            return PrepareStoreOutput((), ())
        offered = set(checked)

        def evictable(key: bytes) -> bool:
            entry = self._entries[key]
            return entry.state is EntryState.READY and entry.pins == 0 and key not in offered

        tail_first = incoming[::-1]
        shortfall = max(0, len(incoming) - (self._capacity - len(self._entries)))
        if shortfall and priority is StorePriority.LOW:
            return Refusal.NO_SPACE  # a LOW unit takes free slots only
        ranked = self._policy.victims(len(self._entries), evictable, tail_first)
        if len(ranked) < shortfall:
            return Refusal.NO_SPACE
        victims = self._dead_weight_first(ranked, shortfall)
        for key in tail_first:
            self._policy.on_miss(key)
        self._evict(victims)
        fresh = set(incoming)
        for key in checked[::-1]:
            if key in fresh:
                self._entries[key] = _Entry(EntryState.STORING, 0, priority)
                self._policy.on_insert(key)
            else:  # a store is not a read: recency only (ARC keeps it in its list)
                self._policy.on_access(key, ready=False)
        for key in dict.fromkeys(bound):
            self._bindings += 1
            self._entries[key] = replace(
                self._entries[key], unit=checked, bound_at=self._bindings, died_at=None
            )
        self._counters["reserved"] += len(incoming)
        return PrepareStoreOutput(incoming, victims)

    def complete_store(self, keys: Sequence[bytes], success: bool) -> None:
        """Finish the stores of ``keys``: READY on success, dropped on failure.

        Pre: distinct keys, each STORING; ``success`` a bool (``ConfigError`` otherwise,
        nothing changed). Post on success: each key READY with 0 pins, one STORED event,
        ``stored`` grew. Post on failure: the reserved entries are gone (no ghost), one REMOVED
        event, ``removed`` grew. Empty ``keys``: nothing changes.
        """
        if not isinstance(success, bool):
            raise ConfigError("success", success, "must be a bool", "pass True or False")
        checked = _checked_keys(keys, distinct=True)
        for key in checked:
            entry = self._entries.get(key)
            if entry is None or entry.state is not EntryState.STORING:
                raise ConfigError("keys", key, "has no store in flight", "complete stores once")
        if not checked:
            return
        for key in checked:
            if success:
                self._entries[key] = replace(self._entries[key], state=EntryState.READY)
            else:
                del self._entries[key]
                self._policy.on_remove(key)
        if not success:
            self._kill(checked)
        kind = EventKind.STORED if success else EventKind.REMOVED
        self._events.append(StoreEvent(kind, checked))
        self._counters[kind.value] += len(checked)

    def evict(self, keys: Sequence[bytes]) -> tuple[bytes, ...]:
        """Evict those of ``keys`` that are READY and unpinned: the caller found their data bad.

        A connector whose load of a key failed drops the entry, so the chunk is computed and
        stored again instead of staying unloadable while present (``prepare_store`` never
        overwrites a present key). The policy forgets the keys without a ghost: they left for
        their data, not for room.

        Pre: distinct bytes keys (``ConfigError`` field ``keys`` otherwise, nothing changed).
        Post: the returned keys (in the given order) were READY with 0 pins and are gone, in one
        EVICTED event, ``evicted`` grew; keys absent, STORING or pinned are left as they are.
        Frame: nothing else changes (no event when nothing is evicted).
        """
        checked = _checked_keys(keys, distinct=True)
        victims = tuple(
            key
            for key in checked
            if key in self._entries
            and self._entries[key].state is EntryState.READY
            and self._entries[key].pins == 0
        )
        if not victims:
            return ()
        for key in victims:
            del self._entries[key]
            self._policy.on_remove(key)
        self._kill(victims)
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

    def stats(self) -> StoreStats:
        """Counts of entries now and of keys since creation. Frame: nothing changes."""
        entries = self._entries.values()
        storing = sum(1 for e in entries if e.state is EntryState.STORING)
        pinned = sum(1 for e in entries if e.pins > 0)
        ready = len(self._entries) - storing
        return StoreStats(
            self._capacity,
            len(self._entries),
            storing,
            ready,
            pinned,
            ready - pinned,
            *(self._counters[name] for name in COUNTER_NAMES),
        )

    def snapshot(self) -> dict[str, Any]:
        """The plain dict of the module docstring's schema. Frame: nothing changes."""
        stats = self.stats()
        return {
            "capacity": self._capacity,
            "used": stats.used,
            "storing": stats.storing,
            "evictable": stats.evictable,
            "entries": tuple(
                sorted((key.hex(), e.state.value, e.pins) for key, e in self._entries.items())
            ),
            "low": tuple(
                sorted(
                    key.hex() for key, e in self._entries.items() if e.priority is StorePriority.LOW
                )
            ),
            "policy": self._policy.snapshot(),
            "counters": dict(self._counters),
            "events": tuple(
                (event.kind.value, tuple(key.hex() for key in event.keys)) for event in self._events
            ),
            "taken": dict(self._taken),
        }

    def freeze(self) -> Hashable:
        """A hashable value of everything that decides the store's future: entries (state, pins
        and priority) and the policy's order. Counters and undelivered events are left out: no
        operation reads them. Frame: nothing changes."""
        # Binding and death counts matter only in their order (which key dies, then leaves,
        # first), so they are frozen as ranks: equal futures freeze equal.
        bound = _ranks(e.bound_at for e in self._entries.values() if e.unit)
        died = _ranks(e.died_at for e in self._entries.values() if e.died_at is not None)
        entries = tuple(
            sorted(
                (
                    key,
                    e.state.value,
                    e.pins,
                    e.priority.value,
                    e.unit,
                    bound.get(e.bound_at, -1) if e.unit else -1,
                    died.get(e.died_at, -1) if e.died_at is not None else -1,
                )
                for key, e in self._entries.items()
            )
        )
        return (self._capacity, entries, self._policy.freeze())

    def copy(self) -> HostStore:
        """An independent copy (same class): mutating one never changes the other.

        Frame: nothing changes in ``self``. Post: the copy's :meth:`snapshot` and :meth:`freeze`
        equal ``self``'s (the policy is copied too, pending events and counters included).
        """
        twin = type(self).__new__(type(self))
        twin._capacity = self._capacity
        twin._policy = self._policy.copy()
        # Entries and events are frozen values: copying the containers is enough.
        twin._entries = dict(self._entries)
        twin._bindings = self._bindings
        twin._deaths = self._deaths
        twin._counters = dict(self._counters)
        twin._events = list(self._events)
        twin._taken = dict(self._taken)
        return twin

    def _dead_weight_first(self, ranked: tuple[bytes, ...], count: int) -> tuple[bytes, ...]:
        """``count`` victims from the policy's order ``ranked`` (every evictable key), one at
        a time: the dead key of ``ranked`` that died first, else the first ranked key not
        chosen. Each victim kills its bound mates as its departure will (:meth:`_kill`)."""
        died = {key: e.died_at for key, e in self._entries.items() if e.died_at is not None}
        deaths = self._deaths
        victims: list[bytes] = []
        while len(victims) < count:
            remaining = [key for key in ranked if key not in victims]
            dead = [key for key in remaining if key in died]
            pick = min(dead, key=died.__getitem__) if dead else remaining[0]
            victims.append(pick)
            for key in self._killed_by(pick, set(died)):
                deaths += 1
                died[key] = deaths
        return tuple(victims)

    def _killed_by(self, departed: bytes, dead: set[bytes]) -> list[bytes]:
        """The resident bound keys, alive (not in ``dead``), whose unit holds ``departed``,
        in the order they were bound."""
        mates = [
            (e.bound_at, key)
            for key, e in self._entries.items()
            if key != departed and key not in dead and departed in e.unit
        ]
        return [key for _, key in sorted(mates)]

    def _kill(self, departed: tuple[bytes, ...]) -> None:
        """After ``departed`` left (in that order): their bound mates die, each departure's
        in the order they were bound."""
        for gone in departed:
            dead = {key for key, e in self._entries.items() if e.died_at is not None}
            for key in self._killed_by(gone, dead):
                self._deaths += 1
                self._entries[key] = replace(self._entries[key], died_at=self._deaths)

    def _evict(self, victims: tuple[bytes, ...]) -> None:
        if not victims:
            return
        self._policy.on_evict(victims)
        for key in victims:
            del self._entries[key]
        self._kill(victims)
        self._events.append(StoreEvent(EventKind.EVICTED, victims))
        self._counters["evicted"] += len(victims)


def _ranks(values: Iterable[int]) -> dict[int, int]:
    """Each distinct value's rank among ``values`` (0 the least)."""
    return {value: rank for rank, value in enumerate(sorted(set(values)))}


def _checked_policy(policy: str | EvictionPolicy, capacity: int) -> EvictionPolicy:
    if isinstance(policy, str):
        return make_policy(policy, capacity)
    if not isinstance(policy, EvictionPolicy) or policy.capacity != capacity:
        raise ConfigError(
            "cache_policy", policy, "is not a policy for this capacity", "pass a policy name"
        )
    if policy.resident() or policy.ghosts():
        raise ConfigError("cache_policy", policy, "is not empty", "pass a fresh policy")
    return policy


def _checked_key(field: str, key: object) -> bytes:
    if not isinstance(key, bytes) or not key:
        raise ConfigError(field, key, "an offload key is non-empty bytes", "pass bytes keys")
    return key


def _checked_keys(keys: object, *, distinct: bool) -> tuple[bytes, ...]:
    if isinstance(keys, (bytes, str)) or not isinstance(keys, Iterable):
        raise ConfigError("keys", keys, "is not a sequence of keys", "pass a list of bytes keys")
    checked = tuple(_checked_key("keys", key) for key in keys)
    if distinct and len(set(checked)) != len(checked):
        raise ConfigError("keys", keys, "repeats a key", "pass each key once")
    return checked
