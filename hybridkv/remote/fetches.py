"""Fetches run side by side: a small pool of threads, each call bounded, a late result a miss.

The worker fetches a step's promoted chunks inside ``start_load_kv``. One after another, each
GET may wait the whole deadline, so a step's fetches could wait ``n`` deadlines; in a pool of
``workers`` threads they wait about ``ceil(n / workers)`` at worst, and the breaker
(:mod:`hybridkv.remote.breaker`) cuts the rest short once the server is seen down.

:meth:`FetchPool.run` runs a batch of calls and returns, per call, its result or :data:`LATE`:

- a call whose own run took longer than ``deadline_s`` is LATE (TT-4: a late fetch is a miss),
  even if it returned a value;
- a call not finished when the batch's wait ends (``deadline_s`` per round of ``workers``
  calls, plus :data:`SLACK_S`) is LATE, and whatever it returns later is dropped: the caller
  never sees it, so it can never write a slot after the caller reported.

The calls must not touch what the caller owns (host slots): they return values, and the
caller applies the ones in time on its own thread, whole or not at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from enum import Enum
from typing import Generic, TypeVar, cast

from hybridkv.errors import HybridKVConfigError

__all__ = ["LATE", "SLACK_S", "FetchPool", "Late"]

_T = TypeVar("_T")
SLACK_S = 0.05
"""Seconds the batch's wait allows beyond its rounds of deadlines (thread hand-offs)."""


class Late(Enum):
    """A call's result that did not come in time."""

    LATE = "late"


LATE = Late.LATE


class _Timed(Generic[_T]):
    __slots__ = ("call", "elapsed", "result")

    def __init__(self, call: Callable[[], _T]) -> None:
        self.call = call
        self.elapsed = 0.0
        self.result: _T | None = None

    def __call__(self) -> _Timed[_T]:
        start = time.monotonic()
        self.result = self.call()
        self.elapsed = time.monotonic() - start
        return self


class FetchPool:
    """``workers`` threads (started on the first batch) that run batches of bounded calls."""

    def __init__(self, workers: int = 4) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise HybridKVConfigError("fetch_workers", workers, "must be an int >= 1", "e.g. 4")
        self.workers = workers
        self._pool: ThreadPoolExecutor | None = None

    def run(self, calls: Sequence[Callable[[], _T]], deadline_s: float) -> list[_T | Late]:
        """Run ``calls`` side by side; per call, in order, its result or :data:`LATE`
        (module docstring). Waits at most ``deadline_s * ceil(len(calls) / workers) +
        SLACK_S``."""
        if not calls:
            return []
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="hybridkv-fetch")
        timed = [_Timed(call) for call in calls]
        futures: list[Future[_Timed[_T]]] = [self._pool.submit(t) for t in timed]
        rounds = -(-len(calls) // self.workers)
        wait(futures, timeout=deadline_s * rounds + SLACK_S)
        found: list[_T | Late] = []
        for future in futures:
            if not future.done():
                future.cancel()  # not started yet: never runs; running: its result is dropped
                found.append(LATE)
                continue
            done = future.result()  # a call that raised (a bug, not a fault) raises here
            found.append(LATE if done.elapsed > deadline_s else cast(_T, done.result))
        return found

    def close(self) -> None:
        """Stop the threads: calls not started never run; a late call still running is
        waited for (it ends at its own deadline), so the caller may then close what the calls
        use."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
