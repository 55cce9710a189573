"""The optimized data plane of ``hybridkv simulate``: the connector core, its worker and engine.

The spec scheduler drives :class:`hybridkv.connector.ConnectorCore` through
:class:`hybridkv.simulator.engine_adapter.CoreConnector`; the core owns the optimized
:class:`hybridkv.store.HostStore`, whose entries own host slots; the
:class:`hybridkv.connector.worker.TransferWorker` runs the core's jobs on a transfer engine
(:class:`~hybridkv.transfer.CpuTransferEngine`, or the CUDA engine with ``--device cuda``) over
the canonical caches and exact-size host memory (pinned when CUDA is present).

The engine is wrapped in a :class:`hybridkv.testbed.timed_engine.TimedTransferEngine`: each job
is reported in the step the copy-time model says it completes, so a load may span steps. The
report's GB/s per direction is bytes over the wall time the real copies of that direction took.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hybridkv.canonical import CanonicalCaches
from hybridkv.connector import ConnectorCore
from hybridkv.connector.api import TransferJob
from hybridkv.connector.worker import TransferWorker
from hybridkv.errors import HybridKVConfigError
from hybridkv.hostmem import HostMemory, PinMode
from hybridkv.kinds import GroupKind
from hybridkv.simulator.engine_adapter import (
    CoreConnector,
    to_core_meta,
    to_spec_output,
    window_reaches,
)
from hybridkv.simulator.reference import PlaneCounts
from hybridkv.simulator.setup import SimSetup
from hybridkv.store import HostStore, LookupResult
from hybridkv.testbed.copy_time import CopyTimeModel
from hybridkv.testbed.faults import FaultPlan
from hybridkv.testbed.timed_engine import TimedTransferEngine
from hybridkv.transfer import CpuTransferEngine, Direction, TransferEngine
from spec.connector_api import ConnectorMeta, KVConnectorOutput, RequestId

__all__ = ["OptimizedPlane", "build_optimized"]


@dataclass
class OptimizedPlane:
    """The :class:`~hybridkv.simulator.plane.DataPlane` over the core's worker (see the module)."""

    worker: TransferWorker
    store: HostStore
    engine: TimedTransferEngine
    host: HostMemory
    counts: PlaneCounts

    def bind_connector_metadata(self, meta: ConnectorMeta) -> None:
        """Start the next step; hand its jobs to the worker, which submits the loads at once."""
        self.engine.start_step()
        self.worker.bind_connector_metadata(to_core_meta(meta))

    def start_load_kv(self) -> None:
        """Nothing more: the worker submitted the loads at bind."""

    def wait_for_save(self) -> None:
        """Submit the step's stores, after the forward."""
        self.engine.end_forward()
        self.worker.wait_for_save()

    def get_transfer_results(self) -> KVConnectorOutput:
        """Run the jobs due by the step's end; fold every job reported so far."""
        self.engine.advance()
        out = to_spec_output(self.worker.get_transfer_results())
        self.counts.bytes_loaded = self.engine.bytes_moved(Direction.LOAD)  # landed, not started
        self.counts.bytes_stored = self.engine.bytes_moved(Direction.STORE)
        self.counts.failures_injected = self.worker.stats().faults_injected
        return out

    def get_block_ids_with_load_errors(self) -> Mapping[RequestId, frozenset[int]]:
        """The worker's block-level load errors (handed out once)."""
        return {
            RequestId(rid): blocks
            for rid, blocks in self.worker.get_block_ids_with_load_errors().items()
        }

    def stats(self) -> PlaneCounts:
        """What moved so far."""
        return self.counts

    def store_occupancy(self) -> tuple[int, int]:
        """``(entries, capacity)`` of the optimized store."""
        stats = self.store.stats()
        return stats.used, stats.capacity

    def store_snapshot(self) -> Mapping[str, Any]:
        """The optimized store's snapshot (the spec's ST-* schema)."""
        return self.store.snapshot()

    def store_holds(self, key: bytes) -> bool:
        """Whether the store holds ``key``, READY or STORING (not MISS)."""
        return self.store.status(key) is not LookupResult.MISS

    def close(self) -> None:
        """Stop the engine and release host memory."""
        self.engine.close()
        self.host.close()


def build_optimized(
    setup: SimSetup,
    canonical: CanonicalCaches,
    entries: int,
    faults: FaultPlan,
    policy: str,
    *,
    model: CopyTimeModel | None = None,
) -> tuple[CoreConnector, OptimizedPlane, Callable[[], Mapping[str, Any]]]:
    """The core (wrapped for the spec scheduler), its plane, and the core's snapshot.

    Refusal: a planner whose unit splits a block (the engine moves whole blocks) raises
    :class:`HybridKVConfigError` (field ``chunk_size``); nothing is allocated.
    """
    planner = setup.planner
    for g, (unit, (_, block)) in enumerate(zip(planner.units, planner.groups, strict=True)):
        if unit != block:
            raise HybridKVConfigError(
                "chunk_size",
                setup.chunk_size,
                f"splits group {g}'s {block}-token block into {unit}-token units; the transfer "
                "engine moves whole blocks",
                f"use a multiple of every block size, e.g. {block}",
            )
    store = HostStore(entries, policy)
    core = ConnectorCore(
        planner,
        store,
        tuple(GroupKind(g.kind.value) for g in setup.scheduler.groups),
        setup.scheduler.hash_block_size,
        setup.chunk_size,
        sliding_windows=window_reaches(setup.scheduler.groups),
    )
    slot_bytes = max(canonical.group_bytes(g) for g in range(len(canonical.group_refs)))
    host = HostMemory(entries * slot_bytes, slot_bytes, PinMode.AUTO)
    inner: TransferEngine
    if canonical.device.type == "cuda":
        from hybridkv.transfer.cuda_engine import CudaTransferEngine

        inner = CudaTransferEngine(canonical, host)
    else:
        inner = CpuTransferEngine(canonical, host)
    counts = PlaneCounts()
    engine = TimedTransferEngine(
        inner, model or CopyTimeModel(), canonical, host, counts.add_seconds
    )

    def fails(job: TransferJob) -> bool:
        return faults.fails(job.kind.value, job.request_id, job.items[0].key)

    worker = TransferWorker(engine, store, canonical, host, fault_hook=fails)
    plane = OptimizedPlane(worker, store, engine, host, counts)
    connector = CoreConnector(core)
    return connector, plane, connector.snapshot
