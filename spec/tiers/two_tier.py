"""The two-tier store: the host store (:class:`spec.store.HostStore`) over the remote map.

Composition, not a new store: the host tier keeps its own accounting, policy and events; this
class adds what the remote tier needs around it (the contract of issue 12):

- the payload each host slot holds (a content tag; :data:`UNWRITTEN` while STORING), so a
  write can copy it and a promotion can fill it;
- :meth:`TwoTierStore.write_behind`: once every member of a chunk is READY, its payloads are
  COPIED into a bounded queue for one SET; a full queue drops the write (``writes_dropped``),
  it never blocks; a chunk already known present (held or queued) is not written again;
- :meth:`TwoTierStore.remote_lookup`: leading chunks the server holds (a fault answers 0);
- :meth:`TwoTierStore.promote` then :meth:`TwoTierStore.complete_promotion`: read-through on a
  host miss, members reserved STORING, resolved exactly once as a :class:`Resolution`;
- :meth:`TwoTierStore.vanish`: the server loses a chunk.

Decisions where the contract leaves room (the library may differ only where it says so):

- A promotion reserves the members ABSENT from the host (``prepare_store`` skips present keys);
  ``promotions`` in the snapshot lists those reserved members, which are then all STORING
  (TT-3). It is refused when a member is STORING (another operation writes it) or when every
  member is READY (a host hit needs no promotion).
- The failure memory (``failed``) lasts until a write of the chunk lands: a fresh copy on the
  server is worth reading again.
- "Known present" is the remote map itself (the model is one engine beside a server that
  another engine may have filled; the library uses its own index).
- Fault injection is an argument of the resolving call (:class:`Injection`), so the explorer
  enumerates every fault as an action; CORRUPT on the wire flips a payload and keeps the header,
  which the digest catches.

Snapshot schema (``snapshot()``; the library exports the same plain dict)::

    host:       the host store's snapshot() (spec.store's schema, unchanged)
    remote:     ((chunk_key_hex, (member_key_hex, ...)), ...) sorted: chunks the map holds
    promotions: ((chunk_key_hex, (member_key_hex, ...)), ...) sorted: promotions in flight,
                with the members each reserved
    writes:     ((chunk_key_hex, (member_key_hex, ...)), ...) sorted: writes queued
    failed:     (chunk_key_hex, ...) sorted: chunks remembered as failed
    counters:   {name: int for name in COUNTER_NAMES}

Content oracle (``content(truth)``; TT-2, TT-6, TT-7 read it beside the snapshot)::

    truth:  {key_hex: tag}             the content stored for each host key
    held:   {key_hex: tag}             what each READY host entry's slot holds
    remote: {chunk_key_hex: (tag, ...)} payloads the map holds, in member order
    writes: {chunk_key_hex: (tag, ...)} payloads each queued write carries
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from spec.errors import ConfigError
from spec.store import HostStore, LookupResult, PrepareStoreOutput, Refusal
from spec.tiers.chunk import ChunkValue, Verdict, checked_members, chunk_key, encode, verify
from spec.tiers.remote import RemoteMap

__all__ = [
    "COUNTER_NAMES",
    "UNWRITTEN",
    "Injection",
    "PromoteRefusal",
    "PromotionStarted",
    "Resolution",
    "Resolved",
    "TwoTierStore",
    "WriteOutcome",
]

COUNTER_NAMES = (
    "promotions_started",
    "promoted",
    "missing",
    "fault",
    "timeout",
    "corrupt",
    "writes_enqueued",
    "written",
    "writes_failed",
    "writes_dropped",
    "lookups",
    "lookup_faults",
)

UNWRITTEN = "unwritten"
"""The tag of a reserved slot that no write has reached yet."""


class Resolution(Enum):
    """How a promotion ends; each value is the counter it adds to."""

    PROMOTED = "promoted"
    MISSING = "missing"
    FAULT = "fault"
    TIMEOUT = "timeout"
    CORRUPT = "corrupt"


class Injection(Enum):
    """What the model lets happen to a fetch: nothing, a reset, the deadline, a flipped byte."""

    NONE = "none"
    FAULT = "fault"
    TIMEOUT = "timeout"
    CORRUPT = "corrupt"


class WriteOutcome(Enum):
    """What :meth:`TwoTierStore.write_behind` did with a chunk."""

    ENQUEUED = "enqueued"
    DROPPED = "dropped"
    PRESENT = "present"
    NOT_READY = "not_ready"


class PromoteRefusal(Enum):
    """Why :meth:`TwoTierStore.promote` started nothing (the refused call changed nothing)."""

    FAILED_BEFORE = "failed_before"
    IN_FLIGHT = "in_flight"
    PENDING = "pending"
    HOST_HIT = "host_hit"
    NO_SPACE = "no_space"


@dataclass(frozen=True, slots=True)
class PromotionStarted:
    """A promotion began: ``reserved`` members are STORING; ``evicted`` made room for them."""

    chunk_key: bytes
    reserved: tuple[bytes, ...]
    evicted: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Resolved:
    """A promotion ended: ``loaded`` holds the payloads written to ``reserved`` (PROMOTED) or
    is empty (every other resolution: the reserved members were REMOVED)."""

    chunk_key: bytes
    resolution: Resolution
    reserved: tuple[bytes, ...]
    loaded: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _Promotion:
    members: tuple[bytes, ...]
    reserved: tuple[bytes, ...]


class TwoTierStore:
    """The host tier, the remote map, the write queue, promotions in flight, failures."""

    def __init__(
        self, host: HostStore, *, namespace: bytes = b"hybridkv", max_pending: int = 4
    ) -> None:
        """A two-tier store over an empty ``host`` and an empty remote map.

        Pre: ``host`` an empty HostStore (field ``host``); ``namespace`` bytes (field
        ``namespace``); ``max_pending`` an int >= 1 (field ``max_pending``). Post: no write,
        no promotion, no failure, zero counters.
        """
        if not isinstance(host, HostStore) or host.stats().used:
            raise ConfigError("host", host, "is not an empty HostStore", "pass a fresh store")
        if not isinstance(namespace, bytes):
            raise ConfigError("namespace", namespace, "is not bytes", "pass e.g. b'hybridkv'")
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ConfigError(
                "max_pending", max_pending, "must be an int >= 1", "allow at least one write"
            )
        self.host = host
        self.remote = RemoteMap()
        self._namespace = namespace
        self._max_pending = max_pending
        self._slots: dict[bytes, str] = {}
        self._writes: dict[bytes, ChunkValue] = {}
        self._promotions: dict[bytes, _Promotion] = {}
        self._failed: set[bytes] = set()
        self._counters = dict.fromkeys(COUNTER_NAMES, 0)

    def chunk_key(self, members: Sequence[bytes]) -> bytes:
        """The chunk key of ``members`` under this store's namespace. Pure."""
        return chunk_key(self._namespace, members)

    # --- the GPU side of the host tier (slots follow the entries) ---

    def prepare_store(self, keys: Sequence[bytes]) -> PrepareStoreOutput | Refusal:
        """:meth:`HostStore.prepare_store`, with the reserved slots :data:`UNWRITTEN`.

        Post/refusal: the host's; the slots of evicted keys are gone. Frame: the remote map,
        the write queue and promotions never change (a queued write holds its own copy, TT-7).
        """
        prepared = self.host.prepare_store(keys)
        if isinstance(prepared, PrepareStoreOutput):
            self._follow(prepared)
        return prepared

    def complete_store(self, keys: Sequence[bytes], payloads: Sequence[str] | None) -> None:
        """Finish a GPU store: ``payloads`` (one per key) make the keys READY; None drops them.

        Pre: the host's, and one str per key when given (field ``payloads``). Post: the host's;
        the slots hold the payloads (or are gone).
        """
        checked = tuple(keys)
        if payloads is not None and len(tuple(payloads)) != len(checked):
            raise ConfigError("payloads", payloads, "is not one per key", "pass one per key")
        self.host.complete_store(checked, success=payloads is not None)
        for index, key in enumerate(checked):
            if payloads is None:
                del self._slots[key]
            else:
                self._slots[key] = tuple(payloads)[index]

    def evict(self, keys: Sequence[bytes]) -> tuple[bytes, ...]:
        """:meth:`HostStore.evict`; the evicted keys' slots are gone. Frame: as prepare_store."""
        evicted = self.host.evict(keys)
        for key in evicted:
            del self._slots[key]
        return evicted

    # --- the remote tier ---

    def write_behind(self, members: Sequence[bytes]) -> WriteOutcome:
        """Queue one SET of the chunk of ``members``, its payloads COPIED now.

        Pre: valid members (``ConfigError`` field ``members``). Post: ENQUEUED (queued,
        ``writes_enqueued`` grew) or DROPPED (queue full, ``writes_dropped`` grew). Refusals
        that change nothing: NOT_READY (a member is not READY), PRESENT (the map holds the
        chunk or a write of it is queued).
        """
        checked = checked_members(members)
        if any(self.host.status(key) is not LookupResult.HIT for key in checked):
            return WriteOutcome.NOT_READY
        key = self.chunk_key(checked)
        if self.remote.get(key) is not None or key in self._writes:
            return WriteOutcome.PRESENT
        if len(self._writes) >= self._max_pending:
            self._counters["writes_dropped"] += 1
            return WriteOutcome.DROPPED
        self._writes[key] = encode(checked, tuple(self._slots[k] for k in checked))
        self._counters["writes_enqueued"] += 1
        return WriteOutcome.ENQUEUED

    def complete_write(self, chunk_key: bytes, success: bool) -> None:
        """The queued SET of ``chunk_key`` ends: WRITTEN (the map holds the value, the chunk is
        no longer remembered as failed) or FAILED (``writes_failed``; the map is unchanged).

        Pre: a write of ``chunk_key`` is queued (``ConfigError`` field ``chunk_key``).
        Post: the write is no longer queued.
        """
        if chunk_key not in self._writes:
            raise ConfigError("chunk_key", chunk_key, "has no queued write", "complete it once")
        value = self._queued(chunk_key)
        del self._writes[chunk_key]
        if success:
            self.remote.put(chunk_key, value)
            self._failed.discard(chunk_key)
            self._counters["written"] += 1
        else:
            self._counters["writes_failed"] += 1

    def remote_lookup(self, chunk_keys: Sequence[bytes], *, fault: bool = False) -> int:
        """How many leading ``chunk_keys`` the server holds; a ``fault`` answers 0.

        Post: ``lookups`` grew by 1 (and ``lookup_faults`` on a fault). Frame: nothing else.
        """
        self._counters["lookups"] += 1
        if fault:
            self._counters["lookup_faults"] += 1
            return 0
        return self.remote.exists(chunk_keys)

    def promote(self, members: Sequence[bytes]) -> PromotionStarted | PromoteRefusal:
        """Reserve the absent members of a chunk and start its fetch.

        Pre: valid members (``ConfigError`` field ``members``). Post: the absent members are
        STORING (slots UNWRITTEN), the promotion is in flight, ``promotions_started`` grew.
        Refusals (nothing changes): FAILED_BEFORE, IN_FLIGHT, PENDING (a member is STORING),
        HOST_HIT (every member READY), NO_SPACE (the host cannot make room).
        """
        checked = checked_members(members)
        key = self.chunk_key(checked)
        if key in self._failed:
            return PromoteRefusal.FAILED_BEFORE
        if key in self._promotions:
            return PromoteRefusal.IN_FLIGHT
        statuses = [self.host.status(k) for k in checked]
        if LookupResult.HIT_PENDING in statuses:
            return PromoteRefusal.PENDING
        if LookupResult.MISS not in statuses:
            return PromoteRefusal.HOST_HIT
        prepared = self.host.prepare_store(checked)
        if not isinstance(prepared, PrepareStoreOutput):
            return PromoteRefusal.NO_SPACE
        self._follow(prepared)
        self._promotions[key] = _Promotion(checked, prepared.keys_to_store)
        self._counters["promotions_started"] += 1
        return PromotionStarted(key, prepared.keys_to_store, prepared.evicted_keys)

    def complete_promotion(self, chunk_key: bytes, injection: Injection) -> Resolved:
        """Fetch the chunk (one GET), verify it and resolve the promotion exactly once.

        Pre: ``chunk_key`` is in flight (``ConfigError`` field ``chunk_key``); ``injection``
        an :class:`Injection` (field ``injection``). Post: PROMOTED writes the payloads to the
        reserved slots, READY; MISSING, FAULT, TIMEOUT and CORRUPT drop the reserved members
        (REMOVED) and remember the chunk as failed. The resolution's counter grew by 1; the
        promotion is no longer in flight. Never raises for a server-side cause (TT-5).
        """
        if not isinstance(injection, Injection):
            raise ConfigError("injection", injection, "is not an Injection", "pass Injection.*")
        promotion = self._promotions.get(chunk_key)
        if promotion is None:
            raise ConfigError("chunk_key", chunk_key, "has no promotion", "complete it once")
        resolution, payloads = self._fetch(chunk_key, promotion.members, injection)
        del self._promotions[chunk_key]
        self._counters[resolution.value] += 1
        reserved = promotion.reserved
        if resolution is Resolution.PROMOTED:
            by_key = dict(zip(promotion.members, payloads, strict=True))
            loaded = tuple(by_key[k] for k in reserved)
            self.complete_store(reserved, loaded)
            return Resolved(chunk_key, resolution, reserved, loaded)
        self.complete_store(reserved, None)
        self._failed.add(chunk_key)
        return Resolved(chunk_key, resolution, reserved, ())

    def vanish(self, chunk_key: bytes) -> bool:
        """The server loses ``chunk_key``: :meth:`RemoteMap.vanish`. Frame: the host, the
        queue and promotions are unchanged (a promotion of it will find it MISSING)."""
        return self.remote.vanish(chunk_key)

    # --- queries ---

    def is_failed(self, chunk_key: bytes) -> bool:
        """Whether ``chunk_key`` is remembered as failed (claims end before it). Pure."""
        return chunk_key in self._failed

    def in_flight(self) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        """(chunk keys of promotions in flight, chunk keys of queued writes), sorted. Pure."""
        return tuple(sorted(self._promotions)), tuple(sorted(self._writes))

    def snapshot(self) -> dict[str, Any]:
        """The plain dict of the module docstring's schema. Frame: nothing changes."""
        return {
            "host": self.host.snapshot(),
            "remote": tuple((k.hex(), _hexes(v.members)) for k, v in self.remote.items()),
            "promotions": tuple(
                sorted((k.hex(), _hexes(p.reserved)) for k, p in self._promotions.items())
            ),
            "writes": tuple(sorted((k.hex(), _hexes(v.members)) for k, v in self._writes.items())),
            "failed": tuple(sorted(k.hex() for k in self._failed)),
            "counters": dict(self._counters),
        }

    def content(self, truth: Mapping[bytes, str]) -> dict[str, Any]:
        """The content oracle of the module docstring, ``truth`` giving each key's content.

        Pure. Pre: ``truth`` maps keys to tags (the caller's oracle; any key may be absent).
        """
        return {
            "truth": {key.hex(): tag for key, tag in truth.items()},
            "held": {
                k.hex(): tag
                for k, tag in sorted(self._slots.items())
                if self.host.status(k) is LookupResult.HIT
            },
            "remote": {k.hex(): v.payloads for k, v in self.remote.items()},
            "writes": {k.hex(): self._queued(k).payloads for k in sorted(self._writes)},
        }

    def copy(self) -> TwoTierStore:
        """An independent copy. Frame: nothing changes in ``self``."""
        twin = type(self).__new__(type(self))
        twin.host = self.host.copy()
        twin.remote = self.remote.copy()
        twin._namespace = self._namespace
        twin._max_pending = self._max_pending
        twin._slots = dict(self._slots)
        twin._writes = dict(self._writes)
        twin._promotions = dict(self._promotions)
        twin._failed = set(self._failed)
        twin._counters = dict(self._counters)
        return twin

    def freeze(self) -> Hashable:
        """A hashable value equal for stores with the same future and the same counters. Pure."""
        return (
            self.host.freeze(),
            self.host.stats(),
            self.remote.freeze(),
            tuple(sorted(self._slots.items())),
            tuple(sorted(self._writes.items())),
            tuple(sorted(self._promotions.items())),
            tuple(sorted(self._failed)),
            tuple(self._counters.values()),
        )

    # --- internals ---

    def _follow(self, prepared: PrepareStoreOutput) -> None:
        for key in prepared.evicted_keys:
            del self._slots[key]
        for key in prepared.keys_to_store:
            self._slots[key] = UNWRITTEN

    def _queued(self, chunk_key: bytes) -> ChunkValue:
        """The value a queued write will SET (its own copy, taken at enqueue)."""
        return self._writes[chunk_key]

    def _fetch(
        self, chunk_key: bytes, members: tuple[bytes, ...], injection: Injection
    ) -> tuple[Resolution, tuple[str, ...]]:
        if injection is Injection.FAULT:
            return Resolution.FAULT, ()
        if injection is Injection.TIMEOUT:
            return Resolution.TIMEOUT, ()
        value = self.remote.get(chunk_key)
        if value is None:
            return Resolution.MISSING, ()
        if injection is Injection.CORRUPT:
            # A flipped byte on the wire: same lengths, same header, different payload.
            flipped = "~" * len(value.payloads[0].encode())
            value = replace(value, payloads=(flipped, *value.payloads[1:]))
        if verify(value, members) is Verdict.CORRUPT:
            return Resolution.CORRUPT, ()
        return Resolution.PROMOTED, value.payloads


def _hexes(keys: Sequence[bytes]) -> tuple[str, ...]:
    return tuple(key.hex() for key in keys)
