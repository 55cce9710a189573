"""Load deadlines, scheduler side: which load jobs have waited too long for their report.

vLLM 0.33 waits for every async load forever (field note #49829): a request stays in
WAITING_FOR_REMOTE_KVS until the worker reports it. A connector bounds that wait itself:
:class:`LoadDeadlines` counts, per load job, the steps since the metadata that carried it, and
names the jobs past the deadline so the next metadata can tell the worker to abandon them
(:meth:`hybridkv.connector.worker.TransferWorker.abandon`). Nothing is freed here: the worker
stops the copy and only then reports the job failed, and the scheduler recomputes the request
when that report arrives (vLLM's ``kv_load_failure_policy="recompute"``), so no block is reused
while a late copy could still write it. A policy apart from the core's accounting: the core
sees an abandoned job as a failed one, through the same report.

The rule: a load job emitted in step ``s``'s metadata and not reported by the outputs of steps
``s .. s + deadline - 1`` is named (once) when the first metadata built after those outputs
were applied is built: step ``s + deadline``'s when one step is in flight at a time, step
``s + deadline + b - 1``'s when vLLM keeps ``b`` batches in flight (async scheduling: ``b`` = 2,
step N+1's metadata is built before step N's output is applied; counting metadata alone would
name a load reported in time one step early). A sync load is never named: it is waited for
inside the step that carries it.

A request whose load was abandoned is recomputed for the rest of its life: the connector claims
nothing more for it (:meth:`LoadDeadlines.recomputing`). Its host chunks were slow once and
would likely be again, each abandoned attempt costs the request ``deadline`` steps, and in
vLLM 0.33 an async claim by a request whose load failed can be refused at every step (finding
F2 of docs/explanation/vllm-differential.md: the request's own remaining blocks stay reserved
against it), so a claim nobody makes is also a wedge nobody can hit.
"""

from __future__ import annotations

from collections.abc import Iterable

from hybridkv.connector.api import JobId, RequestId, TransferJob, TransferKind
from hybridkv.errors import HybridKVConfigError

__all__ = ["LoadDeadlines"]


class LoadDeadlines:
    """Steps each async load job has been pending, and the deadline (module docstring)."""

    def __init__(self, deadline_steps: int, batches_in_flight: int = 1) -> None:
        """Pre: ``deadline_steps`` an int >= 1 (field ``load_deadline_steps``);
        ``batches_in_flight`` an int >= 1, vLLM's ``max_concurrent_batches`` (module docstring).
        Post: nothing pending, nothing fired."""
        for name, value in (
            ("load_deadline_steps", deadline_steps),
            ("batches_in_flight", batches_in_flight),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise HybridKVConfigError(name, value, "must be an integer >= 1", "e.g. 8")
        self.deadline_steps = deadline_steps
        # Metadata built before the outputs of the deadline's steps are all applied.
        self._named_at = deadline_steps + batches_in_flight - 1
        self._age: dict[JobId, int] = {}  # pending job -> metadata built since its emission
        self._fired: set[JobId] = set()  # pending jobs already named
        self._request: dict[JobId, RequestId] = {}  # pending job -> its request
        self._late: set[RequestId] = set()  # requests whose load was abandoned, not finished
        self.fired = 0  # jobs named since creation (``deadlines_fired``)

    def step(self, load_jobs: Iterable[TransferJob]) -> tuple[JobId, ...]:
        """One metadata is being built, carrying ``load_jobs``: age the pending jobs by one
        step, return those reaching the deadline now (ascending, each once in its life; their
        requests are recomputing from now on), then start counting the async ones among
        ``load_jobs``.

        Pre: ``load_jobs`` are load jobs not seen before (field ``load_jobs``; nothing changes
        on a refusal).
        """
        fresh = [job for job in load_jobs if not job.sync]
        for job in fresh:
            if job.kind is not TransferKind.LOAD or job.job_id in self._age:
                raise HybridKVConfigError(
                    "load_jobs", job.job_id, "is not a new load job", "pass each load once"
                )
        due = []
        for job_id in self._age:
            self._age[job_id] += 1
            if self._age[job_id] >= self._named_at and job_id not in self._fired:
                due.append(job_id)
        self._fired.update(due)
        self.fired += len(due)
        self._late.update(self._request[job_id] for job_id in due)
        for job in fresh:
            self._age[job.job_id] = 0
            self._request[job.job_id] = job.request_id
        return tuple(sorted(due))

    def reported(self, job_ids: Iterable[JobId]) -> None:
        """Forget the named jobs (their report arrived); ids not pending are ignored (a store
        job, a sync load)."""
        for job_id in job_ids:
            self._age.pop(job_id, None)
            self._fired.discard(job_id)
            self._request.pop(job_id, None)

    def recomputing(self, request_id: RequestId) -> bool:
        """Whether a load of the request was abandoned (claim nothing more for it)."""
        return request_id in self._late

    def finished(self, request_id: RequestId) -> None:
        """Forget the request (it finished); its jobs still pending stay counted."""
        self._late.discard(request_id)

    def pending(self) -> int:
        """Async load jobs emitted and not reported yet."""
        return len(self._age)

    def abandoned(self) -> tuple[JobId, ...]:
        """Pending jobs already named (abandoned, their report not back yet), ascending."""
        return tuple(sorted(self._fired))
