"""A transfer engine whose jobs report ``delay`` polls late, by the native simulated worker's rule.

The in-process engine gives hybridkv's connector and vLLM's native one the same simulated copy
latency (``tools/bench_vs_native.py`` compares them at the same ``delay``).
:class:`hybridkv.vllm.native_cpu.HostCopyWorker` reports a native job once it has been polled
``delay`` times (one poll a step), in submission order per direction, and ``wait`` releases a job
and the ones before it; :class:`DelayedCompletion` applies that rule to hybridkv's real CPU
transfer engine (:class:`hybridkv.vllm.cpu_worker.HybridKVOnCPU` puts it under the connector's
:class:`~hybridkv.connector.worker.TransferWorker`). Polls are counted before the check, so delay
0 and delay 1 both report a job at the first poll after its submission, as the native rule does.

The bytes move when the inner engine moves them (at once, on its copy thread); only the report
is held back, and a held job is waited for before it is reported, so a reported job's bytes
have landed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from hybridkv.transfer import Direction, TransferEngine, TransferPair
from hybridkv.transfer.api import FinishedJob, JobId

__all__ = ["DelayedCompletion"]


class DelayedCompletion(TransferEngine):
    """A transfer engine whose jobs report after ``delay`` polls (module docstring)."""

    def __init__(self, inner: TransferEngine, delay: int) -> None:
        if delay < 0:
            raise ValueError(f"delay={delay}: a transfer takes 0 or more steps")
        self.inner = inner
        self.delay = delay
        self._queues: dict[Direction, deque[list[int]]] = {d: deque() for d in Direction}
        self._released: list[JobId] = []  # completed by wait(), reported at the next poll
        self._results: dict[JobId, bool] = {}

    def submit(self, direction: Direction, pairs: Sequence[TransferPair]) -> JobId:
        job = self.inner.submit(direction, pairs)
        self._queues[direction].append([job, 0])
        return job

    def poll(self) -> list[FinishedJob]:
        ready, self._released = self._released, []
        for queue in self._queues.values():
            for entry in queue:
                entry[1] += 1
            while queue and queue[0][1] >= self.delay:
                ready.append(JobId(queue.popleft()[0]))
        return self._report(ready)

    def wait(self, job_ids: Iterable[JobId]) -> None:
        wanted = set(job_ids)
        for queue in self._queues.values():
            last = max((i for i, e in enumerate(queue) if e[0] in wanted), default=-1)
            for _ in range(last + 1):
                self._released.append(JobId(queue.popleft()[0]))
        self.inner.wait(self._released)

    def close(self) -> None:
        self.inner.close()

    def pending(self) -> int:
        """Jobs submitted and not yet reported."""
        return sum(len(q) for q in self._queues.values()) + len(self._released)

    def _report(self, ready: list[JobId]) -> list[FinishedJob]:
        if not ready:
            return []
        self.inner.wait(ready)
        for finished in self.inner.poll():
            self._results[finished.job_id] = finished.success
        return [FinishedJob(job, self._results.pop(job)) for job in ready]
