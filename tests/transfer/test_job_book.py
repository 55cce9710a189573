"""The job bookkeeping both transfer engines share (:class:`hybridkv.transfer._jobs.JobBook`):
its memory stays flat over a server's life, and forgetting finished ids loses no check."""

from __future__ import annotations

import threading
import tracemalloc

import pytest

from hybridkv.errors import HybridKVConfigError
from hybridkv.transfer import FinishedJob, JobId
from hybridkv.transfer._jobs import JobBook

JOBS = 100_000
# A set of 100,000 finished ids costs about 7 MB (measured on main: 6.9 MB); what a bounded
# book keeps is a few transient lists. The margin is that far from both.
FLAT_BYTES = 256 << 10


def _run_jobs(book: JobBook, count: int, batch: int = 100) -> None:
    for _ in range(count // batch):
        ids = [book.new_id() for _ in range(batch)]
        for job in ids:
            book.finish(job, True)
        book.wait_done(ids)
        assert book.is_done(ids[-1])
        assert len(book.take_finished()) == batch


def test_100000_jobs_leave_the_books_memory_flat() -> None:
    book = JobBook()
    _run_jobs(book, 1_000)  # warm-up: first-use allocations are not a leak
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        _run_jobs(book, JOBS)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < FLAT_BYTES, f"{grown} bytes kept after {JOBS} finished jobs"
    assert book.in_flight() == 0


def test_forgotten_ids_still_answer_every_question() -> None:
    book = JobBook()
    first, second = book.new_id(), book.new_id()
    assert (book.in_flight(), book.is_done(first)) == (2, False)
    book.finish(first, False)
    assert book.is_done(first)
    assert not book.is_done(second)
    assert book.in_flight() == 1
    with pytest.raises(RuntimeError, match="finished twice"):
        book.finish(first, True)  # forgotten, yet a second finish is still caught
    with pytest.raises(RuntimeError):
        book.finish(JobId(99), True)  # never issued
    assert not book.is_done(JobId(99))
    for bad in (JobId(0), JobId(3), True, "1"):
        with pytest.raises(HybridKVConfigError):
            book.check_known([bad])  # type: ignore[list-item]
    book.wait_done([first])  # finished long ago: returns at once
    waiter = threading.Thread(target=book.wait_done, args=([first, second],))
    waiter.start()
    waiter.join(0.05)
    assert waiter.is_alive()  # second is still in flight
    book.finish(second, True)
    waiter.join(5)
    assert not waiter.is_alive()
    assert book.take_finished() == [FinishedJob(first, False), FinishedJob(second, True)]
    assert book.take_finished() == []
