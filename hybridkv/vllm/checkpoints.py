"""vLLM 0.33's mamba prefill-checkpoint settings read as one ``CheckpointRule`` per KV group.

The worker's ``MambaPrefillCheckpointBuilder`` (``model_executor/layers/mamba/checkpoint.py``,
100-160) exports a checkpoint for a mamba group whose spec has ``num_prefill_checkpoint_blocks`` > 0
(GDN with the FlashInfer prefill, Mamba-2, KDA), at the position
``get_mamba_prefill_checkpoint_position`` gives with the resolved ``cache_hit_alignment_tokens``,
EAGLE's block drop (``use_eagle_block_drop`` unless lookahead hashes are on) and
``num_hash_lookahead_tokens``, valid by the spec's ``prefill_checkpoint_alignment``. The
scheduler's ``MambaManager`` reserves and re-keys the block at the same position. This module
reads those inputs once; :class:`hybridkv.connector.checkpoints.CheckpointRule` applies them.

The same drop shortens prefix-cache hits: :func:`read_eagle_groups` names the groups vLLM's
coordinator drops EAGLE's block from, whose claims need a proof unit
(:class:`hybridkv.connector.geometry.ConnectorGeometry`).
"""

from __future__ import annotations

import math
from typing import Any

from hybridkv.connector.checkpoints import NO_CHECKPOINTS, CheckpointRule

__all__ = ["read_checkpoint_rules", "read_eagle_groups"]


def _drops_eagle_block(vllm_config: Any) -> bool:
    """The scheduler's ``use_eagle_block_drop`` (``v1/core/sched/scheduler.py:330-345``):
    EAGLE/MTP speculation, unless lookahead hashes prove the boundary token. vLLM 0.32 has no
    lookahead hashes (no such field): its rule is 0.33's with 0."""
    lookahead = int(getattr(vllm_config, "num_hash_lookahead_tokens", 0))
    speculative = vllm_config.speculative_config
    return bool(speculative is not None and speculative.use_eagle_block_drop() and not lookahead)


def read_eagle_groups(vllm_config: Any, kv_cache_config: Any) -> tuple[int, ...]:
    """The KV cache groups vLLM's prefix cache drops EAGLE's block from: those holding the
    drafter's layers (``is_eagle_group``), or every group when none is marked (vLLM's
    coordinator falls back to all, ``v1/core/kv_cache_coordinator.py:130-137``); none without
    the drop. The geometry leaves mamba groups out (the margin is the attention groups')."""
    if not _drops_eagle_block(vllm_config):
        return ()
    groups = kv_cache_config.kv_cache_groups
    marked = tuple(i for i, g in enumerate(groups) if getattr(g, "is_eagle_group", False))
    return marked or tuple(range(len(groups)))


def read_checkpoint_rules(
    vllm_config: Any, kv_cache_config: Any, hash_block_size: int
) -> tuple[CheckpointRule, ...]:
    """One rule per KV cache group of ``kv_cache_config`` (module docstring).

    Attention groups and mamba groups without checkpoint blocks get ``NO_CHECKPOINTS``.
    """
    from vllm.v1.core.kv_cache_utils import resolve_cache_hit_alignment_tokens
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = kv_cache_config.kv_cache_groups
    scheduler_block = math.lcm(*(int(g.kv_cache_spec.block_size) for g in groups))
    alignment = int(
        resolve_cache_hit_alignment_tokens(
            kv_cache_config, vllm_config, scheduler_block, hash_block_size
        )
    )
    lookahead = int(getattr(vllm_config, "num_hash_lookahead_tokens", 0))
    drop = _drops_eagle_block(vllm_config)
    rules = []
    for group in groups:
        spec = group.kv_cache_spec
        exports = (
            isinstance(spec, MambaSpec)
            and spec.mamba_cache_mode == "align"
            and spec.num_prefill_checkpoint_blocks > 0
            and spec.prefill_checkpoint_alignment is not None
        )
        rules.append(
            CheckpointRule(
                int(spec.prefill_checkpoint_alignment),
                hash_block_size,
                alignment,
                drop,
                lookahead,
            )
            if exports
            else NO_CHECKPOINTS
        )
    return tuple(rules)
