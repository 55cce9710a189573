"""The eviction-policy protocol of the host store: a policy orders entries and picks victims.

Accounting lives in :class:`spec.store.HostStore` (entries, states, pins, capacity, events,
counters); a policy never sees pins or states except through the arguments the store hands it.
This mirrors vLLM 0.33's split between ``CPUOffloadingManager`` and its ``CachePolicy``.

What a policy tracks: every key that has an entry in the store (STORING or READY, pinned or
not), plus whatever history it keeps about keys that left (ARC's ghost lists). Tracking pinned
and STORING entries too keeps a key's recency across a load pin, as vLLM's LRU does ("logical
recency independent of transfer pinning"); evictability is the store's business and reaches
the policy only as a predicate.

Order within one call is the store's business too: it calls ``on_insert`` / ``on_access`` /
``on_miss`` key by key, tail first, so the head of a prefix ends most recently used.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from typing import Any

__all__ = ["Evictable", "EvictionPolicy"]

Evictable = Callable[[bytes], bool]
"""The store's verdict on a resident key: may it be evicted now (READY, unpinned, not offered)?"""


class EvictionPolicy(ABC):
    """Orders the resident keys of a store of ``capacity`` entries and chooses victims.

    Every method that mutates has the pre-condition stated; a policy does not re-check what
    the store guarantees (the store validates every argument before calling).
    """

    name: str = "abstract"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @abstractmethod
    def on_insert(self, key: bytes) -> None:
        """A new entry (STORING) was reserved for ``key``.

        Pre: ``key`` is not resident. Post: ``key`` is resident and most recently used.
        """

    @abstractmethod
    def on_access(self, key: bytes, *, ready: bool) -> None:
        """A resident ``key`` was used (touch); ``ready`` tells whether its data is loadable.

        Pre: ``key`` is resident. Post: ``key`` is resident and most recently used in the
        policy's sense (ARC: a READY key leaves T1 for T2; a STORING key stays in T1).
        """

    @abstractmethod
    def on_miss(self, key: bytes) -> None:
        """A non-resident ``key`` was asked for (touched or offered for storing).

        Pre: ``key`` is not resident. Post: residency unchanged; a policy with history may
        adapt (ARC: a ghost hit moves the target ``p``).
        """

    @abstractmethod
    def on_remove(self, key: bytes) -> None:
        """``key``'s entry was dropped without eviction (a failed store).

        Pre: ``key`` is resident. Post: ``key`` is not resident and leaves no history.
        """

    @abstractmethod
    def on_evict(self, keys: Sequence[bytes]) -> None:
        """``keys`` (as returned by :meth:`victims`) were evicted.

        Pre: each key is resident, distinct. Post: none is resident; history may remember them.
        """

    @abstractmethod
    def victims(self, n: int, evictable: Evictable, incoming: Sequence[bytes]) -> tuple[bytes, ...]:
        """The ``n`` keys to evict to admit ``incoming``, in eviction order; pure.

        Pre: ``n >= 0``; ``incoming`` keys are not resident, in the order the store will pass
        them to :meth:`on_miss`. The choice is made as if those misses had been observed
        first (ARC adapts ``p`` before replacing, as Megiddo & Modha and vLLM do).
        Post: distinct resident keys, each ``evictable``; fewer than ``n`` exactly when fewer
        than ``n`` resident keys are evictable. Frame: nothing changes.
        """

    @abstractmethod
    def resident(self) -> tuple[bytes, ...]:
        """Every resident key, in the policy's listing order (documented per policy).

        Pure.
        """

    @abstractmethod
    def ghosts(self) -> tuple[bytes, ...]:
        """Keys the policy remembers after they left (empty for a policy without history).

        Pure.
        """

    @abstractmethod
    def copy(self) -> EvictionPolicy:
        """An independent copy: mutating one never changes the other.

        Frame: nothing changes in ``self``. Post: the copy's :meth:`snapshot` and :meth:`freeze`
        equal ``self``'s, so it picks the same victims.
        """

    def snapshot(self) -> dict[str, Any]:
        """Plain view for the ST-* predicates: ``name``, ``resident``, ``ghosts`` (hex keys)
        and ``extra`` (policy-specific, plain values). Frame: nothing changes."""
        return {
            "name": self.name,
            "resident": tuple(key.hex() for key in self.resident()),
            "ghosts": tuple(key.hex() for key in self.ghosts()),
            "extra": self.extra(),
        }

    def extra(self) -> dict[str, Any]:
        """Policy-specific plain state for :meth:`snapshot` (none by default).

        Pure.
        """
        return {}

    def freeze(self) -> Hashable:
        """A hashable value equal for policies that will pick the same victims (the order of
        residents and ghosts is the state). Frame: nothing changes."""
        extra = tuple(sorted(self.extra().items()))
        return (self.name, self.resident(), self.ghosts(), extra)
