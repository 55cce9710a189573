"""Job bookkeeping shared by the engines: ids, finished results, waiting."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from hybridkv.errors import HybridKVConfigError
from hybridkv.transfer.api import FinishedJob, JobId

__all__ = ["JobBook"]


class JobBook:
    """Issues job ids and records each job's single completion; thread-safe.

    Memory is bounded by the jobs in flight, not by the jobs ever run. Ids are issued in
    increasing order, so ``1 <= job < next id`` says a job was issued and membership in the
    in-flight set says whether it finished: a finished id is simply one issued and no longer in
    flight. That is all correctness needs (``finish`` once, ``is_done``, ``wait_done``), so a
    finished id is forgotten the moment it finishes (until its result is polled it also sits in
    the unreported list, which ``take_finished`` drains). A server runs millions of jobs; a set
    of every finished id grew for its whole life.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 1
        self._in_flight: set[JobId] = set()
        self._unreported: list[FinishedJob] = []

    def new_id(self) -> JobId:
        with self._cond:
            job = JobId(self._next)
            self._next += 1
            self._in_flight.add(job)
            return job

    def finish(self, job: JobId, success: bool) -> None:
        """Record ``job``'s completion (once; a second call is a bug and raises)."""
        with self._cond:
            if job not in self._in_flight:
                raise RuntimeError(f"job {job} finished twice (or was never issued)")
            self._in_flight.discard(job)
            self._unreported.append(FinishedJob(job, success))
            self._cond.notify_all()

    def take_finished(self) -> list[FinishedJob]:
        with self._cond:
            out, self._unreported = self._unreported, []
            return out

    def is_done(self, job: JobId) -> bool:
        """Whether an issued ``job`` finished (an id never issued is not done)."""
        with self._cond:
            return self._issued(job) and job not in self._in_flight

    def in_flight(self) -> int:
        """Jobs issued and not finished: the size of everything this book keeps per job, with
        the unreported results (bounded by the caller's polling)."""
        with self._cond:
            return len(self._in_flight)

    def check_known(self, job_ids: Iterable[JobId]) -> list[JobId]:
        """The ids as a list, refusing any this book never issued."""
        ids = list(job_ids)
        with self._cond:
            for job in ids:
                if not self._issued(job):
                    raise HybridKVConfigError(
                        "job_ids", job, "was never returned by submit", "wait for submitted jobs"
                    )
        return ids

    def wait_done(self, job_ids: Iterable[JobId]) -> None:
        ids = self.check_known(job_ids)
        with self._cond:
            self._cond.wait_for(lambda: not any(j in self._in_flight for j in ids))

    def wait_progress(self, timeout_s: float) -> None:
        """Block until a job finishes, for at most ``timeout_s``; at once when none is in
        flight or a finished one is unreported. The wait releases the GIL."""
        with self._cond:
            self._cond.wait_for(lambda: self._unreported or not self._in_flight, timeout_s)

    def _issued(self, job: object) -> bool:
        # Callers may pass anything; checked as a plain object (a bool is no id).
        return isinstance(job, int) and not isinstance(job, bool) and 1 <= job < self._next
