"""The worker side: run the core's load and store jobs with a transfer engine, report them.

A :class:`TransferWorker` turns each :class:`~hybridkv.connector.api.TransferJob` into one
transfer-engine job of ``(group, GPU block, host slot)`` pairs over canonical caches
(:mod:`hybridkv.canonical`), the slot of each offload key read off the host store that owns it
(:meth:`hybridkv.store.HostStore.slots`), and folds finished jobs into request-level outcomes
through a :class:`~hybridkv.connector.tracker.JobTracker`, the twin of the reference worker.
Connector job ids (``TransferJob.job_id``) and the engine's job ids are separate numberings;
the worker maps one to the other.

In vLLM's per-step worker order (``v1/worker/gpu/kv_connector.py``):

1. :meth:`TransferWorker.bind_connector_metadata` (``bind_connector_metadata`` +
   ``start_load_kv``): every job is checked before any is accepted; loads are submitted, and
   sync loads are waited for, since their request runs in this step's forward;
2. the forward;
3. :meth:`TransferWorker.wait_for_save`: stores are submitted, after the forward that wrote
   their sources (a store must read its blocks in stream order after the compute, #39306);
4. :meth:`TransferWorker.get_transfer_results`: finished jobs, folded; completed-job ids in
   ascending order, so a run is reproducible whatever the copy thread's timing.

With speculative decoding vLLM swaps 3 and 4: the runner collects the transfer results right
after the target forward and calls ``wait_for_save`` only after the drafter ran, so the draft
layers' KV of this step is written in between (``v1/worker/kv_connector_model_runner_mixin.py``
lines 91-96 with ``defer_finalize``, ``finalize_kv_connector`` at 53-61, called from
``v1/worker/gpu_model_runner.py:4471-4475``; model runner v2: ``v1/worker/gpu/kv_connector.py``
``post_forward(defer_finalize=True)`` at 146-148, ``finalize_step`` at 162-166, called from
``v1/worker/gpu/model_runner.py:2258-2260`` and ``2343-2344``). So stores are submitted in
:meth:`TransferWorker.wait_for_save` only, never by :meth:`TransferWorker.get_transfer_results`:
a store issued there would copy the draft layers' slots before the drafter wrote them. Such a
step's stores report at a later step's fold (the scheduler side keeps their sources pinned and
the finished request's free delayed until then, so vLLM keeps stepping). A step whose
``wait_for_save`` never comes (vLLM skips it only on a pipeline stage that is not the last,
which the connector refuses) still submits its stores: at the next
:meth:`TransferWorker.bind_connector_metadata`, when every write of that step precedes them in
stream order; no store waits for ever.

Load deadlines: :meth:`TransferWorker.abandon` stops the load jobs the scheduler side gave up on
(:class:`~hybridkv.connector.deadlines.LoadDeadlines`): the engine cancels a copy not started
and waits for one running (:meth:`hybridkv.transfer.TransferEngine.abandon`), and only then is
the job reported, failed. The scheduler learns of the failure (``failed_recving``) no earlier
than the copy stopped, so the blocks it then frees or recomputes into are never written late.

Faults: a ``fault_hook`` (``TransferJob -> bool``) fails a job on purpose: it is not submitted
and reports as failed, never as a silent success; the engine's own failures (an exception while
copying, the CPU engine's own fault hook) report as failed too. A failed load leaves its
destination blocks unspecified, as vLLM's does.

Only whole blocks move (the engine's unit): every group's offload unit must be its block
(``chunk_size`` a multiple of every attention block); a load naming one block twice is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import NamedTuple, Protocol

from hybridkv.canonical import CanonicalCaches
from hybridkv.connector.api import (
    ConnectorMeta,
    JobId,
    JobResult,
    KVConnectorOutput,
    RequestId,
    TransferJob,
    TransferKind,
)
from hybridkv.connector.tracker import JobTracker
from hybridkv.errors import HybridKVConfigError
from hybridkv.hostmem import HostMemory
from hybridkv.store import LookupResult
from hybridkv.transfer import Direction, TransferEngine, TransferPair
from hybridkv.transfer import JobId as EngineJobId

__all__ = ["HostSlots", "JobFaultHook", "TransferWorker", "WorkerStats"]

JobFaultHook = Callable[[TransferJob], bool]
"""Called once per job before it is submitted; True fails the job (fault injection)."""

_LOAD = TransferKind.LOAD
_WANTED = {_LOAD: LookupResult.HIT, TransferKind.STORE: LookupResult.HIT_PENDING}


class HostSlots(Protocol):
    """Where the worker reads each key's host slot and state: a :class:`hybridkv.store.HostStore`
    in one process; in vLLM's split (the store lives with the scheduler) a view the metadata
    carries."""

    @property
    def capacity(self) -> int:
        """Entries (so slots) the store can hand out."""
        ...

    def status(self, key: bytes) -> LookupResult:
        """HIT (READY), HIT_PENDING (STORING) or MISS."""
        ...

    def slots(self, keys: Sequence[bytes]) -> tuple[int, ...]:
        """The host slot of each key (each has an entry)."""
        ...


class WorkerStats(NamedTuple):
    """Jobs and bytes since creation.

    ``blocks_*`` and ``bytes_*`` count the jobs handed to the engine, at submission: a load
    cancelled by :meth:`TransferWorker.abandon` counts there though it moved nothing.
    ``jobs_failed`` counts the jobs that failed before submission or in the engine (a cancelled
    copy included); ``jobs_abandoned`` the load jobs abandoned, whatever their copy did.
    """

    jobs_submitted: int
    jobs_failed: int
    faults_injected: int
    blocks_loaded: int
    blocks_stored: int
    bytes_loaded: int
    bytes_stored: int
    jobs_abandoned: int


class TransferWorker:
    """Runs connector jobs with a transfer engine and reports them (module docstring)."""

    def __init__(
        self,
        engine: TransferEngine,
        store: HostSlots,
        caches: CanonicalCaches,
        host: HostMemory,
        *,
        fault_hook: JobFaultHook | None = None,
    ) -> None:
        """A worker over ``engine`` (built on ``caches`` and ``host``) and ``store``'s slots.

        Pre: ``store``'s capacity fits in ``host``'s slots (field ``num_chunks``): every slot
        the store hands out must exist. Post: nothing in flight.
        """
        if store.capacity > host.num_slots:
            raise HybridKVConfigError(
                "num_chunks",
                store.capacity,
                f"exceeds the {host.num_slots} slots of host memory",
                f"give the store at most {host.num_slots} chunks, or more host memory",
            )
        self.engine = engine
        self.store = store
        self._num_blocks = caches.num_blocks
        self._group_bytes = tuple(caches.group_bytes(g) for g in range(len(caches.group_refs)))
        self._fault_hook = fault_hook
        self._tracker = JobTracker()
        self._jobs_of: dict[EngineJobId, JobId] = {}
        self._stores: list[tuple[TransferJob, list[TransferPair]]] = []
        self._finished: list[JobResult] = []  # finished, not reported yet
        self._abandoned: set[JobId] = set()  # stopped loads, reported failed at the next fold
        self._count = dict.fromkeys(WorkerStats._fields, 0)

    # ----------------------------------------------------------------- the step

    def bind_connector_metadata(self, meta: ConnectorMeta) -> None:
        """Accept this step's jobs: submit the loads (waiting for sync ones), queue the stores
        for :meth:`wait_for_save` (stores still queued from an earlier step are submitted
        first: its ``wait_for_save`` never came).

        Pre: fresh job ids (field ``job_id``); every item names a known group (``group_idx``),
        a real block inside the caches (``block_id``: the null block and blocks past the cache
        are refused), a key whose entry is READY for a load and STORING for a store (``key``),
        and a load names each block once. Refusal: nothing is accepted or submitted, no byte
        moves. Post: the jobs are in flight.
        """
        self._tracker.check_fresh(meta)
        jobs = (*meta.load_jobs, *meta.store_jobs)
        plans = [(job, self._pairs(job)) for job in jobs]
        self._tracker.bind_connector_metadata(meta)
        # Stores of an earlier step whose wait_for_save never came: that step is over, so its
        # writes (the drafter's included) precede them; their sources are still pinned.
        self.wait_for_save()
        sync: list[EngineJobId] = []
        for job, pairs in plans:
            if job.kind is not _LOAD:
                self._stores.append((job, pairs))
                continue
            submitted = self._submit(job, pairs)
            if job.sync and submitted is not None:
                sync.append(submitted)
        if sync:
            self.engine.wait(sync)

    def wait_for_save(self) -> None:
        """Submit the stores bound this step (vLLM ``wait_for_save``: after the forward, and
        after the drafter with speculative decoding); the only place a store is submitted
        besides the next bind (module docstring)."""
        stores, self._stores = self._stores, []
        for job, pairs in stores:
            self._submit(job, pairs)

    def get_transfer_results(
        self, *, wait: bool = False, hold: Collection[JobId] = ()
    ) -> KVConnectorOutput:
        """Fold every finished job into request-level outcomes.

        Submits nothing: with speculative decoding vLLM calls this before the drafter writes
        and before ``wait_for_save`` (module docstring), so stores bound and not submitted yet
        stay queued and report at a later call. ``wait``: block until every job submitted
        (except ``hold``) has finished, so the report does not depend on timing.
        ``hold``: jobs whose results stay unreported this call even if finished (a simulator
        delays completions this way). Post: the reported jobs left flight; the output is the
        :class:`JobTracker`'s, results in ascending job id order.
        """
        if wait:
            self.engine.wait([e for e, j in self._jobs_of.items() if j not in hold])
        self._drain()
        held = set(hold)
        report = sorted(self._outcome(r) for r in self._finished if r.job_id not in held)
        self._finished = [r for r in self._finished if r.job_id in held]
        return self._tracker.get_transfer_results(tuple(report))

    def abandon(self, job_ids: Iterable[JobId]) -> tuple[JobId, ...]:
        """Stop the named load jobs; each reports failed at the next fold (a load deadline).

        Pre: each id names a load job (field ``job_id``: a store job is never abandoned, the
        scheduler pins its sources until it reports). An id not in flight is skipped: its
        report already left (or it was never bound), and that report stands. Refusal: nothing
        is stopped. Post: no byte of a named job moves after the call returns (the engine
        cancelled its copy or waited for it, :meth:`TransferEngine.abandon`); each named job
        in flight reports ``success=False`` at the next :meth:`get_transfer_results`, whether
        or not its bytes landed, so the outcome does not depend on the copy's timing. Returns
        the ids abandoned, ascending.
        """
        wanted = sorted(set(job_ids) & set(self._tracker.in_flight()))
        for job_id in wanted:
            job = self._tracker.job(job_id)
            if job.kind is not _LOAD:
                raise _bad(job, "job_id", job_id, "is a store job", "abandon load jobs only")
        chosen = set(wanted)
        running = [e for e, j in self._jobs_of.items() if j in chosen]
        if running:
            self.engine.abandon(running)
        self._abandoned.update(chosen)
        self._count["jobs_abandoned"] += len(wanted)
        return tuple(wanted)

    def get_block_ids_with_load_errors(self) -> dict[RequestId, frozenset[int]]:
        """Per request whose load failed, the blocks its failed jobs left invalid; handed once
        (:meth:`JobTracker.get_block_ids_with_load_errors`)."""
        return self._tracker.get_block_ids_with_load_errors()

    # ----------------------------------------------------------------- queries

    def in_flight(self) -> tuple[JobId, ...]:
        """Connector job ids bound and not reported yet, ascending."""
        return self._tracker.in_flight()

    def stats(self) -> WorkerStats:
        """Counts since creation."""
        return WorkerStats._make(self._count[name] for name in WorkerStats._fields)

    # ----------------------------------------------------------------- helpers

    def _pairs(self, job: TransferJob) -> list[TransferPair]:
        """The job's (group, block, slot) pairs, every item checked (no side effect)."""
        wanted = _WANTED[job.kind]
        num_groups = len(self._group_bytes)
        seen: set[int] = set()
        keys = []
        for item in job.items:
            g, block, key = item.group_idx, item.block_id, item.key
            if not _int_in(g, 0, num_groups):
                raise _bad(job, "group_idx", g, f"is not one of the {num_groups} groups")
            if not _int_in(block, 1, self._num_blocks):
                why = "is the null block" if block == 0 else "is outside the GPU cache"
                raise _bad(job, "block_id", block, why)
            if job.kind is _LOAD and block in seen:
                raise _bad(
                    job,
                    "block_id",
                    block,
                    "is loaded twice in one job (units smaller than a block)",
                    "use a chunk_size that is a multiple of every attention block",
                )
            seen.add(block)
            status = self.store.status(key)
            if status is not wanted:
                state = {LookupResult.MISS: "has no host entry", LookupResult.HIT: "is READY"}
                raise _bad(job, "key", key.hex(), state.get(status, "is still being stored"))
            keys.append(key)
        if len(set(keys)) != len(keys):
            raise _bad(job, "key", "repeated", "names one key twice")
        slots = self.store.slots(keys)
        return [
            TransferPair(item.group_idx, item.block_id, slot)
            for item, slot in zip(job.items, slots, strict=True)
        ]

    def _submit(self, job: TransferJob, pairs: list[TransferPair]) -> EngineJobId | None:
        """Submit one job, or fail it (an injected fault, an engine refusal): None then."""
        count = self._count
        if self._fault_hook is not None and self._fault_hook(job):
            count["faults_injected"] += 1
            self._fail(job.job_id)
            return None
        direction = Direction.LOAD if job.kind is _LOAD else Direction.STORE
        try:
            submitted = self.engine.submit(direction, pairs)
        except Exception:  # an engine that cannot take the job fails it, never drops it
            self._fail(job.job_id)
            return None
        self._jobs_of[submitted] = job.job_id
        count["jobs_submitted"] += 1
        moved = sum(self._group_bytes[p.group] for p in pairs)
        kind = "loaded" if job.kind is _LOAD else "stored"
        count[f"blocks_{kind}"] += len(pairs)
        count[f"bytes_{kind}"] += moved
        return submitted

    def _outcome(self, result: JobResult) -> JobResult:
        """The result to report: an abandoned job fails, whatever its copy did."""
        if result.job_id not in self._abandoned:
            return result
        self._abandoned.discard(result.job_id)
        return JobResult(result.job_id, False)

    def _fail(self, job_id: JobId) -> None:
        self._count["jobs_failed"] += 1
        self._finished.append(JobResult(job_id, False))

    def _drain(self) -> None:
        for finished in self.engine.poll():
            job_id = self._jobs_of.pop(finished.job_id)
            if not finished.success:
                self._count["jobs_failed"] += 1
            self._finished.append(JobResult(job_id, finished.success))

    def drain(self, job_ids: Iterable[JobId] | None = None) -> None:
        """Block until the named connector jobs (default: all submitted) have finished."""
        wanted = None if job_ids is None else set(job_ids)
        self.engine.wait([e for e, j in self._jobs_of.items() if wanted is None or j in wanted])


def _int_in(value: object, low: int, high: int) -> bool:
    """An int (not a bool) in ``[low, high)``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def _bad(job: TransferJob, field: str, value: object, problem: str, fix: str = "") -> Exception:
    return HybridKVConfigError(
        field,
        value,
        f"{problem} ({job.kind.value} job {job.job_id} of {job.request_id})",
        fix or "bind only jobs the connector core built for this worker's caches and store",
    )
