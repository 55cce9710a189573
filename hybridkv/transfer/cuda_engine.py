"""The CUDA transfer engine: copy-engine DMA on separate load and store streams.

Ordering (why each step is there):

- Every job first makes its stream wait on an event recorded on the submitting thread's
  current (compute) stream. A store therefore reads its GPU source only after the compute
  that wrote it (vLLM #39306: relaxing this is unsafe for stores); a load overwrites its GPU
  blocks only after compute already queued that may still read their previous content.
- Loads and stores run on two streams, so the directions overlap each other and the compute;
  within a direction jobs run in submission order (one stream each).
- Runs are coalesced by :mod:`hybridkv.transfer.plan`, then submitted in one
  ``cuMemcpyBatchAsync`` call when the driver has it, else one ``cudaMemcpyAsync``
  (``copy_(non_blocking=True)``) per run.
- Completion is an event recorded after the copies; ``poll`` queries events in order, ``wait``
  synchronises them. An exception while issuing, or a CUDA error seen on the event, finishes
  the job as failed; a failed job still waits for its event, so nothing reuses a destination
  that an in-flight copy may still write.

Importing this module needs no CUDA; constructing the engine does.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from hybridkv.canonical import CanonicalCaches
from hybridkv.errors import HybridKVConfigError
from hybridkv.hostmem import HostMemory
from hybridkv.transfer._jobs import JobBook
from hybridkv.transfer.api import Direction, FinishedJob, JobId, TransferEngine, TransferPair
from hybridkv.transfer.cpu_engine import FaultHook
from hybridkv.transfer.cuda_batch import (
    SRC_ORDER_ANY,
    SRC_ORDER_STREAM,
    BatchCopier,
    resolve_batch_copier,
)
from hybridkv.transfer.plan import CopyRun, check_fits, plan_copies

__all__ = ["BatchMode", "CudaTransferEngine"]


class BatchMode(Enum):
    """``AUTO`` batches when the driver can; ``OFF`` copies run by run; ``REQUIRED`` refuses
    to construct without cuMemcpyBatchAsync."""

    AUTO = "auto"
    OFF = "off"
    REQUIRED = "required"


@dataclass(frozen=True, slots=True, eq=False)
class _InFlight:
    job: JobId
    done: Any  # torch.cuda.Event (untyped in torch's stubs)
    issued: bool  # False: issuing raised, the job fails once its event completes
    keep_alive: object  # descriptor arrays the driver may still read


class CudaTransferEngine(TransferEngine):
    """Moves blocks between canonical caches on a CUDA device and (pinned) host memory."""

    def __init__(
        self,
        caches: CanonicalCaches,
        host: HostMemory,
        batch: BatchMode = BatchMode.AUTO,
        fault_hook: FaultHook | None = None,
    ) -> None:
        """Pre: the caches live on a CUDA device; every group's block fits one host slot.
        Frame: a refused call creates no stream."""
        if caches.device.type != "cuda" or not torch.cuda.is_available():
            raise HybridKVConfigError(
                "caches",
                str(caches.device),
                "the CUDA engine needs caches on a CUDA device",
                "use CpuTransferEngine for CPU caches",
            )
        check_fits(caches, host.slot_bytes)
        copier = resolve_batch_copier() if batch is not BatchMode.OFF else None
        if batch is BatchMode.REQUIRED and copier is None:
            raise HybridKVConfigError(
                "batch",
                batch.value,
                "cuMemcpyBatchAsync is unavailable (driver < 12.8?)",
                "use BatchMode.AUTO to fall back to one copy per run",
            )
        self._caches = caches
        self._host = host
        self._host_i8 = host.tensor.view(torch.int8)
        self._copier: BatchCopier | None = copier
        self._fault_hook = fault_hook
        self._device = caches.device
        self._streams = {d: _stream(self._device) for d in Direction}
        self._in_flight: dict[Direction, deque[_InFlight]] = {d: deque() for d in Direction}
        self._lock = threading.Lock()
        self._book = JobBook()
        self._closed = False

    @property
    def uses_batch(self) -> bool:
        """Whether jobs go to the driver in one cuMemcpyBatchAsync call."""
        return self._copier is not None

    def submit(self, direction: Direction, pairs: Sequence[TransferPair]) -> JobId:
        if self._closed:
            raise HybridKVConfigError("engine", "closed", "submit after close", "open a new engine")
        runs = plan_copies(
            self._caches, self._host.num_slots, self._host.slot_bytes, direction, pairs
        )
        job = self._book.new_id()
        stream = self._streams[direction]
        keep: object = None
        try:
            ready = _event()
            ready.record(torch.cuda.current_stream(self._device))
            stream.wait_event(ready)
            keep = self._issue(job, direction, runs, stream)
            issued = True
        except Exception:  # the job fails; its event still orders the copies already queued
            issued = False
        try:
            done = _event()
            done.record(stream)
        except Exception:  # the context is unusable: nothing more will run, fail now
            self._book.finish(job, False)
            return job
        with self._lock:
            self._in_flight[direction].append(_InFlight(job, done, issued, keep))
        return job

    def poll(self) -> list[FinishedJob]:
        self._collect()
        return self._book.take_finished()

    def wait(self, job_ids: Iterable[JobId]) -> None:
        ids = set(self._book.check_known(job_ids))
        with self._lock:
            events = [f.done for q in self._in_flight.values() for f in q if f.job in ids]
        for event in events:
            with contextlib.suppress(Exception):  # a failure is reported by _collect
                event.synchronize()
        self._collect()
        self._book.wait_done(ids)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for stream in self._streams.values():
            with contextlib.suppress(Exception):  # failures are reported by _collect
                stream.synchronize()
        self._collect()

    def _issue(self, job: JobId, direction: Direction, runs: list[CopyRun], stream: Any) -> object:
        """Queue the job's copies on ``stream``; return what must outlive them."""
        if self._fault_hook is not None:
            for i in range(len(runs)):
                self._fault_hook(job, direction, i)
        flats = [t.flat for t in self._caches.tensors]
        if self._copier is not None:
            dev = [flats[r.tensor].data_ptr() + r.device_offset for r in runs]
            hst = [self._host_i8.data_ptr() + r.host_offset for r in runs]
            sizes = [r.nbytes for r in runs]
            if direction is Direction.STORE:
                return self._copier.copy(hst, dev, sizes, stream.cuda_stream, SRC_ORDER_STREAM)
            return self._copier.copy(dev, hst, sizes, stream.cuda_stream, SRC_ORDER_ANY)
        with torch.cuda.stream(stream):
            for r in runs:
                d = flats[r.tensor][r.device_offset : r.device_offset + r.nbytes]
                h = self._host_i8[r.host_offset : r.host_offset + r.nbytes]
                if direction is Direction.STORE:
                    h.copy_(d, non_blocking=True)
                else:
                    d.copy_(h, non_blocking=True)
        return None

    def _collect(self) -> None:
        """Finish, in order per direction, every job whose event has completed."""
        with self._lock:
            for queue in self._in_flight.values():
                while queue:
                    head = queue[0]
                    try:
                        if not _query(head.done):
                            break
                        ok = head.issued
                    except Exception:  # a CUDA error surfaced on this job's event
                        ok = False
                    queue.popleft()
                    self._book.finish(head.job, ok)


def _event() -> Any:
    return torch.cuda.Event()  # type: ignore[no-untyped-call]


def _query(event: Any) -> bool:
    return bool(event.query())


def _stream(device: torch.device) -> Any:
    return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
