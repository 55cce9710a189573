"""``HybridKVConnector``'s scheduler role: vLLM's scheduler-side hooks over the connector core.

In the scheduler process vLLM builds the connector with role SCHEDULER; these hooks turn each
call into the core's view of it (:mod:`hybridkv.vllm.views`) and back into vLLM's answer, with
the restart guard (:mod:`hybridkv.vllm.reclaim`), the load deadlines and the remote tier around
the core. :class:`SchedulerRole` is a base class of
:class:`~hybridkv.vllm.connector.HybridKVConnector`, kept apart so one file holds one role; the
state it reads is the connector's, set in its constructor (declared on the class).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from hybridkv.connector import (
    BlockTable,
    ClaimKind,
    ConnectorCore,
    KVConnectorOutput,
    RequestId,
    ScheduledRequest,
    StepView,
    TransferKind,
)
from hybridkv.connector.deadlines import LoadDeadlines
from hybridkv.vllm.admission import LoadAdmission
from hybridkv.vllm.config import HybridKVConfig
from hybridkv.vllm.deferred import DeferredStores, WaitingStep, keyable
from hybridkv.vllm.events import BlockPayloads
from hybridkv.vllm.metrics import GroupAgreement
from hybridkv.vllm.ranks import JobQuorum
from hybridkv.vllm.reclaim import Answer, ReclaimGuard
from hybridkv.vllm.remote import SchedulerRemote
from hybridkv.vllm.reset import guard_pool_reset, reset_connector_cache
from hybridkv.vllm.step_metadata import HybridKVMetadata, HybridKVWorkerMeta
from hybridkv.vllm.views import RequestViews, block_table

__all__ = ["SchedulerRole"]

_CORE = Answer.CORE
_DEFER, _ASYNC = ClaimKind.DEFER, ClaimKind.ASYNC


class _PoolPins:
    """vLLM's ``BlockPool`` as the core's :class:`~hybridkv.connector.GpuBlockPool` (block ids
    to ``KVCacheBlock`` objects; one pool serves every group)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def touch(self, blocks: Iterable[int]) -> None:
        self.pool.touch([self.pool.blocks[b] for b in blocks])

    def free_blocks(self, ordered_blocks: Iterable[int]) -> None:
        self.pool.free_blocks([self.pool.blocks[b] for b in ordered_blocks])


def _tables(block_ids: Any) -> BlockTable:
    return block_table(block_ids)


_NO_IDS: frozenset[RequestId] = frozenset()
_WORKER_SIDE = "scheduler-side call on the worker-side HybridKVConnector"
# What request_finished_all_groups hands the core for the blocks it does not read.
_UNREAD_TABLE: BlockTable = ()


class SchedulerRole:
    """The scheduler-side hooks of :class:`~hybridkv.vllm.connector.HybridKVConnector` (module
    docstring); every attribute below is the connector's."""

    core: ConnectorCore | None
    hybridkv_config: HybridKVConfig
    deadlines: LoadDeadlines | None
    remote: SchedulerRemote | None
    _requests: dict[str, Any]
    _views: RequestViews
    _reclaim: ReclaimGuard
    _admission: LoadAdmission
    _quorum: JobQuorum
    _agreement: GroupAgreement
    _gpu_pool: Any
    _delayed_frees: set[str]
    _payloads: BlockPayloads | None
    _deadline_answers: int
    _deferred: DeferredStores
    _kv_cache_manager: Any  # vLLM's, set by bind_kv_cache_manager

    def _core(self) -> ConnectorCore:
        if self.core is None:
            raise RuntimeError(_WORKER_SIDE)
        return self.core

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
        self._deferred.clear()  # KV computed before a reset is not stored after it
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

    def has_pending_push_work(self) -> bool:
        """Whether vLLM's engine loop must keep stepping for this connector: a job is in
        flight. vLLM asks before each ``schedule()`` (``Scheduler.has_requests``,
        ``scheduler.py:3167-3182``) and with no request left the loop idles, so without this a
        store still reading a finished or aborted request's blocks would report, and unpin
        its sources, only when the next request arrives."""
        core = self.core
        return core is not None and core.has_jobs_in_flight()

    def on_new_request(self, request: Any) -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        self._requests[rid] = request
        core = self.core
        if core is None:
            core = self._core()  # refused: the worker-side connector
        # A request restarted by a failed load that vLLM refused while nothing ran is deferred
        # or answered nothing, or vLLM 0.33 wedges (hybridkv.vllm.reclaim).
        answer = self._reclaim.answer(rid)
        if answer is not _CORE:
            return (None, False) if answer is Answer.DEFER else (0, False)
        if self.deadlines is not None and self.deadlines.recomputing(rid):
            self._deadline_answers += 1
            return 0, False  # its load missed the deadline: recomputed (LoadDeadlines)
        view = self._views.view(request)
        if self.remote is not None and self.remote.before_claim(view, num_computed_tokens):
            return None, False  # its remote lookup is not answered yet: a bounded wait
        claim = core.get_num_new_matched_tokens(view, num_computed_tokens)
        # Claim.as_vllm, inline (this hook runs for every waiting request at every step).
        kind = claim.kind
        if kind is _DEFER:
            return None, False
        if kind is _ASYNC and self._admission.defers(
            request, num_computed_tokens, claim.num_tokens
        ):
            return None, False  # a shared load or no room to run (hybridkv.vllm.admission)
        self._agreement.observe(core, view, num_computed_tokens, claim.num_tokens)
        return claim.num_tokens, kind is _ASYNC

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        # vLLM may call this again for one request; the core loads only for a positive count.
        self._reclaim.admitted(request.request_id)
        if num_external_tokens == 0:
            return  # the core loads only for a positive count and records nothing otherwise
        self._core().update_state_after_alloc(
            self._views.view(request), _tables(blocks.get_block_ids()), num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        core = self.core
        if core is None:
            raise RuntimeError(_WORKER_SIDE)
        num_scheduled = scheduler_output.num_scheduled_tokens
        self._reclaim.schedule_ended(ran=bool(num_scheduled) or self._step_in_flight())
        scheduled = []
        no_unit = []
        completes = core.geometry.completes_a_unit
        prompt_only = not self.hybridkv_config.offload_decode_state
        drafts = scheduler_output.scheduled_spec_decode_tokens
        requests = self._requests
        hash_block = core.geometry.planner.hash_block_size
        deferred = self._deferred
        if deferred:  # steps that waited for their hashes (async) or their drafts' verdict
            preempted = scheduler_output.preempted_req_ids or ()
            for request, held in deferred.due(requests, preempted, hash_block):
                scheduled.append(self._row(request, held.start, held.num_tokens, held.store_limit))
        for rid, num in num_scheduled.items():
            request = requests[rid]
            computed = int(request.num_computed_tokens)
            stored, limit = int(num), None
            if prompt_only:  # the prompt's units only
                stored = min(stored, max(0, request.num_prompt_tokens - computed))
            if not completes(computed, computed + stored):
                # Stores nothing this step (most decode steps): no view, no vLLM block table
                # (StepView.no_unit_ids); its view catches up when a unit completes.
                no_unit.append(rid)
                continue
            if stored < num:
                # offload_decode_state false, a step past the prompt: the row keeps the step's
                # whole range, which places its mamba states (MB-8), and limits what is stored.
                # A preempted request recomputing prompt and output in one chunk leaves its
                # checkpoint where [computed, computed + num) puts it; keyed off a clipped end,
                # that slot was stored as the prompt's end (issue 28).
                stored, limit = int(num), request.num_prompt_tokens
            if drafts and drafts.get(rid):
                # A step with draft tokens (MTP/EAGLE): a unit ending on a draft has no block
                # hash yet and the draft may be rejected. Held until its output is applied,
                # then stored up to the tokens vLLM accepted (hybridkv.vllm.deferred).
                deferred.hold(rid, WaitingStep(computed, stored, limit, speculative=True))
                no_unit.append(rid)
                continue
            if not keyable(computed + stored, hash_block, len(request.block_hashes)):
                # Async scheduling: a unit ends on a token the request does not hold yet (the
                # previous step's sampled token): stored at the next metadata
                # (hybridkv.vllm.deferred).
                deferred.hold(rid, WaitingStep(computed, stored, limit))
                no_unit.append(rid)
                continue
            scheduled.append(self._row(request, computed, stored, limit))
        # The core reads neither the finished ids (request_finished_all_groups tells it) nor
        # the preempted ones (a preempted request's next step is a restart it sees then), so
        # vLLM's sets are not copied into the step's view.
        if scheduled:
            step = StepView(
                0, tuple(scheduled), no_unit_ids=frozenset(no_unit) if no_unit else _NO_IDS
            )
            meta = core.build_connector_meta(step)
        else:  # no request completes a unit (most decode steps): no view of the step
            meta = core.build_unit_free_meta(no_unit)
        metadata = self._metadata(core, meta, scheduled)
        metadata.no_forward = scheduler_output.total_num_scheduled_tokens == 0
        return metadata

    def _metadata(
        self, core: ConnectorCore, meta: Any, scheduled: list[ScheduledRequest]
    ) -> HybridKVMetadata:
        """The step's metadata for the workers: the core's jobs, their host slots, the loads
        past their deadline and the remote tier's orders."""
        load_jobs, store_jobs = meta.load_jobs, meta.store_jobs
        slots = {}
        if load_jobs or store_jobs:  # most decode steps have no job: nothing to name
            if self._payloads is not None and store_jobs:
                self._payloads.record(store_jobs, self._requests)
            keys = [item.key for job in (*load_jobs, *store_jobs) for item in job.items]
            slots = dict(zip(keys, core.store.slots(keys), strict=True)) if keys else {}
        late = () if self.deadlines is None else self.deadlines.step(load_jobs)
        orders = None
        if self.remote is not None:
            views = {str(s.request.request_id): s.request for s in scheduled}
            self.remote.stores_emitted(store_jobs, views)
            orders = self.remote.orders()
        return HybridKVMetadata(meta, slots, tuple(map(int, late)) if late else (), orders)

    def _step_in_flight(self) -> bool:
        """Whether a step scheduled earlier is still in flight: under async scheduling vLLM's
        batch queue holds a step whose output is not applied yet (its requests count
        ``num_in_flight_tokens`` until ``update_from_output``). Such a step's forward still
        frees blocks (it may finish a request), so a ``schedule()`` that scheduled nothing is
        not yet the restart guard's wedge (hybridkv.vllm.reclaim, rule 4). Asked only when
        nothing was scheduled and a restarted request was asked."""
        if not self._reclaim.asked():
            return False
        return any(getattr(r, "num_in_flight_tokens", 0) > 0 for r in self._requests.values())

    def _row(self, request: Any, start: int, num: int, limit: int | None) -> ScheduledRequest:
        """The core's row of a step of ``request`` computing ``[start, start + num)``."""
        blocks = _tables(self._kv_cache_manager.get_block_ids(request.request_id))
        return ScheduledRequest(self._views.view(request), blocks, start, num, limit)

    def update_connector_output(self, connector_output: Any) -> None:
        sending = connector_output.finished_sending
        if sending and self._delayed_frees:
            self._delayed_frees.difference_update(sending)
        worker_meta = connector_output.kv_connector_worker_meta
        ours = isinstance(worker_meta, HybridKVWorkerMeta)
        reports = worker_meta.reports if ours else ()
        failed = connector_output.failed_recving
        if not reports and not failed:
            # No job result and no failed load: nothing below would change the core. The remote
            # tier still folds its fetch reports and ticks its promotion deadline every step,
            # or a promotion reported alone would keep its keys STORING and its claim DEFERred
            # for ever (a wedge, found by tools/bench_remote.py's two engines).
            if self.remote is not None:
                self.remote.fold(worker_meta.fetches if ours else ())
            return
        core = self._core()
        # A job reaches the core once every rank reported it (ranks finish in different steps).
        jobs = self._quorum.fold(reports)
        if failed:
            self._reclaim.load_failed([rid for rid in failed if rid in self._requests])
        if self.deadlines is not None:
            self.deadlines.reported(result.job_id for result in jobs)
        kinds = {}
        if self.remote is not None:
            # Which reported jobs are stores, read before the core forgets them.
            kinds = {r.job_id: core.job_kind(r.job_id) for r in jobs}
        recving = connector_output.finished_recving
        core.update_connector_output(
            KVConnectorOutput(
                finished_recving=frozenset(recving) if recving else _NO_IDS,
                failed_recving=frozenset(failed) if failed else _NO_IDS,
                finished_sending=frozenset(sending) if sending else _NO_IDS,
                completed_jobs=jobs,
            )
        )
        if self.remote is not None:
            for result in jobs:
                if kinds.get(result.job_id) is TransferKind.STORE:
                    self.remote.store_reported(int(result.job_id), result.success)
            self.remote.fold(worker_meta.fetches if ours else ())

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        core = self.core
        if core is None:
            raise RuntimeError(_WORKER_SIDE)
        rid = request.request_id
        self._requests.pop(rid, None)
        self._agreement.forget(rid)
        self._reclaim.finished(rid)
        self._admission.finished(rid)
        if self.deadlines is not None:
            self.deadlines.finished(rid)
        if self.remote is not None:
            self.remote.finished(rid)
        # Its last view: the core's finish reads only the id and no block (its docstring), so
        # vLLM's block lists are not copied into a table here.
        delayed = core.request_finished_all_groups(self._views.pop(request), _UNREAD_TABLE)
        if delayed:
            self._delayed_frees.add(rid)
        return delayed, None
