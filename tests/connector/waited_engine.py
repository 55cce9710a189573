"""A transfer engine for tests whose copies happen only when someone waits for them.

The CPU engine copies on its own thread, so a test that reads bytes right after submitting can
see them land or not, depending on the thread's timing: a check that "the bytes are there"
passes by luck when the code under test forgot to wait. :class:`CopiesWhenWaited` moves nothing
at ``submit``; a job's bytes land inside the ``wait`` that names it (with every earlier job of
its direction first: jobs of one direction run in submission order, the engine contract) or at
``close``. A read that no wait preceded sees the old bytes, every run. ``abandon`` cancels a job
not copied yet: it finishes failed and never copies.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from hybridkv.canonical import CanonicalCaches
from hybridkv.errors import HybridKVConfigError
from hybridkv.hostmem import HostMemory
from hybridkv.transfer import Direction, FinishedJob, JobId, TransferEngine, TransferPair
from hybridkv.transfer.plan import CopyRun, check_fits, plan_copies


class CopiesWhenWaited(TransferEngine):
    """Copies on the waiting thread, at the wait (module docstring)."""

    def __init__(self, caches: CanonicalCaches, host: HostMemory) -> None:
        check_fits(caches, host.slot_bytes)
        self._caches = caches
        self._host = host
        self._pending: dict[JobId, tuple[Direction, list[CopyRun]]] = {}  # submission order
        self._finished: list[FinishedJob] = []
        self._next = 1
        self.copied: list[JobId] = []  # jobs whose bytes moved, in the order they moved
        self.cancelled: list[JobId] = []  # jobs abandoned before they copied

    def submit(self, direction: Direction, pairs: Sequence[TransferPair]) -> JobId:
        host = self._host
        runs = plan_copies(self._caches, host.num_slots, host.slot_bytes, direction, pairs)
        job = JobId(self._next)
        self._next += 1
        self._pending[job] = (direction, runs)
        return job

    def poll(self) -> list[FinishedJob]:
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: Iterable[JobId]) -> None:
        ids = list(job_ids)
        for job in ids:
            if not 1 <= job < self._next:
                raise HybridKVConfigError("job_ids", job, "was never submitted", "wait for yours")
        for job in ids:
            if job in self._pending:
                direction = self._pending[job][0]
                earlier = [j for j, (d, _) in self._pending.items() if d is direction and j <= job]
                for j in earlier:
                    self._copy(j)

    def abandon(self, job_ids: Iterable[JobId]) -> None:
        for job in job_ids:
            if self._pending.pop(job, None) is not None:
                self.cancelled.append(job)
                self._finished.append(FinishedJob(job, False))

    def close(self) -> None:
        for job in list(self._pending):
            self._copy(job)

    def _copy(self, job: JobId) -> None:
        direction, runs = self._pending.pop(job)
        host = self._host.tensor.view(torch.int8)
        for run in runs:
            flat = self._caches.tensors[run.tensor].flat
            dev = flat[run.device_offset : run.device_offset + run.nbytes]
            hst = host[run.host_offset : run.host_offset + run.nbytes]
            if direction is Direction.STORE:
                hst.copy_(dev)
            else:
                dev.copy_(hst)
        self.copied.append(job)
        self._finished.append(FinishedJob(job, True))
