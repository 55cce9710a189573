"""A transfer engine whose jobs complete when a copy-time model says so (``hybridkv simulate``).

:class:`TimedTransferEngine` wraps a real engine (the CPU or CUDA one). ``submit`` checks the
job at once (the contract: a refused job moves no byte) and gives it a due time from the
:class:`~hybridkv.testbed.copy_time.CopyTimeModel`; the job's bytes move only when the simulation's
clock reaches that time (:meth:`TimedTransferEngine.advance`), and only then does ``poll``
report it. Moving the bytes at the modelled completion, not at submission, is the strict
choice: a block a pending load writes holds no loaded data until the load is reported, and a
store reads its source blocks as late as the model allows, so a scheduler that reads, reuses or
rewrites such a block too early leaves wrong content that the simulation's checks see.

The clock is the caller's: :meth:`~TimedTransferEngine.start_step` before a step's loads,
:meth:`~TimedTransferEngine.end_forward` before its stores, :meth:`~TimedTransferEngine.advance`
before polling. ``wait`` (a sync load) completes the named jobs at once: the step stalls for
them, as vLLM's forward waits for a sync load.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from hybridkv.canonical import CanonicalCaches
from hybridkv.errors import HybridKVConfigError
from hybridkv.hostmem import HostMemory
from hybridkv.testbed.copy_time import CopyTimeModel
from hybridkv.transfer import Direction, FinishedJob, JobId, TransferEngine, TransferPair
from hybridkv.transfer.plan import plan_copies

__all__ = ["PendingJob", "TimedTransferEngine"]


@dataclass(frozen=True, slots=True)
class PendingJob:
    """A submitted job whose modelled copy has not finished.

    Attributes:
        job_id: this engine's id for it.
        direction: load or store.
        pairs: the blocks it moves.
        submitted_step: the step it was submitted in.
        due_ns: when the model says its copy ends.
    """

    job_id: JobId
    direction: Direction
    pairs: tuple[TransferPair, ...]
    submitted_step: int
    due_ns: int


class TimedTransferEngine(TransferEngine):
    """Delays each job of ``inner`` to its modelled completion (module docstring)."""

    def __init__(
        self,
        inner: TransferEngine,
        model: CopyTimeModel,
        caches: CanonicalCaches,
        host: HostMemory,
        on_copy: Callable[[Direction, float], None] | None = None,
    ) -> None:
        """Pre: ``inner`` moves blocks of ``caches`` and ``host``. ``on_copy`` hears how long
        each batch of real copies took per direction (the report's GB/s)."""
        self.inner = inner
        self.model = model
        self._caches = caches
        self._host = host
        self._group_bytes = tuple(caches.group_bytes(g) for g in range(len(caches.group_refs)))
        self._on_copy = on_copy
        self._step = 0
        self._now = 0
        self._link_free = dict.fromkeys(Direction, 0)
        self._next = 1
        self._pending: dict[JobId, PendingJob] = {}
        self._finished: list[FinishedJob] = []
        self._moved = dict.fromkeys(Direction, 0)
        self._closed = False

    # ----------------------------------------------------------------- the clock
    def start_step(self) -> int:
        """Begin the next step: the clock is at its start. Returns the step (1-based)."""
        self._step += 1
        self._now = self.model.step_start_ns(self._step)
        return self._step

    def end_forward(self) -> None:
        """The step's forward is done: the clock is at the step's end."""
        self._now = self.model.step_end_ns(self._step)

    def advance(self) -> None:
        """Run every job due by now, in due order (per direction, submission order)."""
        due = sorted(
            (p for p in self._pending.values() if p.due_ns <= self._now),
            key=lambda p: (p.due_ns, p.job_id),
        )
        self._run(due)

    @property
    def step(self) -> int:
        """The current step (0 before the first)."""
        return self._step

    def bytes_moved(self, direction: Direction) -> int:
        """Bytes the successful jobs of ``direction`` have copied so far (at completion)."""
        return self._moved[direction]

    def pending(self) -> tuple[PendingJob, ...]:
        """Jobs submitted and not yet copied, by id."""
        return tuple(self._pending[j] for j in sorted(self._pending))

    # ----------------------------------------------------------------- the engine contract
    def submit(self, direction: Direction, pairs: Sequence[TransferPair]) -> JobId:
        """Check the job now, schedule its copy on its direction's link (module docstring).

        Frame: a refused job (HybridKVConfigError) is not scheduled and takes no link time.
        """
        if self._closed:
            raise HybridKVConfigError("engine", "closed", "submit after close", "open a new engine")
        plan_copies(self._caches, self._host.num_slots, self._host.slot_bytes, direction, pairs)
        nbytes = sum(self._group_bytes[p.group] for p in pairs)
        start = max(self._now, self._link_free[direction])
        due = start + self.model.job_ns(nbytes)
        self._link_free[direction] = due
        job = JobId(self._next)
        self._next += 1
        self._pending[job] = PendingJob(job, direction, tuple(pairs), self._step, due)
        return job

    def poll(self) -> list[FinishedJob]:
        """Jobs whose copy ran (at :meth:`advance` or :meth:`wait`), each once."""
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: Iterable[JobId]) -> None:
        """Run the named jobs now, with every earlier job of their direction (a stall).

        Refusal: an id this engine never issued raises :class:`HybridKVConfigError`.
        """
        ids = list(job_ids)
        for job in ids:
            value: object = job
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < self._next:
                raise HybridKVConfigError(
                    "job_ids", job, "was never returned by submit", "wait for submitted jobs"
                )
        wanted = [self._pending[j] for j in ids if j in self._pending]
        last = {
            d: max((p.job_id for p in wanted if p.direction is d), default=0) for d in Direction
        }
        self._run(
            sorted(
                (p for p in self._pending.values() if p.job_id <= last[p.direction]),
                key=lambda p: (p.due_ns, p.job_id),
            )
        )

    def close(self) -> None:
        """Run what is pending, then close the inner engine. Idempotent."""
        if not self._closed:
            self._run(sorted(self._pending.values(), key=lambda p: (p.due_ns, p.job_id)))
            self._closed = True
            self.inner.close()

    # ----------------------------------------------------------------- helpers
    def _run(self, jobs: Sequence[PendingJob]) -> None:
        """Copy ``jobs`` through the inner engine, loads then stores, each batch timed."""
        for direction in Direction:
            batch = [p for p in jobs if p.direction is direction]
            if not batch:
                continue
            start = time.perf_counter()
            inner_of: dict[JobId, JobId] = {}
            sizes = {p.job_id: sum(self._group_bytes[q.group] for q in p.pairs) for p in batch}
            for p in batch:
                del self._pending[p.job_id]
                try:
                    inner_of[self.inner.submit(direction, p.pairs)] = p.job_id
                except Exception:  # checked at submit; a refusal now still fails, never drops
                    self._finished.append(FinishedJob(p.job_id, False))
            self.inner.wait(list(inner_of))
            done = {f.job_id: f.success for f in self.inner.poll()}
            for inner_id, job in inner_of.items():
                self._finished.append(FinishedJob(job, done[inner_id]))
                if done[inner_id]:
                    self._moved[direction] += sizes[job]
            if self._on_copy is not None:
                self._on_copy(direction, time.perf_counter() - start)
