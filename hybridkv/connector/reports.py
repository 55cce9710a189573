"""How the scheduler-side core folds its jobs' reports: loads unpin, stores complete.

:class:`JobReports` is a mixin of :class:`hybridkv.connector.core.ConnectorCore`, which owns
every attribute it declares. ``update_connector_output`` is vLLM's call; the rest fold one
load or store result each, as ``spec.connector.ReferenceConnector`` does (same store calls,
so the same entries, policy order and events): a successful load unpins its keys, a failed
one's keys are remembered (the re-ask salvages the longest prefix that avoids them) and
dropped from the host where no other load pins them; a store completes its keys (READY or
dropped), gives its pool references back (TR-1) and, when it was the request's last, ends
the request's delayed free.
"""

from __future__ import annotations

from operator import attrgetter

from hybridkv.connector.api import (
    GpuBlockPool,
    JobId,
    KVConnectorOutput,
    RequestId,
    TransferJob,
    TransferKind,
)
from hybridkv.connector.loads import LoadRecord
from hybridkv.connector.memory import KeyMemory
from hybridkv.errors import HybridKVConfigError
from hybridkv.store import HostStore

__all__ = ["JobReports"]

_LOAD = TransferKind.LOAD
_KEY = attrgetter("key")  # an item's key, read in C


class JobReports:
    """The core's folding of job results (module docstring)."""

    store: HostStore
    _count: dict[str, int]
    _memory: KeyMemory
    _jobs: dict[JobId, tuple[TransferJob, str | None]]
    _jobs_of: dict[RequestId, int]
    _store_spans: dict[JobId, tuple[int, int]]
    _stores_of: dict[RequestId, int]
    _store_items: int
    _loads: dict[RequestId, LoadRecord]
    _finished: set[RequestId]
    _restarting: set[RequestId]
    _delayed: set[RequestId]
    _salvage: bool
    _next_job: int
    _pool: GpuBlockPool | None
    _stale_jobs: set[JobId]
    _unpinned: set[JobId]

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Fold every job result of ``output.completed_jobs``, in order.

        Pre: each result names a job in flight (field ``completed_jobs`` otherwise; earlier
        results stay folded, that one and later ones change nothing). Post: a load job's keys
        are unpinned, a failed one's remembered; a store job completes its keys (READY or
        dropped), unpins its blocks, and a success clears their failure memory; a delayed
        request whose last store reported is no longer delayed.
        """
        jobs, spans, jobs_of = self._jobs, self._store_spans, self._jobs_of
        # Successful loads of one request reported one after another are folded together (one
        # unpin, one record update): a long load has a job per segment, usually all reported in
        # the same step. Folding them one by one would change nothing else: a success only
        # unpins, evicts remembered failed keys (still job by job) and records.
        run: list[TransferJob] = []
        for result in output.completed_jobs:
            entry = jobs.pop(result.job_id, None)
            if entry is None:
                if run:
                    self._loads_succeeded(run)
                raise HybridKVConfigError(
                    "completed_jobs", result.job_id, "no such job", "report once"
                )
            spans.pop(result.job_id, None)
            job = entry[0]
            rid = job.request_id
            left = jobs_of[rid] - 1  # the request's jobs in flight (inlined: once per job)
            if left:
                jobs_of[rid] = left
            else:
                del jobs_of[rid]
            if job.kind is _LOAD and result.success:
                if run and run[0].request_id != rid:
                    self._loads_succeeded(run)
                    run = []
                run.append(job)
                continue
            if run:
                self._loads_succeeded(run)
                run = []
            keys = tuple(map(_KEY, job.items))
            if job.kind is _LOAD:
                self._load_failed(job, keys)
            else:
                self._store_reported(job, keys, result.success)
        if run:
            self._loads_succeeded(run)

    # A load job in flight always has its request's record, and the record lists it: a load is
    # refused while another of the request is in flight, and a record is dropped only when no
    # job of it is in flight (at the finish, or at the last report of a finished request).

    def _load_failed(self, job: TransferJob, keys: tuple[bytes, ...]) -> None:
        """Fold the failure of load job ``job`` (``keys``: its items' keys)."""
        self.store.complete_load(keys)
        self._count["load_jobs_failed"] += 1
        memory = self._memory
        memory.remember_failed(keys, self._next_job)
        # Drop the failed entries no other load still pins: their data may be bad, and left in
        # place they would stay unclaimable while present (the reference's rule).
        memory.departed(self.store.evict([key for key in keys if key in memory]))
        rid = job.request_id
        if not (self._salvage or rid in self._finished):
            self._restarting.add(rid)
        record = self._loads[rid]
        record.job_failed(job.job_id, job.items)
        self._forget_if_done(rid, record)

    def _loads_succeeded(self, run: list[TransferJob]) -> None:
        """Fold the successes of the load jobs of ``run``, one request's, in report order, at
        once: one unpin of all their keys and one record update (the evictions of remembered
        failed keys stay one per job)."""
        keys = [item.key for job in run for item in job.items]
        self.store.complete_load(keys)
        memory = self._memory
        # Job by job, as the reference: each eviction is one event of the store's log (its
        # grouping is observable), and nothing is evicted while nothing is remembered.
        for job in run if memory else ():
            failed = [item.key for item in job.items if item.key in memory]
            memory.departed(self.store.evict(failed))
        rid = run[0].request_id
        record = self._loads[rid]
        record.jobs_succeeded([job.job_id for job in run], keys)
        self._forget_if_done(rid, record)

    def _forget_if_done(self, rid: RequestId, record: LoadRecord) -> None:
        """A finished request's load record goes with the last report of its load."""
        if rid in self._finished and not record.in_flight:
            del self._loads[rid]
            self._finished.discard(rid)

    def _store_reported(self, job: TransferJob, keys: tuple[bytes, ...], success: bool) -> None:
        stale = job.job_id in self._stale_jobs
        if stale:  # emitted before a reset: its keys never become READY (reset_cache)
            self._stale_jobs.discard(job.job_id)
            success = False
        self.store.complete_store(keys, success=success)
        if job.job_id in self._unpinned:
            self._unpinned.discard(job.job_id)  # its pool references went back at the reset
        else:
            self._store_items -= len(job.items)
            if self._pool is not None:
                self._pool.free_blocks([item.block_id for item in job.items])
        rid = job.request_id
        left = self._stores_of[rid] - 1
        if left:
            self._stores_of[rid] = left
        else:
            del self._stores_of[rid]
        if success:
            self._memory.stored(keys)
        else:
            if not stale:
                self._count["store_jobs_failed"] += 1
            self._memory.departed(keys)
        if not left:
            self._delayed.discard(rid)
