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
        """See :meth:`EvictionPolicy.on_insert`: ``key`` becomes most recent.

        Pre: ``key`` is not resident (not checked: a resident key keeps its place). Post:
        ``key`` is resident, most recent. Never refuses.
        """
        self._order[key] = None

    def on_access(self, key: bytes, *, ready: bool) -> None:
        """See :meth:`EvictionPolicy.on_access`: ``key`` becomes most recent, ready or not.

        Pre: ``key`` is resident (``KeyError`` otherwise, nothing changed). Post: ``key`` is
        the most recent; the others keep their order.
        """
        del self._order[key]
        self._order[key] = None

    def on_miss(self, key: bytes) -> None:
        """See :meth:`EvictionPolicy.on_miss`: LRU keeps no history, so nothing changes."""

    def on_remove(self, key: bytes) -> None:
        """See :meth:`EvictionPolicy.on_remove`.

        Pre: ``key`` is resident (``KeyError`` otherwise, nothing changed). Post: ``key`` is not
        resident; the others keep their order; no history is kept.
        """
        del self._order[key]

    def on_evict(self, keys: Sequence[bytes]) -> None:
        """See :meth:`EvictionPolicy.on_evict`.

        Pre: ``keys`` are resident and distinct. Post: none is resident; the others keep their
        order; no history is kept. A key that is not resident raises ``KeyError`` after the
        keys before it left (the store never passes one).
        """
        for key in keys:
            del self._order[key]

    def victims(self, n: int, evictable: Evictable, incoming: Sequence[bytes]) -> tuple[bytes, ...]:
        """See :meth:`EvictionPolicy.victims`: the ``n`` least recent evictable keys.

        Pure: ``incoming`` does not matter to LRU. Pre: ``n >= 0`` (not checked).
        """
        picked: list[bytes] = []
        for key in self._order:
            if len(picked) == n:
                break
            if evictable(key):
                picked.append(key)
        return tuple(picked)

    def resident(self) -> tuple[bytes, ...]:
        """Resident keys, least recently used first.

        Pure.
        """
        return tuple(self._order)

    def ghosts(self) -> tuple[bytes, ...]:
        """LRU remembers nothing: always empty.

        Pure.
        """
        return ()

    def copy(self) -> LRUPolicy:
        """See :meth:`EvictionPolicy.copy`.

        Frame: nothing changes in ``self``. Post: the copy lists the same keys in the same order.
        """
        twin = LRUPolicy(self.capacity)
        twin._order = dict(self._order)
        return twin
