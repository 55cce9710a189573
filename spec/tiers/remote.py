"""The remote map: chunk key -> chunk value on a server that many engines share.

Redis commands on one key are atomic, so the map holds, per key, a whole value or nothing
(TT-1): :meth:`RemoteMap.put` is the one SET, :meth:`RemoteMap.get` the one GET. The server
may lose any chunk at any time (TTL, maxmemory eviction, flush, another engine):
:meth:`RemoteMap.vanish` models that, and a vanished chunk reads as absent, never as an error.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from spec.tiers.chunk import ChunkValue

__all__ = ["RemoteMap"]


class RemoteMap:
    """Chunk key -> :class:`~spec.tiers.chunk.ChunkValue`, whole values only."""

    def __init__(self) -> None:
        """An empty map. Post: holds nothing."""
        self._values: dict[bytes, ChunkValue] = {}

    def put(self, key: bytes, value: ChunkValue) -> None:
        """One SET. Post: ``key`` holds ``value`` (replacing any older value); frame: the
        other keys are unchanged."""
        self._values[key] = value

    def get(self, key: bytes) -> ChunkValue | None:
        """One GET: the value ``key`` holds, or None when the server has none. Pure."""
        return self._values.get(key)

    def exists(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the server holds (one pipelined EXISTS). Pure."""
        for index, key in enumerate(keys):
            if key not in self._values:
                return index
        return len(keys)

    def vanish(self, key: bytes) -> bool:
        """The server loses ``key`` (TTL, maxmemory, flush). Post: ``key`` is absent; returns
        whether it was held (frame of a miss: nothing changes)."""
        return self._values.pop(key, None) is not None

    def items(self) -> tuple[tuple[bytes, ChunkValue], ...]:
        """Every held (key, value), sorted by key. Pure."""
        return tuple(sorted(self._values.items()))

    def copy(self) -> RemoteMap:
        """An independent copy. Frame: nothing changes in ``self`` (values are frozen)."""
        twin = RemoteMap()
        twin._values = dict(self._values)
        return twin

    def freeze(self) -> Hashable:
        """A hashable value equal for maps holding the same values. Pure."""
        return self.items()
