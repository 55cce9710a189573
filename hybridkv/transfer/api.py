"""The transfer engine's contract: jobs of (group, GPU block, host slot) pairs.

One API, two implementations with identical semantics (:class:`~hybridkv.transfer.cpu_engine.
CpuTransferEngine`, the reference, and :class:`~hybridkv.transfer.cuda_engine.
CudaTransferEngine`). A job copies, for every pair, the bytes of one block of one KV cache group
(all its layers, see :class:`hybridkv.canonical.CanonicalCaches`) between the GPU cache and a
host slot. The slot holds the group's runs back to back, in reference order.

Semantics both engines share:

- ``submit`` validates eagerly and refuses bad input (HybridKVConfigError) before any byte moves.
- Every accepted job finishes exactly once, successfully or not, and ``poll`` reports it exactly
  once. An exception while copying finishes the job as failed, never as a silent success; the
  destination bytes of a failed job are unspecified.
- Jobs of one direction run in submission order. Nothing orders a store against a load: a caller
  that needs it (loading a slot a store is still writing) waits for the first job.
- A store reads its source only after all work already submitted on the compute stream (on the
  CPU, work is synchronous, so this holds trivially).
- ``wait_progress`` is a hint a caller with nothing else to do gives the engine: it may block
  for at most its timeout and never changes what ``poll`` reports, only when.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from enum import Enum
from types import TracebackType
from typing import NamedTuple, NewType

__all__ = ["Direction", "EngineWrapper", "FinishedJob", "JobId", "TransferEngine", "TransferPair"]

JobId = NewType("JobId", int)


class Direction(Enum):
    """``STORE`` copies GPU blocks to host slots; ``LOAD`` copies host slots to GPU blocks."""

    STORE = "store"
    LOAD = "load"


class TransferPair(NamedTuple):
    """One block moved by a job: group ``group``'s block ``block`` and host slot ``slot``."""

    group: int
    block: int
    slot: int


class FinishedJob(NamedTuple):
    """A job that completed, successfully or not."""

    job_id: JobId
    success: bool


class TransferEngine(ABC):
    """Moves blocks between canonical GPU caches and host memory, asynchronously."""

    @abstractmethod
    def submit(self, direction: Direction, pairs: Sequence[TransferPair]) -> JobId:
        """Queue a job and return its id.

        Pre: every pair names an existing group, a block inside the cache and a slot inside host
        memory; a store names each slot at most once, a load each block at most once.
        Post: the job will finish exactly once and ``poll`` will report it.
        Frame: a refused call (HybridKVConfigError) queues nothing and moves no byte.
        """

    @abstractmethod
    def poll(self) -> list[FinishedJob]:
        """Jobs finished since the last poll, each reported once, in completion order."""

    @abstractmethod
    def wait(self, job_ids: Iterable[JobId]) -> None:
        """Block until every named job has finished (``poll`` still reports them).

        Pre: every id was returned by ``submit`` of this engine; refused otherwise, waiting for
        nothing.
        """

    def wait_progress(self, timeout_s: float) -> None:
        """Block until some job finishes, at most ``timeout_s`` seconds; a caller's idle turn.

        Returns at once when no job is in flight or a finished job awaits ``poll``. A caller
        that loops on ``poll`` with nothing else to do (vLLM's engine on a step that runs no
        forward) calls it so the engine's copies run: an engine whose copies need the
        caller's thread to step aside (the CPU engine's copy thread needs the GIL) blocks here,
        releasing it. This default returns at once, right for an engine whose copies progress
        without the caller (the CUDA engine: the GPU copies while Python spins, and ``poll``
        only queries events).

        Pre: ``timeout_s >= 0``. Frame: starts, finishes and reports nothing itself.
        """
        return

    def abandon(self, job_ids: Iterable[JobId]) -> None:
        """Stop the named jobs: when this returns, none of them moves another byte.

        A job not started yet may be cancelled (it then finishes failed, having moved nothing);
        a job already running is waited for. This default cancels nothing: it waits, the only
        safe stop for work already handed to hardware (a copy queued on a CUDA stream cannot
        be recalled). ``poll`` reports each named job once, as usual.

        Pre: every id was returned by ``submit`` of this engine; refused otherwise, waiting for
        nothing. Frame: other jobs are not affected.
        """
        self.wait(job_ids)

    @abstractmethod
    def close(self) -> None:
        """Finish queued jobs and release the engine's threads or streams. Idempotent."""

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class EngineWrapper(TransferEngine):
    """An engine over another one (``inner``) that hands every call through unchanged: a
    wrapper overrides only the calls it changes (a replica rank's stores, injected faults,
    held reports), so the rest of the contract is ``inner``'s by construction."""

    def __init__(self, inner: TransferEngine) -> None:
        self.inner = inner

    def submit(self, direction: Direction, pairs: Sequence[TransferPair]) -> JobId:
        return self.inner.submit(direction, pairs)

    def poll(self) -> list[FinishedJob]:
        return self.inner.poll()

    def wait(self, job_ids: Iterable[JobId]) -> None:
        self.inner.wait(job_ids)

    def wait_progress(self, timeout_s: float) -> None:
        self.inner.wait_progress(timeout_s)

    def abandon(self, job_ids: Iterable[JobId]) -> None:
        self.inner.abandon(job_ids)

    def close(self) -> None:
        self.inner.close()
