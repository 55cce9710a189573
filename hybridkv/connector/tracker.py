"""The worker side's bookkeeping: jobs in flight folded into request-level outcomes.

:class:`JobTracker` follows the worker-side contract of docs/explanation/connector-core.md,
which ``spec.connector.ReferenceWorker`` also models (never imported here), and satisfies
:class:`~hybridkv.connector.api.WorkerConnector`; it moves no byte (the
:class:`~hybridkv.connector.worker.TransferWorker` runs the jobs and folds through it). Rules:

- an ASYNC load of a request is finished (``finished_recving``) when every load job of that
  request has reported, and failed (``failed_recving``) if any of them failed; the destination
  blocks of its failed jobs are then handed out once by :meth:`JobTracker.
  get_block_ids_with_load_errors` (vLLM's hook of that name; shared truncation reads it);
- a SYNC load never reports at the request level (its request already runs); its outcome
  reaches the scheduler side through ``completed_jobs`` only;
- a request announced in ``ConnectorMeta.delayed_free_ids`` is reported in
  ``finished_sending`` at the first fold where none of its store jobs is in flight;
- every folded result is passed on in ``KVConnectorOutput.completed_jobs``.

Where the reference recounts every job in flight per request and rescans every delayed request
at each fold, per-request counters and a set of delayed requests whose stores are done make a
fold cost O(results).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hybridkv.connector.api import (
    ConnectorMeta,
    JobId,
    JobResult,
    KVConnectorOutput,
    RequestId,
    TransferJob,
    TransferKind,
)
from hybridkv.errors import HybridKVConfigError

__all__ = ["JobTracker"]

_STORE = TransferKind.STORE


class JobTracker:
    """Jobs in flight and the request-level outcomes they fold into (module docstring)."""

    def __init__(self) -> None:
        """A tracker with nothing in flight."""
        self._jobs: dict[JobId, TransferJob] = {}
        self._loads_of: dict[RequestId, int] = {}  # load jobs in flight, sync ones included
        self._stores_of: dict[RequestId, int] = {}
        # Failed loads in flight -> their failed jobs' destination blocks; then, once the load
        # finished, the same per request until handed out.
        self._load_failed: dict[RequestId, frozenset[int]] = {}
        self._errors: dict[RequestId, frozenset[int]] = {}
        self._delayed: set[RequestId] = set()
        self._sendable: set[RequestId] = set()  # delayed, with no store left in flight

    def job(self, job_id: JobId) -> TransferJob:
        """The job in flight with id ``job_id`` (field ``job_id`` if there is none)."""
        job = self._jobs.get(job_id)
        if job is None:
            raise HybridKVConfigError("job_id", job_id, "is not in flight", "name a bound job")
        return job

    def in_flight(self) -> tuple[JobId, ...]:
        """The ids of the jobs in flight, ascending. Frame: nothing changes."""
        return tuple(sorted(self._jobs))

    def check_fresh(self, meta: ConnectorMeta) -> None:
        """Refuse (field ``job_id``) a job id already in flight or repeated in ``meta``."""
        seen: set[JobId] = set()
        for job in (*meta.load_jobs, *meta.store_jobs):
            if job.job_id in self._jobs or job.job_id in seen:
                raise HybridKVConfigError(
                    "job_id", job.job_id, "is already in flight", "use fresh ids"
                )
            seen.add(job.job_id)

    def bind_connector_metadata(self, meta: ConnectorMeta) -> None:
        """Accept this step's jobs and delayed frees.

        Pre: no job id is already in flight (field ``job_id``, nothing changed). Post: the jobs
        are in flight; the delayed requests await their stores.
        """
        self.check_fresh(meta)
        for job in (*meta.load_jobs, *meta.store_jobs):
            self._jobs[job.job_id] = job
            counts = self._stores_of if job.kind is _STORE else self._loads_of
            counts[job.request_id] = counts.get(job.request_id, 0) + 1
        for rid in meta.delayed_free_ids:
            self._delayed.add(rid)
            if not self._stores_of.get(rid):
                self._sendable.add(rid)

    def get_transfer_results(self, results: tuple[JobResult, ...]) -> KVConnectorOutput:
        """Fold ``results`` (module docstring rules).

        Pre: each result names a job in flight, once (field ``results``, nothing changed).
        Post: the reported jobs left flight; the output names the requests whose async load
        completed (and failed), the delayed requests with no store left, and carries
        ``results`` as ``completed_jobs``.
        """
        ids = [result.job_id for result in results]
        if len(set(ids)) != len(ids) or any(job_id not in self._jobs for job_id in ids):
            raise HybridKVConfigError("results", ids, "names a job not in flight", "report once")
        touched: set[RequestId] = set()
        for job_id, success in results:
            job = self._jobs.pop(job_id)
            rid = job.request_id
            counts = self._stores_of if job.kind is _STORE else self._loads_of
            left = counts[rid] - 1
            if left:
                counts[rid] = left
            else:
                del counts[rid]
            if job.kind is _STORE:
                if not left and rid in self._delayed:
                    self._sendable.add(rid)
            elif not job.sync:  # a sync load reports through completed_jobs only
                touched.add(rid)
                if not success:
                    bad = frozenset(item.block_id for item in job.items)
                    self._load_failed[rid] = self._load_failed.get(rid, frozenset()) | bad
        finished = frozenset(rid for rid in touched if rid not in self._loads_of)
        failed = frozenset(rid for rid in finished if rid in self._load_failed)
        for rid in failed:
            self._errors[rid] = self._errors.get(rid, frozenset()) | self._load_failed.pop(rid)
        sent = frozenset(self._sendable)
        self._delayed -= sent
        self._sendable = set()
        return KVConnectorOutput(finished, failed, sent, tuple(results))

    def get_block_ids_with_load_errors(self) -> dict[RequestId, frozenset[int]]:
        """The blocks failed load jobs left invalid, per request whose load failed; handed once.

        Per request, not vLLM's flat union (which vLLM 0.33 refuses with several groups): the
        shape shared truncation needs. Post: the next call returns nothing new until another
        load fails.
        """
        errors, self._errors = self._errors, {}
        return errors

    def snapshot(self) -> dict[str, Any]:
        """The reference worker's plain snapshot: ``jobs`` ((job_id, kind, request_id, sync),
        ...) by id, ``load_failed`` (sorted ids), ``invalid_blocks`` and ``load_errors``
        ((request_id, (block ids...)), ...) and ``delayed`` (sorted ids). Frame: nothing
        changes."""
        in_flight = sorted(self._jobs.items())
        return {
            "jobs": tuple((int(j), t.kind.value, t.request_id, t.sync) for j, t in in_flight),
            "load_failed": _sorted_ids(self._load_failed),
            "invalid_blocks": _plain_blocks(self._load_failed),
            "load_errors": _plain_blocks(self._errors),
            "delayed": _sorted_ids(self._delayed),
        }


def _plain_blocks(
    blocks: dict[RequestId, frozenset[int]],
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((rid, tuple(sorted(ids))) for rid, ids in sorted(blocks.items()))


def _sorted_ids(ids: Iterable[RequestId]) -> tuple[RequestId, ...]:
    return tuple(sorted(ids))
