"""The eviction-policy protocol: a policy orders resident keys and picks victims, nothing else.

The manager (:mod:`hybridkv.store.manager`) keeps entries, states, pins, capacity, counters and
events; a policy sees states only through the arguments the manager hands it. Same split and
same call order as the reference model (``spec.policies.base``):

- a policy tracks every key that has an entry (STORING or READY, pinned or not), so a key's
  recency survives a load pin, plus any history of keys that left (ARC's ghosts);
- the manager calls ``on_insert`` / ``on_access`` / ``on_miss`` key by key, tail first, so the
  head of a prefix ends most recently used;
- evictability (READY, unpinned, not offered in the same call) reaches the policy only as a
  predicate, and :meth:`EvictionPolicy.victims` is pure.

The manager validates every argument before calling, so a policy does not re-check.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Evictable", "EvictionPolicy"]

Evictable = Callable[[bytes], bool]
"""The manager's verdict on a resident key: may it be evicted now?"""


class EvictionPolicy(ABC):
    """Orders the resident keys of a store of ``capacity`` entries and chooses victims."""

    name: str = "abstract"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @abstractmethod
    def on_insert(self, key: bytes) -> None:
        """Pre: ``key`` not resident. Post: resident, most recently used; no longer a ghost."""

    @abstractmethod
    def on_access(self, key: bytes, *, ready: bool) -> None:
        """Pre: ``key`` resident. Post: most recently used in the policy's sense."""

    def on_access_many(self, keys: Sequence[bytes], *, ready: bool) -> None:
        """:meth:`on_access` for each of ``keys`` in order (each resident, so the last ends
        the most recent). A policy may do it faster; the result must be the same."""
        for key in keys:
            self.on_access(key, ready=ready)

    @abstractmethod
    def on_miss(self, key: bytes) -> None:
        """Pre: ``key`` not resident. Post: residency unchanged; history may adapt."""

    @abstractmethod
    def on_remove(self, key: bytes) -> None:
        """Pre: ``key`` resident (a failed store). Post: not resident, no history left."""

    @abstractmethod
    def on_evict(self, keys: Sequence[bytes]) -> None:
        """Pre: distinct resident ``keys`` from :meth:`victims`. Post: none resident."""

    @abstractmethod
    def victims(self, n: int, evictable: Evictable, incoming: Sequence[bytes]) -> tuple[bytes, ...]:
        """The ``n`` keys to evict to admit ``incoming`` (not resident), in eviction order.

        Chosen as if ``on_miss`` had been called for each of ``incoming`` first. Post: distinct
        resident evictable keys, fewer than ``n`` exactly when fewer are evictable; the walk
        stops after the ``n``-th victim. Frame: nothing changes.
        """

    @abstractmethod
    def resident(self) -> tuple[bytes, ...]:
        """Every resident key, in the policy's listing order."""

    @abstractmethod
    def ghosts(self) -> tuple[bytes, ...]:
        """Keys remembered after they left (empty for a policy without history)."""

    @abstractmethod
    def copy(self) -> EvictionPolicy:
        """An independent copy: mutating one never changes the other."""

    def extra(self) -> dict[str, Any]:
        """Policy-specific plain state for :meth:`snapshot` (none by default)."""
        return {}

    def snapshot(self) -> dict[str, Any]:
        """Plain view in the reference schema: ``name``, ``resident``, ``ghosts`` (hex keys)
        and ``extra``."""
        return {
            "name": self.name,
            "resident": tuple(key.hex() for key in self.resident()),
            "ghosts": tuple(key.hex() for key in self.ghosts()),
            "extra": self.extra(),
        }
