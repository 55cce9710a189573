"""vLLM's KV cache groups, read as hybridkv's planner, claim geometry and canonical specs.

Both roles read the same ``KVCacheConfig``, so the scheduler sizes the host store on exactly the
slots the worker allocates. The chunk is the largest group's block: then every group's offload
unit is its whole block (planner rule PL-3: a chunk that divides no block keeps the block), which
is what the transfer engine moves (one ``TransferPair`` per group block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridkv import HybridKVConfigError
from hybridkv.canonical import CacheGroupSpec
from hybridkv.connector import ConnectorGeometry
from hybridkv.planner import GroupKind, HybridOffloadPlanner


@dataclass(frozen=True, slots=True)
class Layout:
    """What the connector needs of one model's KV cache configuration."""

    groups: tuple[CacheGroupSpec, ...]
    reaches: tuple[int, ...]  # per group: tokens a sliding window reads back (0: full)
    hash_block_size: int  # the granularity of vLLM's request.block_hashes
    num_blocks: int
    max_model_len: int

    @property
    def slot_bytes(self) -> int:
        """One host slot: the largest group's block over all its layers."""
        return max(len(g.layer_names) * g.real_page_size_bytes for g in self.groups)

    def planner(self) -> HybridOffloadPlanner:
        chunk = max(g.block_size for g in self.groups)
        groups = tuple((g.kind, g.block_size) for g in self.groups)
        return HybridOffloadPlanner(groups, self.hash_block_size, chunk, self.max_model_len)

    def geometry(self) -> ConnectorGeometry:
        """The claim geometry: which units a claim needs per group (full: all, sliding: the
        window's)."""
        kinds = tuple(g.kind for g in self.groups)
        return ConnectorGeometry.build(self.planner(), kinds, sliding_windows=self.reaches)

    def host_slots(self, host_bytes: int) -> int:
        slots = host_bytes // self.slot_bytes
        if slots < 1:
            raise HybridKVConfigError(
                "kv_connector_extra_config.host_bytes",
                host_bytes,
                f"holds no host slot of {self.slot_bytes} bytes (one block of every layer)",
                f"give at least {self.slot_bytes}",
            )
        return slots


def read_layout(vllm_config: Any, kv_cache_config: Any) -> Layout:
    """The layout of ``kv_cache_config``; a mamba group is refused (see the tutorial's scope)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups, reaches = [], []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        sliding = isinstance(spec, SlidingWindowSpec)
        if not sliding and not isinstance(spec, FullAttentionSpec):
            raise HybridKVConfigError(
                f"kv_cache_groups[{g}]",
                type(spec).__name__,
                "is not attention: this example moves full and sliding-window attention only",
                "use hybridkv.vllm.HybridKVConnector for mamba/GDN hybrids",
            )
        kind = GroupKind.SLIDING if sliding else GroupKind.FULL
        groups.append(
            CacheGroupSpec(
                kind,
                int(spec.block_size),
                int(spec.page_size_bytes),
                int(spec.real_page_size_bytes),
                tuple(group.layer_names),
            )
        )
        # The tokens a sliding layer reads back from its last one (vLLM's own reach).
        reach = spec.sliding_window - 1 + spec.extra_retained_tokens if sliding else 0
        reaches.append(int(reach))
    return Layout(
        tuple(groups),
        tuple(reaches),
        _hash_block_size(vllm_config, kv_cache_config),
        int(kv_cache_config.num_blocks),
        int(vllm_config.model_config.max_model_len),
    )


def _hash_block_size(vllm_config: Any, kv_cache_config: Any) -> int:
    if getattr(kv_cache_config, "hash_block_size", None):
        return int(kv_cache_config.hash_block_size)
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    return int(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1])
