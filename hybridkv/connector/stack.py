"""One model's offload stack on the CPU engine: core, host store, host memory, engine, worker.

:func:`build_cpu_stack` wires, for a model's KV caches (vLLM-shaped per-layer tensors and
their :class:`~hybridkv.canonical.CacheGroupSpec`):

- the planner and the :class:`~hybridkv.connector.ConnectorCore` (scheduler side) over a
  :class:`~hybridkv.store.HostStore` of ``num_chunks`` entries (or as many as ``host_bytes``
  holds);
- :class:`~hybridkv.hostmem.HostMemory` with one slot per store entry, each as large as the
  largest group's block (:meth:`CanonicalCaches.group_bytes`);
- the :class:`~hybridkv.transfer.CpuTransferEngine` over the canonical caches and the
  :class:`~hybridkv.connector.worker.TransferWorker` (worker side).

Everything is checked before anything is allocated: a refused build (a
:class:`HybridKVConfigError` naming the field) leaves no thread and no host allocation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hybridkv.canonical import CacheGroupSpec, CanonicalCaches, build_canonical_caches
from hybridkv.connector.core import ConnectorCore, LoadMode
from hybridkv.connector.worker import JobFaultHook, TransferWorker
from hybridkv.errors import HybridKVConfigError
from hybridkv.hostmem import HostMemory, PinMode
from hybridkv.planner import HybridOffloadPlanner
from hybridkv.store import HostStore
from hybridkv.transfer import CpuTransferEngine, FaultHook

__all__ = ["OffloadStack", "build_cpu_stack"]


@dataclass(frozen=True, slots=True, eq=False)
class OffloadStack:
    """The parts of one offload stack; :meth:`close` stops the engine's thread."""

    core: ConnectorCore
    worker: TransferWorker
    store: HostStore
    engine: CpuTransferEngine
    host: HostMemory
    caches: CanonicalCaches

    def close(self) -> None:
        """Finish queued copies, stop the engine thread, unpin host memory. Idempotent."""
        self.engine.close()
        self.host.close()


def build_cpu_stack(
    groups: Sequence[CacheGroupSpec],
    kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
    num_blocks: int,
    *,
    hash_block_size: int,
    chunk_size: int,
    max_model_len: int,
    num_chunks: int | None = None,
    host_bytes: int | None = None,
    policy: str = "lru",
    load_mode: LoadMode = LoadMode.ASYNC,
    sliding_windows: Sequence[int] = (),
    fault_hook: JobFaultHook | None = None,
    engine_fault_hook: FaultHook | None = None,
) -> OffloadStack:
    """Build the stack for ``kv_caches`` (module docstring).

    Pre: exactly one of ``num_chunks`` (host entries) and ``host_bytes`` (a budget, cut into
    whole slots); a planner geometry whose offload unit is every group's block (the engine
    moves whole blocks: ``chunk_size`` a multiple of every attention block, field
    ``chunk_size``); ``sliding_windows`` as :class:`ConnectorCore`. ``fault_hook`` fails
    chosen connector jobs, ``engine_fault_hook`` raises inside the engine's copies (both report
    the job failed). Refusal: :class:`HybridKVConfigError`, nothing allocated.
    """
    planner = HybridOffloadPlanner(
        tuple((g.kind, g.block_size) for g in groups), hash_block_size, chunk_size, max_model_len
    )
    for g, (unit, spec) in enumerate(zip(planner.units, groups, strict=True)):
        if unit != spec.block_size:
            raise HybridKVConfigError(
                "chunk_size",
                chunk_size,
                f"splits group {g}'s {spec.block_size}-token block into {unit}-token units, "
                "but the transfer engine moves whole blocks",
                f"use a multiple of every attention block size, e.g. {spec.block_size}",
            )
    caches = build_canonical_caches(kv_caches, groups, num_blocks)
    slot_bytes = max(caches.group_bytes(g) for g in range(len(groups)))
    chunks = _chunks(num_chunks, host_bytes, slot_bytes)
    store = HostStore(chunks, policy)
    core = ConnectorCore(
        planner,
        store,
        tuple(g.kind for g in groups),
        hash_block_size,
        chunk_size,
        sliding_windows=sliding_windows,
        load_mode=load_mode,
    )
    host = HostMemory(chunks * slot_bytes, slot_bytes, PinMode.OFF)
    engine = CpuTransferEngine(caches, host, engine_fault_hook)
    worker = TransferWorker(engine, store, caches, host, fault_hook=fault_hook)
    return OffloadStack(core, worker, store, engine, host, caches)


def _chunks(num_chunks: int | None, host_bytes: int | None, slot_bytes: int) -> int:
    if (num_chunks is None) == (host_bytes is None):
        raise HybridKVConfigError(
            "num_chunks",
            num_chunks,
            f"give exactly one of num_chunks and host_bytes (host_bytes={host_bytes!r})",
            "size the host tier in chunks or in bytes",
        )
    if num_chunks is not None:
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
            raise HybridKVConfigError("num_chunks", num_chunks, "must be an int >= 1", "raise it")
        return num_chunks
    if isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes < slot_bytes:
        raise HybridKVConfigError(
            "host_bytes",
            host_bytes,
            f"holds no whole slot of {slot_bytes} bytes (the largest group's block)",
            f"give at least {slot_bytes} bytes",
        )
    return host_bytes // slot_bytes
