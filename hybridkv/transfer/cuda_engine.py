"""The CUDA transfer engine: copy-engine DMA on separate load and store streams.

Ordering (why each step is there):

- Every job first makes its stream wait on an event recorded on the submitting thread's
  current (compute) stream. A store therefore reads its GPU source only after the compute
  that wrote it (vLLM #39306: relaxing this is unsafe for stores); a load overwrites its GPU
  blocks only after compute already queued that may still read their previous content.
- Loads and stores run on two dedicated non-blocking streams (created through the driver, not
  drawn from torch's stream pool, whose streams vLLM's own side streams may alias), so the
  directions overlap each other and the compute; within a direction jobs run in submission
  order (one stream each).
- Pairs are validated into an int64 table by :mod:`hybridkv.transfer.plan`. A job then moves
  by DMA or by index kernels (``CopyMethod``; AUTO picks per job from a cost model measured on
  an H100). DMA: runs coalesced as arrays (never across two host registrations), submitted by
  ``cuMemcpyBatchAsync`` reading the descriptor tensor in place, in chunks, when the driver
  has it, else one ``cudaMemcpyAsync`` (``copy_(non_blocking=True)``) per run. Kernels: two
  index kernels per template run over host memory mapped into the device
  (:mod:`hybridkv.transfer.cuda_kernels`); they use SMs, DMA does not. Their GPU scratch
  (``scratch_bytes``, both directions together) is allocated once, when the engine is built,
  and is the engine's only device allocation besides its streams and events; ``scratch_bytes``
  0 allocates none and copies by DMA only.
- ``submit`` issues under the engine's device (the calling thread's current device may be
  another GPU) and under the engine's lock: the job id, the copies' place in the stream and
  the job's place in the in-flight list are one step, so a ``wait`` on another thread always
  finds the job, and the list's order is the stream's.
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

from hybridkv import cuda_driver
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
from hybridkv.transfer.cuda_kernels import DEFAULT_SCRATCH_BYTES, KernelCopier
from hybridkv.transfer.plan import CopyPlanner, check_fits, take

__all__ = ["BatchMode", "CopyMethod", "CudaTransferEngine"]


class CopyMethod(Enum):
    """How a job's bytes move. ``DMA``: copy-engine descriptors (batched per ``BatchMode``).
    ``KERNEL``: index kernels over mapped host memory (:mod:`cuda_kernels`). ``AUTO``: per
    job, whichever the cost model below says is cheaper."""

    AUTO = "auto"
    DMA = "dma"
    KERNEL = "kernel"


# Cost model of AUTO, in microseconds, from tools/bench_gpu_transfer.py on an H100 (PCIe 5,
# docs/benchmarks). DMA: the driver takes about 0.8 us per batched descriptor on the submitting
# thread, then the copy engines move about 53 GB/s; the two add up (measured: 64 KB scattered
# blocks take the sum). Kernels: about 5 us per launch, then about 46 GB/s. Decided on the
# uncoalesced run count (an upper bound: coalescing only merges), so a kernel job never pays
# for coalescing.
_US_PER_DESCRIPTOR = 0.8
_US_PER_RUN_COPY = 10.0  # one cudaMemcpyAsync per run, when the driver cannot batch
_US_PER_LAUNCH = 5.0
_DMA_BYTES_PER_US = 53_000.0
_KERNEL_BYTES_PER_US = 46_000.0


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
    """Moves blocks between canonical caches on a CUDA device and (pinned) host memory.

    ``batch_chunk``: descriptors per cuMemcpyBatchAsync call. The driver takes about 0.8 us per
    descriptor before it returns (measured on an H100, docs/benchmarks); one call for 32,768
    scattered 32 KB blocks moved 18.1 GB/s, calls of 512 descriptors 23.2 GB/s (64 to 2,048
    measured within 7% of that).
    """

    batch_chunk = 512

    def __init__(
        self,
        caches: CanonicalCaches,
        host: HostMemory,
        batch: BatchMode = BatchMode.AUTO,
        fault_hook: FaultHook | None = None,
        method: CopyMethod = CopyMethod.AUTO,
        *,
        scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
    ) -> None:
        """Pre: the caches live on a CUDA device; every group's block fits one host slot.
        ``scratch_bytes``: GPU scratch of the kernel path, both directions together, allocated
        here (0: none, DMA only; refused with ``CopyMethod.KERNEL``).
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
        self._planner = CopyPlanner(caches, host.num_slots, host.slot_bytes, host.region_bytes)
        self._flats = [t.flat for t in caches.tensors]
        self._flat_ptrs = torch.tensor([f.data_ptr() for f in self._flats], dtype=torch.int64)
        self._copier: BatchCopier | None = copier
        self._orders = {Direction.STORE: SRC_ORDER_STREAM, Direction.LOAD: SRC_ORDER_ANY}
        self._fault_hook = fault_hook
        self._device = caches.device
        index = caches.device.index
        self._device_index: int = torch.cuda.current_device() if index is None else index
        self._method = method
        self._kernels = _kernel_copier(caches, host, self._device_index, method, scratch_bytes)
        self._stream_handles = {
            d: cuda_driver.nonblocking_stream(self._device_index) for d in Direction
        }
        self._streams = {
            d: _external_stream(h, self._device_index) for d, h in self._stream_handles.items()
        }
        self._in_flight: dict[Direction, deque[_InFlight]] = {d: deque() for d in Direction}
        self._lock = threading.Lock()
        self._book = JobBook()
        self._closed = False

    @property
    def caches(self) -> CanonicalCaches:
        """The canonical caches this engine copies from and to."""
        return self._caches

    @property
    def scratch_bytes(self) -> int:
        """GPU bytes the engine allocated as kernel scratch (0 when jobs go by DMA only)."""
        return 0 if self._kernels is None else self._kernels.scratch_bytes

    @property
    def uses_batch(self) -> bool:
        """Whether jobs go to the driver in one cuMemcpyBatchAsync call."""
        return self._copier is not None

    def submit(self, direction: Direction, pairs: Sequence[TransferPair]) -> JobId:
        if self._closed:
            raise HybridKVConfigError("engine", "closed", "submit after close", "open a new engine")
        table = self._planner.validated(direction, pairs)
        with self._lock, torch.cuda.device(self._device_index):
            job = self._book.new_id()
            flight = self._enqueue(job, direction, table)
            if flight is None:  # the context is unusable: nothing more will run, fail now
                self._book.finish(job, False)
            else:
                self._in_flight[direction].append(flight)
        return job

    def _enqueue(self, job: JobId, direction: Direction, table: torch.Tensor) -> _InFlight | None:
        """Queue the job behind the compute and mark its end; None if no event could be."""
        stream = self._streams[direction]
        keep: object = None
        try:
            ready = _event()
            ready.record(torch.cuda.current_stream(self._device))
            stream.wait_event(ready)
            keep = self._issue(job, direction, table, stream)
            issued = True
        except Exception:  # the job fails; its event still orders the copies already queued
            issued = False
        try:
            done = _event()
            done.record(stream)
        except Exception:
            return None
        return _InFlight(job, done, issued, keep)

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
        for handle in self._stream_handles.values():
            with contextlib.suppress(OSError, cuda_driver.CudaDriverError):
                cuda_driver.destroy_stream(handle, self._device_index)

    def _issue(self, job: JobId, direction: Direction, table: torch.Tensor, stream: Any) -> object:
        """Queue the job's copies on ``stream``; return what must outlive them."""
        kernels = self._kernels
        use_kernels = kernels is not None and (
            self._method is CopyMethod.KERNEL or not self._dma_is_cheaper(table, kernels)
        )
        plan = None if use_kernels else self._planner.coalesced(table)
        if self._fault_hook is not None:
            for i in range(len(plan) if plan is not None else table.shape[0]):
                self._fault_hook(job, direction, i)
        if plan is None:
            assert kernels is not None
            with torch.cuda.stream(stream):
                return kernels.copy(direction, table)
        if self._copier is not None:
            dev = take(self._flat_ptrs, plan.tensor) + plan.device_offset
            hst = plan.host_offset + self._host_i8.data_ptr()
            if direction is Direction.STORE:
                desc = torch.stack((hst, dev, plan.nbytes))
            else:
                desc = torch.stack((dev, hst, plan.nbytes))
            return self._copier.copy(
                desc, stream.cuda_stream, self._orders[direction], self.batch_chunk
            )
        with torch.cuda.stream(stream):
            for r in plan.runs():
                d = self._flats[r.tensor][r.device_offset : r.device_offset + r.nbytes]
                h = self._host_i8[r.host_offset : r.host_offset + r.nbytes]
                if direction is Direction.STORE:
                    h.copy_(d, non_blocking=True)
                else:
                    d.copy_(h, non_blocking=True)
        return None

    def _dma_is_cheaper(self, table: torch.Tensor, kernels: KernelCopier) -> bool:
        """The AUTO cost model: estimated microseconds of each method for this job."""
        groups = len(self._caches.group_refs)
        counts: list[int] = torch.bincount(table[:, 0], minlength=groups).tolist()
        nbytes = sum(self._caches.group_bytes(g) * n for g, n in enumerate(counts))
        runs, launches = kernels.runs_and_launches(counts)
        per_run = _US_PER_DESCRIPTOR if self._copier is not None else _US_PER_RUN_COPY
        dma = runs * per_run + nbytes / _DMA_BYTES_PER_US
        return dma <= launches * _US_PER_LAUNCH + nbytes / _KERNEL_BYTES_PER_US

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


def _kernel_copier(
    caches: CanonicalCaches, host: HostMemory, device: int, method: CopyMethod, scratch: int
) -> KernelCopier | None:
    """The kernel path where the method allows it, the host memory is mapped at its own
    address and scratch is granted; AUTO falls back to DMA without it, KERNEL refuses."""
    if method is CopyMethod.DMA:
        return None
    if scratch == 0:
        if method is CopyMethod.KERNEL:
            raise HybridKVConfigError(
                "scratch_bytes", 0, "kernel copies need GPU scratch", "give scratch or use DMA"
            )
        return None
    try:
        if not host.pinned:
            raise RuntimeError("host memory is not pinned")
        return KernelCopier(caches, host, device, scratch)
    except (RuntimeError, OSError) as exc:  # CudaDriverError is a RuntimeError
        if method is CopyMethod.KERNEL:
            raise HybridKVConfigError(
                "method",
                method.value,
                f"kernel copies need pinned host memory mapped at its own address ({exc})",
                "pin the host memory or use CopyMethod.DMA",
            ) from exc
        return None


def _event() -> Any:
    return torch.cuda.Event()  # type: ignore[no-untyped-call]


def _query(event: Any) -> bool:
    return bool(event.query())


def _external_stream(handle: int, device: int) -> Any:
    """torch's view of a stream the engine created (and destroys at close)."""
    return torch.cuda.ExternalStream(handle, device=device)  # type: ignore[no-untyped-call]
