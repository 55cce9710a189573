"""The remote tier: write-behind to a shared server, lookups, and verified fetches.

Accounting only (the host side is :mod:`hybridkv.remote.two_tier`'s): the index of chunks this
tier wrote and has not seen vanish, the writes queued or in flight, the promotions in flight,
the chunks remembered as failed, and the TT-8 counters. Every server call goes through a
:class:`~hybridkv.remote.client.ChunkClient`, which returns faults instead of raising, so no
server failure reaches the caller (TT-5).

The index is what lets an engine skip re-writing a chunk it wrote. It is bounded and ages, so
it neither grows with an engine's lifetime nor hides a chunk the server dropped for good: it
keeps the ``index_entries`` most recent writes, and with a TTL an entry counts as written only
for half the TTL (after that the next store writes the chunk again, renewing it on the
server, instead of trusting a copy about to expire). A forgotten entry costs one identical SET.

Writes never block the caller (TT-7): :meth:`RemoteTier.write_behind` encodes (copies) the
chunk's bytes at once and queues them; a full queue drops the write. One writer thread (or, with
``background=False``, whoever calls :meth:`RemoteTier.write_pending`) SETs them in order. Every
server wait is bounded by the config's deadline, so every write and fetch resolves (TT-4).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

from hybridkv.errors import HybridKVConfigError
from hybridkv.remote.client import ChunkClient
from hybridkv.remote.cluster import client_for
from hybridkv.remote.codec import decode_chunk, encode_chunk, redis_key
from hybridkv.remote.config import RemoteConfig
from hybridkv.remote.security import Refusals
from hybridkv.remote.values import (
    REMOTE_COUNTER_NAMES,
    Admission,
    Chunk,
    ClientFault,
    Fetched,
    PromoteOutcome,
    WriteOutcome,
)

__all__ = ["RemoteTier"]

_FAULT_OUTCOME = {
    ClientFault.FAULT: PromoteOutcome.FAULT,
    ClientFault.TIMEOUT: PromoteOutcome.TIMEOUT,
    ClientFault.SKIPPED: PromoteOutcome.FAULT,  # the breaker is open: the server is down
}
# The server no longer holds these whole: forget them (a vanished chunk is a miss, TT-5).
_GONE = (PromoteOutcome.MISSING, PromoteOutcome.CORRUPT)


class RemoteTier:
    """Chunks on a shared Redis/Valkey server, written behind and fetched verified."""

    def __init__(
        self,
        config: RemoteConfig,
        client: ChunkClient | None = None,
        *,
        background: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """A tier on ``config``'s server (through ``client``, by default
        :func:`~hybridkv.remote.cluster.client_for`'s: a cluster's or one server's).

        ``background``: a daemon thread writes the queue; without it nothing is written until
        :meth:`write_pending` (deterministic tests). ``clock``: seconds, for the index's age
        under a TTL (tests pass their own). Post: empty, zero counters.
        """
        if not isinstance(config, RemoteConfig):
            raise HybridKVConfigError("config", config, "is not a RemoteConfig", "build one")
        self.config = config
        self._client = client if client is not None else client_for(config)
        self._lock = threading.Condition()
        self._clock = clock
        # Chunk key -> (chunk, when written), oldest first (module docstring: bounded, aging).
        self._index: OrderedDict[bytes, tuple[Chunk, float]] = OrderedDict()
        self._writes: dict[bytes, Chunk] = {}  # queued or in flight
        self._queue: deque[tuple[Chunk, bytes]] = deque()
        self._promotions: dict[bytes, Chunk] = {}
        self._failed: set[bytes] = set()
        self._counters = dict.fromkeys(REMOTE_COUNTER_NAMES, 0)
        # Why CORRUPT fetches were refused, apart from the contract's counters (TT-8).
        self.refusals = Refusals()
        self._closed = False
        self._writer: threading.Thread | None = None
        if background:
            self._writer = threading.Thread(target=self._write_loop, name="hybridkv-remote")
            self._writer.daemon = True
            self._writer.start()

    # --- writes ---

    def write_behind(self, chunk: Chunk, payloads: Sequence[bytes | memoryview]) -> Admission:
        """Queue one SET of ``chunk`` with a copy of ``payloads`` (one per member); never blocks.

        Post: ENQUEUED (``writes_enqueued`` grew; the copy is the tier's, so the caller may
        reuse or evict the host slots at once, TT-7), DROPPED (queue full: ``writes_dropped``
        grew, nothing queued), KNOWN (the tier holds it whole already and it is not remembered
        as failed) or PENDING (a write of it is queued or in flight); the last two change
        nothing.
        """
        with self._lock:
            early = self._admission(chunk)
        if early is not Admission.ENQUEUED:
            return early
        # The copy (and the MAC or encryption), made outside the lock.
        value = encode_chunk(chunk.members, payloads, self.config.key, chunk.key)
        with self._lock:
            verdict = self._admission(chunk)
            if verdict is Admission.ENQUEUED:
                self._writes[chunk.key] = chunk
                self._queue.append((chunk, value))
                self._counters["writes_enqueued"] += 1
                self._lock.notify_all()
            return verdict

    def write_pending(self, limit: int | None = None) -> int:
        """Write up to ``limit`` queued chunks (all when None) here; how many were written.

        Each SET waits at most the deadline; each write resolves WRITTEN or FAILED.
        """
        done = 0
        while limit is None or done < limit:
            with self._lock:
                if not self._queue:
                    break
                chunk, value = self._queue.popleft()
            self._write_one(chunk, value)
            done += 1
        return done

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every queued write to resolve; whether they all did."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._writes, timeout_s)

    # --- reads ---

    def lookup(self, chunks: Sequence[Chunk]) -> int:
        """How many leading ``chunks`` the server holds, stopping before a failed one.

        One pipelined EXISTS round trip. A fault counts ``lookup_faults`` and answers 0; an
        indexed chunk the server lacks is forgotten (seen vanish). Post: ``lookups`` grew.
        """
        with self._lock:
            self._counters["lookups"] += 1
            asked = []
            for chunk in chunks:
                if chunk.key in self._failed:
                    break
                asked.append(chunk)
        if not asked:
            return 0
        found = self._client.exists([redis_key(chunk.key) for chunk in asked])
        with self._lock:
            if isinstance(found, ClientFault):
                self._counters["lookup_faults"] += 1
                return 0
            for chunk, present in zip(asked, found, strict=True):
                if not present:
                    self._index.pop(chunk.key, None)
        return found.index(False) if False in found else len(found)

    def begin_promotion(self, chunk: Chunk) -> bool:
        """Count a promotion of ``chunk`` as in flight; False (nothing changed) if it is
        remembered as failed or already in flight."""
        with self._lock:
            if chunk.key in self._failed or chunk.key in self._promotions:
                return False
            self._promotions[chunk.key] = chunk
            self._counters["promotions_started"] += 1
            return True

    def fetch(
        self, chunk: Chunk, accept: Callable[[tuple[bytes, ...]], bool] = lambda _: True
    ) -> Fetched:
        """GET and verify the in-flight promotion of ``chunk``, and resolve it.

        ``accept`` gets the verified payloads and may still refuse them (e.g. a length the host
        slots cannot hold): CORRUPT. Post: exactly one outcome counted, the promotion no longer
        in flight (TT-4); any outcome but PROMOTED remembers the chunk as failed, and MISSING
        or CORRUPT forgets it from the index. Payloads are returned only when PROMOTED.
        """
        with self._lock:
            if self._promotions.get(chunk.key) != chunk:
                raise HybridKVConfigError(
                    "chunk", chunk.key.hex(), "has no promotion in flight", "begin_promotion first"
                )
        fetched = self._fetched(chunk, self._client.get(redis_key(chunk.key)), accept)
        with self._lock:
            del self._promotions[chunk.key]
            self._counters[fetched.outcome.value] += 1
            if fetched.outcome is not PromoteOutcome.PROMOTED:
                self._failed.add(chunk.key)
            if fetched.outcome in _GONE:
                self._index.pop(chunk.key, None)
        return fetched

    def forget(self, key: bytes) -> bool:
        """The server was seen without chunk ``key`` (a fetch elsewhere found it missing or
        corrupt): drop it from the index, so the next store of it writes it again. Whether it
        was indexed. Nothing else changes."""
        with self._lock:
            return self._index.pop(key, None) is not None

    def in_flight(self, chunk: Chunk) -> bool:
        """Whether a promotion of ``chunk`` is in flight."""
        with self._lock:
            return chunk.key in self._promotions

    def is_failed(self, chunk: Chunk) -> bool:
        """Whether ``chunk`` is remembered as failed (claims end before it)."""
        with self._lock:
            return chunk.key in self._failed

    # --- lifecycle, snapshot ---

    def close(self) -> None:
        """Write what is queued (each SET bounded by the deadline), stop the writer, disconnect.

        Post: nothing queued or in flight; later writes are DROPPED.
        """
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._writer is not None:
            self._writer.join()
        self.write_pending()
        self._client.close()

    def snapshot(self) -> dict[str, Any]:
        """The contract's two-tier snapshot without ``host``. Frame: nothing changes."""
        with self._lock:
            return {
                "remote": _plain({key: chunk for key, (chunk, _) in self._index.items()}),
                "promotions": _plain(self._promotions),
                "writes": _plain(self._writes),
                "failed": tuple(sorted(key.hex() for key in self._failed)),
                "counters": dict(self._counters),
            }

    # --- internals ---

    def _admission(self, chunk: Chunk) -> Admission:
        # A chunk remembered as failed is written again: a verified fresh copy ends the memory.
        if chunk.key in self._index and chunk.key not in self._failed:
            ttl = self.config.ttl_s
            if not ttl or self._clock() - self._index[chunk.key][1] < ttl / 2:
                return Admission.KNOWN
            del self._index[chunk.key]  # half its TTL gone: write it again, renewing it
        if chunk.key in self._writes:
            return Admission.PENDING
        if self._closed or len(self._writes) >= self.config.max_pending:
            self._counters["writes_dropped"] += 1
            return Admission.DROPPED
        return Admission.ENQUEUED

    def _write_one(self, chunk: Chunk, value: bytes) -> WriteOutcome:
        fault = self._client.set(redis_key(chunk.key), value, self.config.ttl_s)
        outcome = WriteOutcome.WRITTEN if fault is None else WriteOutcome.FAILED
        with self._lock:
            del self._writes[chunk.key]
            if outcome is WriteOutcome.WRITTEN:
                self._counters["written"] += 1
                self._index[chunk.key] = (chunk, self._clock())
                self._index.move_to_end(chunk.key)
                while len(self._index) > self.config.index_entries:
                    self._index.popitem(last=False)  # the oldest write is forgotten
                self._failed.discard(chunk.key)  # the server holds a fresh, whole copy
            else:
                self._counters["writes_failed"] += 1
            self._lock.notify_all()
        return outcome

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: bool(self._queue) or self._closed)
                if not self._queue:
                    return
                chunk, value = self._queue.popleft()
            self._write_one(chunk, value)

    def _fetched(
        self,
        chunk: Chunk,
        reply: bytes | ClientFault | None,
        accept: Callable[[tuple[bytes, ...]], bool],
    ) -> Fetched:
        if reply is None:
            return Fetched(PromoteOutcome.MISSING)
        if isinstance(reply, ClientFault):
            return Fetched(_FAULT_OUTCOME[reply])
        decoded = decode_chunk(reply, chunk.members, self.config.key, chunk.key)
        if decoded.corruption is not None:
            self.refusals.note(decoded.corruption, chunk.key)
        if decoded.corruption is not None or not accept(decoded.payloads):
            return Fetched(PromoteOutcome.CORRUPT)
        return Fetched(PromoteOutcome.PROMOTED, decoded.payloads)


def _plain(chunks: dict[bytes, Chunk]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return tuple(sorted(chunk.plain() for chunk in chunks.values()))
