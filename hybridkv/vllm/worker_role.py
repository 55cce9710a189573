"""``HybridKVConnector``'s worker role: vLLM's worker-side hooks over the transfer worker.

In each worker vLLM builds the connector with role WORKER and registers its KV caches; this
role builds the canonical caches, the host memory and the transfer engine (CPU or CUDA) under
the core's :class:`~hybridkv.connector.worker.TransferWorker`, starts each step's loads and
stores from the step's metadata (:mod:`hybridkv.vllm.step_metadata`) and reports results back.
Loads of attention KV and mamba state run at step granularity: mamba and GDN layers never call
the per-layer hooks. :class:`WorkerRole` is a base class of
:class:`~hybridkv.vllm.connector.HybridKVConnector`, kept apart so one file holds one role; the
state it reads is the connector's, set in its constructor (declared on the class).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

from hybridkv.canonical import build_canonical_caches
from hybridkv.connector import JobId, JobResult
from hybridkv.connector.worker import JobFaultHook, TransferWorker
from hybridkv.errors import HybridKVConfigError
from hybridkv.hostmem import HostMemory, PinMode
from hybridkv.remote import ShardPlan
from hybridkv.transfer import TransferEngine
from hybridkv.transfer.cpu_engine import FaultHook
from hybridkv.vllm.config import HybridKVConfig
from hybridkv.vllm.disk import DISK_INDEX_ENTRIES, disk_remote_config, worker_disk_client
from hybridkv.vllm.layout import VllmLayout
from hybridkv.vllm.metrics import TransferMeter
from hybridkv.vllm.ranks import HostSharding, RankReport, ReplicaEngine
from hybridkv.vllm.remote import (
    FetchReport,
    WorkerRemote,
    breaker_config,
    model_identity,
    remote_config,
)
from hybridkv.vllm.step_metadata import HybridKVMetadata, HybridKVWorkerMeta, MetaSlots

__all__ = ["WorkerRole"]

logger = logging.getLogger("vllm.hybridkv")  # under vLLM's logger: its handlers print it

# The longest a step that runs no forward waits for a copy to finish before reporting. vLLM's
# engine loop with loads in flight and nothing to compute spins through such steps without
# blocking, so the CPU engine's copy thread got the GIL only when the interpreter's switch
# interval (5 ms) forced it: one run per 5 ms. Waiting releases the GIL; a few milliseconds let
# many runs (or a whole job) through, and bound the delay a request arriving meanwhile sees
# before the loop schedules it. A constant, not a setting: nothing a user knows tunes it.
IDLE_STEP_WAIT_S = 0.002


class WorkerRole:
    """The worker-side hooks of :class:`~hybridkv.vllm.connector.HybridKVConnector` (module
    docstring); every attribute below is the connector's."""

    worker: TransferWorker | None
    worker_remote: WorkerRemote | None
    hybridkv_config: HybridKVConfig
    layout: VllmLayout
    sharding: HostSharding
    remote_shards: ShardPlan
    rank: int
    num_chunks: int
    _slots: MetaSlots
    _host: HostMemory | None
    _engine: Any
    _reported: tuple[JobResult, ...]
    _fetched: tuple[FetchReport, ...]
    _meter: TransferMeter
    _vllm_config: Any  # vLLM's, set by KVConnectorBase_V1
    # Whether this step's metadata said the step runs no forward (set by start_load_kv).
    _idle_step: bool = False

    def _worker(self) -> TransferWorker:
        if self.worker is None:
            raise RuntimeError("worker-side call before register_kv_caches")
        return self.worker

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
        in-process engine's adapter, :mod:`hybridkv.vllm.harness.cpu_worker`, injects faults and
        delays reports this way; never a user setting)."""
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
        self.worker_remote = self._worker_tier(host)
        self.worker = TransferWorker(engine, self._slots, caches, host, fault_hook=job_fault_hook)

    def _worker_tier(self, host: HostMemory) -> WorkerRemote | None:
        """The worker side of the tiers under the host (the scheduler's ``_scheduler_tier``).
        The disk: this rank's shard directory (hybridkv.vllm.disk), OWNER where the rank writes
        it, its index rebuilt from the files now, before the first step."""
        remote, disk = self.hybridkv_config.remote, self.hybridkv_config.disk
        client = None
        if disk is not None:
            identity = model_identity(self._vllm_config, self.layout)
            client = worker_disk_client(disk, identity, self.remote_shards, self.rank)
        if remote is not None:
            config = remote_config(remote)
            if client is not None:  # the disk stacked over the server: hybridkv.vllm.disk
                config = replace(config, index_entries=DISK_INDEX_ENTRIES)
            return WorkerRemote(
                config,
                host,
                breaker=breaker_config(remote),
                rank=self.rank,
                shards=self.remote_shards,
                near=client,
            )
        if client is not None:
            return WorkerRemote(
                disk_remote_config(),
                host,
                client=client,
                breaker=None,
                rank=self.rank,
                shards=self.remote_shards,
            )
        return None

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
        self._idle_step = metadata.no_forward

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
        worker = self._worker()
        if self._idle_step:
            # Nothing to compute this step: give the copies a turn before reporting (see
            # IDLE_STEP_WAIT_S). Returns at once with no job in flight; a step that runs a
            # forward never waits.
            self._idle_step = False
            self._engine.wait_progress(IDLE_STEP_WAIT_S)
        output = worker.get_transfer_results()
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
