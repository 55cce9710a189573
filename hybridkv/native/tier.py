"""hybridkv's shared tier as a ``SecondaryTierManager`` under native's ``TieringOffloadingSpec``.

Native's tiering manager owns the CPU primary tier; a secondary tier sees chunks only through
it: a store job copies primary slots out (cascade), a load job fills primary slots the manager
reserved (promotion). This tier does both through :class:`hybridkv.remote.RemoteTier` on a
:class:`~hybridkv.remote.ChunkClient`: Redis/Valkey (:class:`HybridKVRemoteTier`) or a
directory (:class:`HybridKVDiskTier`, :class:`hybridkv.disk.DiskClient`). So a native user gets
what ``HybridKVConnector``'s shared tier guarantees:

- integrity: every value carries its members and a digest (``encode_chunk``), a fetch is
  verified before one byte reaches the primary slot, and a corrupt, truncated, foreign or
  vanished value is a miss (the key fails, native recomputes it), never wrong KV;
- identity: chunk keys are scoped by the model and the KV layout (:mod:`.identity`);
- faults: no server or disk failure raises (``ClientFault`` values), every wait is bounded by
  the deadline, a down server makes lookups miss and stores fail, and the engine goes on.

Native's contract, and where each part is kept:

- ``lookup`` is non-blocking: vLLM's ``AsyncLookupManager`` asks EXISTS off the scheduler
  thread once per step (``on_schedule_end`` flushes), answering RETRY until it knows;
- ``submit_store`` / ``submit_load`` only queue: the copy, the encoding and the fetch run on the
  tier's threads; a store job finishes when its chunks are copied into the write-behind queue
  (the primary slots are free from then on: TT-7); a load job finishes when every fetch has
  resolved, its ``successful_keys`` those whose bytes verified and were copied;
- ``get_finished_jobs`` drains what the threads finished; ``drain_jobs`` waits for every job
  (no thread touches the primary view after it); ``has_pending_work`` while any job runs;
- ``take_events``: the keys each finished store job wrote, ``removed=False``, when vLLM's KV
  events are on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import (
    JobResult,
    ScheduleEndContext,
    SecondaryTierManager,
    TransferJob,
)

from hybridkv.disk import DiskClient
from hybridkv.native.identity import identity_fields, scoped
from hybridkv.native.settings import TierSettings, disk_settings, remote_settings
from hybridkv.remote import (
    Admission,
    Chunk,
    ChunkClient,
    CircuitBreaker,
    ClientFault,
    GuardedClient,
    PromoteOutcome,
    RemoteTier,
    breaker_counters,
    client_for,
    held_on_every_shard,
    make_chunk,
)

__all__ = ["NATIVE_TIER_COUNTERS", "HybridKVDiskTier", "HybridKVRemoteTier"]

logger = logging.getLogger(__name__)

NATIVE_TIER_COUNTERS = (
    "lookups",
    "lookup_faults",
    "store_jobs",
    "store_jobs_failed",
    "chunks_enqueued",
    "chunks_known",
    "chunks_dropped",
    "load_jobs",
    "load_jobs_failed",
    "chunks_promoted",
    "chunks_not_promoted",
)
"""The plug-in's own counters (:meth:`snapshot`), beside the remote tier's (TT-8)."""


class _Lookups(AsyncLookupManager):
    """EXISTS for one request's keys, one round trip, on vLLM's lookup thread."""

    def __init__(self, tier: _ChunkTier, tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.held(keys)


class _ChunkTier(SecondaryTierManager):
    """The tier on a :class:`~hybridkv.remote.ChunkClient` (the module docstring)."""

    breaker: CircuitBreaker | None = None  # a Redis tier's (HybridKVRemoteTier)

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        *,
        settings: TierSettings,
        client: ChunkClient,
        backpressure_detector: Any = None,
        locality: str | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        self.identity = identity_fields(offloading_spec, self.block_size_bytes)
        self._namespace = scoped(settings.remote.namespace, self.identity)
        self._client = client
        self.remote = RemoteTier(settings.remote, client)
        self._pool = ThreadPoolExecutor(settings.threads, thread_name_prefix="hybridkv-native")
        self._lock = threading.Lock()
        self._jobs: set[Future[None]] = set()
        self._finished: list[JobResult] = []
        self._missed: list[OffloadKey] = []  # keys of failed fetches, for get_finished_jobs
        self._stored: list[OffloadingEvent] = []
        self._events = offloading_spec.kv_events_config.enable_kv_cache_events
        self._counters = dict.fromkeys(NATIVE_TIER_COUNTERS, 0)
        # The primary tier as one byte run: slot ``c`` is bytes [c * size, (c + 1) * size).
        self._flat = primary_kv_view.cast("B")
        self._lookups = _Lookups(self, tier_type)
        logger.info("hybridkv tier %r scoped by %s", tier_type, self.identity)

    # --- lookups ---

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT / MISS once the lookup thread answered, RETRY until then (never blocks)."""
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def held(self, keys: Sequence[OffloadKey]) -> tuple[bool, ...]:
        """Per key, whether the store holds its chunk (one EXISTS); a chunk remembered as
        failed is not held; a fault answers every key absent. Runs on the lookup thread."""
        chunks = [self._chunk(key) for key in keys]
        found = held_on_every_shard(self._client, [[chunk.key] for chunk in chunks])
        with self._lock:
            self._counters["lookups"] += 1
            if isinstance(found, ClientFault):
                self._counters["lookup_faults"] += 1
                return (False,) * len(keys)
        return tuple(
            present and not self.remote.is_failed(chunk)
            for chunk, present in zip(chunks, found, strict=True)
        )

    # --- jobs ---

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Queue the job's copy into the write-behind queue on a tier thread."""
        keys, slots = list(job_metadata.keys), [int(c) for c in job_metadata.chunk_ids]
        self._submit(job_metadata.job_id, lambda: self._store(job_metadata.job_id, keys, slots))

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Queue the job's verified fetches into its primary slots on a tier thread."""
        keys, slots = list(job_metadata.keys), [int(c) for c in job_metadata.chunk_ids]
        self._submit(job_metadata.job_id, lambda: self._load(job_metadata.job_id, keys, slots))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """The jobs finished since the last call; the keys their fetches failed become misses
        for the next lookups (here, on the thread that holds native's manager lock: the lookup
        manager's state is that thread's)."""
        with self._lock:
            done, self._finished = self._finished, []
            missed, self._missed = self._missed, []
        if missed:
            self._lookups.mark_miss(missed)
        return done

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._jobs or self._finished)

    def drain_jobs(self) -> None:
        """Wait for every job submitted (each fetch and write bounded by the deadline)."""
        with self._lock:
            jobs = set(self._jobs)
        wait(jobs)

    def take_events(self) -> Iterable[OffloadingEvent]:
        with self._lock:
            events, self._stored = self._stored, []
        return events

    # --- requests, steps, lifecycle ---

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def shutdown(self) -> None:
        """Finish the jobs, stop the lookup thread, write what is queued, disconnect."""
        self._pool.shutdown(wait=True)
        self._lookups.shutdown()
        self.remote.close()

    def snapshot(self) -> dict[str, Any]:
        """The plug-in's counters, the remote tier's snapshot and the identity. Frame: none."""
        with self._lock:
            counters = dict(self._counters)
        snap = {"counters": counters, "remote": self.remote.snapshot(), "identity": self.identity}
        if self.breaker is not None:
            snap["breaker"] = breaker_counters("breaker_", self.breaker.counts())
        return snap

    # --- internals ---

    def _chunk(self, key: OffloadKey) -> Chunk:
        return make_chunk(self._namespace, [bytes(key)])

    def _slot(self, slot: int) -> memoryview:
        size = self.block_size_bytes
        return self._flat[slot * size : (slot + 1) * size]

    def _submit(self, job_id: int, work: Any) -> None:
        future = self._pool.submit(self._reported, job_id, work)
        with self._lock:
            self._jobs.add(future)
        future.add_done_callback(self._forget)

    def _reported(self, job_id: int, work: Any) -> None:
        # A job that raised (a bug, never a store fault: those are values) still reports, as a
        # failure, so native unpins its primary slots and the engine never waits on it.
        try:
            work()
        except Exception:
            logger.exception("hybridkv tier job %d failed", job_id)
            with self._lock:
                self._finished.append(JobResult(job_id, success=False))

    def _forget(self, future: Future[None]) -> None:
        with self._lock:
            self._jobs.discard(future)

    def _store(self, job_id: int, keys: list[OffloadKey], slots: list[int]) -> None:
        verdicts = [
            self.remote.write_behind(self._chunk(key), [self._slot(slot)])
            for key, slot in zip(keys, slots, strict=True)
        ]
        dropped = verdicts.count(Admission.DROPPED)
        enqueued = verdicts.count(Admission.ENQUEUED)
        result = JobResult(
            job_id, success=not dropped, transfer_bytes=enqueued * self.block_size_bytes
        )
        with self._lock:
            c = self._counters
            c["store_jobs"] += 1
            c["store_jobs_failed"] += bool(dropped)
            c["chunks_enqueued"] += enqueued
            c["chunks_dropped"] += dropped
            c["chunks_known"] += len(keys) - enqueued - dropped
            self._finished.append(result)
            if self._events and not dropped:
                self._stored.append(OffloadingEvent(keys, self.medium, False, self.locality))

    def _load(self, job_id: int, keys: list[OffloadKey], slots: list[int]) -> None:
        promoted = [key for key, slot in zip(keys, slots, strict=True) if self._fetch(key, slot)]
        landed = set(promoted)
        failed = [key for key in keys if key not in landed]
        result = JobResult(
            job_id,
            success=not failed,
            successful_keys=tuple(promoted) if failed else None,
            transfer_bytes=len(promoted) * self.block_size_bytes,
        )
        with self._lock:
            c = self._counters
            c["load_jobs"] += 1
            c["load_jobs_failed"] += bool(failed)
            c["chunks_promoted"] += len(promoted)
            c["chunks_not_promoted"] += len(failed)
            self._missed += failed
            self._finished.append(result)

    def _fetch(self, key: OffloadKey, slot: int) -> bool:
        """One verified fetch into ``slot``; whether its bytes landed there."""
        chunk = self._chunk(key)
        if not self.remote.begin_promotion(chunk):
            return False
        size = self.block_size_bytes
        fetched = self.remote.fetch(chunk, lambda p: len(p) == 1 and len(p[0]) == size)
        if fetched.outcome is not PromoteOutcome.PROMOTED:
            return False
        self._slot(slot)[:] = fetched.payloads[0]
        return True


class HybridKVRemoteTier(_ChunkTier):
    """hybridkv's shared tier on a Redis/Valkey server (``remote_url``), as a native tier.

    ``secondary_tiers: [{"type": "HybridKVRemoteTier", "module_path": "hybridkv.native",
    "remote_url": "redis://host:6379"}]``; the other keys: :func:`.settings.remote_settings`.
    """

    medium: ClassVar[Medium] = Medium.CPU

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        *,
        backpressure_detector: Any = None,
        locality: str | None = "REMOTE",
        client: ChunkClient | None = None,
        **keys: Any,
    ) -> None:
        settings = remote_settings(**keys)
        # A server seen down is skipped (SKIPPED at once) until the backoff's probe: a dead or
        # paused server costs the lookup thread and the fetches one deadline per backoff.
        breaker = CircuitBreaker(settings.breaker) if settings.breaker else None
        self.breaker = breaker
        chosen = client if client is not None else client_for(settings.remote)
        if breaker is not None:
            chosen = GuardedClient(chosen, breaker)
        super().__init__(
            offloading_spec,
            primary_kv_view,
            tier_type,
            settings=settings,
            client=chosen,
            backpressure_detector=backpressure_detector,
            locality=locality,
        )


class HybridKVDiskTier(_ChunkTier):
    """hybridkv's disk tier (``disk_dir``, ``disk_bytes``), as a native tier.

    Its files go in ``disk_dir/<identity digest hex>``: a restart of the same model finds them,
    another model never does. Other keys: :func:`.settings.disk_settings`.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        *,
        backpressure_detector: Any = None,
        locality: str | None = "LOCAL",
        **keys: Any,
    ) -> None:
        settings = disk_settings(**keys)
        block = primary_kv_view.strides[0] if primary_kv_view.strides else 0
        digest = scoped(settings.remote.namespace, identity_fields(offloading_spec, block)).hex()
        disk = replace(settings.disk_config(), directory=settings.disk_config().directory / digest)
        self._disk = DiskClient(disk)
        super().__init__(
            offloading_spec,
            primary_kv_view,
            tier_type,
            settings=replace(settings, disk=disk),
            client=self._disk,
            backpressure_detector=backpressure_detector,
            locality=locality,
        )

    def snapshot(self) -> dict[str, Any]:
        """As the Redis tier's, with the disk client's snapshot (bytes, index, counters)."""
        snap = super().snapshot()
        snap["disk"] = self._disk.snapshot()
        return snap
