"""``HybridKVConnector``: vLLM 0.33's ``KVConnectorBase_V1`` + ``SupportsHMA`` over the core.

vLLM builds the class twice with ``(vllm_config, role, kv_cache_config)``: in the scheduler
process (role SCHEDULER) it wraps a :class:`~hybridkv.connector.ConnectorCore` over a
:class:`~hybridkv.store.HostStore`; in each worker (role WORKER) a
:class:`~hybridkv.connector.worker.TransferWorker` over canonical caches and host memory. Both
read the same geometry off vLLM's ``KVCacheConfig`` (:mod:`hybridkv.vllm.layout`) and the same
extra config (:mod:`hybridkv.vllm.config`), so they agree on the chunk and the host slot count.

The store lives with the scheduler; the worker learns each job's host slots from the step's
metadata (:class:`HybridKVMetadata`), and reports job results back through vLLM's worker
metadata (:class:`HybridKVWorkerMeta`, ``KVConnectorOutput.kv_connector_worker_meta``).
Failures are reported per request (``failed_recving``), never as block ids: vLLM 0.33 raises on
block-level load errors for models with more than one KV cache group (``scheduler.py:3712``).
Under tensor parallelism (:mod:`hybridkv.vllm.ranks`) each worker moves its own rank's shard
through its own host memory (``host_memory_bytes`` is split evenly over the ranks' distinct
shards), and the scheduler side releases a job result only once every rank reported it, failed
if any rank failed it. Ranks holding identical KV (``kv_tp_replicas``, MLA) share one host copy
that only the first of them writes. Pipeline and context parallelism are refused at start-up.
Offload keys are read off vLLM's own ``request.block_hashes`` (multimodal inputs, LoRA and the
cache salt folded in).

Load deadline (``load_deadline_steps``): the scheduler side counts the steps each load job has
been pending (:class:`~hybridkv.connector.deadlines.LoadDeadlines`) and names the late ones in
the next metadata (``HybridKVMetadata.abandon``); the worker stops their copies
(:meth:`~hybridkv.connector.worker.TransferWorker.abandon`) and only then reports them failed.
vLLM frees a failed request's blocks when it reads that report (``_update_waiting_for_remote_kv``
frees them, the request having 0 computed tokens after ``_handle_failed_recving``) and
recomputes into whatever it allocates next, so no block it reuses is written by a late copy;
until the report the request stays in WAITING_FOR_REMOTE_KVS holding its blocks, and the core
keeps the host entries pinned.

Remote tier (``remote_url``, :mod:`hybridkv.vllm.remote`): the scheduler side asks the shared
server before each claim and reserves promotions through the core; the metadata carries the
step's write and fetch orders (``HybridKVMetadata.remote``); the worker copies and queues the
writes, runs the fetches into the host slots in ``start_load_kv`` and reports each outcome in
``HybridKVWorkerMeta.fetches``. Under tensor parallelism each rank writes and fetches its own
shard of every chunk, a chunk is found only if every shard is, and a promotion resolves once
every fetching rank reported it (:mod:`hybridkv.remote.shards`).

Disk tier (``disk_dir``, :mod:`hybridkv.vllm.disk`): the same machinery on a directory, files
that outlive the process; with ``remote_url`` too, the disk stacks over the server
(:class:`hybridkv.remote.StackedClient`).

The class is this module's; its two roles' hooks are in :mod:`hybridkv.vllm.scheduler_role`
and :mod:`hybridkv.vllm.worker_role` (base classes of it), what crosses between them each step
in :mod:`hybridkv.vllm.step_metadata`. This module keeps the construction both roles share,
the start-up refusals, and the metrics and events.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from operator import sub
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hybridkv.connector import ConnectorCore, JobResult
from hybridkv.connector.deadlines import LoadDeadlines
from hybridkv.connector.worker import TransferWorker
from hybridkv.errors import HybridKVConfigError
from hybridkv.hostmem import HostMemory
from hybridkv.store import HostStore, LookupResult
from hybridkv.vllm.admission import read_admission
from hybridkv.vllm.checkpoints import read_checkpoint_rules, read_eagle_groups
from hybridkv.vllm.config import HybridKVConfig, check_failure_policy, parse_extra_config
from hybridkv.vllm.deferred import DeferredStores
from hybridkv.vllm.disk import disk_remote_config, scheduler_disk_client
from hybridkv.vllm.events import BlockPayloads
from hybridkv.vllm.layout import VllmLayout, read_layout, recommended_chunk_size, whole_blocks
from hybridkv.vllm.metrics import (
    SCHEDULER_COUNTERS,
    GroupAgreement,
    HybridKVPromMetrics,
    HybridKVStats,
    TransferMeter,
    scheduler_counter_values,
    scheduler_counters,
    store_events_to_vllm,
)
from hybridkv.vllm.platform_check import refuse_unsupported_platform
from hybridkv.vllm.ranks import JobQuorum, host_sharding, refuse_unsupported_parallelism
from hybridkv.vllm.reclaim import ReclaimGuard
from hybridkv.vllm.remote import (
    FetchReport,
    SchedulerRemote,
    WorkerRemote,
    breaker_config,
    lookup_policy,
    model_identity,
    refuse_unshared_hashes,
    remote_config,
    remote_shards,
)
from hybridkv.vllm.scheduler_role import SchedulerRole
from hybridkv.vllm.step_metadata import HybridKVMetadata, HybridKVWorkerMeta, MetaSlots
from hybridkv.vllm.versions import check_vllm_version
from hybridkv.vllm.views import RequestViews
from hybridkv.vllm.worker_role import WorkerRole

__all__ = ["HybridKVConnector", "HybridKVMetadata", "HybridKVStats", "HybridKVWorkerMeta"]


def refuse_unsupported_setups(vllm_config: Any) -> None:
    """Every start-up refusal, before anything is built: another vLLM version (it may place
    loads elsewhere), a hybrid model without the hybrid manager, a platform without a hybridkv
    engine, pipeline or context parallelism."""
    import vllm

    check_vllm_version(vllm.__version__)
    require_hma(vllm_config)
    refuse_unsupported_platform()
    refuse_unsupported_parallelism(vllm_config.parallel_config)


def require_hma(vllm_config: Any) -> None:
    """Refuse a hybrid model with the hybrid KV cache manager off (one group per layer kind is
    what keeps mamba state and sliding windows apart; without it vLLM fails later)."""
    if not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        return
    model = vllm_config.model_config
    hybrid = model is not None and (
        getattr(model, "is_hybrid", False) or model.get_sliding_window() is not None
    )
    if hybrid:
        raise HybridKVConfigError(
            "disable_hybrid_kv_cache_manager",
            True,
            "HybridKVConnector needs vLLM's hybrid KV cache manager on a hybrid model",
            "drop --disable-hybrid-kv-cache-manager",
        )


def _load_deadlines(config: HybridKVConfig, vllm_config: Any) -> LoadDeadlines | None:
    """The load deadlines of ``load_deadline_steps`` (None: no deadline), counted over the
    batches vLLM keeps in flight (2 under async scheduling: hybridkv.connector.deadlines)."""
    deadline = config.load_deadline_steps
    if deadline is None:
        return None
    return LoadDeadlines(deadline, int(getattr(vllm_config, "max_concurrent_batches", 1) or 1))


def _shared_tier_key(config: HybridKVConfig) -> str | None:
    """The key of the tier whose chunks outlive this process (a server, a directory), whose
    hits need block hashes equal across processes; None without one."""
    if config.remote is not None:
        return "remote_url"
    return None if config.disk is None else "disk_dir"


class HybridKVConnector(SchedulerRole, WorkerRole, KVConnectorBase_V1, SupportsHMA):
    """hybridkv's offload connector for vLLM 0.33 (module docstring)."""

    # vLLM's hits-by-source metrics (vllm:prompt_tokens_cached_by_source) read this for every
    # external hit: each one is loaded from host memory (a remote-tier chunk is promoted into
    # host memory before it is claimed).
    _cache_hit_source = CacheHitSource.HOST

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a best-effort cache (as vLLM's OffloadingConnector, ``offloading_connector.py
        :73-77``). The inherited default (``kv_role`` is a producer) makes vLLM drop a preempted
        request's in-flight output under async scheduling (``scheduler.py:975``, ``1832``,
        ``2338``) to protect a hand-off the preemption's free would void; no store of this
        connector is voided so (its sources stay pinned in the pool until it reports)."""
        return False

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        refuse_unsupported_setups(vllm_config)
        super().__init__(vllm_config, role, kv_cache_config)
        # With pipeline and context parallel refused, the workers are the tensor-parallel
        # ranks: the count vLLM's KVOutputAggregator waits for (get_finished_count is None).
        self.world_size = int(vllm_config.parallel_config.world_size)
        # Ranks with identical KV (MLA) share one host copy, written by one of them.
        self.sharding = host_sharding(vllm_config.parallel_config, kv_cache_config)
        # A remote tier keeps one shard of each chunk per group of identical ranks.
        self.remote_shards = remote_shards(self.sharding, kv_cache_config)
        self.rank = int(vllm_config.parallel_config.rank)  # the worker's own (vLLM sets it)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.hybridkv_config: HybridKVConfig = parse_extra_config(extra)
        check_failure_policy(
            self.hybridkv_config, vllm_config.kv_transfer_config.kv_load_failure_policy
        )
        self.layout: VllmLayout = read_layout(vllm_config, kv_cache_config)
        self.chunk_size = self._chunk_size()
        self.num_chunks = self._num_chunks()
        self.core: ConnectorCore | None = None
        self.worker: TransferWorker | None = None
        self._requests: dict[str, Any] = {}
        # One view per request, rebuilt only when the request changed (hybridkv.vllm.views).
        self._views = RequestViews()
        self._slots = MetaSlots(self.num_chunks)
        self._host: HostMemory | None = None
        self._engine: Any = None
        self._reported: tuple[JobResult, ...] = ()
        self._quorum = JobQuorum(self.world_size)
        self._last_stats: dict[str, int | float] = {}
        self._last_mark: tuple[int, ...] | None = None  # get_kv_connector_stats's mark
        self._agreement = GroupAgreement()
        self._meter = TransferMeter(
            len(g.layer_names) * g.real_page_size_bytes for g in self.layout.groups
        )
        # Restarts after failed loads that vLLM refused (hybridkv.vllm.reclaim).
        self._reclaim = ReclaimGuard()
        # Async loads never fill the pool so that none can run (hybridkv.vllm.admission).
        self._admission = read_admission(vllm_config, kv_cache_config, self.layout)
        # has_pending_block_frees: vLLM's pool, and the requests whose free waits for a store.
        self._gpu_pool: Any = None
        self._delayed_frees: set[str] = set()
        # KV events' parent hashes and tokens, snapshotted at each store (hybridkv.vllm.events).
        events = vllm_config.kv_events_config
        self._payloads: BlockPayloads | None = None
        if events is not None and events.enable_kv_cache_events:
            sizes = tuple(g.block_size for g in self.layout.groups)
            self._payloads = BlockPayloads(sizes, self.layout.hash_block_size)
        self.deadlines: LoadDeadlines | None = None
        # Lookups answered 0 in front of the core for requests whose load missed its deadline.
        self._deadline_answers = 0
        self._deferred = DeferredStores()  # async scheduling: stores waiting for hashes
        # The remote tier's two sides (hybridkv.vllm.remote); None without remote_url.
        self.remote: SchedulerRemote | None = None
        self.worker_remote: WorkerRemote | None = None
        self._fetched: tuple[FetchReport, ...] = ()
        tier_key = _shared_tier_key(self.hybridkv_config)
        if tier_key is not None:
            hash_algo = vllm_config.cache_config.prefix_caching_hash_algo
            refuse_unshared_hashes(hash_algo, os.environ, tier_key)
        if role == KVConnectorRole.SCHEDULER:
            self.deadlines = _load_deadlines(self.hybridkv_config, vllm_config)
            self.core = ConnectorCore(
                self.layout.planner(self.chunk_size),
                HostStore(self.num_chunks, self.hybridkv_config.eviction_policy),
                tuple(g.kind for g in self.layout.groups),
                self.layout.hash_block_size,
                self.chunk_size,
                sliding_windows=self.layout.window_reaches,
                checkpoints=read_checkpoint_rules(
                    vllm_config, kv_cache_config, self.layout.hash_block_size
                ),
                eagle_groups=read_eagle_groups(vllm_config, kv_cache_config),
            )
            self.remote = self._scheduler_tier(vllm_config, self.core)

    def _scheduler_tier(self, vllm_config: Any, core: ConnectorCore) -> SchedulerRemote | None:
        """The scheduler side of the tiers under the host: the shared server's (``remote_url``),
        the disk's (``disk_dir``: hybridkv.vllm.disk, the same machinery on READER clients of
        each shard's directory, without a breaker), both stacked, or None."""
        remote, disk = self.hybridkv_config.remote, self.hybridkv_config.disk
        if remote is None and disk is None:
            return None
        identity = model_identity(vllm_config, self.layout)
        if remote is not None:
            # With disk_dir too, the disk's readers stack over the server (host -> disk ->
            # server): asked first, never behind the server's breaker.
            shards = self.remote_shards
            near = None if disk is None else scheduler_disk_client(disk, identity, shards)
            return SchedulerRemote(
                core,
                remote_config(remote),
                identity=identity,
                shards=self.remote_shards,
                lookups=lookup_policy(remote),
                breaker=breaker_config(remote),
                near=near,
            )
        if disk is not None:
            return SchedulerRemote(
                core,
                disk_remote_config(),
                scheduler_disk_client(disk, identity, self.remote_shards),
                identity=identity,
                shards=self.remote_shards,
                breaker=None,
            )
        return None

    def _chunk_size(self) -> int:
        chunk = self.hybridkv_config.chunk_size
        if chunk is None:
            return recommended_chunk_size(self.layout)
        if not whole_blocks(self.layout, chunk):
            raise HybridKVConfigError(
                "kv_connector_extra_config.chunk_size",
                chunk,
                "is refused by the planner or splits a group's block "
                f"(blocks {[g.block_size for g in self.layout.groups]})",
                f"use null (recommended: {recommended_chunk_size(self.layout)})",
            )
        return chunk

    def _num_chunks(self) -> int:
        # One slot per shard per chunk: the KV cache config is one rank's (every rank's page
        # is the same size), and each distinct shard has its own copy of every chunk (ranks
        # with replicated KV share theirs: hybridkv.vllm.ranks.HostSharding).
        slot = self.layout.slot_bytes
        ranks = self.sharding.copies
        chunks = self.hybridkv_config.host_memory_bytes // (slot * ranks)
        if chunks < 1:
            on_ranks = f" for each of {ranks} shards" if ranks > 1 else ""
            raise HybridKVConfigError(
                "kv_connector_extra_config.host_memory_bytes",
                self.hybridkv_config.host_memory_bytes,
                f"holds no whole slot of {slot} bytes (the largest group's block){on_ranks}",
                f"give at least {slot * ranks}",
            )
        return chunks

    # ============================================================ metrics and events

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This side's counter increments since the last call (hybridkv.vllm.metrics): the
        scheduler's from the core, a worker's from its transfer meter; None when nothing moved."""
        mark = self._stats_mark()
        if mark is None:  # no mark: the counters are built and compared each call
            now, last = self._counters(), self._last_stats
            if now == last:
                return None  # every increment is 0: no delta to build
            delta = {k: v - last.get(k, 0) for k, v in now.items()}
            self._last_stats = now
            return HybridKVStats(delta) if any(delta.values()) else None
        before = self._last_mark
        if mark == before:
            return None  # nothing the counters are read from changed (most steps)
        self._last_mark = mark
        # The counters are linear in the mark (scheduler_counter_values), so the increments
        # are the counters of the mark's difference: C-level passes, no dict per side.
        moved = scheduler_counter_values(
            tuple(map(sub, mark, before)) if before is not None else mark
        )
        if not any(moved):
            return None  # only counts no counter reads moved (hashes, items)
        return HybridKVStats(dict(zip(SCHEDULER_COUNTERS, moved, strict=True)))

    def _stats_mark(self) -> tuple[int, ...] | None:
        """Everything the scheduler side's counters are computed from, laid out as
        :func:`~hybridkv.vllm.metrics.scheduler_mark` lays it out (built here in one frame: it
        is read every step), or None (worker side, remote tier: no mark, the counters are
        read each call). Equal marks give equal counters, so an unchanged mark means a zero
        delta without building the counters."""
        core = self.core
        if core is None or self.remote is not None:
            return None
        guard = self._reclaim
        deadlines = self.deadlines
        return (
            *core.counts(),
            guard.overridden,
            guard.deferred,
            guard.whole,
            self._agreement.count,
            0 if deadlines is None else deadlines.fired,
            self._deadline_answers,
            self._admission.deferred,
            self._admission.deferred_tokens,
        )

    def _counters(self) -> dict[str, int | float]:
        if self.core is not None:
            fired = 0 if self.deadlines is None else self.deadlines.fired
            found: dict[str, int | float] = dict(
                scheduler_counters(
                    self.core,
                    self._agreement.count,
                    self._reclaim,
                    deadlines_fired=fired,
                    deadline_answers=self._deadline_answers,
                    admission=(self._admission.deferred, self._admission.deferred_tokens),
                )
            )
            if self.remote is not None:
                found.update(self.remote.count)
            return found
        if self.worker is not None:
            found = {**self._meter.counts, "jobs_abandoned": self.worker.stats().jobs_abandoned}
            if self.worker_remote is not None:
                found.update(self.worker_remote.counters())
            return found
        return {}

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return HybridKVStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return HybridKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def take_events(self) -> Iterable[Any]:
        """The host store's events since the last call as vLLM KV cache events (medium CPU),
        when vLLM's KV events are on. Drained every call either way: nothing else takes them,
        and an undrained store would grow its event list for the server's life."""
        core = self.core
        if core is None:
            raise RuntimeError("scheduler-side call on the worker-side HybridKVConnector")
        events = core.store.take_events()
        # Events on <=> payloads kept (__init__ reads kv_events_config once for both).
        if not events or self._payloads is None:
            return ()
        store = core.store
        return list(
            store_events_to_vllm(
                events,
                core.geometry.units,
                self._payloads,
                lambda key: store.status(key) is not LookupResult.MISS,
            )
        )

    def shutdown(self) -> None:
        if self.remote is not None:
            self.remote.close()
        if self.worker_remote is not None:
            self.worker_remote.close()  # writes what is queued, each SET bounded
        if self._engine is not None:
            self._engine.close()
        if self._host is not None:
            self._host.close()
