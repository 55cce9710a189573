"""Transfer engines: move KV blocks between canonical GPU caches and host memory.

Import the CUDA engine from :mod:`hybridkv.transfer.cuda_engine`; it imports without CUDA and
refuses to construct without it.
"""

from __future__ import annotations

from hybridkv.transfer.api import Direction, FinishedJob, JobId, TransferEngine, TransferPair
from hybridkv.transfer.cpu_engine import CpuTransferEngine, FaultHook

__all__ = [
    "CpuTransferEngine",
    "Direction",
    "FaultHook",
    "FinishedJob",
    "JobId",
    "TransferEngine",
    "TransferPair",
]
