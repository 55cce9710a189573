"""``ExampleOffloadConnector``: the vLLM facade that hands each hook to one side.

vLLM builds the class twice from ``(vllm_config, role, kv_cache_config)``: in the scheduler
(role SCHEDULER) it holds an :class:`~examples.hma_offload.scheduler.OffloadScheduler`, in each
worker (role WORKER) an :class:`~examples.hma_offload.worker.OffloadWorker`. ``SupportsHMA``
tells vLLM it may keep its hybrid KV cache manager on: one KV cache group per layer kind, each
with its own block table, which is what the planner and the claim rule read.

What crosses between the sides each step: :class:`ExampleMeta` (the step's jobs, scheduler to
workers) and :class:`ExampleWorkerMeta` (their results, workers to scheduler, folded with
vLLM's ``aggregate`` over the workers).

Scope, refused at start-up rather than served wrongly: attention groups only (full and sliding
window), no speculative decoding, one worker (tensor parallel size 1), prompt tokens only
(decode tokens are not stored). ``hybridkv.vllm.HybridKVConnector`` does all of these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from examples.hma_offload.layout import read_layout
from examples.hma_offload.scheduler import OffloadScheduler, Scheduled, StepPlan
from examples.hma_offload.worker import OffloadWorker
from hybridkv import HybridKVConfigError


@dataclass(frozen=True)
class ExampleMeta(KVConnectorMetadata):
    """Scheduler to workers: the step's jobs."""

    plan: StepPlan


@dataclass(frozen=True)
class ExampleWorkerMeta(KVConnectorWorkerMetadata):
    """Workers to scheduler: ``(job id, success)`` per job, a job failed if any worker's did."""

    results: tuple[tuple[int, bool], ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, ExampleWorkerMeta)
        merged = dict(self.results)
        for job_id, success in other.results:
            merged[job_id] = merged.get(job_id, True) and success
        return ExampleWorkerMeta(tuple(merged.items()))


def _host_bytes(extra: dict[str, Any] | None) -> int:
    value = (extra or {}).get("host_bytes")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HybridKVConfigError(
            "kv_connector_extra_config.host_bytes",
            value,
            "must be a positive int: the bytes of host memory for offloaded KV",
            'add "host_bytes": 1073741824 (1 GiB)',
        )
    return value


def _refuse_unsupported(vllm_config: Any) -> None:
    if int(vllm_config.parallel_config.world_size) != 1:
        raise HybridKVConfigError(
            "tensor_parallel_size",
            vllm_config.parallel_config.world_size,
            "this example runs one worker",
            "use 1, or hybridkv.vllm.HybridKVConnector",
        )
    if vllm_config.speculative_config is not None:
        raise HybridKVConfigError(
            "speculative_config",
            "set",
            "this example keys no draft-model (EAGLE/MTP) proof",
            "drop it, or use hybridkv.vllm.HybridKVConnector",
        )


class ExampleOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """Host-memory KV offload for hybrid attention models (module docstring)."""

    # vLLM's hits-by-source metric files every token this connector supplies under host memory.
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _refuse_unsupported(vllm_config)
        layout = read_layout(vllm_config, kv_cache_config)
        slots = layout.host_slots(_host_bytes(self._kv_transfer_config.kv_connector_extra_config))
        scheduler_side = role == KVConnectorRole.SCHEDULER
        self.scheduler = OffloadScheduler(layout, slots) if scheduler_side else None
        self.worker = None if scheduler_side else OffloadWorker(layout, slots)
        self._requests: dict[str, Any] = {}
        self._manager: Any = None

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a cache, not a hand-off to another engine. vLLM's default (True for a KV
        producer) drops a preempted request's in-flight output under async scheduling to
        protect a transfer this connector never makes."""
        return False

    # ------------------------------------------------------------- scheduler side

    def _sched(self) -> OffloadScheduler:
        if self.scheduler is None:
            raise RuntimeError("scheduler-side call on the worker-side connector")
        return self.scheduler

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._manager = kv_cache_manager  # each step's block tables are read from it

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request
        hashes, n = request.block_hashes, request.num_tokens
        decision = self._sched().claim(request.request_id, hashes, n, num_computed_tokens)
        if decision.defer:
            return None, False  # vLLM asks again next step
        return decision.end - num_computed_tokens, False  # False: loads run before the forward

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._requests[request.request_id] = request
        if num_external_tokens > 0:
            table = blocks.get_block_ids()
            rid, hashes = request.request_id, request.block_hashes
            self._sched().allocated(rid, hashes, table, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        rows = []
        for rid, num in scheduler_output.num_scheduled_tokens.items():
            request = self._requests[rid]
            start = int(request.num_computed_tokens)
            end = min(start + int(num), int(request.num_prompt_tokens))  # prompt tokens only
            if end > start:
                table = self._manager.get_block_ids(rid)
                rows.append(Scheduled(request.block_hashes, table, start, end))
        return ExampleMeta(self._sched().plan_step(rows))

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, ExampleWorkerMeta):
            self._sched().reported(meta.results)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        # Every job of the request ran inside its step: nothing holds its blocks past here.
        self._requests.pop(request.request_id, None)
        self._sched().forget(request.request_id)
        return False, None

    # ------------------------------------------------------------- worker side

    def _work(self) -> OffloadWorker:
        if self.worker is None:
            raise RuntimeError("worker-side call on the scheduler-side connector")
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._work().register(kv_caches)

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ExampleMeta)
        return meta.plan

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._work().run(self._plan().loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every load landed in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return  # stores copy whole blocks of every layer in wait_for_save

    def wait_for_save(self) -> None:
        self._work().run(self._plan().stores)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        results = self._work().take_results()
        return ExampleWorkerMeta(results) if results else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
