"""Full attention: every token's KV is kept, and a hit is the longest cached prefix.

vLLM 0.33: ``FullAttentionManager.find_longest_cache_hit``
(``v1/core/single_type_kv_cache_manager.py:743-838``): a left-to-right scan that stops at the
first miss (hashes are chained, so every later block misses too), then rounds the hit down to the
cache-hit alignment. Fine-grained (sub-block) hits and EAGLE are not modelled.
"""

from __future__ import annotations

from collections.abc import Sequence

from spec.block_pool import BlockHash, BlockId, BlockPool
from spec.managers.base import GroupHit, SingleTypeManager

__all__ = ["FullAttentionManager"]


class FullAttentionManager(SingleTypeManager):
    """A full-attention group: nothing is ever skipped, so its tables hold no null block."""

    def find_longest_cache_hit(
        self, pool: BlockPool, block_hashes: Sequence[BlockHash], max_length: int
    ) -> GroupHit:
        """The longest cached prefix of at most ``max_length`` tokens, rounded down to alignment.

        Pure. Post: ``num_tokens`` is a multiple of ``alignment_tokens`` and ``blocks`` are the
        first ``num_tokens // block_size`` cached blocks, all real.
        """
        found: list[BlockId] = []
        for block_hash in block_hashes[: max_length // self.block_size]:
            hit = pool.get_cached_block(block_hash, (self.kv_cache_group_id,))
            if not hit:
                break
            found.append(hit[0])
        num_tokens = len(found) * self.block_size
        num_tokens -= num_tokens % self.alignment_tokens
        return GroupHit(tuple(found[: num_tokens // self.block_size]), num_tokens)
