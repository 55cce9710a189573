"""The disk's byte-bounded index: complete files, writes in flight, pins; the policy orders.

Accounting apart from policy (as :mod:`hybridkv.store.manager` does it): this class keeps each
complete file's padded size, the reservations of writes in flight and the read pins, and hands
the eviction policy (:class:`~hybridkv.store.lru.LRUPolicy` or
:class:`~hybridkv.store.arc.ARCPolicy`, reused as they are) only keys and an "evictable"
predicate. The policies pick victims by order and count; this class takes them, least wanted
first, until their bytes make room. ARC's lists and target are counted in entries: its capacity
in entries is ``capacity_bytes // 4096`` capped at 65,536 (the ghost lists' bound).

``capacity`` is the limit in force: the configured bytes, or less while the filesystem has
run out of space (the client lowers it then, and raises it again as space frees up).

Not thread-safe: the client calls it under its lock. Invariants it keeps (DK-2, DK-3):
``bytes + reserved <= capacity`` after every call, ``bytes`` and ``reserved`` equal the sums
they count (:meth:`DiskIndex.check`), and a pinned key is never a victim.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from hybridkv.disk.fileformat import ALIGN
from hybridkv.errors import HybridKVError
from hybridkv.store.arc import ARCPolicy
from hybridkv.store.lru import LRUPolicy
from hybridkv.store.policy import EvictionPolicy

__all__ = ["ARC_ENTRIES", "DiskIndex", "DiskIndexError"]

ARC_ENTRIES = 1 << 16
"""The most entries ARC's capacity counts (and each ghost list keeps)."""


class DiskIndexError(HybridKVError):
    """A broken index invariant; the message starts with its id."""


class DiskIndex:
    """Complete files by key, with their padded sizes, reservations and pins."""

    def __init__(self, capacity_bytes: int, policy: str) -> None:
        self.capacity = capacity_bytes
        self.policy: EvictionPolicy = (
            ARCPolicy(max(1, min(capacity_bytes // ALIGN, ARC_ENTRIES)))
            if policy == "arc"
            else LRUPolicy(capacity_bytes)
        )
        self.sizes: dict[bytes, int] = {}
        self.born: dict[bytes, int] = {}  # key -> generation it entered (rescans use it)
        # First byte of the key (its subdirectory) -> the keys indexed there (rescans use it).
        self.groups: dict[int, set[bytes]] = {}
        self.writing: dict[bytes, int] = {}
        self.pins: Counter[bytes] = Counter()
        self.bytes = 0
        self.reserved = 0
        self.generation = 0

    def victims_for(self, size: int) -> list[tuple[bytes, int]] | None:
        """The unpinned files, in eviction order, whose removal makes room for ``size`` more
        bytes; None when even all of them would not. Pure."""
        need = self.bytes + self.reserved + size - self.capacity
        if need <= 0:
            return []
        n = 1
        while True:
            keys = self.policy.victims(n, self._evictable, ())
            freed, picked = 0, []
            for key in keys:
                picked.append((key, self.sizes[key]))
                freed += self.sizes[key]
                if freed >= need:
                    return picked
            if len(keys) < n:
                return None
            n *= 2

    def evict(self, victims: Sequence[tuple[bytes, int]]) -> None:
        """Forget ``victims`` (from :meth:`victims_for`)."""
        self.policy.on_evict([key for key, _ in victims])
        for key, size in victims:
            self._forget(key, size)

    def reserve(self, key: bytes, size: int) -> None:
        """Hold ``size`` bytes for a write of ``key`` (room made first: :meth:`victims_for`)."""
        self.writing[key] = size
        self.reserved += size

    def finish(self, key: bytes, *, complete: bool) -> None:
        """End ``key``'s write: its reservation becomes a complete file, or is released."""
        size = self.writing.pop(key)
        self.reserved -= size
        if complete and key not in self.sizes:
            self.insert(key, size)

    def insert(self, key: bytes, size: int) -> None:
        """``key``'s complete file of ``size`` bytes, most recent (room made first)."""
        self.generation += 1
        self.sizes[key] = size
        self.born[key] = self.generation
        self.groups.setdefault(key[0], set()).add(key)
        self.bytes += size
        self.policy.on_insert(key)

    def insert_all(self, found: Sequence[tuple[bytes, int]]) -> None:
        """:meth:`insert` each ``(key, size)`` of ``found`` in order (the rebuild's million),
        without a call per key."""
        sizes, born, groups, on_insert = self.sizes, self.born, self.groups, self.policy.on_insert
        generation = self.generation
        for key, size in found:
            generation += 1
            sizes[key] = size
            born[key] = generation
            group = groups.get(key[0])
            if group is None:
                group = groups[key[0]] = set()
            group.add(key)
            on_insert(key)
            self.bytes += size
        self.generation = generation

    def remove(self, key: bytes) -> None:
        """Forget ``key``'s file (found damaged or gone), if indexed."""
        size = self.sizes.get(key)
        if size is not None:
            self._forget(key, size)
            self.policy.on_remove(key)

    def touch(self, key: bytes) -> None:
        """``key`` was read: most recent in the policy's sense, if indexed."""
        if key in self.sizes:
            self.policy.on_access(key, ready=True)

    def pin(self, key: bytes) -> None:
        """A read of ``key`` begins: no eviction takes it until :meth:`unpin` (DK-3)."""
        self.pins[key] += 1

    def unpin(self, key: bytes) -> None:
        """A read of ``key`` ends."""
        self.pins[key] -= 1
        if not self.pins[key]:
            del self.pins[key]

    def order(self) -> tuple[bytes, ...]:
        """Every indexed key in eviction order, next victim first, pins aside."""
        return self.policy.victims(len(self.sizes), lambda _: True, ())

    def check(self) -> None:
        """Raise :class:`DiskIndexError` naming the first broken invariant (DK-2, DK-3's
        bookkeeping): the byte sums recounted, the bound, the policy tracking exactly the
        indexed keys, no negative pin."""
        if self.bytes != sum(self.sizes.values()) or self.reserved != sum(self.writing.values()):
            raise DiskIndexError("DK-2: bytes or reserved differ from the sizes they count")
        if self.bytes + self.reserved > self.capacity:
            raise DiskIndexError(
                f"DK-2: bytes {self.bytes} + reserved {self.reserved} > {self.capacity}"
            )
        if set(self.policy.resident()) != set(self.sizes):
            raise DiskIndexError("DK-2: the policy tracks other keys than the index")
        if sum(len(group) for group in self.groups.values()) != len(self.sizes):
            raise DiskIndexError("DK-2: the subdirectory groups miscount the index")
        if any(count <= 0 for count in self.pins.values()):
            raise DiskIndexError("DK-3: a pin count is not positive")

    def _forget(self, key: bytes, size: int) -> None:
        del self.sizes[key]
        del self.born[key]
        group = self.groups[key[0]]
        group.discard(key)
        if not group:
            del self.groups[key[0]]
        self.bytes -= size

    def _evictable(self, key: bytes) -> bool:
        return key not in self.pins
