"""Belady's MIN as an offline eviction policy: evict the key next used furthest in the future.

An analysis tool, not a user setting (not in :data:`~hybridkv.store.policies.POLICY_NAMES`;
vLLM never sees it): it needs the future, which only a recorded run has. Evicting the key read
furthest ahead is Belady's rule for the most reads that find their key resident; here it runs
under the same store contract as LRU and ARC (capacity in entries; only READY unpinned keys not
offered in the same call are evicted), so it is the yardstick, not a proven optimum of claimed
tokens (a claim needs a whole prefix of keys). ``tools/host_tier_bound.py`` replays a real
run's host store calls under it (:mod:`hybridkv.testbed.host_replay`) to measure what an eviction
policy could have loaded on that run.

:class:`FutureUses` is the oracle: for each key, the sorted positions (``uses``) at which it is
read, and a clock the replay moves forward. A key with no later use is the first victim; ties
go to the key inserted earliest, so a replay is deterministic.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

from hybridkv.errors import HybridKVConfigError
from hybridkv.store.policy import Evictable, EvictionPolicy

__all__ = ["NEVER", "BeladyPolicy", "FutureUses"]

NEVER = 1 << 62
"""The next use of a key that is never read again (later than every position)."""


class FutureUses:
    """Each key's read positions and the replay's clock ``now`` (uses at ``now`` are future)."""

    def __init__(self, uses: Iterable[tuple[int, bytes]]) -> None:
        """``uses``: ``(position, key)`` pairs, any order, positions >= 0 (field ``uses``)."""
        table: dict[bytes, list[int]] = {}
        for position, key in uses:
            if isinstance(position, bool) or not isinstance(position, int) or position < 0:
                raise HybridKVConfigError(
                    "uses", position, "a position is an int >= 0", "number reads from 0"
                )
            table.setdefault(key, []).append(position)
        for positions in table.values():
            positions.sort()
        self._uses = table
        self.now = 0

    def advance(self, position: int) -> None:
        """Move the clock to ``position`` (field ``position`` if it would move backwards)."""
        if position < self.now:
            raise HybridKVConfigError(
                "position", position, f"is before the clock {self.now}", "replay in order"
            )
        self.now = position

    def next_use(self, key: bytes) -> int:
        """The first read of ``key`` at or after ``now``; :data:`NEVER` if none."""
        positions = self._uses.get(key)
        if not positions:
            return NEVER
        i = bisect.bisect_left(positions, self.now)
        return positions[i] if i < len(positions) else NEVER


class BeladyPolicy(EvictionPolicy):
    """MIN over the resident keys, reading the future from a shared :class:`FutureUses`."""

    name = "min"

    def __init__(self, capacity: int, future: FutureUses) -> None:
        super().__init__(capacity)
        self.future = future
        self._order: dict[bytes, None] = {}  # insertion order: the tie-break

    def on_insert(self, key: bytes) -> None:
        """``key`` becomes resident."""
        self._order[key] = None

    def on_access(self, key: bytes, *, ready: bool) -> None:
        """MIN ignores the past: nothing changes."""

    def on_miss(self, key: bytes) -> None:
        """MIN keeps no history: nothing changes."""

    def on_remove(self, key: bytes) -> None:
        """``key`` leaves."""
        del self._order[key]

    def on_evict(self, keys: Sequence[bytes]) -> None:
        """Each of ``keys`` leaves."""
        for key in keys:
            del self._order[key]

    def victims(self, n: int, evictable: Evictable, incoming: Sequence[bytes]) -> tuple[bytes, ...]:
        """The ``n`` evictable keys next used furthest from now (never-used first)."""
        if n <= 0:
            return ()
        ranked = self.ranked(evictable)
        return tuple(key for _, _, key in ranked[:n])

    def ranked(self, evictable: Evictable) -> list[tuple[int, int, bytes]]:
        """Evictable keys as ``(-next use, insertion rank, key)``, best victim first."""
        next_use = self.future.next_use
        ranked = [
            (-next_use(key), rank, key) for rank, key in enumerate(self._order) if evictable(key)
        ]
        ranked.sort()
        return ranked

    def resident(self) -> tuple[bytes, ...]:
        """Resident keys, in insertion order."""
        return tuple(self._order)

    def ghosts(self) -> tuple[bytes, ...]:
        """MIN remembers nothing: always empty."""
        return ()

    def copy(self) -> BeladyPolicy:
        """An independent copy sharing the (read-only but for the clock) oracle."""
        twin = BeladyPolicy(self.capacity, self.future)
        twin._order = dict(self._order)
        return twin
