"""Least-recently-used eviction, the default policy of vLLM 0.33's CPU offload tier.

One ordered list of resident keys, least recent first. Insertion and access move a key to the
most-recent end; a victim is the least recent evictable key. Pinned and STORING entries keep
their place while they cannot be evicted, so a key's recency survives a load pin (vLLM's LRU:
"logical recency independent of transfer pinning").
"""

from __future__ import annotations

from collections.abc import Sequence

from spec.policies.base import Evictable, EvictionPolicy

__all__ = ["LRUPolicy"]


class LRUPolicy(EvictionPolicy):
    """LRU over resident keys. ``resident()`` lists least recent first (next victim first)."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # dict keeps insertion order: first key = least recently used.
        self._order: dict[bytes, None] = {}

    def on_insert(self, key: bytes) -> None:
        """See :meth:`EvictionPolicy.on_insert`: ``key`` becomes most recent."""
        self._order[key] = None

    def on_access(self, key: bytes, *, ready: bool) -> None:
        """See :meth:`EvictionPolicy.on_access`: ``key`` becomes most recent, ready or not."""
        del self._order[key]
        self._order[key] = None

    def on_miss(self, key: bytes) -> None:
        """See :meth:`EvictionPolicy.on_miss`: LRU keeps no history, so nothing changes."""

    def on_remove(self, key: bytes) -> None:
        """See :meth:`EvictionPolicy.on_remove`."""
        del self._order[key]

    def on_evict(self, keys: Sequence[bytes]) -> None:
        """See :meth:`EvictionPolicy.on_evict`."""
        for key in keys:
            del self._order[key]

    def victims(self, n: int, evictable: Evictable, incoming: Sequence[bytes]) -> tuple[bytes, ...]:
        """See :meth:`EvictionPolicy.victims`: the ``n`` least recent evictable keys."""
        picked: list[bytes] = []
        for key in self._order:
            if len(picked) == n:
                break
            if evictable(key):
                picked.append(key)
        return tuple(picked)

    def resident(self) -> tuple[bytes, ...]:
        """Resident keys, least recently used first."""
        return tuple(self._order)

    def ghosts(self) -> tuple[bytes, ...]:
        """LRU remembers nothing: always empty."""
        return ()

    def copy(self) -> LRUPolicy:
        """See :meth:`EvictionPolicy.copy`."""
        twin = LRUPolicy(self.capacity)
        twin._order = dict(self._order)
        return twin
