"""The reference data plane: the spec's worker and connector over a real transfer engine.

``hybridkv simulate --connector reference`` runs the spec's reference connector
(:class:`spec.connector.ReferenceConnector`, which owns a :class:`spec.store.HostStore`) and
folds job results with :class:`spec.connector.ReferenceWorker`, while the bytes move through
the same CPU transfer engine the optimized path uses, timed by the same copy-time model
(:class:`hybridkv.testbed.timed_engine.TimedTransferEngine`): a job is reported in the step the
model says it completes. An injected fault fails its job at submission, as the optimized
worker's fault hook does, so both planes fail the same jobs in the same steps. Host slots are
assigned per key here, taken when a store job starts and given back when the store drops the
key (an eviction or a failed store, read from the store's events), so at most ``capacity``
slots are ever in use.

A run with the reference plane and a run with the optimized core must agree on every count
but time: that is ``tests/sim/test_simulate_agreement.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridkv.canonical import CanonicalCaches
from hybridkv.errors import HybridKVConfigError
from hybridkv.hostmem import HostMemory, PinMode
from hybridkv.testbed.copy_time import CopyTimeModel
from hybridkv.testbed.faults import FaultPlan
from hybridkv.testbed.timed_engine import TimedTransferEngine
from hybridkv.transfer import CpuTransferEngine, Direction, JobId, TransferPair
from spec.connector import ReferenceConnector, ReferenceWorker
from spec.connector_api import (
    ConnectorMeta,
    JobResult,
    KVConnectorOutput,
    RequestId,
    TransferJob,
)
from spec.store import EventKind, LookupResult

__all__ = ["PlaneCounts", "ReferencePlane"]


@dataclass
class PlaneCounts:
    """Bytes and seconds moved per direction, and failures injected (the ``PlaneStats``)."""

    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    failures_injected: int = 0

    def add_seconds(self, direction: Direction, seconds: float) -> None:
        """Add the wall time of a batch of real copies to its direction."""
        if direction is Direction.LOAD:
            self.load_seconds += seconds
        else:
            self.store_seconds += seconds


class ReferencePlane:
    """The :class:`~hybridkv.simulator.plane.DataPlane` over the spec connector (see module)."""

    def __init__(
        self,
        connector: ReferenceConnector,
        caches: CanonicalCaches,
        faults: FaultPlan,
        model: CopyTimeModel | None = None,
    ) -> None:
        """Pre: ``connector``'s store capacity is the number of host slots wanted."""
        self.connector = connector
        self.caches = caches
        self.faults = faults
        capacity = connector.store.capacity
        slot_bytes = max(caches.group_bytes(g) for g in range(len(caches.group_refs)))
        self.host = HostMemory(capacity * slot_bytes, slot_bytes, PinMode.AUTO)
        self.counts = PlaneCounts()
        self.engine = TimedTransferEngine(
            CpuTransferEngine(caches, self.host),
            model or CopyTimeModel(),
            caches,
            self.host,
            self.counts.add_seconds,
        )
        self.worker = ReferenceWorker()
        self._slots: dict[bytes, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._meta = ConnectorMeta()
        self._started: dict[JobId, TransferJob] = {}
        self._results: list[JobResult] = []

    # ----------------------------------------------------------------- the step
    def bind_connector_metadata(self, meta: ConnectorMeta) -> None:
        """Start the next step; accept its jobs; give back the slots of keys the store dropped."""
        self.engine.start_step()
        self._free_dropped_slots()
        self.worker.bind_connector_metadata(meta)
        self._meta = meta

    def start_load_kv(self) -> None:
        """Submit the step's load jobs (host slots to GPU blocks); they run when they are due."""
        for job in self._meta.load_jobs:
            pairs = [TransferPair(i.group_idx, i.block_id, self._slot(i.key)) for i in job.items]
            self._submit(job, Direction.LOAD, pairs)

    def wait_for_save(self) -> None:
        """Submit the step's store jobs (GPU blocks to fresh host slots), after the forward."""
        self.engine.end_forward()
        for job in self._meta.store_jobs:
            pairs = [TransferPair(i.group_idx, i.block_id, self._take(i.key)) for i in job.items]
            self._submit(job, Direction.STORE, pairs)

    def get_transfer_results(self) -> KVConnectorOutput:
        """Run the jobs due by the step's end; fold their results with the reference worker."""
        self._collect()
        results = tuple(sorted(self._results, key=lambda r: r.job_id))
        self._results = []
        return self.worker.get_transfer_results(results)

    def _collect(self) -> None:
        self.engine.advance()
        for finished in self.engine.poll():
            job = self._started.pop(finished.job_id)
            self._results.append(JobResult(job.job_id, finished.success))
        self.counts.bytes_loaded = self.engine.bytes_moved(Direction.LOAD)
        self.counts.bytes_stored = self.engine.bytes_moved(Direction.STORE)

    def get_block_ids_with_load_errors(self) -> Mapping[RequestId, frozenset[int]]:
        """The reference worker's block-level load errors (handed out once)."""
        return self.worker.get_block_ids_with_load_errors()

    # ----------------------------------------------------------------- observations
    def stats(self) -> PlaneCounts:
        """What moved so far."""
        return self.counts

    def store_occupancy(self) -> tuple[int, int]:
        """``(entries, capacity)`` of the reference store."""
        stats = self.connector.store.stats()
        return stats.used, stats.capacity

    def store_snapshot(self) -> Mapping[str, Any]:
        """The reference store's snapshot (the ST-* schema)."""
        return self.connector.store.snapshot()

    def store_holds(self, key: bytes) -> bool:
        """Whether the store holds ``key``, READY or STORING (not MISS)."""
        return self.connector.store.status(key) is not LookupResult.MISS

    def close(self) -> None:
        """Stop the engine's thread and release host memory."""
        self.engine.close()
        self.host.close()

    # ----------------------------------------------------------------- helpers
    def _submit(self, job: TransferJob, direction: Direction, pairs: list[TransferPair]) -> None:
        if self.faults.fails(direction.value, job.request_id, job.items[0].key):
            self.counts.failures_injected += 1
            self._results.append(JobResult(job.job_id, False))  # never submitted, as the core's
            return
        self._started[self.engine.submit(direction, pairs)] = job

    def _slot(self, key: bytes) -> int:
        slot = self._slots.get(key)
        if slot is None:
            raise HybridKVConfigError(
                "key", key.hex(), "is loaded but was never stored", "the connector is broken"
            )
        return slot

    def _take(self, key: bytes) -> int:
        if key in self._slots or not self._free:
            raise HybridKVConfigError(
                "key", key.hex(), "has a slot already or none is free", "the store is broken"
            )
        slot = self._free.pop()
        self._slots[key] = slot
        return slot

    def _free_dropped_slots(self) -> None:
        for event in self.connector.store.take_events():
            if event.kind in (EventKind.EVICTED, EventKind.REMOVED):
                for key in event.keys:
                    slot = self._slots.pop(key, None)
                    if slot is not None:
                        self._free.append(slot)
