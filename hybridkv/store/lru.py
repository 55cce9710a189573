"""Least-recently-used eviction in O(1) per operation (an ``OrderedDict``).

Agrees with the reference ``spec.policies.lru``: insertion and access move a key to the most
recent end, whatever its state, so recency survives a load pin; victims are the least recent
evictable keys. ``victims`` walks from the least recent end and stops at the ``n``-th victim,
so it only passes over the unevictable (pinned or STORING) keys ahead of them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from hybridkv.store.policy import Evictable, EvictionPolicy

__all__ = ["LRUPolicy"]


class LRUPolicy(EvictionPolicy):
    """LRU over resident keys. ``resident()`` lists least recent first (next victim first)."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # First key = least recently used.
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def on_insert(self, key: bytes) -> None:
        """``key`` becomes most recent."""
        self._order[key] = None

    def on_access(self, key: bytes, *, ready: bool) -> None:
        """``key`` becomes most recent, ready or not."""
        self._order.move_to_end(key)

    def on_access_many(self, keys: Sequence[bytes], *, ready: bool) -> None:
        """Each of ``keys`` becomes most recent in turn: one C-level move per key (a claim's
        refresh walks every key it would load, at each ask: ``HostStore.refresh``)."""
        move = self._order.move_to_end
        for key in keys:
            move(key)

    def on_miss(self, key: bytes) -> None:
        """LRU keeps no history: nothing changes."""

    def on_remove(self, key: bytes) -> None:
        """``key`` leaves the order."""
        del self._order[key]

    def on_evict(self, keys: Sequence[bytes]) -> None:
        """Each of ``keys`` leaves the order."""
        order = self._order
        for key in keys:
            del order[key]

    def victims(self, n: int, evictable: Evictable, incoming: Sequence[bytes]) -> tuple[bytes, ...]:
        """The ``n`` least recent evictable keys (``incoming`` does not matter to LRU)."""
        picked: list[bytes] = []
        if n <= 0:
            return ()
        for key in self._order:
            if evictable(key):
                picked.append(key)
                if len(picked) == n:
                    break
        return tuple(picked)

    def resident(self) -> tuple[bytes, ...]:
        """Resident keys, least recently used first."""
        return tuple(self._order)

    def ghosts(self) -> tuple[bytes, ...]:
        """LRU remembers nothing: always empty."""
        return ()

    def copy(self) -> LRUPolicy:
        """An independent copy."""
        twin = LRUPolicy(self.capacity)
        twin._order = OrderedDict(self._order)
        return twin
