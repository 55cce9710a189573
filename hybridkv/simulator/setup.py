"""What ``hybridkv simulate`` derives from a model before it runs: geometry, planner, scheduler.

The geometry is vLLM 0.33's own (:func:`spec.layout.derive_layout`, the same derivation
``hybridkv plan`` prints and ``nox -s vllm`` checks against vLLM): groups, block sizes, padded
pages, mamba state shapes. From it come the simulated caches' groups
(:class:`hybridkv.testbed.caches.SimGroup`), the offload planner with the recommended chunk, and the
spec scheduler's configuration (:class:`spec.scheduler.SchedulerConfig`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridkv.errors import HybridKVConfigError
from hybridkv.kinds import GroupKind as LibKind
from hybridkv.planner import HybridOffloadPlanner
from hybridkv.simulator.chunking import chunk_options, recommend
from hybridkv.testbed.caches import SimGroup
from spec.kinds import GroupKind
from spec.layout import Layout, LayoutSettings, derive_layout, model_from_config
from spec.managers.group_spec import GroupSpec
from spec.platforms import DEFAULT_PLATFORM
from spec.scheduler import RecoveryMode, SchedulerConfig

__all__ = ["SimSetup", "derive_setup"]


@dataclass(frozen=True, slots=True)
class SimSetup:
    """Everything fixed for one simulation run.

    Attributes:
        layout: the derived KV cache layout (vLLM 0.33's geometry).
        sim_groups: the simulated caches' groups, one per layout group.
        scheduler: the spec scheduler's configuration.
        planner: the optimized offload planner (groups, hash block, chunk, max_model_len).
        chunk_size: the offload chunk in tokens.
        layers_per_group: layers simulated per group (the model has ``layout_layers``).
        layout_layers: the model's layers per group.
    """

    layout: Layout
    sim_groups: tuple[SimGroup, ...]
    scheduler: SchedulerConfig
    planner: HybridOffloadPlanner
    chunk_size: int
    layers_per_group: int
    layout_layers: int

    @property
    def group_kinds(self) -> tuple[str, ...]:
        """Each group's kind name, in group order."""
        return tuple(g.kind.value for g in self.layout.groups)


def derive_setup(
    config: Mapping[str, Any],
    *,
    max_model_len: int,
    gpu_blocks: int,
    max_num_batched_tokens: int,
    max_num_running: int,
    layers_per_group: int,
    load_deadline_steps: int | None,
    recovery: RecoveryMode = RecoveryMode.SHARED_TRUNCATION,
    chunk_size: int | None = None,
    platform: str = DEFAULT_PLATFORM,
) -> SimSetup:
    """Derive the run's fixed parts from a model's config.json dict.

    Pre: none. Post: a consistent setup. Refusal: bad values raise the spec's ConfigError or
    :class:`HybridKVConfigError` naming the field (``--gpu-blocks``, ``--chunk-size``...);
    nothing is allocated here.
    """
    for field, value in (
        ("--gpu-blocks", gpu_blocks),
        ("--max-num-batched-tokens", max_num_batched_tokens),
        ("--max-num-running", max_num_running),
        ("--layers-per-group", layers_per_group),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise HybridKVConfigError(field, value, "must be an int >= 1", f"pass {field} >= 1")
    model = model_from_config(config)
    layout = derive_layout(model, LayoutSettings(max_model_len=max_model_len, platform=platform))
    if chunk_size is None:
        best = recommend(chunk_options(layout, max_model_len))
        if best is None:
            raise HybridKVConfigError(
                "--max-model-len",
                max_model_len,
                "leaves no chunk size with which offload can hit",
                "raise --max-model-len (hybridkv plan lists the options)",
            )
        chunk_size = best.chunk_size
    planner = HybridOffloadPlanner(
        [(LibKind(g.kind.value), g.block_size) for g in layout.groups],
        layout.hash_block_size,
        chunk_size,
        max_model_len,
    )
    largest = max(g.block_size for g in layout.groups)
    if max_num_batched_tokens < largest:
        raise HybridKVConfigError(
            "--max-num-batched-tokens",
            max_num_batched_tokens,
            f"is below the {largest}-token block: an aligned prefill chunk never fits",
            f"pass at least {largest}",
        )
    scheduler = SchedulerConfig(
        groups=tuple(_group_spec(g) for g in layout.groups),
        num_blocks=gpu_blocks + 1,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_running=max_num_running,
        hash_block_size=layout.hash_block_size,
        recovery=recovery,
        load_deadline_steps=load_deadline_steps,
    )
    return SimSetup(
        layout,
        tuple(_sim_group(g, layout.dtype) for g in layout.groups),
        scheduler,
        planner,
        chunk_size,
        layers_per_group,
        max(len(g.layer_indices) for g in layout.groups),
    )


def _group_spec(g: Any) -> GroupSpec:
    if g.kind is GroupKind.SLIDING:
        return GroupSpec(g.kind, g.block_size, g.sliding_window or 0, g.extra_retained_tokens)
    return GroupSpec(g.kind, g.block_size)


_TORCH_DTYPES = {"bfloat16", "float16", "float32", "float8_e4m3fn", "int8", "uint8"}


def _sim_group(g: Any, kv_dtype: str) -> SimGroup:
    attention_dtype = kv_dtype if kv_dtype in _TORCH_DTYPES else "bfloat16"
    if g.kind is GroupKind.MAMBA:
        return SimGroup(
            LibKind.MAMBA,
            g.block_size,
            g.page_size_bytes,
            g.real_page_size_bytes,
            state_shapes=tuple(tuple(s) for s in g.mamba_shapes),
            state_dtypes=tuple(g.mamba_dtypes),
        )
    return SimGroup(
        LibKind(g.kind.value),
        g.block_size,
        g.page_size_bytes,
        g.real_page_size_bytes,
        attention_dtype=attention_dtype,
        sliding_window=g.sliding_window,
    )
