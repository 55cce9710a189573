"""The disk tier's OWNER client over one directory, and the READER's view of it.

The OWNER (the worker's client) keeps an index of the final files it knows (key -> size, in a
policy's order), byte reservations of its writes in flight, and read pins. The READER (the
scheduler's lookup side, another process) keeps nothing: its ``exists`` looks at the names in
the directory (:func:`reader_exists`).

The library's calls are synchronous; the model splits each into the two moments that other
things may happen between:

- ``set`` = :meth:`DiskTier.write_begin` (reserve the file's padded size, evicting unpinned
  victims by policy; create the temp) then :meth:`DiskTier.write_finish` (rename on success;
  on ENOSPC / EIO remove the temp and release the reservation);
- ``get`` = :meth:`DiskTier.read_begin` (open the file, pin the key) then
  :meth:`DiskTier.read_end` (read and verify, unpin).

Rules where the contract leaves room (each one a choice the differential tests hold the
library to):

- the index holds final files only; a write joins it at its rename, most recent;
- ``set`` of an indexed key whose file is there writes nothing: the file holds equal bytes
  (content addressing); the key is refreshed as a store, not a read (the policy's
  ``on_access(ready=False)``: ARC keeps it in T1, as the host store does). An indexed key
  whose file another engine removed is forgotten (``vanished``) and written again;
- an accepted write is the policy's miss of its key: the victims are chosen with ARC's
  target adapted to the key, then ``on_miss`` records that adaptation (a ghost hit moves the
  target), then the victims leave. Adapting before the eviction keeps the recorded target the
  one the choice used: the victims' new ghosts would change the step, and the ghost lists'
  trim could drop the key's own ghost first. A refused write changes nothing;
- a write that finds, when its I/O would begin, a final file of its key and size (another
  engine wrote it) adopts that file instead of writing (``adopted_on_set``);
- ``get`` opens the key's file whether indexed or not (another engine may have written it);
  only an indexed key is pinned (a pin keeps an index entry from eviction). A hit refreshes
  an indexed key as a read, and renews the file's mtime so a restart keeps the order;
- ``exists`` of the OWNER looks at the directory as the READER's does (a final file of a
  plausible size), not at its index, which another engine's removal leaves stale;
- a read that finds no file is a miss; an indexed key's entry is dropped (``vanished``);
- a read that finds a damaged file unlinks that inode (never a newer file of the name) and
  drops the index entry once no read pins it: a miss, counted;
- :meth:`DiskTier.rescan` removes torn temps and final files of an impossible size, forgets
  unpinned indexed keys whose file is gone, and adopts final files it does not index, a
  subdirectory at a time (oldest mtime first within each), each only if room can be made
  (else ``adopt_refused``). An adopted file is no miss of this engine's: its victims are
  chosen with ARC's target as it is, and the target does not move;
- the rebuild (construction) removes the temps of dead writers and the final files of an
  impossible size (``truncated``), keeps the newest files that fit the capacity (each file,
  newest first, kept when it fits in the room left, else removed: ``over_capacity``) and
  indexes them oldest first (the next victims). It reads no file's content: damage is found
  by a read (DK-6).

A refused call changes nothing (the default frame); an expected refusal is a returned
:class:`DiskRefusal`, a broken pre-condition a :class:`~spec.errors.ConfigError`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from spec.disk.directory import Directory, DiskFile, FileLayout, FsyncPolicy, Verdict, verify
from spec.errors import ConfigError
from spec.policies import POLICY_NAMES, EvictionPolicy, make_policy

__all__ = [
    "COUNTER_NAMES",
    "DiskRefusal",
    "DiskTier",
    "ReadFault",
    "ReadHandle",
    "WriteStarted",
    "reader_exists",
]

COUNTER_NAMES = (
    "writes",
    "written",
    "write_faults",
    "present",
    "adopted_on_set",
    "refused",
    "evicted",
    "reads",
    "reads_done",
    "hits",
    "damaged",
    "misses",
    "vanished",
    "adopted",
    "adopt_refused",
    "rebuilt",
    "torn",
    "truncated",
    "over_capacity",
)
"""Keys counted since construction: writes begun (``writes``: reserved), renamed
(``written``), failed (``write_faults``), sets of indexed keys (``present``), writes that found
another engine's file and adopted it, refused sets, keys evicted, pinned reads begun and ended
(``reads``, ``reads_done``), reads that verified (``hits``) or found damage (``damaged``), reads
that found no file (``misses``), indexed keys whose file was gone (``vanished``), files a rescan
adopted or had no room for, files the rebuild indexed, torn temps removed, final files of an
impossible size removed, files the rebuild removed to fit the capacity."""


class DiskRefusal(Enum):
    """Why :meth:`DiskTier.write_begin` wrote nothing (the call changed nothing but, for
    PRESENT, the key's recency)."""

    PRESENT = "present"
    IN_FLIGHT = "in_flight"
    TOO_LARGE = "too_large"
    NO_SPACE = "no_space"


class ReadFault(Enum):
    """An I/O error a read returns (the library's ClientFault). The model's reads never return
    it: DK-7 says a file another engine removed is a miss, never a fault."""

    FAULT = "fault"


@dataclass(frozen=True, slots=True)
class WriteStarted:
    """An accepted write: ``size`` bytes reserved; ``evicted`` made room for them."""

    key: bytes
    size: int
    evicted: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class ReadHandle:
    """A read in flight: the key, the file it opened (its inode and content at open), and
    whether it pins the key (an indexed key)."""

    key: bytes
    file: DiskFile
    pinned: bool


@dataclass(frozen=True, slots=True)
class _Write:
    size: int
    temp: int
    value: bytes


def reader_exists(directory: Directory, keys: Sequence[bytes]) -> tuple[bool, ...]:
    """The READER's ``exists``: which keys have a final file (damaged or not: a stat tells no
    more). A temp is never visible (DK-4). Pure."""
    return tuple(key in directory.files for key in keys)


class DiskTier:
    """The OWNER: index, policy, reservations and pins over a :class:`Directory`."""

    def __init__(
        self,
        directory: Directory,
        capacity: int,
        *,
        policy: str = "lru",
        fsync: FsyncPolicy = FsyncPolicy.FILE,
        layout: FileLayout | None = None,
        writer: str = "self",
    ) -> None:
        """Rebuild from ``directory`` (module docstring): a restart is a new tier.

        Pre: ``capacity`` an int >= 1 (``ConfigError`` field ``disk_bytes``); ``policy`` a
        policy name (field ``disk_policy``); ``fsync`` a :class:`FsyncPolicy` (field
        ``disk_fsync``). Post: the index is exactly the directory's final files, evicted down to
        ``capacity``; no temp of a dead writer remains (DK-5).
        """
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError("disk_bytes", capacity, "must be an int >= 1", "give the disk bytes")
        if policy not in POLICY_NAMES:
            raise ConfigError("disk_policy", policy, "unknown policy", f"use one of {POLICY_NAMES}")
        if not isinstance(fsync, FsyncPolicy):
            raise ConfigError("disk_fsync", fsync, "is not an FsyncPolicy", "pass FILE or NEVER")
        self.directory = directory
        self.capacity = capacity
        self.fsync = fsync
        self.layout = layout or FileLayout()
        self.writer = writer
        # The policy counts entries: at most one per aligned block fits.
        self._policy: EvictionPolicy = make_policy(
            policy, max(1, capacity // self.layout.alignment)
        )
        self._index: dict[bytes, int] = {}
        self._writes: dict[bytes, _Write] = {}
        self._pins: dict[bytes, int] = {}
        self._counters = dict.fromkeys(COUNTER_NAMES, 0)
        self._rebuild()

    # --- queries (frame: nothing changes) ---

    @property
    def held_bytes(self) -> int:
        """Bytes of the indexed files."""
        return sum(self._index.values())

    @property
    def reserved_bytes(self) -> int:
        """Bytes reserved by writes in flight."""
        return sum(w.size for w in self._writes.values())

    def exists(self, keys: Sequence[bytes]) -> tuple[bool, ...]:
        """The OWNER's ``exists``, as the READER's: which keys have a final file of a plausible
        size (a temp is never visible, DK-4). The index is not asked: another engine's removal
        leaves it stale until a read or a rescan. Pure."""
        files = self.directory.files
        return tuple(key in files and self.layout.plausible(files[key].size) for key in keys)

    def indexed(self, key: bytes) -> bool:
        """Whether the index holds ``key``. Pure."""
        return key in self._index

    def in_flight(self) -> tuple[bytes, ...]:
        """Keys with a write in flight, sorted. Pure."""
        return tuple(sorted(self._writes))

    # --- writes ---

    def write_begin(self, key: bytes, value: bytes) -> WriteStarted | DiskRefusal:
        """Reserve the file of ``key`` holding ``value`` and open its temp.

        Pre: non-empty bytes ``key``, bytes ``value`` (``ConfigError`` field ``key`` /
        ``value``). Post: ``size`` bytes reserved, a live temp of this writer, the victims
        evicted (their files unlinked, DK-3: never a pinned key). Refusals: PRESENT (indexed
        and its file there: refreshed as a store), IN_FLIGHT, TOO_LARGE (the file exceeds the
        capacity), NO_SPACE (the unpinned files cannot make room); each changes nothing else.
        """
        if not isinstance(key, bytes) or not key:
            raise ConfigError("key", key, "is not non-empty bytes", "pass the chunk key")
        if not isinstance(value, bytes):
            raise ConfigError("value", value, "is not bytes", "pass the encoded chunk")
        if key in self._index:
            if key in self.directory.files:
                self._policy.on_access(key, ready=False)
                self._counters["present"] += 1
                return DiskRefusal.PRESENT
            self._forget(key)  # another engine removed it: write it again
            self._counters["vanished"] += 1
        if key in self._writes:
            return DiskRefusal.IN_FLIGHT
        size = self.layout.footprint(key, value)
        victims = self._room(size, key) if size <= self.capacity else None
        if victims is None:
            self._counters["refused"] += 1
            return DiskRefusal.TOO_LARGE if size > self.capacity else DiskRefusal.NO_SPACE
        self._policy.on_miss(key)  # the target the victims were chosen with (module docstring)
        self._evict(victims)
        temp = self.directory.create_temp(key, self.writer, size)
        self._writes[key] = _Write(size, temp, value)
        self._counters["writes"] += 1
        return WriteStarted(key, size, victims)

    def write_finish(self, key: bytes, ok: bool) -> bool:
        """End the write of ``key``: another engine's final file of the same size adopted, the
        temp renamed (``ok``), or the temp removed (an I/O error).

        Pre: ``key`` has a write in flight (``ConfigError`` field ``key``). Post on success:
        the key indexed, most recent, its reservation now its bytes (DK-2: the sum is
        unchanged). Post on failure (or a temp someone removed): the temp gone, the reservation
        released, ``write_faults`` grew. Returns whether the key was indexed.
        """
        write = self._writes.pop(key, None)
        if write is None:
            raise ConfigError("key", key, "has no write in flight", "finish each write once")
        found = self.directory.files.get(key)
        if found is not None and found.size == write.size:
            self.directory.remove_temp(write.temp)  # equal bytes are there already
            self._insert(key, write.size)
            self._counters["adopted_on_set"] += 1
            return True
        durable = self.fsync is FsyncPolicy.FILE
        if ok and self.directory.rename(write.temp, write.value, durable=durable):
            self._insert(key, write.size)
            self._counters["written"] += 1
            return True
        self.directory.remove_temp(write.temp)
        self._counters["write_faults"] += 1
        return False

    # --- reads ---

    def read_begin(self, key: bytes) -> ReadHandle | ReadFault | None:
        """Open the file of ``key``, pinning it if indexed; None is a miss (no file: an indexed
        key's entry is dropped, ``vanished``, DK-7). FAULT is an I/O error opening the file
        (the model injects none; nothing changes).
        """
        file = self.directory.files.get(key)
        if file is None:  # never written, or another engine removed it (DK-7)
            self._counters["misses"] += 1
            if key in self._index:
                self._forget(key)
                self._counters["vanished"] += 1
            return None
        pinned = key in self._index
        if pinned:
            self._pins[key] = self._pins.get(key, 0) + 1
            self._counters["reads"] += 1
        return ReadHandle(key, file, pinned)

    def read_end(self, handle: ReadHandle) -> bytes | ReadFault | None:
        """Read and verify what ``handle`` opened, unpin. The value when it verifies (DK-1;
        an indexed key refreshed as a read, the file's mtime renewed); else None, ``damaged``
        counted, that inode unlinked and the entry dropped once unpinned (DK-6).

        Pre: ``handle`` came from :meth:`read_begin` and was not ended (``ConfigError``).
        """
        key = handle.key
        if handle.pinned:
            if self._pins.get(key, 0) < 1:
                raise ConfigError("handle", handle, "is not a read in flight", "end it once")
            self._unpin(key)
            self._counters["reads_done"] += 1
        current = self.directory.files.get(key)
        # The inode still linked reads as it is now (damage in place shows); an unlinked or
        # replaced one reads as it was opened.
        file = current if current is not None and current.inode == handle.file.inode else None
        opened = file or handle.file
        if verify(opened, key) is Verdict.WHOLE:
            if key in self._index:
                self._policy.on_access(key, ready=True)
            self.directory.touch(key, opened.inode)
            self._counters["hits"] += 1
            return opened.value
        self._counters["damaged"] += 1
        self.directory.unlink(key, opened.inode)
        if key in self._index and key not in self._pins:
            self._forget(key)
        return None

    # --- the shared directory ---

    def rescan(self) -> tuple[bytes, ...]:
        """One pass, a subdirectory (a key's first byte) at a time, in order: remove its torn
        temps and final files of an impossible size; forget its unpinned indexed keys whose
        file is gone (``vanished``); adopt its final files not indexed nor being written,
        oldest mtime first, each if room can be made (evicting by policy; ``adopted``, else
        ``adopt_refused``). Post: the adopted keys, returned, are indexed most recent;
        DK-2 holds (each adoption made room first). Never refuses.

        Why by subdirectory: the library spreads a pass over ``rescan_s``, one subdirectory per
        tick, so what it adopts (and the order it indexes them in) goes by subdirectory."""
        self._sweep()
        files = self.directory.files
        known = set(self._index) | set(files)
        adopted: list[bytes] = []
        for group in sorted({key[0] for key in known}):
            for key in [k for k in self._index if k[0] == group]:
                if key not in files and key not in self._pins:
                    self._forget(key)
                    self._counters["vanished"] += 1
            for key in [k for k in self._unknown() if k[0] == group]:
                victims = self._room(files[key].size, None)  # no miss of ours
                if victims is None:
                    self._counters["adopt_refused"] += 1
                    continue
                self._evict(victims)
                self._insert(key, files[key].size)
                self._counters["adopted"] += 1
                adopted.append(key)
        return tuple(adopted)

    # --- snapshot ---

    def snapshot(self) -> dict[str, Any]:
        """The plain view the DK-* predicates read (the library exports the contract's part:
        index, bytes, reserved, pins, counters). Frame: nothing changes.

        ``capacity``; ``index``: key hex in eviction order (the policy's listing, next victim
        first); ``sizes``: ((key_hex, bytes), ...) sorted; ``bytes``; ``reserved``;
        ``writes``: ((key_hex, bytes), ...) sorted; ``pins``: ((key_hex, count), ...) sorted;
        ``counters``: :data:`COUNTER_NAMES`.
        """
        return {
            "capacity": self.capacity,
            "index": self._order(),
            "sizes": tuple(sorted((key.hex(), size) for key, size in self._index.items())),
            "bytes": self.held_bytes,
            "reserved": self.reserved_bytes,
            "writes": tuple(sorted((key.hex(), w.size) for key, w in self._writes.items())),
            "pins": tuple(sorted((key.hex(), n) for key, n in self._pins.items())),
            "counters": dict(self._counters),
        }

    def freeze(self) -> Hashable:
        """A hashable value of what decides the tier's future (counters left out). Pure but
        for the temps, frozen as whether each is still in the directory."""
        writes = tuple(
            sorted(
                (key, w.size, w.value, w.temp in self.directory.temps)
                for key, w in self._writes.items()
            )
        )
        index = tuple(sorted(self._index.items()))
        return (index, self._policy.freeze(), writes, tuple(sorted(self._pins.items())))

    def copy(self, directory: Directory) -> DiskTier:
        """An independent copy over ``directory`` (a copy of this tier's). Frame: ``self``."""
        twin = type(self).__new__(type(self))
        twin.directory = directory
        twin.capacity, twin.fsync, twin.layout = self.capacity, self.fsync, self.layout
        twin.writer = self.writer
        twin._policy = self._policy.copy()
        twin._index = dict(self._index)
        twin._writes = dict(self._writes)
        twin._pins = dict(self._pins)
        twin._counters = dict(self._counters)
        return twin

    # --- helpers ---

    def _rebuild(self) -> None:
        self._sweep()
        files = self.directory.files
        room, kept = self.capacity, []
        for key in reversed(self._unknown()):  # newest first
            if files[key].size <= room:
                room -= files[key].size
                kept.append(key)
            else:
                self.directory.unlink(key)
                self._counters["over_capacity"] += 1
        for key in reversed(kept):  # oldest first: the next victims
            self._insert(key, files[key].size)
            self._counters["rebuilt"] += 1

    def _sweep(self) -> None:
        """Remove the temps of dead writers (``torn``) and the final files of an impossible
        size (``truncated``)."""
        directory = self.directory
        for number in [n for n, temp in directory.temps.items() if not temp.live]:
            directory.remove_temp(number)
            self._counters["torn"] += 1
        for key, file in list(directory.files.items()):
            if not self.layout.plausible(file.size):
                directory.unlink(key)
                self._counters["truncated"] += 1

    def _unknown(self) -> list[bytes]:
        """Final files neither indexed nor being written, oldest mtime first (key breaks ties)."""
        files = self.directory.files
        found = [k for k in files if k not in self._index and k not in self._writes]
        return sorted(found, key=lambda k: (files[k].mtime, k))

    def _order(self) -> tuple[str, ...]:
        """Every indexed key's hex in eviction order, next victim first, pins aside (ARC's
        order follows its target: T2 first while T1 is below it). Pure."""
        order = self._policy.victims(len(self._index), lambda _: True, ())
        return tuple(key.hex() for key in order)

    def _room(self, size: int, incoming: bytes | None) -> tuple[bytes, ...] | None:
        """Victims whose bytes make room for ``size`` more (unpinned indexed keys, by policy,
        ARC's target adapted to ``incoming``, the key of a write of ours), or None when even
        all of them fall short. Pure."""
        shortfall = self.held_bytes + self.reserved_bytes + size - self.capacity
        if shortfall <= 0:
            return ()
        victims = self._ranked(lambda key: key not in self._pins, incoming, shortfall)
        freed = sum(self._index[key] for key in victims)
        return victims if freed >= shortfall else None

    def _ranked(
        self, evictable: Callable[[bytes], bool], incoming: bytes | None, need: int
    ) -> tuple[bytes, ...]:
        """The policy's victims, in order, until their bytes reach ``need`` (or all). Pure."""
        wanted = () if incoming is None else (incoming,)
        order = self._policy.victims(len(self._index), evictable, wanted)
        picked: list[bytes] = []
        freed = 0
        for key in order:
            if freed >= need:
                break
            picked.append(key)
            freed += self._index[key]
        return tuple(picked)

    def _evict(self, victims: tuple[bytes, ...]) -> None:
        if not victims:
            return
        self._policy.on_evict(victims)
        for key in victims:
            del self._index[key]
            if not self.directory.unlink(key):
                self._counters["vanished"] += 1  # another engine removed it first
        self._counters["evicted"] += len(victims)

    def _insert(self, key: bytes, size: int) -> None:
        self._index[key] = size
        self._policy.on_insert(key)

    def _forget(self, key: bytes) -> None:
        del self._index[key]
        self._policy.on_remove(key)

    def _unpin(self, key: bytes) -> None:
        left = self._pins[key] - 1
        if left:
            self._pins[key] = left
        else:
            del self._pins[key]
