"""vLLM's own KV-cache planning, run in-process without a GPU (what its engine core does at
start-up): the one-rank distributed state the model constructors read, a stand-in executor that
reports one worker's per-layer KV specs, and ``EngineCore._initialize_kv_caches`` over it.

vLLM is imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import os
import types
from typing import Any

__all__ = ["InProcessExecutor", "init_distributed", "plan_kv_caches"]


def init_distributed(port_base: int) -> None:
    """Start vLLM's one-rank gloo process group once per process (a no-op after that).

    ``port_base`` keeps the pytest process and the geometry subprocesses on distinct ports.
    """
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port_base + os.getpid() % 20000}",
            backend="gloo",
        )
        parallel_state.ensure_model_parallel_initialized(1, 1)


class InProcessExecutor:
    """Stands in for the model executor: one in-process worker reporting ``layer_specs``.

    ``available_bytes`` is what the worker reports as free for the KV cache; a test that fixes
    the pool with ``num_gpu_blocks_override`` passes anything large enough.
    """

    def __init__(self, vllm_config: Any, layer_specs: dict[str, Any], available_bytes: int) -> None:
        from vllm.v1.worker.worker_base import WorkerBase

        self._worker = types.SimpleNamespace(vllm_config=vllm_config)
        self._base = WorkerBase
        self._specs = layer_specs
        self._available = available_bytes

    def get_kv_cache_specs(self) -> list[dict[str, Any]]:
        return [self._specs]

    def get_supported_kv_cache_layouts(self) -> list[list[str]]:
        return [self._base.get_supported_kv_cache_layouts(self._worker)]

    def set_kv_cache_layout(self, layout: str, interleave: int) -> None:
        self._base.set_kv_cache_layout(self._worker, layout, interleave)

    def determine_available_memory(self) -> list[int]:
        return [self._available]

    def initialize_from_config(self, _configs: Any) -> None:
        """No model and no KV tensors live here: the in-process engine allocates its own caches."""

    def compile_or_warm_up_model(self) -> None:
        """No model to compile: the stand-in runner computes content tags, not layers."""


def plan_kv_caches(vllm_config: Any, available_bytes: int) -> tuple[Any, int, int]:
    """vLLM's own KV-cache planning for ``vllm_config``, as its engine core runs it.

    The model is built on the meta device by vLLM's loader, the platform raises the block size
    for its backends, each layer reports its own KV spec, and ``EngineCore._initialize_kv_caches``
    plans the groups over an :class:`InProcessExecutor`. Returns ``(KVCacheConfig,
    scheduler_block_size, hash_block_size)`` (vLLM's ``resolve_kv_cache_block_sizes``).
    """
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("meta"):
        initialize_model(vllm_config=vllm_config)
    current_platform.update_block_size_for_backend(vllm_config)
    with set_current_vllm_config(vllm_config):
        layer_specs = get_kv_cache_spec(vllm_config)
        engine = types.SimpleNamespace(
            model_executor=InProcessExecutor(vllm_config, layer_specs, available_bytes),
            available_gpu_memory_for_kv_cache=0,
            collective_rpc=lambda *_a, **_k: None,
        )
        kv_cache_config = EngineCore._initialize_kv_caches(engine, vllm_config)
        block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    return kv_cache_config, block_size, hash_block_size
