"""The worker side of the remote tier (:class:`WorkerRemote`): copies the ordered chunks' slot
bytes and queues their writes, fetches this rank's shards side by side, verifies them and
copies them into their host slots before reporting (the package docstring: Write-behind,
Read-through, Tensor parallelism)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from hybridkv.errors import HybridKVConfigError
from hybridkv.hostmem import HostMemory
from hybridkv.remote import (
    LATE,
    Admission,
    BreakerConfig,
    Chunk,
    ChunkClient,
    CircuitBreaker,
    ClientFault,
    Fetched,
    FetchPool,
    GuardedClient,
    PromoteOutcome,
    Refusals,
    RemoteConfig,
    RemoteTier,
    ShardPlan,
    StackedClient,
    breaker_counters,
    client_for,
    decode_chunk,
    redis_key,
)
from hybridkv.vllm.remote.orders import FetchOrder, FetchReport, RemoteOrders
from hybridkv.vllm.remote.settings import DEFAULT_BREAKER

__all__ = ["FETCH_WORKERS", "WORKER_COUNTERS", "WorkerRemote"]


WORKER_COUNTERS = (
    "remote_writes_enqueued",
    "remote_writes_dropped",
    "remote_writes_skipped",
    "remote_written",
    "remote_writes_failed",
    "remote_fetches",
    "remote_fetches_late",
    "remote_fetched_bytes",
    "remote_written_bytes",
    "remote_fetches_unauthenticated",
)
FETCH_WORKERS = 4
"""Fetch threads per worker (:class:`hybridkv.remote.FetchPool`)."""


class WorkerRemote:
    """The worker side's remote tier: copies and queues writes, runs verified fetches, each of
    this rank's own shard (:mod:`hybridkv.remote.shards`)."""

    def __init__(
        self,
        config: RemoteConfig,
        host: HostMemory,
        *,
        client: Any = None,
        background: bool = True,
        breaker: BreakerConfig | None = DEFAULT_BREAKER,
        fetch_workers: int = FETCH_WORKERS,
        clock: Callable[[], float] | None = None,
        rank: int = 0,
        shards: ShardPlan | None = None,
        near: ChunkClient | None = None,
    ) -> None:
        """Writes and fetches go through ``client`` (default:
        :func:`hybridkv.remote.client_for`'s) behind a circuit breaker of ``breaker`` (None:
        none) timed by ``clock``; fetches run on ``fetch_workers`` threads. ``rank``: this
        worker's tensor-parallel rank; ``shards``: how the ranks map onto a chunk's shards
        (default: one rank). A rank that is not its shard's writer queues no write; a rank
        whose shared host region its group's first rank fills runs no fetch and reports none
        (the promotion waits for ``shards.fetchers`` reports). ``near``: a store stacked above
        the server (this rank's disk tier, :mod:`hybridkv.remote.stacked`): read first, filled
        on a server hit, written with it; never behind the breaker, so writes go on to it
        while the breaker skips the server."""
        self.config = config
        self.host = host
        self.shards = shards if shards is not None else ShardPlan()
        if not 0 <= rank < self.shards.tp_size:
            raise HybridKVConfigError(
                "rank", rank, f"must be in [0, {self.shards.tp_size})", "pass the worker's rank"
            )
        self.rank = rank
        self.shard = self.shards.shard_of(rank)  # which of an order's shard keys is ours
        raw = client if client is not None else client_for(config)
        now = clock if clock is not None else time.monotonic
        self.breaker = None if breaker is None else CircuitBreaker(breaker, now)
        self._client: ChunkClient = (
            raw if self.breaker is None else GuardedClient(raw, self.breaker)
        )
        self.stack: StackedClient | None = None
        if near is not None:
            self.stack = StackedClient(near, self._client)
            self._client = self.stack
        self.tier = RemoteTier(config, self._client, background=background)
        self.pool = FetchPool(fetch_workers)
        self.count = dict.fromkeys(WORKER_COUNTERS, 0)
        self.outcomes = dict.fromkeys((o.value for o in PromoteOutcome), 0)
        self.refusals = Refusals()  # why CORRUPT fetches were refused; logs the first forgery
        # In-package test hook (never a user setting): called for each fetch before any GET
        # of the step, so a test can kill the server, reset connections, pause it or delete
        # the chunk between the scheduler's lookup and the worker's load.
        self.before_fetch: Callable[[FetchOrder], None] | None = None

    def run(self, orders: RemoteOrders) -> tuple[FetchReport, ...]:
        """Copy and queue every write (dropped while the breaker is open), then fetch every
        chunk side by side and write the verified ones into their slots; the outcomes (this
        rank's shard of each; none where this rank neither writes nor fetches)."""
        slot_bytes = self.host.slot_bytes
        breaker = self.breaker
        writes = orders.writes if self.shards.writes(self.rank) else ()
        for order in writes:
            if breaker is not None and self.stack is None and breaker.skipping():
                breaker.skipped()  # the server is seen down: no copy, no SET
                self.count["remote_writes_skipped"] += 1
                continue
            payloads = [bytes(self.host.slot(s).numpy()) for s in order.slots]  # the copy
            chunk = Chunk(order.shard_keys[self.shard], order.members)
            verdict = self.tier.write_behind(chunk, payloads)
            if verdict is Admission.ENQUEUED:
                self.count["remote_writes_enqueued"] += 1
                self.count["remote_written_bytes"] += slot_bytes * len(payloads)
            elif verdict is Admission.DROPPED:
                self.count["remote_writes_dropped"] += 1
        if not self.shards.fetches(self.rank):
            return ()  # the group's first rank fills the shared slots and reports
        return self._fetch_all(orders.fetches)

    def _fetch_all(self, fetches: tuple[FetchOrder, ...]) -> tuple[FetchReport, ...]:
        """GET and verify every fetch on the pool's threads; here, on the caller's thread,
        the payloads of those in time are copied into their slots (whole chunks only) before
        any is reported. A result past the deadline is TIMEOUT and never copied (TT-4)."""
        if not fetches:
            return ()
        if self.before_fetch is not None:
            for order in fetches:
                self.before_fetch(order)
        calls = [functools.partial(self._get_verified, order) for order in fetches]
        results = self.pool.run(calls, self.config.deadline_s)
        reports = []
        for order, fetched in zip(fetches, results, strict=True):
            self.count["remote_fetches"] += 1
            if fetched is LATE:
                self.count["remote_fetches_late"] += 1
                outcome = PromoteOutcome.TIMEOUT
            else:
                outcome = fetched.outcome
                if outcome is PromoteOutcome.PROMOTED:
                    self._copy_into(order, fetched.payloads)
            if outcome in (PromoteOutcome.MISSING, PromoteOutcome.CORRUPT):
                # The server lost it (TTL, eviction, flush) or holds a bad copy: if this
                # worker wrote it, the next store of it must write it again.
                self.tier.forget(order.shard_keys[self.shard])
            self.outcomes[outcome.value] += 1
            reports.append(FetchReport(order.chunk_key, outcome.value))
        return tuple(reports)

    def _get_verified(self, order: FetchOrder) -> Fetched:
        """On a fetch thread: GET and verify this rank's shard of ``order``'s chunk (touches
        no slot)."""
        reply = self._client.get(redis_key(order.shard_keys[self.shard]))
        if reply is None:
            return Fetched(PromoteOutcome.MISSING)
        if isinstance(reply, ClientFault):
            timed_out = reply is ClientFault.TIMEOUT
            return Fetched(PromoteOutcome.TIMEOUT if timed_out else PromoteOutcome.FAULT)
        # The MAC binds the key the value is stored under: this rank's shard key, not the
        # chunk's name (a shard moved under another rank's key is refused).
        shard_key = order.shard_keys[self.shard]
        decoded = decode_chunk(reply, order.members, self.config.key, shard_key)
        if decoded.corruption is not None:
            self.refusals.note(decoded.corruption, shard_key)  # thread-safe
            return Fetched(PromoteOutcome.CORRUPT)
        size = self.host.slot_bytes
        if any(len(p) != size for p in decoded.payloads):
            return Fetched(PromoteOutcome.CORRUPT)
        return Fetched(PromoteOutcome.PROMOTED, decoded.payloads)

    def _copy_into(self, order: FetchOrder, payloads: tuple[bytes, ...]) -> None:
        for slot, payload in zip(order.slots, payloads, strict=True):
            self.host.slot(slot).copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.count["remote_fetched_bytes"] += self.host.slot_bytes * len(order.slots)

    def counters(self) -> dict[str, int]:
        """Worker counters, the tier's write outcomes and the breaker's counts
        (``remote_breaker_*``, present only with a breaker) folded in."""
        tier = self.tier.snapshot()["counters"]
        found = dict(self.count)
        found["remote_written"] = tier["written"]
        found["remote_writes_failed"] = tier["writes_failed"]
        if self.breaker is not None:
            found.update(breaker_counters("remote_breaker_", self.breaker.counts()))
        found["remote_fetches_unauthenticated"] = self.refusals.unauthenticated()
        return found

    def flush(self, timeout_s: float) -> bool:
        """Wait for the queued writes (tests and shutdown)."""
        return self.tier.flush(timeout_s)

    def close(self) -> None:
        self.pool.close()
        self.tier.close()
