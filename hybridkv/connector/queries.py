"""What the scheduler-side core answers without changing: its read-only queries.

:class:`CoreQueries` is a mixin of :class:`hybridkv.connector.core.ConnectorCore`, which owns
every attribute it declares. Each query's frame is "nothing changes"; those that need the
request's hash chain (``first_invalid_token``, ``request_keys``) stay with the core, which
grows it.
"""

from __future__ import annotations

from typing import Any

from hybridkv.connector.api import GpuBlockPool, JobId, RequestId, TransferJob, TransferKind
from hybridkv.connector.counts import COUNTED, ConnectorStats
from hybridkv.connector.geometry import ConnectorGeometry
from hybridkv.connector.loads import LoadRecord
from hybridkv.connector.memory import KeyMemory
from hybridkv.connector.snapshot import plain_core
from hybridkv.errors import HybridKVConfigError
from hybridkv.store import HostStore

__all__ = ["CoreQueries"]


class CoreQueries:
    """The core's read-only queries (module docstring)."""

    geometry: ConnectorGeometry
    store: HostStore
    _pool: GpuBlockPool | None
    _jobs: dict[JobId, tuple[TransferJob, str | None]]
    _jobs_of: dict[RequestId, int]
    _unpinned: set[JobId]
    _delayed: set[RequestId]
    _loads: dict[RequestId, LoadRecord]
    _memory: KeyMemory
    _count: dict[str, int]
    _requests: dict[RequestId, Any]
    _store_items: int
    _next_job: int
    _store_spans: dict[JobId, tuple[int, int]]

    def held_blocks(self) -> tuple[int, ...]:
        """The pool references the core holds: every block of each in-flight store, by job id.

        Empty when no pool is bound. Frame: nothing changes.
        """
        if self._pool is None:
            return ()
        return tuple(
            item.block_id
            for job_id, (job, _) in self._jobs.items()
            if job.kind is TransferKind.STORE and job_id not in self._unpinned
            for item in job.items
        )

    def loading_requests(self) -> frozenset[RequestId]:
        """The requests with a load job in flight (or built, not yet sent). Frame: nothing
        changes."""
        return frozenset(
            job.request_id for job, _ in self._jobs.values() if job.kind is TransferKind.LOAD
        )

    def has_jobs_in_flight(self) -> bool:
        """Whether any load or store job is in flight (or built, not yet sent). Frame:
        nothing changes."""
        return bool(self._jobs)

    def has_transfers(self, request_id: RequestId) -> bool:
        """Whether a load or store job of the request is in flight (or built, not yet sent)."""
        return bool(self._jobs_of.get(request_id))

    def delayed_requests(self) -> frozenset[RequestId]:
        """The finished requests whose block free waits for their stores (delayed by
        :meth:`request_finished_all_groups`, until their last store reports)."""
        return frozenset(self._delayed)

    def busy_blocks(self) -> frozenset[int]:
        """Blocks an in-flight job reads (store) or writes (load)."""
        return frozenset(item.block_id for job, _ in self._jobs.values() for item in job.items)

    def invalid_blocks(self, request_id: RequestId) -> frozenset[int]:
        """The destination blocks of the failed jobs of the request's latest load.

        Pre: the request has a load record (field ``request_id``).
        """
        return frozenset(self._record(request_id).bad_blocks)

    def failed_keys(self) -> frozenset[bytes]:
        """The keys the failure memory holds now."""
        return self._memory.failed_keys()

    def counts(self) -> tuple[int, ...]:
        """The counts of :meth:`stats` (its first 14 fields, in order), without the holdings
        and without building it: what the facade's stats hook compares each step. O(1)."""
        return tuple(self._count.values())

    def stats(self) -> ConnectorStats:
        """Counts since creation and holdings now, in O(1)."""
        held = self._store_items if self._pool is not None else 0  # == len(held_blocks())
        now = (len(self._requests), len(self._jobs), held, len(self._memory))
        return ConnectorStats._make((*map(self._count.__getitem__, COUNTED), *now))

    def job_kind(self, job_id: JobId) -> TransferKind | None:
        """The kind of the job in flight ``job_id``; None when none is."""
        entry = self._jobs.get(job_id)
        return None if entry is None else entry[0].kind

    def snapshot(self) -> dict[str, Any]:
        """The reference connector's plain snapshot (``spec.connector.scheduler_side`` schema,
        which the MB-* and SEC-1 predicates read; :mod:`hybridkv.connector.snapshot`).
        Frame: nothing changes."""
        return plain_core(
            self.geometry,
            next_job=self._next_job,
            jobs=self._jobs,
            loads=self._loads,
            delayed=self._delayed,
            store_spans=self._store_spans,
            memory=self._memory.snapshot(),
            store=self.store.snapshot(),
        )

    def _record(self, request_id: RequestId) -> LoadRecord:
        """The request's latest load record (field ``request_id`` when it has none)."""
        record = self._loads.get(request_id)
        if record is None:
            raise HybridKVConfigError(
                "request_id", request_id, "has no load recorded", "ask after a load"
            )
        return record
