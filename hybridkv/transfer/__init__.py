"""Transfer engines: move KV blocks between canonical GPU caches and host memory.

The engines (:class:`CpuTransferEngine`, and :class:`CudaTransferEngine`, which imports without
CUDA and refuses to construct without it) copy between canonical caches and the host memory
they are given (:class:`HostMemory`, re-exported from :mod:`hybridkv.hostmem`). The public names
are ``__all__`` (docs/reference/api/transfer.md); the modules under it are not, and may move.
"""

from __future__ import annotations

from hybridkv.hostmem import HostMemory, PinMode
from hybridkv.transfer.api import Direction, FinishedJob, JobId, TransferEngine, TransferPair
from hybridkv.transfer.cpu_engine import CpuTransferEngine, FaultHook
from hybridkv.transfer.cuda_engine import BatchMode, CopyMethod, CudaTransferEngine

__all__ = [
    "BatchMode",
    "CopyMethod",
    "CpuTransferEngine",
    "CudaTransferEngine",
    "Direction",
    "FaultHook",
    "FinishedJob",
    "HostMemory",
    "JobId",
    "PinMode",
    "TransferEngine",
    "TransferPair",
]
