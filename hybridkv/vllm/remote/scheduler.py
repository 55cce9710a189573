"""The scheduler side of the remote tier (:class:`SchedulerRemote`): read-through lookups
off the scheduler thread, promotions reserved through the core, write orders from reported
stores, and the resolution of every rank's fetch reports (the package docstring: Write-behind,
Read-through, Termination, Tensor parallelism)."""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hybridkv.connector import ConnectorCore, RequestView
from hybridkv.remote import (
    EPOCH_BYTES,
    BreakerConfig,
    Chunk,
    ChunkClient,
    CircuitBreaker,
    ClientFault,
    Consult,
    GuardedClient,
    LookupBook,
    LookupPolicy,
    LookupQueue,
    ModelIdentity,
    PromoteOutcome,
    RemoteConfig,
    ShardPlan,
    StackedClient,
    breaker_counters,
    chunk_key,
    client_for,
    combined_outcome,
    make_chunk,
    shard_namespaces,
)
from hybridkv.store import LookupResult
from hybridkv.vllm.remote.orders import FetchOrder, FetchReport, RemoteOrders
from hybridkv.vllm.remote.settings import DEFAULT_BREAKER, DEFAULT_LOOKUPS

__all__ = ["FAILED_MEMORY", "PROMOTION_DEADLINE_STEPS", "SCHEDULER_COUNTERS", "SchedulerRemote"]

PROMOTION_DEADLINE_STEPS = 8
FAILED_MEMORY = 4096
_MISS = LookupResult.MISS
_HIT = LookupResult.HIT


@dataclass(slots=True)
class _Promotion:
    members: tuple[bytes, ...]
    keys: tuple[bytes, ...]  # every shard's key, as looked up (a reset may come in between)
    salt: str | None
    born: int
    sent: bool = False
    heard: int = 0  # fetching ranks that reported it
    outcome: PromoteOutcome = PromoteOutcome.PROMOTED  # combined over those ranks


SCHEDULER_COUNTERS = (
    "remote_lookups",
    "remote_lookup_faults",
    "remote_chunks_found",
    "promotions_started",
    "promotions_refused",
    "promoted",
    "missing",
    "fault",
    "timeout",
    "corrupt",
    "promotion_deadlines",
    "late_reports",
    "writes_ordered",
    "remote_lookups_waited",
    "remote_lookups_late",
    "remote_lookups_refused",
)


class SchedulerRemote:
    """The scheduler side's remote tier: lookups, promotions through the core, write orders."""

    def __init__(
        self,
        core: ConnectorCore,
        config: RemoteConfig,
        client: Any = None,
        *,
        identity: ModelIdentity,
        shards: ShardPlan | None = None,
        lookups: LookupPolicy = DEFAULT_LOOKUPS,
        breaker: BreakerConfig | None = DEFAULT_BREAKER,
        clock: Callable[[], float] | None = None,
        near: ChunkClient | None = None,
    ) -> None:
        """Lookups go through ``client`` (default: :func:`hybridkv.remote.client_for`'s, on
        ``config``'s server or cluster; this side only asks EXISTS), asked as ``lookups`` says
        (off this thread by default, :mod:`hybridkv.remote.lookup_book`) behind a circuit
        breaker of ``breaker`` (None: none); ``clock`` (seconds) times the lookup wait and the
        breaker's backoff (tests pass a fake one). Every chunk key is scoped by ``identity``
        and the weights version, 0 until the first :meth:`reset`, after which the engine's own
        epoch (random, drawn at the first reset) scopes it too. ``shards``: how the TP ranks
        map onto each chunk's shards (default: one per rank of ``identity.tp_size``, private
        memory); a lookup asks every shard's key. ``near``: a store stacked above the server
        (the disk tier's readers, :mod:`hybridkv.remote.stacked`), asked first and never
        behind the breaker."""
        self.core = core
        self.config = config
        self.identity = identity
        self.shards = shards if shards is not None else ShardPlan(identity.tp_size)
        self.weights_version = 0
        self.epoch = b""  # shared with every engine of this identity until a reset
        self._scope()
        self._client = client if client is not None else client_for(config)
        now = clock if clock is not None else time.monotonic
        self.breaker = None if breaker is None else CircuitBreaker(breaker, now)
        asking: ChunkClient = (
            self._client if self.breaker is None else GuardedClient(self._client, self.breaker)
        )
        self._near = near
        if near is not None:
            asking = StackedClient(near, asking)
        queue = LookupQueue(asking, workers=lookups.workers, max_queued=lookups.max_queued)
        self.lookups = LookupBook(queue, lookups, breaker=self.breaker, clock=now)
        self._step = 0
        self._promotions: dict[bytes, _Promotion] = {}
        self._failed: OrderedDict[bytes, None] = OrderedDict()
        self._tried: dict[str, set[bytes]] = {}  # per request: chunks promoted for it once
        self._asked: dict[str, tuple[Any, ...]] = {}  # per request: the last question answered
        self._job_chunks: dict[int, tuple[tuple[bytes, ...], ...]] = {}
        self._job_salt: dict[int, str | None] = {}
        self._writes: dict[bytes, tuple[tuple[bytes, ...], str | None]] = {}
        self._count = dict.fromkeys(SCHEDULER_COUNTERS, 0)
        # Observed history for tests and reports, kept only with ``record`` on (it grows):
        # (chunk key, salt) of every write order and every promotion that came back PROMOTED.
        self.record = False
        self.written_log: list[tuple[bytes, str | None]] = []
        self.promoted_log: list[tuple[bytes, str | None]] = []

    # ------------------------------------------------------------ read-through

    @property
    def count(self) -> dict[str, int]:
        """The scheduler side's counters (a fresh dict; the breaker's under
        ``remote_lookup_breaker_*``, present only with a breaker)."""
        found = dict(self._count)
        book = self.lookups.count
        found["remote_lookups"] = book["asked"]
        found["remote_lookups_waited"] = book["waits"]
        found["remote_lookups_late"] = book["late"]
        found["remote_lookups_refused"] = book["refused"]
        if self.breaker is not None:
            found.update(breaker_counters("remote_lookup_breaker_", self.breaker.counts()))
        return found

    def before_claim(self, view: RequestView, start: int) -> bool:
        """Promote the leading server-held chunks the host lacks for ``view``'s claim; whether
        the request should wait instead (vLLM's answer None) for its lookup, which is then not
        answered yet and the request's wait not spent (:class:`hybridkv.remote.LookupBook`).

        Never waits on the server (in the default ASYNC mode): the lookup is asked on the
        lookup threads and its answer applied on a later call, when it is in.
        """
        core = self.core
        geometry = core.geometry
        limit = geometry.planner.claimable_prefix_tokens(len(view.token_ids))
        limit -= limit % geometry.align
        if limit <= start:
            return False
        rid = str(view.request_id)
        tried = self._tried.setdefault(rid, set())
        steps = self._steps(view, start, limit, tried)
        if not steps:
            return False
        asked = [c for options in steps for c in options]
        question = (start, len(view.token_ids), tuple(c.key for c in asked))
        if self._asked.get(rid) == question:
            return False  # answered before and nothing changed: the answer stands
        # Every shard's key of every chunk: a chunk is present only if all are (the all-ranks
        # rule, :func:`hybridkv.remote.held_on_every_shard`), asked off this thread.
        consulted = self.lookups.consult(rid, [self._shard_keys(c) for c in asked])
        if consulted.verdict is not Consult.READY:
            return consulted.verdict is Consult.WAIT
        self._asked[rid] = question
        fault = consulted.fault
        if fault is not None:
            if consulted.first and fault is not ClientFault.SKIPPED:
                self._count["remote_lookup_faults"] += 1
            return False  # a fault answers nothing present
        present = consulted.present
        for options in steps:
            chunk = next((c for c in options if c.key in present), None)
            if chunk is None:
                break  # the first end the server lacks: the claim cannot pass it
            self._count["remote_chunks_found"] += 1
            slots = core.reserve_promotion(chunk.members, view.cache_salt)
            if slots is None:
                self._count["promotions_refused"] += 1
                break  # no room in the host: the claim simply ends here
            tried.add(chunk.key)
            self._promotions[chunk.key] = _Promotion(
                chunk.members, self._shard_keys(chunk), view.cache_salt, self._step
            )
            self._count["promotions_started"] += 1
        return False

    def settle_lookups(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until every asked lookup is answered; whether all are.
        For tests and benchmarks that model a server answering within one engine step."""
        return self.lookups.settle(timeout_s)

    def _steps(
        self, view: RequestView, start: int, limit: int, tried: set[bytes]
    ) -> list[tuple[Chunk, ...]]:
        """Per end in ``(start, limit]`` whose chunk the host lacks, the variants to ask."""
        status = self.core.store.status
        steps: list[tuple[Chunk, ...]] = []
        for end in _ends(self.core.geometry.distinct_units, start, limit):
            absent = [
                m for m in self._variants(view, end) if all(status(k) is _MISS for k in m)
            ]  # held (or being stored) in the host, even partly: not a remote matter
            chunks = [make_chunk(self.namespace, m) for m in absent]
            options = tuple(
                c
                for c in chunks
                if c.key not in self._failed
                and c.key not in tried
                and c.key not in self._promotions
            )
            if options:
                steps.append(options)
            elif chunks:
                break  # only failed or already-tried variants: the claim ends before them
        return steps

    def _scope(self) -> None:
        """Every shard's namespace for the current weights version and epoch; the chunk's own
        (what names it) is the first shard's."""
        self.namespaces = shard_namespaces(
            self.config.namespace, self.identity, self.shards, self.weights_version, self.epoch
        )
        self.namespace = self.namespaces[0]

    def _shard_keys(self, chunk: Chunk) -> tuple[bytes, ...]:
        """Every shard's key of ``chunk`` (made under the first shard's namespace)."""
        rest = (chunk_key(namespace, chunk.members) for namespace in self.namespaces[1:])
        return (chunk.key, *rest)

    def _variants(self, view: RequestView, end: int) -> tuple[tuple[bytes, ...], ...]:
        """The chunk ending at ``end``, then (on a model with mamba groups) its attention-only
        variant, written when the host never held the state at ``end`` (module docstring)."""
        whole = self.core.chunk_members(view, end)
        attention = self.core.chunk_members(view, end, recurrent=False)
        return tuple(m for m in ((whole, attention) if attention != whole else (whole,)) if m)

    # ------------------------------------------------------------ write-behind

    def stores_emitted(self, jobs: Iterable[Any], views: dict[str, RequestView]) -> None:
        """Remember, per store job, the chunks its items end (members from the request's keys)."""
        for job in jobs:
            view = views.get(str(job.request_id))
            if view is None:
                continue
            ends = sorted({item.end_token for item in job.items})
            self._job_chunks[int(job.job_id)] = tuple(self._variants(view, e) for e in ends)
            self._job_salt[int(job.job_id)] = view.cache_salt

    def store_reported(self, job_id: int, success: bool) -> None:
        """A store job reported: per end it stored, the whole chunk if all its members are
        READY, else the attention-only variant if those are: a write order."""
        chunks = self._job_chunks.pop(job_id, ())
        salt = self._job_salt.pop(job_id, None)
        if not success:
            return
        status = self.core.store.status
        for variants in chunks:
            for members in variants:
                if all(status(key) is _HIT for key in members):
                    chunk = make_chunk(self.namespace, members)
                    self._writes.setdefault(chunk.key, (members, salt))
                    break

    # ------------------------------------------------------------ the step

    def orders(self) -> RemoteOrders | None:
        """This step's orders (call after the core built the step's stores): the writes still
        READY with their slots read now, and the promotions reserved since the last call."""
        core = self.core
        status = core.store.status
        writes = []
        for key, (members, salt) in self._writes.items():
            if all(status(m) is _HIT for m in members):
                keys = self._shard_keys(Chunk(key, members))
                writes.append(FetchOrder(key, members, core.store.slots(members), keys))
                self._count["writes_ordered"] += 1
                if self.record:
                    self.written_log.append((key, salt))
        self._writes = {}
        fetches = []
        for key, promotion in self._promotions.items():
            if not promotion.sent:
                promotion.sent = True
                members = promotion.members
                slots = core.store.slots(members)
                fetches.append(FetchOrder(key, members, slots, promotion.keys))
        self._step += 1
        if not writes and not fetches:
            return None
        return RemoteOrders(tuple(writes), tuple(fetches))

    def fold(self, reports: Iterable[FetchReport]) -> None:
        """Resolve the promotions every fetching rank reported (PROMOTED only if each rank
        promoted its shard: :func:`~hybridkv.remote.combined_outcome`), then those past their
        deadline. A promotion some ranks reported waits for the others."""
        fetchers = self.shards.fetchers
        for report in reports:
            promotion = self._promotions.get(report.chunk_key)
            if promotion is None:
                self._count["late_reports"] += 1  # resolved TIMEOUT already
                continue
            promotion.heard += 1
            reported = PromoteOutcome(report.outcome)
            promotion.outcome = combined_outcome((promotion.outcome, reported))
            if promotion.heard == fetchers:
                del self._promotions[report.chunk_key]
                self._resolve(report.chunk_key, promotion, promotion.outcome)
        late = [
            key
            for key, p in self._promotions.items()
            if self._step - p.born > PROMOTION_DEADLINE_STEPS
        ]
        for key in late:
            self._count["promotion_deadlines"] += 1
            self._resolve(key, self._promotions.pop(key), PromoteOutcome.TIMEOUT)

    def reset(self) -> None:
        """The weights may have changed (vLLM's connector reset: a weight update, a sleep, an
        operator's reset; the connector cannot tell which): from now on every chunk is asked
        and written under the next weights version in this engine's own epoch, so nothing
        written before is read after, and no other engine, whatever its resets, ever reads
        what this one writes (another replica's version 2 may be other weights).

        Post: the version grew by 1, the epoch is this engine's (drawn at the first reset);
        pending write orders, the chunks of stores in flight
        (the core drops those stores), the failure memory and the per-request lookup records
        are forgotten. Frame: promotions in flight stay and resolve as usual (the core drops
        their keys); the server keeps the old chunks until their TTL or its eviction.
        """
        self.weights_version += 1
        if not self.epoch:
            self.epoch = os.urandom(EPOCH_BYTES)
        self._scope()
        self._writes = {}
        self._job_chunks = {}
        self._job_salt = {}
        self._failed.clear()
        self._tried.clear()
        self._asked.clear()
        self.lookups.clear()

    def finished(self, request_id: str) -> None:
        """Forget the request's lookup memo and its once-per-request record."""
        self._tried.pop(request_id, None)
        self._asked.pop(request_id, None)
        self.lookups.forget(request_id)

    def in_flight(self) -> int:
        """Promotions reserved and not resolved."""
        return len(self._promotions)

    def close(self) -> None:
        """Stop the lookup threads (each ends within the deadline), then disconnect."""
        self.lookups.queue.close(self.config.deadline_s + self.config.connect_timeout_s)
        self._client.close()
        if self._near is not None:
            self._near.close()

    def _resolve(self, key: bytes, promotion: _Promotion, outcome: PromoteOutcome) -> None:
        success = outcome is PromoteOutcome.PROMOTED
        self.core.complete_promotion(promotion.members, success)
        self._count[outcome.value] += 1
        if success:
            if self.record:
                self.promoted_log.append((key, promotion.salt))
            self._failed.pop(key, None)
            return
        self._failed[key] = None
        while len(self._failed) > FAILED_MEMORY:
            self._failed.popitem(last=False)


def _ends(units: Iterable[int], start: int, limit: int) -> list[int]:
    """Every token in ``(start, limit]`` where some group's unit ends, ascending."""
    found: set[int] = set()
    for u in units:
        found.update(range((start // u + 1) * u, limit + 1, u))
    return sorted(found)
