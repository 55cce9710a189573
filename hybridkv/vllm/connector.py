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
``HybridKVWorkerMeta.fetches``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hybridkv.canonical import build_canonical_caches
from hybridkv.connector import (
    BlockTable,
    ConnectorCore,
    ConnectorMeta,
    JobId,
    JobResult,
    KVConnectorOutput,
    ScheduledRequest,
    StepView,
    TransferKind,
)
from hybridkv.connector.deadlines import LoadDeadlines
from hybridkv.connector.worker import JobFaultHook, TransferWorker
from hybridkv.errors import HybridKVConfigError
from hybridkv.hostmem import HostMemory, PinMode
from hybridkv.store import HostStore, LookupResult
from hybridkv.transfer import TransferEngine
from hybridkv.transfer.cpu_engine import FaultHook
from hybridkv.vllm.checkpoints import read_checkpoint_rules
from hybridkv.vllm.config import HybridKVConfig, check_failure_policy, parse_extra_config
from hybridkv.vllm.events import BlockPayloads
from hybridkv.vllm.layout import VllmLayout, read_layout, recommended_chunk_size, whole_blocks
from hybridkv.vllm.metrics import (
    GroupAgreement,
    HybridKVPromMetrics,
    HybridKVStats,
    TransferMeter,
    scheduler_counters,
    store_events_to_vllm,
)
from hybridkv.vllm.platform_check import refuse_unsupported_platform
from hybridkv.vllm.ranks import (
    JobQuorum,
    RankReport,
    ReplicaEngine,
    host_sharding,
    merge_reports,
    refuse_unsupported_parallelism,
)
from hybridkv.vllm.reclaim import Answer, ReclaimGuard
from hybridkv.vllm.remote import (
    FetchReport,
    RemoteOrders,
    SchedulerRemote,
    WorkerRemote,
    model_identity,
    refuse_tensor_parallel,
    remote_config,
)
from hybridkv.vllm.reset import guard_pool_reset, reset_connector_cache
from hybridkv.vllm.versions import check_vllm_version
from hybridkv.vllm.views import RequestViews, block_table

__all__ = ["HybridKVConnector", "HybridKVMetadata", "HybridKVStats", "HybridKVWorkerMeta"]

logger = logging.getLogger("vllm.hybridkv")  # under vLLM's logger: its handlers print it


@dataclass
class HybridKVMetadata(KVConnectorMetadata):
    """One step's jobs, the host slot of every key they name (the worker has no store), and
    the load jobs past their deadline, to abandon."""

    meta: ConnectorMeta
    slots: dict[bytes, int]
    abandon: tuple[int, ...] = ()
    remote: RemoteOrders | None = None


@dataclass
class HybridKVWorkerMeta(KVConnectorWorkerMetadata):
    """The job results workers folded this step, for the scheduler side's quorum: per job,
    how many workers reported it and whether all of them succeeded (:mod:`hybridkv.vllm.ranks`).
    """

    reports: tuple[RankReport, ...] = ()
    fetches: tuple[FetchReport, ...] = ()  # remote tier (one worker: TP is refused with it)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Workers added, success ANDed per job (vLLM folds the workers of one step so)."""
        assert isinstance(other, HybridKVWorkerMeta)
        return HybridKVWorkerMeta(
            merge_reports(self.reports, other.reports), (*self.fetches, *other.fetches)
        )


class _MetaSlots:
    """The worker's view of the store (:class:`hybridkv.connector.worker.HostSlots`): the keys
    of the metadata being bound, READY for loads and STORING for stores."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._slots: dict[bytes, int] = {}
        self._status: dict[bytes, LookupResult] = {}

    @property
    def capacity(self) -> int:
        return self._capacity

    def show(self, metadata: HybridKVMetadata) -> None:
        self._slots = metadata.slots
        self._status = {}
        for job in (*metadata.meta.load_jobs, *metadata.meta.store_jobs):
            status = LookupResult.HIT if job.kind is TransferKind.LOAD else LookupResult.HIT_PENDING
            for item in job.items:
                self._status[item.key] = status

    def status(self, key: bytes) -> LookupResult:
        return self._status.get(key, LookupResult.MISS)

    def slots(self, keys: Iterable[bytes]) -> tuple[int, ...]:
        return tuple(self._slots[key] for key in keys)


class _PoolPins:
    """vLLM's ``BlockPool`` as the core's :class:`~hybridkv.connector.GpuBlockPool` (block ids
    to ``KVCacheBlock`` objects; one pool serves every group)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def touch(self, blocks: Iterable[int]) -> None:
        self.pool.touch([self.pool.blocks[b] for b in blocks])

    def free_blocks(self, ordered_blocks: Iterable[int]) -> None:
        self.pool.free_blocks([self.pool.blocks[b] for b in ordered_blocks])


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


def _tables(block_ids: Any) -> BlockTable:
    return block_table(block_ids)


class HybridKVConnector(KVConnectorBase_V1, SupportsHMA):
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
        self._slots = _MetaSlots(self.num_chunks)
        self._host: HostMemory | None = None
        self._engine: Any = None
        self._reported: tuple[JobResult, ...] = ()
        self._quorum = JobQuorum(self.world_size)
        self._last_stats: dict[str, int | float] = {}
        self._last_mark: tuple[Any, ...] | None = None  # get_kv_connector_stats's fast path
        self._agreement = GroupAgreement()
        self._meter = TransferMeter(
            len(g.layer_names) * g.real_page_size_bytes for g in self.layout.groups
        )
        # Restarts after failed loads that vLLM refused (hybridkv.vllm.reclaim).
        self._reclaim = ReclaimGuard()
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
        # The remote tier's two sides (hybridkv.vllm.remote); None without remote_url.
        self.remote: SchedulerRemote | None = None
        self.worker_remote: WorkerRemote | None = None
        self._fetched: tuple[FetchReport, ...] = ()
        if self.hybridkv_config.remote is not None:
            refuse_tensor_parallel(self.world_size)
        if role == KVConnectorRole.SCHEDULER:
            deadline = self.hybridkv_config.load_deadline_steps
            self.deadlines = None if deadline is None else LoadDeadlines(deadline)
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
            )
            if self.hybridkv_config.remote is not None:
                config = remote_config(self.hybridkv_config.remote)
                identity = model_identity(vllm_config, self.layout)
                self.remote = SchedulerRemote(self.core, config, identity=identity)

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

    def _core(self) -> ConnectorCore:
        if self.core is None:
            raise RuntimeError("scheduler-side call on the worker-side HybridKVConnector")
        return self.core

    def _worker(self) -> TransferWorker:
        if self.worker is None:
            raise RuntimeError("worker-side call before register_kv_caches")
        return self.worker

    # ============================================================ scheduler side

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """Store sources are pinned in vLLM's pool from a store's emission to its report; a
        prefix-cache reset gives them back first (hybridkv.vllm.reset)."""
        self._core().bind_gpu_block_pool(_PoolPins(gpu_block_pool))
        self._gpu_pool = gpu_block_pool
        manager = getattr(self, "_kv_cache_manager", None)  # set first by bind_kv_cache_manager
        guard_pool_reset(gpu_block_pool, self._core(), manager)

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: nothing stored before it is
        served after it, host or remote (hybridkv.vllm.reset)."""
        return reset_connector_cache(self._core(), self.remote)

    def has_pending_block_frees(self) -> bool:
        """Whether a store in flight returns blocks to vLLM's free pool when it reports: a
        finished request's free delayed until ``finished_sending``, or a store source nothing
        but the store's pin holds (a preempted or finished request's block). vLLM then waits
        a step instead of preempting a running request (``scheduler.py:924-928``); a store
        reading blocks a running request still holds frees nothing, so it does not count."""
        if self._delayed_frees:
            return True
        pool = self._gpu_pool
        if pool is None:
            return False
        pins: dict[int, int] = {}
        for block in self._core().held_blocks():
            pins[block] = pins.get(block, 0) + 1
        return any(pool.blocks[b].ref_cnt <= n for b, n in pins.items())

    def on_new_request(self, request: Any) -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        self._requests[rid] = request
        # A request restarted by a failed load that vLLM refused while nothing ran is deferred
        # or answered nothing, or vLLM 0.33 wedges (hybridkv.vllm.reclaim).
        answer = self._reclaim.answer(rid)
        if answer is Answer.DEFER:
            return None, False
        if answer is Answer.NONE:
            return 0, False
        if self.deadlines is not None and self.deadlines.recomputing(rid):
            self._deadline_answers += 1
            return 0, False  # its load missed the deadline: recomputed (LoadDeadlines)
        view = self._views.view(request)
        if self.remote is not None:
            self.remote.before_claim(view, num_computed_tokens)
        claim = self._core().get_num_new_matched_tokens(view, num_computed_tokens)
        vllm_answer = claim.as_vllm()
        if vllm_answer[0] is not None:
            self._agreement.observe(self._core(), view, num_computed_tokens, vllm_answer[0])
        return vllm_answer

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        # vLLM may call this again for one request; the core loads only for a positive count.
        self._reclaim.admitted(request.request_id)
        if num_external_tokens == 0:
            return  # the core loads only for a positive count and records nothing otherwise
        self._core().update_state_after_alloc(
            self._views.view(request), _tables(blocks.get_block_ids()), num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        core = self._core()
        self._reclaim.schedule_ended(ran=bool(scheduler_output.num_scheduled_tokens))
        scheduled = []
        no_unit = []
        completes = core.geometry.completes_a_unit
        prompt_only = not self.hybridkv_config.offload_decode_state
        drafts = scheduler_output.scheduled_spec_decode_tokens
        for rid, num in scheduler_output.num_scheduled_tokens.items():
            request = self._requests[rid]
            computed = int(request.num_computed_tokens)
            stored = int(num)
            if prompt_only:  # the prompt's units only
                stored = min(stored, max(0, request.num_prompt_tokens - computed))
            if drafts and drafts.get(rid):
                # A step with draft tokens (MTP/EAGLE) stores nothing of its request: a unit
                # ending on a draft has no block hash yet and may be rejected, and a mamba
                # state of such a step is not the running state at a unit end. Its prompt's
                # units were stored by the prefill, which never carries drafts.
                stored = 0
            if not completes(computed, computed + stored):
                # Stores nothing this step (most decode steps): no view, no vLLM block table
                # (StepView.no_unit_ids); its view catches up when a unit completes.
                no_unit.append(rid)
                continue
            blocks = _tables(self._kv_cache_manager.get_block_ids(rid))
            scheduled.append(ScheduledRequest(self._views.view(request), blocks, computed, stored))
        step = StepView(
            step=0,
            scheduled=tuple(scheduled),
            # RequestId is a NewType of str: the ids are taken as they are.
            finished_ids=frozenset(scheduler_output.finished_req_ids),
            preempted_ids=frozenset(scheduler_output.preempted_req_ids or ()),
            no_unit_ids=frozenset(no_unit),
        )
        meta = core.build_connector_meta(step)
        if self._payloads is not None and meta.store_jobs:
            self._payloads.record(meta.store_jobs, self._requests)
        slots = {}
        if meta.load_jobs or meta.store_jobs:  # most decode steps have no job: nothing to name
            keys = [item.key for job in (*meta.load_jobs, *meta.store_jobs) for item in job.items]
            slots = dict(zip(keys, core.store.slots(keys), strict=True)) if keys else {}
        late = () if self.deadlines is None else self.deadlines.step(meta.load_jobs)
        orders = None
        if self.remote is not None:
            views = {str(s.request.request_id): s.request for s in scheduled}
            self.remote.stores_emitted(meta.store_jobs, views)
            orders = self.remote.orders()
        return HybridKVMetadata(meta, slots, tuple(int(j) for j in late) if late else (), orders)

    def update_connector_output(self, connector_output: Any) -> None:
        self._delayed_frees.difference_update(connector_output.finished_sending or ())
        worker_meta = connector_output.kv_connector_worker_meta
        reports = worker_meta.reports if isinstance(worker_meta, HybridKVWorkerMeta) else ()
        if not reports and not connector_output.failed_recving:
            # No job result and no failed load: nothing below would change the core. The remote
            # tier still folds its fetch reports and ticks its promotion deadline every step,
            # or a promotion reported alone would keep its keys STORING and its claim DEFERred
            # for ever (a wedge, found by tools/bench_remote.py's two engines).
            if self.remote is not None:
                fetched = worker_meta.fetches if isinstance(worker_meta, HybridKVWorkerMeta) else ()
                self.remote.fold(fetched)
            return
        # A job reaches the core once every rank reported it (ranks finish in different steps).
        jobs = self._quorum.fold(reports)
        failed = connector_output.failed_recving or ()
        self._reclaim.load_failed(rid for rid in failed if rid in self._requests)
        if self.deadlines is not None:
            self.deadlines.reported(result.job_id for result in jobs)
        kinds = {}
        if self.remote is not None:
            # Which reported jobs are stores, read before the core forgets them.
            kinds = {r.job_id: self._core().job_kind(r.job_id) for r in jobs}
        self._core().update_connector_output(
            KVConnectorOutput(
                finished_recving=frozenset(connector_output.finished_recving or ()),
                failed_recving=frozenset(connector_output.failed_recving or ()),
                finished_sending=frozenset(connector_output.finished_sending or ()),
                completed_jobs=tuple(jobs),
            )
        )
        if self.remote is not None:
            for result in jobs:
                if kinds.get(result.job_id) is TransferKind.STORE:
                    self.remote.store_reported(int(result.job_id), result.success)
            fetched = worker_meta.fetches if isinstance(worker_meta, HybridKVWorkerMeta) else ()
            self.remote.fold(fetched)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        self._requests.pop(request.request_id, None)
        self._agreement.forget(request.request_id)
        self._reclaim.finished(request.request_id)
        if self.deadlines is not None:
            self.deadlines.finished(request.request_id)
        if self.remote is not None:
            self.remote.finished(request.request_id)
        view = self._views.pop(request)  # its last view: the core reads only the id here
        delayed = self._core().request_finished_all_groups(view, _tables(block_ids))
        if delayed:
            self._delayed_frees.add(request.request_id)
        return delayed, None

    # ============================================================ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._register(kv_caches)

    def _register(
        self,
        kv_caches: dict[str, Any],
        job_fault_hook: JobFaultHook | None = None,
        copy_fault_hook: FaultHook | None = None,
        wrap_engine: Callable[[TransferEngine], TransferEngine] | None = None,
    ) -> None:
        """``register_kv_caches`` with fault hooks and an engine wrapper (in-package only: the
        in-process engine's adapter, :mod:`hybridkv.vllm.cpu_worker`, injects faults and delays
        reports this way; never a user setting)."""
        caches = build_canonical_caches(kv_caches, self.layout.groups, self.layout.num_blocks)
        measured = max(caches.group_bytes(g) for g in range(len(self.layout.groups)))
        if measured != self.layout.slot_bytes:
            raise HybridKVConfigError(
                "kv_caches",
                measured,
                f"bytes per block differ from the {self.layout.slot_bytes} the KV cache config "
                "implies (the scheduler sized the host store on those)",
                "register the caches vLLM allocated for this KVCacheConfig",
            )
        on_cuda = caches.device.type == "cuda"
        shared = self.sharding.shared_path(
            str(self._vllm_config.kv_transfer_config.engine_id), self.rank
        )
        host = HostMemory(
            self.num_chunks * measured,
            measured,
            PinMode.AUTO if on_cuda else PinMode.OFF,
            shared_path=shared,
        )
        if on_cuda:
            from hybridkv.transfer.cuda_engine import CudaTransferEngine

            if copy_fault_hook is not None:
                raise ValueError("copy_fault_hook: the CUDA engine takes no copy fault hook")
            scratch = self.hybridkv_config.gpu_scratch_bytes
            engine: Any = CudaTransferEngine(caches, host, scratch_bytes=scratch)
            # Allocated after vLLM sized its KV cache: say how much, once per worker.
            logger.info(
                "hybridkv: %d bytes of GPU scratch for kernel copies on %s, outside vLLM's KV "
                "cache (kv_connector_extra_config.gpu_scratch_bytes=%d)",
                engine.scratch_bytes,
                caches.device,
                scratch,
            )
        else:
            from hybridkv.transfer import CpuTransferEngine

            engine = CpuTransferEngine(caches, host, fault_hook=copy_fault_hook)
        if wrap_engine is not None:
            engine = wrap_engine(engine)
        if not self.sharding.writes(self.rank):
            # Outermost: a replica's store reaches no copy (nor a copy fault a harness wraps
            # around the engine); its group's writer stores the shared slots.
            engine = ReplicaEngine(engine)
        self._host, self._engine = host, engine
        if self.hybridkv_config.remote is not None:
            self.worker_remote = WorkerRemote(remote_config(self.hybridkv_config.remote), host)
        self.worker = TransferWorker(engine, self._slots, caches, host, fault_hook=job_fault_hook)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        # Nothing to flush: every block an in-flight store reads is pinned in vLLM's block pool
        # by the scheduler-side core until the store reports (and a request's free is delayed
        # while its stores run), and loads only write blocks of requests waiting for them,
        # which vLLM never preempts; so no block about to be reused is still being read.
        return

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # Loads of attention KV and mamba state both start here, at step granularity: mamba
        # and GDN layers never call the per-layer hooks.
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, HybridKVMetadata)
        worker = self._worker()
        # Late loads first: their copies stop (cancelled, or waited for) before this step's
        # jobs are submitted; each reports failed in this step's results.
        worker.abandon(JobId(j) for j in metadata.abandon)
        if self.worker_remote is not None and metadata.remote is not None:
            # Writes copy READY slots before anything this step writes a slot; fetches write
            # only their own reserved slots, and land before they are reported.
            self._fetched = (*self._fetched, *self.worker_remote.run(metadata.remote))
        self._slots.show(metadata)
        worker.bind_connector_metadata(metadata.meta)
        stores = metadata.meta.store_jobs if self.sharding.writes(self.rank) else ()
        self._meter.bound((*metadata.meta.load_jobs, *stores))  # bytes this rank moves

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Step granularity (start_load_kv): an async load's request is not in this forward.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        # Step granularity (wait_for_save): mamba/GDN layers never reach this hook.
        return

    def wait_for_save(self) -> None:
        self._worker().wait_for_save()
        self._meter.saving()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        output = self._worker().get_transfer_results()
        self._reported = (*self._reported, *output.completed_jobs)
        self._meter.reported(output.completed_jobs)
        return KVConnectorTransferResults(
            finished_sending=set(output.finished_sending),
            finished_recving=set(output.finished_recving),
            failed_recving=set(output.failed_recving),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Failed loads are reported per request in failed_recving: vLLM 0.33 raises on block
        # ids for models with more than one KV cache group. The worker's per-request block
        # record is drained so it does not grow.
        self._worker().get_block_ids_with_load_errors()
        return set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        reported, self._reported = self._reported, ()
        fetched, self._fetched = self._fetched, ()
        if not reported and not fetched:
            return None
        return HybridKVWorkerMeta(
            tuple(RankReport(r.job_id, 1, r.success) for r in reported), fetched
        )

    # ============================================================ metrics and events

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This side's counter increments since the last call (hybridkv.vllm.metrics): the
        scheduler's from the core, a worker's from its transfer meter; None when nothing moved."""
        mark = self._stats_mark()
        if mark is not None and mark == self._last_mark:
            return None  # nothing the counters are read from changed (most steps)
        self._last_mark = mark
        now, last = self._counters(), self._last_stats
        if now == last:
            return None  # every increment is 0: no delta to build
        delta = {k: v - last.get(k, 0) for k, v in now.items()}
        self._last_stats = now
        return HybridKVStats(delta) if any(delta.values()) else None

    def _stats_mark(self) -> tuple[Any, ...] | None:
        """Everything the scheduler side's counters are computed from, or None (worker side,
        remote tier: no mark, the counters are read each call). Equal marks give equal
        counters (:meth:`_counters` is a function of them), so an unchanged mark means a zero
        delta without building the counters (the core's ``counts()``: one C call)."""
        if self.core is None or self.remote is not None:
            return None
        guard = self._reclaim
        return (
            self.core.counts(),
            guard.overridden,
            guard.deferred,
            guard.whole,
            self._agreement.count,
            None if self.deadlines is None else self.deadlines.fired,
            self._deadline_answers,
        )

    def _counters(self) -> dict[str, int | float]:
        if self.core is not None:
            fired = 0 if self.deadlines is None else self.deadlines.fired
            found = dict(
                scheduler_counters(
                    self.core,
                    self._agreement.count,
                    self._reclaim,
                    deadlines_fired=fired,
                    deadline_answers=self._deadline_answers,
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
        events = self._core().store.take_events()
        config = self._vllm_config.kv_events_config
        if not events or config is None or not config.enable_kv_cache_events:
            return ()
        store = self._core().store
        return list(
            store_events_to_vllm(
                events,
                self._core().geometry.units,
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
