"""The worker side: copies between vLLM's KV caches and host memory, whole blocks at a time.

:func:`hybridkv.canonical.build_canonical_caches` reads vLLM's per-layer tensors (whatever
their layout) as one byte view per group, so a ``TransferPair(group, block, slot)`` moves every
layer of that group's block in one copy; the engine (:class:`hybridkv.transfer.CpuTransferEngine`
on CPU caches, :class:`hybridkv.transfer.CudaTransferEngine` on CUDA ones) runs each job once,
reporting it exactly once, success or failure.

Every job here is waited for in the hook that submits it: loads in ``start_load_kv`` before
the forward reads them, stores in ``wait_for_save`` after the forward wrote their sources. That
is the simplest schedule that keeps TR-1 and TR-2 without pinning blocks in vLLM's pool; an
asynchronous connector would overlap copies with the next forward and pin their sources.
"""

from __future__ import annotations

from typing import Any

from examples.hma_offload.layout import Layout
from examples.hma_offload.scheduler import Job, JobKind
from hybridkv.canonical import build_canonical_caches
from hybridkv.transfer import (
    CpuTransferEngine,
    CudaTransferEngine,
    Direction,
    HostMemory,
    PinMode,
    TransferEngine,
)


class LoadFailed(RuntimeError):
    """A load did not land: the request's KV would be wrong, so the engine stops."""


class OffloadWorker:
    """One worker's host memory and transfer engine (module docstring)."""

    def __init__(self, layout: Layout, host_slots: int) -> None:
        self.layout = layout
        self.host_slots = host_slots
        self._engine: TransferEngine | None = None
        self._host: HostMemory | None = None
        self._results: list[tuple[int, bool]] = []

    def register(self, kv_caches: dict[str, Any]) -> None:
        groups = self.layout.groups
        caches = build_canonical_caches(kv_caches, groups, self.layout.num_blocks)
        slot = self.layout.slot_bytes
        if max(caches.group_bytes(g) for g in range(len(groups))) != slot:
            raise RuntimeError("the caches' block bytes differ from the KV cache config's")
        on_cuda = caches.device.type == "cuda"
        pin = PinMode.AUTO if on_cuda else PinMode.OFF
        self._host = HostMemory(self.host_slots * slot, slot, pin)
        engine = CudaTransferEngine if on_cuda else CpuTransferEngine
        self._engine = engine(caches, self._host)

    def run(self, jobs: tuple[Job, ...]) -> None:
        """Run ``jobs`` and wait for them; their results go to the next worker metadata."""
        engine = self._engine
        if engine is None or not jobs:
            return
        ours = {}
        for job in jobs:
            direction = Direction.LOAD if job.kind is JobKind.LOAD else Direction.STORE
            ours[engine.submit(direction, job.pairs)] = job
        engine.wait(ours)
        for finished in engine.poll():
            job = ours.pop(finished.job_id)
            if job.kind is JobKind.LOAD and not finished.success:
                raise LoadFailed(f"load job {job.job_id} failed: its request would read wrong KV")
            self._results.append((job.job_id, finished.success))
        if ours:
            raise RuntimeError(f"the engine did not report jobs {sorted(ours)} after waiting")

    def take_results(self) -> tuple[tuple[int, bool], ...]:
        found, self._results = tuple(self._results), []
        return found

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
        if self._host is not None:
            self._host.close()
