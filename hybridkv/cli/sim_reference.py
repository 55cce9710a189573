"""The reference data plane: the spec's worker and connector over a real transfer engine.

``hybridkv simulate --connector reference`` runs the spec's reference connector
(:class:`spec.connector.ReferenceConnector`, which owns a :class:`spec.store.HostStore`) and
folds job results with :class:`spec.connector.ReferenceWorker`, while the bytes move through
the same CPU transfer engine the optimized path uses. Host slots are assigned per key here,
taken when a store job starts and given back when the store drops the key (an eviction or a
failed store, read from the store's events), so at most ``capacity`` slots are ever in use.

A run with the reference plane and a run with the optimized core must agree on every count
but time: that is ``tests/sim/test_simulate_agreement.py``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridkv.canonical import CanonicalCaches
from hybridkv.errors import HybridKVConfigError
from hybridkv.hostmem import HostMemory, PinMode
from hybridkv.sim.faults import FaultPlan
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


class _InjectedFault(RuntimeError):
    """Raised inside the transfer engine to fail a job on purpose."""


class ReferencePlane:
    """The :class:`hybridkv.cli.sim_engine.DataPlane` over the spec connector (module docstring)."""

    def __init__(
        self, connector: ReferenceConnector, caches: CanonicalCaches, faults: FaultPlan
    ) -> None:
        """Pre: ``connector``'s store capacity is the number of host slots wanted."""
        self.connector = connector
        self.caches = caches
        self.faults = faults
        capacity = connector.store.capacity
        slot_bytes = max(caches.group_bytes(g) for g in range(len(caches.group_refs)))
        self.host = HostMemory(capacity * slot_bytes, slot_bytes, PinMode.AUTO)
        self._failing: set[JobId] = set()
        self.engine = CpuTransferEngine(caches, self.host, self._fault_hook)
        self.worker = ReferenceWorker()
        self.counts = PlaneCounts()
        self._slots: dict[bytes, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._meta = ConnectorMeta()
        self._started: dict[JobId, TransferJob] = {}
        self._results: list[JobResult] = []

    def _fault_hook(self, job: JobId, direction: Direction, run: int) -> None:
        if job in self._failing:
            raise _InjectedFault(f"injected failure of transfer job {job}")

    # ----------------------------------------------------------------- the step
    def bind_connector_metadata(self, meta: ConnectorMeta) -> None:
        """Accept the step's jobs; give back the slots of keys the store dropped."""
        self._free_dropped_slots()
        self.worker.bind_connector_metadata(meta)
        self._meta = meta

    def start_load_kv(self) -> None:
        """Submit the step's load jobs (host slots to GPU blocks) and drain them, timed."""
        start = time.perf_counter()
        for job in self._meta.load_jobs:
            pairs = [TransferPair(i.group_idx, i.block_id, self._slot(i.key)) for i in job.items]
            self._submit(job, Direction.LOAD, pairs)
        self._drain()
        self.counts.load_seconds += time.perf_counter() - start

    def wait_for_save(self) -> None:
        """Submit the step's store jobs (GPU blocks to fresh host slots), after the forward,
        and drain them, timed."""
        start = time.perf_counter()
        for job in self._meta.store_jobs:
            pairs = [TransferPair(i.group_idx, i.block_id, self._take(i.key)) for i in job.items]
            self._submit(job, Direction.STORE, pairs)
        self._drain()
        self.counts.store_seconds += time.perf_counter() - start

    def get_transfer_results(self) -> KVConnectorOutput:
        """Fold the step's results (every job was drained) with the reference worker."""
        results = tuple(sorted(self._results, key=lambda r: r.job_id))
        self._results = []
        return self.worker.get_transfer_results(results)

    def _drain(self) -> None:
        self.engine.wait(list(self._started))
        for finished in self.engine.poll():
            job = self._started.pop(finished.job_id)
            if finished.success:
                moved = sum(self.caches.group_bytes(i.group_idx) for i in job.items)
                if job.kind.value == "load":
                    self.counts.bytes_loaded += moved
                else:
                    self.counts.bytes_stored += moved
            self._results.append(JobResult(job.job_id, finished.success))

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
        fails = self.faults.fails(direction.value, job.request_id, job.items[0].key)
        engine_job = self.engine.submit(direction, pairs)
        if fails:
            self._failing.add(engine_job)
            self.counts.failures_injected += 1
        self._started[engine_job] = job

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
