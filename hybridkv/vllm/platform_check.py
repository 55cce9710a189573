"""The platforms hybridkv.vllm moves KV on, and a start-up refusal of the others.

Two transfer engines exist: the CUDA engine (:mod:`hybridkv.transfer.cuda_engine`: driver-API
pinning, ``cuMemcpyBatchAsync``, streams ordered after the compute stream) and the CPU engine
(caches in host memory, where a copy reads what compute wrote because CPU work is synchronous).
A GPU the CUDA engine does not drive would still hand the worker caches on a ``cuda`` device
(ROCm's torch does) or on another accelerator, and neither engine is correct there: the driver
calls are CUDA's, and the CPU engine's ordering argument does not hold for device work. So the
connector refuses those platforms when vLLM builds it, naming the platform, instead of failing
on the first copy or storing bytes the compute has not written yet.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridkv.errors import HybridKVConfigError

__all__ = ["refuse_unsupported_platform"]

# vLLM's PlatformEnum names the connector runs on: CUDA (the CUDA engine), CPU (the CPU
# engine), UNSPECIFIED (no accelerator found: a CPU-only install, caches in host memory).
_SUPPORTED = frozenset({"CUDA", "CPU", "UNSPECIFIED"})


def refuse_unsupported_platform(platform: Any = None) -> None:
    """Refuse ROCm (``torch.version.hip`` set, or vLLM's ``current_platform.is_rocm()``) and
    every other accelerator platform but CUDA, naming it.

    ``platform``: vLLM's ``current_platform`` (read from ``vllm.platforms`` when None).
    Frame: nothing changes; a supported platform returns None.
    """
    if platform is None:
        from vllm import platforms

        platform = platforms.current_platform
    hip = getattr(torch.version, "hip", None)
    if hip or platform.is_rocm():
        raise HybridKVConfigError(
            "platform",
            "rocm" if not hip else f"rocm (HIP {hip})",
            "hybridkv's GPU transfer engine drives CUDA only (driver-API pinning, "
            "cuMemcpyBatchAsync, CUDA streams); ROCm is not supported",
            "run on an NVIDIA GPU, or use vLLM's native OffloadingConnector on ROCm",
        )
    name = getattr(getattr(platform, "_enum", None), "name", "UNSPECIFIED")
    if name not in _SUPPORTED:
        raise HybridKVConfigError(
            "platform",
            name.lower(),
            "hybridkv moves KV with a CUDA engine or a CPU engine only; this accelerator has "
            "neither",
            "run on an NVIDIA GPU or on CPU",
        )
