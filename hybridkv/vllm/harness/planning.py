"""vLLM's own KV-cache planning, run in-process without a GPU (what its engine core does at
start-up): the one-rank distributed state the model constructors read, a stand-in executor that
reports each worker's per-layer KV specs, and ``EngineCore._initialize_kv_caches`` over it.

Tensor parallel (:func:`plan_tensor_parallel`) is simulated in this one process: no second
process and no collective exist. For each rank, vLLM constructs the model on the meta device in
its own ``VllmConfig`` (``tensor_parallel_size`` = the world) while the one-rank TP group reads
as that rank of that world (:func:`as_tensor_parallel_rank`: its ``world_size`` and
``rank_in_group``, which ``get_tensor_model_parallel_world_size`` / ``_rank`` return), so each
layer reports its own rank's shard spec; ``EngineCore._initialize_kv_caches`` then plans over
the per-rank specs exactly as with real workers and hands each rank its ``KVCacheConfig``.

vLLM is imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "InProcessExecutor",
    "as_tensor_parallel_rank",
    "init_distributed",
    "plan_kv_caches",
    "plan_tensor_parallel",
]


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
    """Stands in for the model executor: in-process workers, one per dict of ``layer_specs``
    (a single dict: one worker), each reporting its layers' KV specs.

    ``available_bytes`` is what each worker reports as free for the KV cache; a test that fixes
    the pool with ``num_gpu_blocks_override`` passes anything large enough. ``configs``: the
    per-worker ``KVCacheConfig`` list the engine core handed ``initialize_from_config``.
    """

    def __init__(
        self,
        vllm_config: Any,
        layer_specs: dict[str, Any] | list[dict[str, Any]],
        available_bytes: int,
    ) -> None:
        from vllm.v1.worker.worker_base import WorkerBase

        self._worker = types.SimpleNamespace(vllm_config=vllm_config)
        self._base = WorkerBase
        self._specs = layer_specs if isinstance(layer_specs, list) else [layer_specs]
        self._available = available_bytes
        self.configs: list[Any] = []

    def get_kv_cache_specs(self) -> list[dict[str, Any]]:
        return list(self._specs)

    def get_supported_kv_cache_layouts(self) -> list[list[str]]:
        return [self._base.get_supported_kv_cache_layouts(self._worker)]

    def set_kv_cache_layout(self, layout: str, interleave: int) -> None:
        self._base.set_kv_cache_layout(self._worker, layout, interleave)

    def determine_available_memory(self) -> list[int]:
        return [self._available] * len(self._specs)

    def initialize_from_config(self, configs: Any) -> None:
        """Keeps the per-worker configs; no model and no KV tensors live here: the in-process
        engine allocates its own caches."""
        self.configs = list(configs)

    def compile_or_warm_up_model(self) -> None:
        """No model to compile: the stand-in runner computes content tags, not layers."""


def _layer_specs(vllm_config: Any) -> dict[str, Any]:
    """One worker's per-layer KV specs: the model built on the meta device by vLLM's loader,
    the platform's block size for its backends, each layer's own spec."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("meta"):
        initialize_model(vllm_config=vllm_config)
    current_platform.update_block_size_for_backend(vllm_config)
    with set_current_vllm_config(vllm_config):
        specs: dict[str, Any] = get_kv_cache_spec(vllm_config)
    return specs


def _plan(
    vllm_config: Any, rank_specs: list[dict[str, Any]], available_bytes: int
) -> tuple[Any, list[Any], int, int]:
    """``EngineCore._initialize_kv_caches`` over workers reporting ``rank_specs``: the
    scheduler's config, each worker's, and vLLM's ``resolve_kv_cache_block_sizes``."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.engine.core import EngineCore

    with set_current_vllm_config(vllm_config):
        executor = InProcessExecutor(vllm_config, rank_specs, available_bytes)
        engine = types.SimpleNamespace(
            model_executor=executor,
            available_gpu_memory_for_kv_cache=0,
            collective_rpc=lambda *_a, **_k: None,
        )
        kv_cache_config = EngineCore._initialize_kv_caches(engine, vllm_config)
        block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    return kv_cache_config, executor.configs, block_size, hash_block_size


def plan_kv_caches(vllm_config: Any, available_bytes: int) -> tuple[Any, int, int]:
    """vLLM's own KV-cache planning for ``vllm_config``, as its engine core runs it, one worker.

    The model is built on the meta device by vLLM's loader, the platform raises the block size
    for its backends, each layer reports its own KV spec, and ``EngineCore._initialize_kv_caches``
    plans the groups over an :class:`InProcessExecutor`. Returns ``(KVCacheConfig,
    scheduler_block_size, hash_block_size)`` (vLLM's ``resolve_kv_cache_block_sizes``).
    """
    config, _, block_size, hash_block_size = _plan(
        vllm_config, [_layer_specs(vllm_config)], available_bytes
    )
    return config, block_size, hash_block_size


@contextlib.contextmanager
def as_tensor_parallel_rank(rank: int, world: int) -> Iterator[None]:
    """vLLM's (one-rank) TP group reads as ``rank`` of ``world`` inside the block (module
    docstring); only model construction on the meta device may run inside: nothing
    communicates."""
    from vllm.distributed import parallel_state

    group = parallel_state.get_tp_group()
    saved = group.world_size, group.rank_in_group
    group.world_size, group.rank_in_group = world, rank
    try:
        yield
    finally:
        group.world_size, group.rank_in_group = saved


def plan_tensor_parallel(
    make_config: Callable[[], Any], available_bytes: int
) -> tuple[Any, Any, list[Any], int, int]:
    """vLLM's planning for a ``tensor_parallel_size`` > 1 config, each rank's model built as that
    rank (module docstring). ``make_config()`` builds a fresh ``VllmConfig`` (each rank's model
    registers its layers in its own). Returns ``(engine VllmConfig, scheduler KVCacheConfig,
    [rank's KVCacheConfig], scheduler_block_size, hash_block_size)``; the engine's config is
    rank 0's, as when the engine core and rank 0 share a process.
    """
    configs = [make_config()]
    world = int(configs[0].parallel_config.tensor_parallel_size)
    configs += [make_config() for _ in range(world - 1)]
    rank_specs = []
    for rank, config in enumerate(configs):
        with as_tensor_parallel_rank(rank, world):
            rank_specs.append(_layer_specs(config))
    scheduler, per_rank, block_size, hash_block_size = _plan(
        configs[0], rank_specs, available_bytes
    )
    return configs[0], scheduler, per_rank, block_size, hash_block_size
