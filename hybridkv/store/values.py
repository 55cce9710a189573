"""The host store's vocabulary: what :class:`~hybridkv.store.HostStore` answers and reports.

Grouped by the call that produces them: an entry's lifecycle, the ``lookup`` verdict, the two
accepted halves of the two-phase calls (``prepare_store``, ``prepare_load``), the refusals that
replace an exception when a call cannot proceed, the events ``take_events`` drains, and the
``stats`` snapshot. Enum values and field names are the store contract's (docs/explanation
/connector-core.md), so a differential test can compare this store with the reference model
through ``.value`` strings and plain tuples without either importing the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

__all__ = [
    "COUNTER_NAMES",
    "EntryState",
    "EventKind",
    "LookupOutcome",
    "LookupResult",
    "PrepareLoadOutput",
    "PrepareStoreOutput",
    "Refusal",
    "StoreEvent",
    "StorePriority",
    "StoreStats",
]

Keys = tuple[bytes, ...]
"""Offload keys in the order a call handled them."""


# --- lookup --------------------------------------------------------------------------------------


class LookupOutcome(NamedTuple):
    """A lookup's answer: the length of the READY prefix of the keys, and why it ended there.

    With ``stop`` HIT the whole list was READY. MISS means the key after the prefix has no
    entry, so the answer is final. HIT_PENDING means that key is STORING: the prefix can still
    grow, so the caller asks again on a later step.
    """

    hits: int
    stop: LookupResult


class LookupResult(Enum):
    """One key's verdict in vLLM's words: present and READY, absent, or still being written."""

    HIT = "hit"
    MISS = "miss"
    HIT_PENDING = "hit_pending"


# --- accepted two-phase calls --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrepareLoadOutput:
    """What an accepted ``prepare_load`` pinned: one more pin on each of ``keys``.

    A pin holds its READY entry against eviction until the matching ``complete_load``.
    """

    keys: Keys


@dataclass(frozen=True, slots=True)
class PrepareStoreOutput:
    """What an accepted ``prepare_store`` did.

    ``keys_to_store`` are the keys that got a STORING entry (already present keys are left
    out); ``evicted_keys`` are the READY, unpinned entries dropped to make room.
    """

    keys_to_store: Keys
    evicted_keys: Keys


# --- refusals ------------------------------------------------------------------------------------


class Refusal(Enum):
    """Why a two-phase call was turned down; a refusal leaves the store exactly as it was.

    NO_SPACE: the pinned and STORING entries leave no room. MISSING: a key has no entry.
    NOT_READY: a key's entry is still STORING.
    """

    NO_SPACE = "no_space"
    MISSING = "missing"
    NOT_READY = "not_ready"


# --- lifecycle and events ------------------------------------------------------------------------


class EntryState(Enum):
    """Where a host entry is in its life.

    ``prepare_store`` creates it STORING (its slot is reserved while the worker copies);
    a successful ``complete_store`` makes it READY, the only state ``prepare_load`` accepts.
    """

    STORING = "storing"
    READY = "ready"


@dataclass(frozen=True, slots=True)
class StoreEvent:
    """A batch of keys that one call moved through the same ``kind`` of change."""

    kind: EventKind
    keys: Keys


class StorePriority(Enum):
    """Admission class of a ``prepare_store`` call, kept by the entries it reserves.

    NORMAL may displace any evictable entry. LOW (units less likely to be claimed: past the
    prompt, or a sliding window's units far before its end) displaces nothing: it is stored
    where there are free slots and refused where the room would cost any entry.
    """

    NORMAL = "normal"
    LOW = "low"


class EventKind(Enum):
    """The three things ``take_events`` tells vLLM's KV-event stream about.

    STORED: entries became READY. EVICTED: READY entries were dropped for room. REMOVED:
    entries of a failed store were dropped before they were ever READY.
    """

    STORED = "stored"
    EVICTED = "evicted"
    REMOVED = "removed"


# --- stats ----------------------------------------------------------------------------------------

COUNTER_NAMES = ("reserved", "stored", "removed", "evicted", "loads_prepared", "loads_completed")
"""The cumulative fields of :class:`StoreStats` (keys counted since creation), in field order."""


class StoreStats(NamedTuple):
    """The store at one moment: six gauges of entries, then the :data:`COUNTER_NAMES` counters.

    Gauges count entries: ``used`` is ``storing + ready``, ``pinned`` the READY entries with a
    load in flight, ``evictable`` the READY ones without. Counters count keys and only grow.
    """

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
