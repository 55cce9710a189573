"""vLLM 0.33's KV cache configuration read as hybridkv's geometry (both roles compute the same).

:func:`read_layout` turns a ``KVCacheConfig`` (and the ``VllmConfig`` that resolves its hash
block size) into a :class:`VllmLayout`: one :class:`~hybridkv.canonical.CacheGroupSpec` per KV
cache group, each group's sliding-window reach, the hash block size ``request.block_hashes``
use, and the bytes one host slot needs. The scheduler side sizes the host store from
``slot_bytes`` without seeing a tensor; the worker side checks its canonical caches agree.

:func:`recommended_chunk_size` is the default ``chunk_size``
(:func:`hybridkv.default_chunk.default_chunk_size`): among the chunks that the planner accepts
and that keep every group's offload unit its whole block (the transfer engine moves whole
blocks), the smallest with the finest claim, so a claim rounds off no token a whole-block chunk
could claim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridkv.canonical import CacheGroupSpec
from hybridkv.default_chunk import default_chunk_size, whole_block_planner
from hybridkv.errors import HybridKVConfigError
from hybridkv.kinds import GroupKind
from hybridkv.planner import HybridOffloadPlanner

__all__ = ["VllmLayout", "read_layout", "recommended_chunk_size", "whole_blocks"]


@dataclass(frozen=True, slots=True)
class VllmLayout:
    """What hybridkv needs of vLLM's KV cache configuration."""

    groups: tuple[CacheGroupSpec, ...]
    window_reaches: tuple[int, ...]
    hash_block_size: int
    num_blocks: int
    max_model_len: int

    @property
    def slot_bytes(self) -> int:
        """Bytes of one host slot: the largest group's block over all its layers, unpadded
        (what :meth:`hybridkv.canonical.CanonicalCaches.group_bytes` measures)."""
        return max(len(g.layer_names) * g.real_page_size_bytes for g in self.groups)

    def planner(self, chunk_size: int) -> HybridOffloadPlanner:
        """The planner for ``chunk_size`` (refusal: its :class:`HybridKVConfigError`)."""
        return HybridOffloadPlanner(
            tuple((g.kind, g.block_size) for g in self.groups),
            self.hash_block_size,
            chunk_size,
            self.max_model_len,
        )


def read_layout(vllm_config: Any, kv_cache_config: Any) -> VllmLayout:
    """The layout of ``kv_cache_config``; a group kind hybridkv does not move is refused."""
    groups = []
    reaches = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = _kind(g, spec)
        groups.append(
            CacheGroupSpec(
                kind,
                int(spec.block_size),
                int(spec.page_size_bytes),
                int(spec.real_page_size_bytes),
                tuple(group.layer_names),
            )
        )
        reach = 0
        if kind is GroupKind.SLIDING:
            reach = spec.sliding_window - 1 + getattr(spec, "extra_retained_tokens", 0)
        reaches.append(reach)
    return VllmLayout(
        tuple(groups),
        tuple(reaches),
        _hash_block_size(vllm_config, kv_cache_config),
        int(kv_cache_config.num_blocks),
        int(vllm_config.model_config.max_model_len),
    )


def recommended_chunk_size(layout: VllmLayout) -> int:
    """The default chunk size (module docstring); refusal when no chunk fits."""
    chunk = default_chunk_size(
        _planner_groups(layout), layout.hash_block_size, layout.max_model_len
    )
    if chunk is None:
        raise HybridKVConfigError(
            "kv_connector_extra_config.chunk_size",
            None,
            f"no chunk size fits groups {[(g.kind.value, g.block_size) for g in layout.groups]}"
            f" within max_model_len {layout.max_model_len}",
            "raise --max-model-len",
        )
    return chunk


def whole_blocks(layout: VllmLayout, chunk_size: int) -> bool:
    """Whether the planner accepts ``chunk_size`` and every group's unit is its whole block."""
    groups = _planner_groups(layout)
    planner = whole_block_planner(groups, layout.hash_block_size, chunk_size, layout.max_model_len)
    return planner is not None


def _planner_groups(layout: VllmLayout) -> tuple[tuple[GroupKind, int], ...]:
    return tuple((g.kind, g.block_size) for g in layout.groups)


def _kind(g: int, spec: Any) -> GroupKind:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    if isinstance(spec, MambaSpec):
        return GroupKind.MAMBA
    if isinstance(spec, SlidingWindowSpec):
        return GroupKind.SLIDING
    if isinstance(spec, FullAttentionSpec) and not getattr(spec, "sliding_window", None):
        return GroupKind.FULL
    raise HybridKVConfigError(
        f"kv_cache_groups[{g}]",
        type(spec).__name__,
        "is a KV cache spec hybridkv does not offload",
        "use a model whose groups are full attention, sliding window or mamba",
    )


def _hash_block_size(vllm_config: Any, kv_cache_config: Any) -> int:
    """The granularity of ``request.block_hashes`` (vLLM's ``resolve_kv_cache_block_sizes``)."""
    if kv_cache_config.hash_block_size:
        return int(kv_cache_config.hash_block_size)
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    return int(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1])
