"""Values the host store hands out: lifecycles, lookup verdicts, refusals, events, outputs.

Names and values follow the reference model (``spec.store``, never imported here) one for one,
so a differential test compares the two stores through ``.value`` and plain tuples.
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

COUNTER_NAMES = ("reserved", "stored", "removed", "evicted", "loads_prepared", "loads_completed")
"""Keys counted since creation, in the order :class:`StoreStats` lists them."""


class EntryState(Enum):
    """Lifecycle of an entry: STORING (reserved, being written) -> READY (loadable)."""

    STORING = "storing"
    READY = "ready"


class LookupResult(Enum):
    """vLLM's per-key lookup verdict: READY (HIT), STORING (HIT_PENDING) or absent (MISS)."""

    HIT = "hit"
    MISS = "miss"
    HIT_PENDING = "hit_pending"


class LookupOutcome(NamedTuple):
    """How many leading keys are READY, and what stopped the run.

    ``stop`` is HIT when every key hit, MISS when ``keys[hits]`` is absent, HIT_PENDING when
    ``keys[hits]`` is STORING (ask again later: the hit may grow).
    """

    hits: int
    stop: LookupResult


class Refusal(Enum):
    """An expected refusal; the refused call changed nothing."""

    NO_SPACE = "no_space"
    MISSING = "missing"
    NOT_READY = "not_ready"


class StorePriority(Enum):
    """Admission class of a ``prepare_store`` call, kept by the entries it reserves.

    NORMAL may displace any evictable entry. LOW (units less likely to be claimed: past the
    prompt, or a sliding window's units far before its end) may displace LOW entries only, so
    it is stored where there is room and refused where the room would cost a NORMAL entry.
    """

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
    """Accepted load: each of ``keys`` holds one more pin until ``complete_load``."""

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
