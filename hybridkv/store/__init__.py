"""The host store: the CPU tier's accounting (:mod:`.manager`) apart from its eviction policy
(:mod:`.lru`, :mod:`.arc`, protocol in :mod:`.policy`), sized in chunks or from a byte budget
(:mod:`.capacity`). The optimized twin of ``spec.store``; it never imports spec.
"""

from __future__ import annotations

from hybridkv.store.arc import ARCPolicy
from hybridkv.store.capacity import HostCapacity
from hybridkv.store.lru import LRUPolicy
from hybridkv.store.manager import HostStore
from hybridkv.store.policies import POLICY_NAMES, make_policy
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

__all__ = [
    "COUNTER_NAMES",
    "POLICY_NAMES",
    "ARCPolicy",
    "EntryState",
    "EventKind",
    "Evictable",
    "EvictionPolicy",
    "HostCapacity",
    "HostStore",
    "LRUPolicy",
    "LookupOutcome",
    "LookupResult",
    "PrepareLoadOutput",
    "PrepareStoreOutput",
    "Refusal",
    "StoreEvent",
    "StorePriority",
    "StoreStats",
    "make_policy",
]
