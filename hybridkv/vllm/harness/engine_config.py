"""The in-process engine's settings (:class:`EngineSettings`) and the ``VllmConfig`` built from
them, as ``vllm serve`` would build it from the same flags: prefix caching, chunked prefill,
async scheduling (or sync: :attr:`EngineSettings.async_scheduling`), the hybrid KV cache
manager on (a connector that turns it off is refused), and optionally tensor parallel, LoRA,
KV events and the scheduler side of speculative decoding.

The model is a directory holding only the config.json (:func:`_config_dir`): no weights, no
tokenizer; vLLM's own planning (:mod:`hybridkv.vllm.harness.planning`) derives the KV-cache config
from it. :func:`_process_setup` prepares the process once (vLLM's one-rank distributed state).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridkv.vllm.harness.planning import init_distributed

__all__ = ["ENGINE_LOOP_ENV", "EngineSettings", "WedgedError", "default_async_scheduling"]

ENGINE_LOOP_ENV = "HYBRIDKV_ENGINE_LOOP"
"""Names the engine loop a run gets when its settings do not: ``async`` (the default, vLLM's
default on a GPU) or ``sync``; ``nox -s vllm`` runs the vLLM-driven tests under each."""


def default_async_scheduling() -> bool:
    """Async scheduling unless :data:`ENGINE_LOOP_ENV` says ``sync``."""
    value = os.environ.get(ENGINE_LOOP_ENV, "async").strip().lower()
    if value not in ("async", "sync"):
        raise ValueError(f"{ENGINE_LOOP_ENV}={value!r}: use 'async' or 'sync'")
    return value == "async"


class WedgedError(RuntimeError):
    """The run did not finish within ``max_steps`` engine steps."""


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """The engine's knobs ("the engine's docstring": :mod:`hybridkv.vllm.harness.inprocess`'s).

    Attributes:
        num_gpu_blocks: the GPU pool (``num_gpu_blocks_override``).
        max_model_len: ``--max-model-len``.
        block_size: ``--block-size`` (``None``: the platform's choice).
        max_num_seqs / max_num_batched_tokens: the scheduler's limits (chunked prefill).
        max_steps: the wedge guard.
        tensor_parallel_size: ranks simulated in this process (the engine's docstring).
        device: where ``allocate_kv_cache`` puts the caches (``"cuda"``: the connector's
            worker picks its CUDA transfer engine; tests/gpu).
        max_loras: > 0 turns LoRA on (``LoRAConfig(max_loras=...)``) so requests may name an
            adapter (:meth:`~hybridkv.vllm.harness.inprocess.InProcessEngine.add`); no adapter
            weights are loaded.
        kv_events: turn vLLM's KV cache events on (``KVEventsConfig``, the null publisher):
            the scheduler then drains the block pool's and the connector's ``take_events``.
        replicated_kv: under tensor parallel, simulate KV replicated on every rank (the
            engine's docstring).
        model_name: names the model's directory (vLLM's ``model``, with a digest of the
            config.json): engines of equal names and configs serve the same model path, like
            two replicas; another name is another model of the same geometry.
        speculative: ``SpeculativeConfig`` fields (e.g. ``{"method": "mtp",
            "num_speculative_tokens": 1}``; the target model is the draft's ``model``): the
            scheduler side of speculative decoding (EAGLE's block drop, speculative mamba
            blocks). The stand-in runner proposes no draft tokens, so every step schedules the
            request's real tokens only.
        prefix_match_unit: ``--prefix-match-unit`` (the hash block, below the block size: vLLM's
            partial hash hits and its ``cache_hit_alignment_tokens``).
        hash_algo: ``--prefix-caching-hash-algo`` (``sha256``, ``sha256_cbor``, ``xxhash``,
            ``xxhash_cbor``).
        async_scheduling: vLLM's ``--async-scheduling`` (on by default, as vLLM 0.33 turns it
            on wherever the executor supports it: every GPU server): the ``AsyncScheduler`` and
            vLLM's ``step_with_batch_queue`` loop (:mod:`hybridkv.vllm.harness.engine_loop`);
            off: the ``Scheduler`` and ``EngineCore.step``. The default comes from
            :data:`ENGINE_LOOP_ENV`.
        speculative_hooks: follow the runner's hook order under speculative decoding (the
            engine's docstring): the model's last attention layer stands in for the drafter's layer
            (an EAGLE head shares its group's block table); the target forward writes every
            other layer, ``get_transfer_results`` runs, then the "drafter" writes that layer's
            KV of the step's tokens, then ``wait_for_save``. No draft tokens are proposed:
            only the order of the writes and the hooks is the runner's.
    """

    num_gpu_blocks: int
    max_model_len: int
    block_size: int | None = None
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 256
    max_steps: int = 5000
    tensor_parallel_size: int = 1
    device: str = "cpu"
    max_loras: int = 0
    kv_events: bool = False
    replicated_kv: bool = False
    model_name: str = "model"
    speculative: dict[str, Any] | None = None
    prefix_match_unit: int | None = None
    speculative_hooks: bool = False
    hash_algo: str = "sha256"
    async_scheduling: bool = field(default_factory=default_async_scheduling)


@functools.cache
def _process_setup() -> None:
    # With AVX-512 BF16 vLLM makes the SSM state float32 and the hybrid block doubles: pin "no"
    # so the geometry does not depend on the host CPU.
    torch.cpu._is_avx512_bf16_supported = lambda: False  # type: ignore[attr-defined]
    init_distributed(23000)


def _config_dir(config_json: dict[str, Any], name: str) -> str:
    """The model directory ``name`` + a digest of the config: equal for equal arguments (the
    remote tier keys chunks by the model path, so two replicas must serve the same one)."""
    text = json.dumps(config_json, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    directory = (
        Path(tempfile.gettempdir()) / f"hybridkv-inprocess-{os.getuid()}" / (f"{name}-{digest}")
    )
    target = directory / "config.json"
    if not target.exists():
        directory.mkdir(parents=True, exist_ok=True)
        # Written whole, then renamed: a process building the same engine never reads half.
        fd, partial = tempfile.mkstemp(dir=directory, suffix=".json")
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(partial, target)
    return str(directory)


def _vllm_config(config_json: dict[str, Any], settings: EngineSettings, kv_transfer: Any) -> Any:
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig

    directory = _config_dir(config_json, settings.model_name)
    cache: dict[str, Any] = {
        "enable_prefix_caching": True,
        "num_gpu_blocks_override": settings.num_gpu_blocks,
        "prefix_caching_hash_algo": settings.hash_algo,
    }
    if settings.block_size is not None:
        cache["block_size"] = settings.block_size
    if settings.prefix_match_unit is not None:
        cache["prefix_match_unit"] = settings.prefix_match_unit
    model_config = ModelConfig(
        model=directory,
        tokenizer=directory,
        skip_tokenizer_init=True,
        max_model_len=settings.max_model_len,
        seed=0,
        enforce_eager=True,
    )
    parallel_config = ParallelConfig(tensor_parallel_size=settings.tensor_parallel_size)
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(**cache),
        scheduler_config=SchedulerConfig(
            max_model_len=settings.max_model_len,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_num_seqs=settings.max_num_seqs,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            async_scheduling=settings.async_scheduling,
        ),
        parallel_config=parallel_config,
        speculative_config=_speculative_config(settings.speculative, model_config, parallel_config),
        kv_transfer_config=copy.deepcopy(kv_transfer),
        lora_config=_lora_config(settings.max_loras),
        kv_events_config=_kv_events_config(settings.kv_events),
    )
    # vLLM's CPU platform turns async scheduling off (platforms/cpu.py:348); a GPU server keeps
    # it on, and that is the loop this engine stands in for.
    vllm_config.scheduler_config.async_scheduling = settings.async_scheduling
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        raise ValueError(
            f"kv_transfer_config={kv_transfer!r}: vLLM switched the hybrid KV cache manager off "
            "(the connector class must subclass SupportsHMA)"
        )
    return vllm_config


def _speculative_config(fields: dict[str, Any] | None, model: Any, parallel: Any) -> Any:
    if fields is None:
        return None
    from vllm.config import SpeculativeConfig

    return SpeculativeConfig(
        **{"model": model.model, **fields},
        target_model_config=model,
        target_parallel_config=parallel,
    )


def _lora_config(max_loras: int) -> Any:
    if max_loras <= 0:
        return None
    from vllm.config import LoRAConfig

    return LoRAConfig(max_loras=max_loras)


def _kv_events_config(enabled: bool) -> Any:
    from vllm.config import KVEventsConfig

    return KVEventsConfig(enable_kv_cache_events=enabled, publisher="null")


def _checkpoint_settings(
    vllm_config: Any, kv_cache_config: Any, block_size: int, hash_block_size: int
) -> tuple[int, bool]:
    """``(cache_hit_alignment_tokens, drop_eagle_block)`` as the worker's
    ``MambaPrefillCheckpointBuilder`` reads them (vLLM's own resolution of the first)."""
    from vllm.v1.core.kv_cache_utils import resolve_cache_hit_alignment_tokens

    alignment = resolve_cache_hit_alignment_tokens(
        kv_cache_config, vllm_config, block_size, hash_block_size
    )
    spec = vllm_config.speculative_config
    drop = (
        spec is not None
        and spec.use_eagle_block_drop()
        and not vllm_config.num_hash_lookahead_tokens
    )
    return alignment, bool(drop)
