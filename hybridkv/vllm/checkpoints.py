"""vLLM 0.33's mamba prefill-checkpoint settings read as one ``CheckpointRule`` per KV group.

The worker's ``MambaPrefillCheckpointBuilder`` (``model_executor/layers/mamba/checkpoint.py``,
100-160) exports a checkpoint for a mamba group whose spec has ``num_prefill_checkpoint_blocks`` > 0
(GDN with the FlashInfer prefill, Mamba-2, KDA), at the position
``get_mamba_prefill_checkpoint_position`` gives with the resolved ``cache_hit_alignment_tokens``,
EAGLE's block drop (``use_eagle_block_drop`` unless lookahead hashes are on) and
``num_hash_lookahead_tokens``, valid by the spec's ``prefill_checkpoint_alignment``. The
scheduler's ``MambaManager`` reserves and re-keys the block at the same position. This module
reads those inputs once; :class:`hybridkv.connector.checkpoints.CheckpointRule` applies them.
"""

from __future__ import annotations

import math
from typing import Any

from hybridkv.connector.checkpoints import NO_CHECKPOINTS, CheckpointRule

__all__ = ["read_checkpoint_rules"]


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
    # vLLM 0.32 has no lookahead hashes (no such field): its checkpoint rule is 0.33's with 0.
    lookahead = int(getattr(vllm_config, "num_hash_lookahead_tokens", 0))
    speculative = vllm_config.speculative_config
    drop = bool(speculative is not None and speculative.use_eagle_block_drop() and not lookahead)
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
