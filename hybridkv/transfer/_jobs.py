"""Job bookkeeping shared by the engines: ids, finished results, waiting."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from hybridkv.errors import HybridKVConfigError
from hybridkv.transfer.api import FinishedJob, JobId

__all__ = ["JobBook"]


class JobBook:
    """Issues job ids and records each job's single completion; thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 1
        self._done: set[JobId] = set()
        self._unreported: list[FinishedJob] = []

    def new_id(self) -> JobId:
        with self._cond:
            job = JobId(self._next)
            self._next += 1
            return job

    def finish(self, job: JobId, success: bool) -> None:
        """Record ``job``'s completion (once; a second call is a bug and raises)."""
        with self._cond:
            if job in self._done:
                raise RuntimeError(f"job {job} finished twice")
            self._done.add(job)
            self._unreported.append(FinishedJob(job, success))
            self._cond.notify_all()

    def take_finished(self) -> list[FinishedJob]:
        with self._cond:
            out, self._unreported = self._unreported, []
            return out

    def is_done(self, job: JobId) -> bool:
        with self._cond:
            return job in self._done

    def check_known(self, job_ids: Iterable[JobId]) -> list[JobId]:
        """The ids as a list, refusing any this book never issued."""
        ids = list(job_ids)
        with self._cond:
            for job in ids:
                value: object = job  # callers may pass anything; check it as a plain object
                if (
                    isinstance(value, bool)
                    or not isinstance(value, int)
                    or not 1 <= value < self._next
                ):
                    raise HybridKVConfigError(
                        "job_ids", job, "was never returned by submit", "wait for submitted jobs"
                    )
        return ids

    def wait_done(self, job_ids: Iterable[JobId]) -> None:
        ids = self.check_known(job_ids)
        with self._cond:
            self._cond.wait_for(lambda: all(j in self._done for j in ids))
