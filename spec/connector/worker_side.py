"""The reference connector, worker side: jobs in flight folded into request-level outcomes.

:class:`ReferenceWorker` implements :class:`spec.connector_api.WorkerConnector`:

- an ASYNC load of a request is finished (``finished_recving``) when every load job of that
  request has reported, and failed (``failed_recving``) if any of them failed; the destination
  blocks of its failed jobs are then handed out once by :meth:`get_block_ids_with_load_errors`
  (the block-level report shared truncation reads; vLLM's hook of the same name, reported no
  later than the pass in which the request is in ``finished_recving``);
- a SYNC load (``TransferJob.sync``) never reports at the request level: its request already
  runs (vLLM's worker, ``start_kv_transfers``); its outcome reaches the scheduler-side
  connector through ``completed_jobs`` only;
- a request announced in ``ConnectorMeta.delayed_free_ids`` is reported in
  ``finished_sending`` at the first fold where none of its store jobs is in flight;
- every folded result is passed on in ``KVConnectorOutput.completed_jobs``.

Snapshot schema: ``jobs`` ((job_id, kind, request_id, sync), ...) in flight by id;
``load_failed`` (request ids whose in-flight async load already had a failed job);
``invalid_blocks`` ((request_id, (block ids...)), ...): the failed jobs' destination blocks of
loads still in flight; ``load_errors`` (the same shape): those of finished failed loads not yet
handed out; ``delayed`` (request ids awaiting ``finished_sending``).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from spec.connector_api import (
    ConnectorMeta,
    JobId,
    JobResult,
    KVConnectorOutput,
    RequestId,
    TransferJob,
    TransferKind,
)
from spec.errors import ConfigError

__all__ = ["ReferenceWorker"]


class ReferenceWorker:
    """The worker-side reference connector (module docstring)."""

    def __init__(self) -> None:
        """A worker with nothing in flight."""
        self._jobs: dict[JobId, TransferJob] = {}
        self._load_failed: dict[RequestId, frozenset[int]] = {}
        self._errors: dict[RequestId, frozenset[int]] = {}
        self._delayed: set[RequestId] = set()

    def bind_connector_metadata(self, meta: ConnectorMeta) -> None:
        """Accept this step's jobs and delayed frees.

        Pre: no job id is already in flight (``ConfigError`` otherwise, nothing changed).
        Post: the jobs are in flight; the delayed requests await their stores.
        """
        jobs = (*meta.load_jobs, *meta.store_jobs)
        for job in jobs:
            if job.job_id in self._jobs:
                raise ConfigError("job_id", job.job_id, "is already in flight", "use fresh ids")
        for job in jobs:
            self._jobs[job.job_id] = job
        self._delayed |= meta.delayed_free_ids

    def get_transfer_results(self, results: tuple[JobResult, ...]) -> KVConnectorOutput:
        """Fold ``results`` (module docstring rules).

        Pre: each result names a job in flight, once (``ConfigError`` otherwise, nothing
        changed). Post: the reported jobs left flight; the output names the requests whose
        async load completed (and failed), the delayed requests with no store left, and
        carries ``results`` as ``completed_jobs``; the invalid blocks of every failed request
        await :meth:`get_block_ids_with_load_errors`.
        """
        ids = [result.job_id for result in results]
        if len(set(ids)) != len(ids) or any(job_id not in self._jobs for job_id in ids):
            raise ConfigError("results", ids, "names a job not in flight", "report each once")
        touched: set[RequestId] = set()
        for result in results:
            job = self._jobs.pop(result.job_id)
            if job.kind is TransferKind.LOAD and not job.sync:
                touched.add(job.request_id)
                if not result.success:
                    blocks = self._load_failed.get(job.request_id, frozenset())
                    blocks |= {item.block_id for item in job.items}
                    self._load_failed[job.request_id] = blocks
        finished = frozenset(rid for rid in touched if not self._loads_of(rid))
        failed = frozenset(rid for rid in finished if rid in self._load_failed)
        for rid in failed:
            self._errors[rid] = self._errors.get(rid, frozenset()) | self._load_failed.pop(rid)
        sent = frozenset(rid for rid in self._delayed if not self._stores_of(rid))
        self._delayed -= sent
        return KVConnectorOutput(finished, failed, sent, tuple(results))

    def get_block_ids_with_load_errors(self) -> dict[RequestId, frozenset[int]]:
        """The blocks failed load jobs left invalid, per request whose load failed; handed once.

        vLLM's hook returns the flat union of block ids, which it refuses on a layout with several
        KV cache groups (``scheduler.py:3712-3721``); here the ids come per request (the shape
        of :class:`spec.scheduler.FailureReport`), and block ids name blocks of the one shared
        pool. Post: every request failed since the last call, with its failed jobs' destination
        blocks; the next call returns nothing new until another load fails.
        """
        errors, self._errors = self._errors, {}
        return errors

    # ----------------------------------------------------------------- copies and views

    def clone(self) -> ReferenceWorker:
        """An independent copy (jobs are frozen values).

        Frame: nothing changes in ``self``. Post: the copy's :meth:`snapshot` and :meth:`freeze`
        equal ``self``'s; no container is shared, so mutating one never changes the other.
        """
        twin = type(self).__new__(type(self))
        twin._jobs = dict(self._jobs)
        twin._load_failed = dict(self._load_failed)
        twin._errors = dict(self._errors)
        twin._delayed = set(self._delayed)
        return twin

    def snapshot(self) -> dict[str, Any]:
        """The plain dict of the module docstring's schema. Frame: nothing changes."""
        return {
            "jobs": tuple(
                (int(j), job.kind.value, job.request_id, job.sync)
                for j, job in sorted(self._jobs.items())
            ),
            "load_failed": tuple(sorted(self._load_failed)),
            "invalid_blocks": _plain_blocks(self._load_failed),
            "load_errors": _plain_blocks(self._errors),
            "delayed": tuple(sorted(self._delayed)),
        }

    def freeze(self) -> Hashable:
        """A hashable key of the worker's state.

        The values of :meth:`snapshot`, in schema order: equal exactly when the snapshots are.
        Frame: nothing changes.
        """
        snap = self.snapshot()
        return tuple(snap[name] for name in _SNAPSHOT_KEYS)

    def _loads_of(self, rid: RequestId) -> int:
        return sum(1 for j in self._jobs.values() if j.request_id == rid and not _is_store(j))

    def _stores_of(self, rid: RequestId) -> int:
        return sum(1 for j in self._jobs.values() if j.request_id == rid and _is_store(j))


_SNAPSHOT_KEYS = ("jobs", "load_failed", "invalid_blocks", "load_errors", "delayed")


def _plain_blocks(
    blocks: dict[RequestId, frozenset[int]],
) -> tuple[tuple[RequestId, tuple[int, ...]], ...]:
    return tuple((rid, tuple(sorted(ids))) for rid, ids in sorted(blocks.items()))


def _is_store(job: TransferJob) -> bool:
    return job.kind is TransferKind.STORE
