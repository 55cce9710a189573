"""The remote tier inside :class:`~hybridkv.vllm.connector.HybridKVConnector` (issue 12): two
vLLM engines, each with its own host tier, share one Redis/Valkey server under the CPU tier.

vLLM runs the scheduler and the workers in separate processes, so the two sides share no
Python object: each side opens its own connection to the server, and everything else crosses
in the connector metadata (scheduler -> worker, :class:`RemoteOrders`) and the worker metadata
(worker -> scheduler, :class:`FetchReport` in ``HybridKVWorkerMeta.fetches``).

Chunks. A chunk is one prefix step: the host keys of every group's unit that ends at the same
token ``end`` (attention blocks of full and sliding groups and the mamba state ending there),
in group order (:meth:`hybridkv.connector.ConnectorCore.chunk_members`). vLLM keeps a mamba
state only at the end of each scheduled step, so a host often holds the attention units ending
at ``end`` without the state there; such a step is written as its attention-only variant (the
same rule without the mamba members: other members, so another chunk key), and a reader asks
for the whole chunk first, then that variant (a claim may pass an end without its state, never
end there). Each variant is still written and read whole. The chunk key is the
contract's chunk key over those host keys (:func:`hybridkv.remote.chunk_key`) under
``remote_namespace`` scoped by the model identity and the weights version
(:func:`hybridkv.remote.scoped_namespace`, :func:`model_identity`): model name or path,
revision, dtypes, a fingerprint of the KV cache layout, TP size and rank, a digest of vLLM's
own config hashes and the model's config, and after a connector reset the engine's own epoch.
Member keys come from vLLM's block hashes, which know nothing of the model, so without the
scope two deployments of different models with equal geometry would read each other's KV; with
it they never share a key. A reset may or may not come with new weights (a sleep, a training
step), so after one the engine reads and writes a namespace no other engine uses, failing
closed (:meth:`SchedulerRemote.reset`, :mod:`hybridkv.remote.identity`). The cache salt and
vLLM's extra keys, already chained into the host keys, separate tenants by content addressing
alone (TT-6). Each member travels as its whole host slot (``slot_bytes``, the largest group's
block), so every group's layout in the slot is carried as is.

Write-behind (:class:`SchedulerRemote.store_reported`): when a store job reports success, each
chunk it touched whose members are all READY in the host becomes a write order. Orders are
re-checked (every member still READY, slots read afresh) when the next metadata is built, after
the core reserved that step's stores, so no order names a slot that step's stores or
promotions reuse. The worker (:class:`WorkerRemote`) copies the members' slot bytes at the
start of its step, before it writes any slot (fetches, then the step's stores in
``wait_for_save``), and queues one SET on :class:`hybridkv.remote.RemoteTier`'s background
writer: bounded, never blocking (a full queue drops the write, counted).

Read-through (:class:`SchedulerRemote.before_claim`): before the core answers a claim, the
chunks ending in ``(num_computed_tokens, claimable end]`` whose members are all absent from the
host are asked of the server (one pipelined EXISTS over every end's variants, bounded by
``remote_timeout_ms``; a fault answers none present). The EXISTS never runs on the scheduler
thread (issue 30): it is queued to the lookup threads (:class:`hybridkv.remote.LookupBook`),
and until its answer is in the request waits (vLLM's None) for at most
``remote_lookup_wait_ms`` and 16 steps in all, then goes on without the remote hit; an answer,
once in, is the request's answer for every chunk it covers. A circuit breaker on each side
(:mod:`hybridkv.remote.breaker`) skips a server seen down: lookups answer no hit at once,
fetches resolve FAULT at once, writes are dropped, until a probe after the backoff succeeds.
In prefix order, the ends the server holds up to the first it lacks are promoted (per end, the
whole chunk if present, else the attention-only one): their members are reserved STORING
through the core (:meth:`~hybridkv.connector.ConnectorCore.reserve_promotion`), so the claim
DEFERs on them like on any STORING key, and the next metadata orders the fetch.
The worker GETs each chunk (bounded by the same timeout), verifies it against the expected
members (:func:`hybridkv.remote.decode_chunk`: magic, version, member keys, lengths, digest
or, with a fleet key, the MAC or AES-GCM tag over the key the value is stored under (this
rank's shard key) and the value, and each payload exactly one slot), writes the payloads into
the reserved slots and reports the outcome: PROMOTED (members READY) or MISSING / FAULT /
TIMEOUT / CORRUPT (members dropped; the chunk is remembered failed, so the claim ends before it
and vLLM recomputes exactly what is missing). A step's fetches run side by side on a few threads
inside ``start_load_kv`` (:class:`hybridkv.remote.FetchPool`); a result past the deadline is
TIMEOUT, and the bytes of those in time are copied into their slots on the worker's thread
before it reports, so a report never precedes its writes and a late fetch writes nothing.

Termination (TT-4): a promotion not reported within ``PROMOTION_DEADLINE_STEPS`` engine steps
(it cannot be, with vLLM's in-order outputs; the bound guards against a lost report) resolves
TIMEOUT and its members are dropped; a late report of it is ignored (counted). Each chunk is
promoted at most once per request, so read-through cannot loop evicting what it promoted.
Failed chunks are remembered (at most ``FAILED_MEMORY`` of them, oldest forgotten first).

Tensor parallelism (:mod:`hybridkv.remote.shards`): each rank holds its own shard of every
chunk, so a chunk is one server value per shard, each under its own key (the namespace scoped
by an identity naming the shard's rank and the TP size). Orders carry every shard's key
(``FetchOrder.shard_keys``); each rank's worker writes and fetches only its own. A lookup asks
every shard's key in the same pipelined EXISTS and counts a chunk only if all are there, so a
shard missing on one rank is a miss. A promotion resolves once every fetching rank reported it
(vLLM's aggregator hands the scheduler every rank's worker metadata), PROMOTED only if each
rank promoted its shard; a shard gone between the lookup and one rank's fetch fails the
promotion, its members are dropped on every rank, and the claim ends before the chunk, before
vLLM ever counted it: never a partial load. Replicated KV (MLA, ``kv_tp_replicas``) is one
shard per group of replicas, written by the group's first rank only.

Not built: writes on host eviction (writes happen on store).
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.connector import ConnectorCore, RequestView
from hybridkv.errors import HybridKVConfigError
from hybridkv.hostmem import HostMemory
from hybridkv.remote import (
    EPOCH_BYTES,
    LATE,
    Admission,
    BreakerConfig,
    Chunk,
    ChunkClient,
    CircuitBreaker,
    ClientFault,
    Consult,
    Fetched,
    FetchPool,
    GuardedClient,
    LookupBook,
    LookupPolicy,
    LookupQueue,
    ModelIdentity,
    PromoteOutcome,
    Refusals,
    RemoteConfig,
    RemoteTier,
    ShardPlan,
    StackedClient,
    breaker_counters,
    chunk_key,
    client_for,
    combined_outcome,
    decode_chunk,
    make_chunk,
    redis_key,
    shard_namespaces,
)
from hybridkv.store import LookupResult
from hybridkv.vllm.config import RemoteSettings
from hybridkv.vllm.ranks import HostSharding

__all__ = [
    "DEFAULT_BREAKER",
    "DEFAULT_LOOKUPS",
    "FAILED_MEMORY",
    "PROMOTION_DEADLINE_STEPS",
    "FetchOrder",
    "FetchReport",
    "RemoteOrders",
    "SchedulerRemote",
    "WorkerRemote",
    "breaker_config",
    "config_digest",
    "lookup_policy",
    "model_identity",
    "refuse_unshared_hashes",
    "remote_config",
    "remote_shards",
]

PROMOTION_DEADLINE_STEPS = 8
DEFAULT_LOOKUPS = LookupPolicy()
DEFAULT_BREAKER = BreakerConfig()
FAILED_MEMORY = 4096
_MISS = LookupResult.MISS
_HIT = LookupResult.HIT


def lookup_policy(settings: RemoteSettings) -> LookupPolicy:
    """The scheduler side's lookup policy for the connector's parsed keys."""
    return LookupPolicy(wait_s=settings.lookup_wait_s)


def breaker_config(settings: RemoteSettings) -> BreakerConfig:
    """Each side's circuit breaker for the connector's parsed keys."""
    return BreakerConfig(settings.breaker_failures, settings.breaker_backoff_s)


def remote_config(settings: RemoteSettings) -> RemoteConfig:
    """The library tier's config for the connector's parsed keys."""
    return RemoteConfig(
        host=settings.host,
        port=settings.port,
        connect_timeout_s=settings.timeout_s,
        deadline_s=settings.timeout_s,
        ttl_s=settings.ttl_s,
        max_pending=settings.max_pending_writes,
        namespace=settings.namespace.encode(),
        credentials=settings.credentials,
        tls=settings.tls,
        key=settings.key,
        cluster_nodes=settings.cluster_nodes,
    )


@dataclass(frozen=True, slots=True)
class FetchOrder:
    """One chunk's members and their host slots (a write copies from them, a fetch into them).

    ``chunk_key`` names the chunk (its first shard's key: what reports name); ``shard_keys``
    is every shard's server key in shard order (:mod:`hybridkv.remote.shards`; one at TP 1,
    equal to ``chunk_key``), of which each rank writes or fetches its own."""

    chunk_key: bytes
    members: tuple[bytes, ...]
    slots: tuple[int, ...]
    shard_keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class RemoteOrders:
    """What the worker's remote side does this step: copy and queue ``writes``, then fetch
    ``fetches`` (metadata, scheduler -> worker)."""

    writes: tuple[FetchOrder, ...] = ()
    fetches: tuple[FetchOrder, ...] = ()


@dataclass(frozen=True, slots=True)
class FetchReport:
    """One rank's fetch outcome (worker metadata, worker -> scheduler): ``outcome`` is a
    :class:`hybridkv.remote.PromoteOutcome` value. Under tensor parallelism every fetching rank
    reports each chunk; vLLM's aggregator concatenates them."""

    chunk_key: bytes
    outcome: str


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


def model_identity(vllm_config: Any, layout: Any, tp_rank: int = 0) -> ModelIdentity:
    """The :class:`~hybridkv.remote.ModelIdentity` of the engine ``vllm_config`` serves, over
    its :class:`~hybridkv.vllm.layout.VllmLayout`. ``tp_rank``: the rank whose shard the chunks
    hold (each shard's namespace names its own: :func:`hybridkv.remote.shard_namespaces`)."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    groups = ";".join(
        f"{g.kind.value}:{g.block_size}:{g.page_size_bytes}:{g.real_page_size_bytes}:"
        + ",".join(g.layer_names)
        for g in layout.groups
    )
    return ModelIdentity(
        model=str(model.model),
        revision=str(model.revision or ""),
        dtype=f"{model.dtype}/{cache.cache_dtype}",
        layout=f"hash={layout.hash_block_size};{groups}",
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
        tp_rank=tp_rank,
        config=config_digest(vllm_config),
    )


def config_digest(vllm_config: Any) -> str:
    """SHA-256 over what the engine's configuration says about its KV bytes beyond the named
    fields, read from vLLM rather than picked by hand: vLLM's version, its model config hash
    (``ModelConfig.compute_hash``, ``config/model.py:457-526``: quantization, dtype, revision,
    max length, ...), its cache config hash (``CacheConfig.compute_hash``, ``config/cache.py``:
    KV-cache and mamba dtypes, block size, ...), and the model's config as vLLM loaded it, which
    carries ``hf_overrides`` (vLLM's own hash leaves them out, ``config/model.py:488``). Two
    engines whose digests differ might hold different KV for the same tokens: they never share.
    """
    from vllm import __version__

    model = vllm_config.model_config
    hf_config = model.hf_config
    to_json = getattr(hf_config, "to_json_string", None)
    hf_text = to_json(use_diff=False) if callable(to_json) else repr(hf_config)
    parts = (__version__, model.compute_hash(), vllm_config.cache_config.compute_hash(), hf_text)
    digest = hashlib.sha256()
    for part in parts:  # length-prefixed: no part runs into the next
        data = str(part).encode()
        digest.update(len(data).to_bytes(8, "big") + data)
    return digest.hexdigest()


def remote_shards(sharding: HostSharding, kv_cache_config: Any) -> ShardPlan:
    """The shards of a chunk for vLLM's ranks: one per group of ranks holding identical KV
    (``kv_tp_replicas``, whether or not the group shares a host region), fetched into a shared
    region by its first rank only (``sharding``, :func:`hybridkv.vllm.ranks.host_sharding`,
    which refused a replica count that does not divide the ranks)."""
    replicas = int(getattr(kv_cache_config, "kv_tp_replicas", 1))
    return ShardPlan(sharding.world_size, replicas, shared_host=sharding.replicas > 1)


# vLLM's non-cryptographic block hashes (``_NON_CRYPTO_HASH_FUNCTIONS``,
# ``v1/core/kv_cache_utils.py:111``): without PYTHONHASHSEED their seed is fresh random bytes per
# process (``resolve_none_hash_seed``, 117-130), so no two engines, nor one engine after a
# restart, ever compute the same block hash.
_PER_PROCESS_SEEDED = frozenset({"xxhash", "xxhash_cbor"})


def refuse_unshared_hashes(
    hash_algo: str, environ: Mapping[str, str], key: str = "remote_url"
) -> None:
    """A remote or disk tier (``key``: the one configured) is keyed by vLLM's block hashes:
    refuse a hash whose seed is random per process (it would never hit across engines or
    restarts, and nothing would say so)."""
    if hash_algo in _PER_PROCESS_SEEDED and environ.get("PYTHONHASHSEED") is None:
        raise HybridKVConfigError(
            f"kv_connector_extra_config.{key}",
            f"--prefix-caching-hash-algo {hash_algo} without PYTHONHASHSEED",
            f"{hash_algo} block hashes are seeded with random bytes per process, so the shared "
            "tier would never hit across engines or restarts",
            "set PYTHONHASHSEED to the same value on every engine, or use "
            f"--prefix-caching-hash-algo sha256 (the default), or drop {key}",
        )
