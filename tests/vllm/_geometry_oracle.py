"""What vLLM 0.33's own code derives for a model's KV-cache geometry (a subprocess helper).

    python _geometry_oracle.py PLATFORM < cases.json > results.json

PLATFORM is one of spec.platforms.PLATFORMS; stdin holds a JSON list of cases
``{"config_dir", "max_model_len", "cache_mode", "block_size"}``; stdout gets one JSON result per
case (vLLM's logs go to stderr). One process serves one platform because the platform is chosen
when vLLM is imported.

Every number comes from vLLM's code paths, none is computed here:

1. ``VllmConfig(...)``: its post-init runs the model's config hooks (mamba cache mode, SSM
   dtype) and the platform's ``check_and_update_config``.
2. The model class is built on the meta device by the loader (``initialize_model``), so every
   attention and mamba layer registers itself.
3. ``current_platform.update_block_size_for_backend`` (the call the executors make after
   loading): backend block size and ``_align_hybrid_block_size``.
4. The per-layer specs of the GPU model runner (``attn_utils.get_kv_cache_spec``).
5. ``EngineCore._initialize_kv_caches`` itself, with a stand-in executor that answers with the
   specs of step 4 and a fixed memory budget, then ``resolve_kv_cache_block_sizes`` as
   ``EngineCore.__init__`` calls it.

Platforms: ``cpu`` is vLLM's real CpuPlatform with ``torch.cpu._is_avx512_bf16_supported``
answering False (``cpu-avx512bf16``: True), since vLLM reads the host ISA. ``cuda-sm90`` puts
vLLM's own ``CudaPlatformBase`` policy methods on the platform object and answers device
questions like an H100 (capability 9.0); compiled ops that layer constructors bind are replaced
by placeholders that raise if called (nothing runs forward). torchvision's compiled ops are
declared (never run) when its CUDA-built extension cannot load beside CPU torch: the caller puts
``_torchvision_shim`` on PYTHONPATH, whose ``sitecustomize`` does it in this process and in the
subprocess vLLM's model registry starts to inspect a model.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import types
from collections.abc import Iterator
from typing import Any

from _inprocess import init_distributed, plan_kv_caches, set_cpu_env

set_cpu_env()

import torch  # noqa: E402


def _torchvision_extension_loads() -> bool:
    try:
        from torchvision import extension
    except ImportError:
        return False
    return bool(extension._has_ops())


def _preimport(config_dirs: list[str]) -> None:
    """Import, on the real CPU platform, what branches on is_cuda() at import time.

    The attention backends and each model's module are imported before CUDA emulation starts,
    so no import tries a missing CUDA extension (e.g. vllm_flash_attn).
    """
    import vllm.model_executor.model_loader
    import vllm.v1.attention.backends.fa_utils
    from vllm.config import ModelConfig
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, MambaAttentionBackendEnum

    for name in ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "FLASHINFER", "CPU_ATTN"):
        with contextlib.suppress(Exception):
            AttentionBackendEnum[name].get_class()
    for backend in MambaAttentionBackendEnum:
        with contextlib.suppress(Exception):
            backend.get_class()
    # Probes a compiled op at import time; on the real CPU platform it answers without one.
    import vllm.model_executor.layers.quantization.online.fp8  # noqa: F401

    for config_dir in config_dirs:
        mc = ModelConfig(model=config_dir, tokenizer=config_dir, skip_tokenizer_init=True)
        ModelRegistry.resolve_model_cls(mc.architectures, model_config=mc)


_PATCHED = (
    "_enum",
    "get_device_capability",
    "get_cuda_runtime_major",
    "device_count",
    "get_device_name",
    "check_and_update_config",
    "get_attn_backend_cls",
    "get_valid_backends",
    "support_hybrid_kv_cache",
    "update_block_size_for_backend",
)


@contextlib.contextmanager
def _as_h100() -> Iterator[None]:
    """The CPU platform object answers like CUDA on an H100, with vLLM's CUDA policy code."""
    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    import torch._ops as torch_ops
    from vllm.platforms import current_platform
    from vllm.platforms.cuda import CudaPlatformBase
    from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum

    cls = type(current_platform)
    saved = {name: cls.__dict__[name] for name in _PATCHED if name in cls.__dict__}
    cls._enum = PlatformEnum.CUDA
    cls.get_device_capability = classmethod(lambda _c, device_id=0: DeviceCapability(9, 0))
    cls.get_cuda_runtime_major = classmethod(lambda _c: 12)
    cls.device_count = classmethod(lambda _c: 1)
    cls.get_device_name = classmethod(lambda _c, device_id=0: "NVIDIA H100 (emulated)")
    for name in (
        "check_and_update_config",
        "get_attn_backend_cls",
        "get_valid_backends",
        "support_hybrid_kv_cache",
    ):
        setattr(cls, name, classmethod(getattr(CudaPlatformBase, name).__func__))
    # CudaPlatformBase inherits this one from Platform.
    cls.update_block_size_for_backend = classmethod(Platform.update_block_size_for_backend.__func__)
    original_getattr = torch_ops._OpNamespace.__getattr__

    def bind_missing_op(namespace: Any, op_name: str) -> Any:
        try:
            return original_getattr(namespace, op_name)
        except AttributeError:
            if op_name.startswith("__"):
                raise

            def missing(*_a: Any, **_k: Any) -> Any:
                raise RuntimeError(f"compiled op {op_name} is not available on CPU")

            return missing

    class _NoStream:
        def __init__(self, *_a: Any, **_k: Any) -> None:
            pass

        def __getattr__(self, _name: str) -> Any:
            return lambda *_a, **_k: None

    # flash_attn.py imports its fa_utils helpers only when CUDA was seen at import time; the
    # backend selector still asks one of them (sinks support), so bind vLLM's own function.
    from vllm.v1.attention.backends import fa_utils, flash_attn

    if not hasattr(flash_attn, "flash_attn_supports_sinks"):
        flash_attn.flash_attn_supports_sinks = fa_utils.flash_attn_supports_sinks
    saved_cuda = {name: getattr(torch.cuda, name) for name in ("Stream", "Event")}
    torch_ops._OpNamespace.__getattr__ = bind_missing_op
    torch.cuda.Stream = torch.cuda.Event = _NoStream
    try:
        yield
    finally:
        torch_ops._OpNamespace.__getattr__ = original_getattr
        for name, value in saved_cuda.items():
            setattr(torch.cuda, name, value)
        for name in _PATCHED:
            if name in saved:
                setattr(cls, name, saved[name])
            elif name in cls.__dict__:
                delattr(cls, name)


def _group_summary(group: Any) -> dict[str, Any]:
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    spec = group.kv_cache_spec
    out: dict[str, Any] = {
        "spec": type(spec).__name__,
        # vLLM's own reading of a layer name's index: Falcon-H1 names its mamba branches
        # ``model.<n + i>.mixer``, outside ``layers.``.
        "layer_indices": [extract_layer_index(n) for n in group.layer_names],
        "block_size": spec.block_size,
        "page_size_bytes": spec.page_size_bytes,
        "real_page_size_bytes": spec.real_page_size_bytes,
        "prefix_cacheable": bool(spec.prefix_cacheable),
    }
    if isinstance(spec, SlidingWindowSpec):
        out["sliding_window"] = spec.sliding_window
        out["extra_retained_tokens"] = spec.extra_retained_tokens
    if isinstance(spec, MambaSpec):
        out["mamba_cache_mode"] = spec.mamba_cache_mode
        out["mamba_type"] = spec.mamba_type.name
        out["shapes"] = [list(s) for s in spec.shapes]
        out["dtypes"] = [str(d).replace("torch.", "") for d in spec.dtypes]
    return out


class _Warnings(logging.Handler):
    """Collects what vLLM logs at WARNING and above (e.g. the CPU block-size warning)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _vllm_warnings() -> Iterator[list[str]]:
    handler = _Warnings()
    logger = logging.getLogger("vllm")
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


def _measure(case: dict[str, Any]) -> dict[str, Any]:
    with _vllm_warnings() as warnings:
        result = _plan(case)
    return {**result, "warnings": sorted(set(warnings))}


def _plan(case: dict[str, Any]) -> dict[str, Any]:
    from vllm.config import (
        CacheConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.platforms import current_platform

    directory, max_len = case["config_dir"], case["max_model_len"]
    model_config = ModelConfig(
        model=directory,
        tokenizer=directory,
        skip_tokenizer_init=True,
        max_model_len=max_len,
        seed=0,
        enforce_eager=True,
    )
    cache_kwargs: dict[str, Any] = {"enable_prefix_caching": case["cache_mode"] == "align"}
    if case.get("block_size") is not None:
        cache_kwargs["block_size"] = case["block_size"]
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(**cache_kwargs),
        scheduler_config=SchedulerConfig(
            max_model_len=max_len,
            max_num_batched_tokens=8192,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
    )
    kv_config, scheduler_block_size, hash_block_size = plan_kv_caches(vllm_config, 64 << 30)
    cache = vllm_config.cache_config
    return {
        "case": case,
        "attention_backends": sorted(
            {b.get_name() for b in current_platform._find_non_ssm_backends(vllm_config)}
        ),
        "groups": [_group_summary(g) for g in kv_config.kv_cache_groups],
        "block_size": cache.block_size,
        "mamba_block_size": cache.mamba_block_size,
        "mamba_cache_mode": cache.mamba_cache_mode,
        "scheduler_block_size": scheduler_block_size,
        "hash_block_size": hash_block_size,
        "kv_config_hash_block_size": kv_config.hash_block_size,
        "cache_hit_alignment_tokens": kv_config.cache_hit_alignment_tokens,
    }


def main(platform: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if platform.startswith("cpu"):
        has_bf16 = platform == "cpu-avx512bf16"
        torch.cpu._is_avx512_bf16_supported = lambda: has_bf16
    _preimport(sorted({c["config_dir"] for c in cases}))
    init_distributed(20000)
    emulate = _as_h100() if platform == "cuda-sm90" else contextlib.nullcontext()
    results = []
    with emulate:
        for case in cases:
            try:
                results.append(_measure(case))
            except Exception as exc:  # reported per case, the others still run
                results.append({"case": case, "error": f"{type(exc).__name__}: {exc}"})
    return results


if __name__ == "__main__":
    _out = main(sys.argv[1], json.load(sys.stdin))
    _out.append({"torchvision_extension_loads": _torchvision_extension_loads()})
    json.dump(_out, sys.stdout)
