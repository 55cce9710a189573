"""A transfer engine whose jobs report ``delay`` polls late, by the native simulated worker's rule.

The in-process engine gives hybridkv's connector and vLLM's native one the same simulated copy
latency (``tools/bench_vs_native.py`` compares them at the same ``delay``).
:class:`hybridkv.vllm.harness.native_cpu.HostCopyWorker` reports a native job once it has been
polled ``delay`` times (one poll a step), in submission order per direction, and ``wait`` releases a
job and the ones before it; :class:`DelayedCompletion` applies that rule to hybridkv's real CPU
transfer engine (:class:`hybridkv.vllm.harness.cpu_worker.HybridKVOnCPU` puts it under the
connector's :class:`~hybridkv.connector.worker.TransferWorker`). Polls are counted before the check,
so delay 0 and delay 1 both report a job at the first poll after its submission, as the native rule
does.

When the bytes move:

- a load's bytes land when the load is due (its reporting poll, or a ``wait`` that releases
  it), as the native worker's do: a slow copy writes its blocks late. So a load abandoned before
  it is due (:meth:`DelayedCompletion.abandon`, a load deadline) is cancelled and never writes,
  and a connector that reported such a load without stopping it would see its bytes land later
  in blocks vLLM had already handed back (the in-process runner's content check catches that);
- a store's bytes move at submission, on the inner engine's copy thread, right after the
  step's forward wrote its sources (the order a GPU stream gives); only its report waits.

A reported job's bytes have landed: a job is waited for before it is reported. A load the inner
engine refuses when it falls due reports failed (the transfer worker checks every pair before
it submits, so its jobs are not refused there).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hybridkv.transfer import Direction, TransferEngine, TransferPair
from hybridkv.transfer.api import FinishedJob, JobId

__all__ = ["DelayedCompletion"]


@dataclass(slots=True)
class _Job:
    """One job: its id here, the polls it has seen, and the inner engine's job once submitted
    (``pairs`` kept until then; ``cancelled``: abandoned before it was, it never will be)."""

    job_id: JobId
    direction: Direction
    pairs: Sequence[TransferPair]
    polls: int = 0
    inner: JobId | None = None
    cancelled: bool = False


class DelayedCompletion(TransferEngine):
    """A transfer engine whose jobs report after ``delay`` polls (module docstring)."""

    def __init__(self, inner: TransferEngine, delay: int) -> None:
        if delay < 0:
            raise ValueError(f"delay={delay}: a transfer takes 0 or more steps")
        self.inner = inner
        self.delay = delay
        self._next = 1
        self._queues: dict[Direction, deque[_Job]] = {d: deque() for d in Direction}
        self._released: list[_Job] = []  # due before their poll (wait, abandon): next poll
        self._results: dict[JobId, bool] = {}  # inner job -> success, polled, not reported
        self.cancelled = 0  # loads abandoned before they were due: they moved no byte

    def submit(self, direction: Direction, pairs: Sequence[TransferPair]) -> JobId:
        job = _Job(JobId(self._next), direction, tuple(pairs))
        if direction is Direction.STORE:
            job.inner = self.inner.submit(direction, pairs)
        self._next += 1
        self._queues[direction].append(job)
        return job.job_id

    def poll(self) -> list[FinishedJob]:
        ready, self._released = self._released, []
        for queue in self._queues.values():
            for job in queue:
                job.polls += 1
            while queue and queue[0].polls >= self.delay:
                ready.append(queue.popleft())
        return self._report(ready)

    def wait(self, job_ids: Iterable[JobId]) -> None:
        wanted = set(job_ids)
        for queue in self._queues.values():
            last = max((i for i, job in enumerate(queue) if job.job_id in wanted), default=-1)
            for _ in range(last + 1):
                self._released.append(queue.popleft())
        self._land(self._released)

    def abandon(self, job_ids: Iterable[JobId]) -> None:
        """Cancel each named load not due yet (it reports failed at the next poll, no byte
        moved); a named job whose copy was submitted (a store, a released load) is stopped
        by the inner engine's own ``abandon`` and reports at the next poll."""
        wanted = set(job_ids)
        stopping: list[JobId] = []
        for queue in self._queues.values():
            for job in [j for j in queue if j.job_id in wanted]:
                queue.remove(job)
                self._released.append(job)
        for job in self._released:
            if job.job_id not in wanted:
                continue
            if job.inner is None:
                job.cancelled = True
                self.cancelled += 1
            else:
                stopping.append(job.inner)
        if stopping:
            self.inner.abandon(stopping)

    def close(self) -> None:
        # Queued loads still run (the contract: close finishes queued jobs); nobody polls them.
        self._land([job for queue in self._queues.values() for job in queue])
        self.inner.close()

    def pending(self) -> int:
        """Jobs submitted and not yet reported."""
        return sum(len(q) for q in self._queues.values()) + len(self._released)

    def _land(self, jobs: Iterable[_Job]) -> None:
        """Submit the loads among ``jobs`` not submitted yet, then wait for all their copies."""
        for job in jobs:
            if job.inner is None and not job.cancelled:
                try:
                    job.inner = self.inner.submit(job.direction, job.pairs)
                except Exception:  # refused: the job reports failed, no byte moved
                    job.cancelled = True
        self.inner.wait([job.inner for job in jobs if job.inner is not None])

    def _report(self, ready: list[_Job]) -> list[FinishedJob]:
        if not ready:
            return []
        self._land(ready)
        for finished in self.inner.poll():
            self._results[finished.job_id] = finished.success
        return [
            FinishedJob(job.job_id, job.inner is not None and self._results.pop(job.inner))
            for job in ready
        ]
