"""The hybrid prefix hit: the longest length every group accepts at once (a fixed point).

vLLM 0.33, ``HybridKVCacheCoordinator.find_longest_cache_hit``
(``v1/core/kv_cache_coordinator.py:806-941``): groups are ordered full attention first (758-760),
each group in turn either accepts the candidate length or shrinks it, and the passes repeat until
a pass shrinks nothing. Lengths only decrease and are bounded by 0, so the loop ends; because each
group's answer is monotone in its bound, the result is the LONGEST length all groups accept.

The model evaluates each group on its own where vLLM batches groups of equal spec into one look-up
that must hit in all of them; by that monotonicity both reach the same fixed point. vLLM stops the
"simple hybrid" (full attention + one other kind) after one pass (838-841, 912-916); a second pass
there changes nothing, so the model always runs until stable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spec.block_pool import BlockHash, BlockId, BlockPool
from spec.kinds import GroupKind
from spec.managers.base import GroupHit, SingleTypeManager, coarse_hashes

__all__ = ["NO_HIT", "CacheHit", "find_longest_cache_hit", "find_longest_cache_hit_per_group"]


@dataclass(frozen=True, slots=True)
class CacheHit:
    """A prefix hit of ``num_tokens`` tokens; ``blocks[g]`` are group ``g``'s (null-padded).

    ``num_uncached_common_prefix_tokens``: how much longer the longest single-group hit was
    than the reconciled one (vLLM's ``longest_hit_length - hit_length``,
    ``kv_cache_coordinator.py:934-941``): a prefix other requests share that a sparse group
    (mamba, sliding window) has not cached at that length.
    """

    blocks: tuple[tuple[BlockId, ...], ...]
    num_tokens: int
    num_uncached_common_prefix_tokens: int = 0

    @property
    def shared_prefix_boundary(self) -> int:
        """Where that shared prefix ends (0 if none): vLLM's ``get_computed_blocks`` pins it
        (``kv_cache_manager.py:319-328``) and the mamba split stops there."""
        extra = self.num_uncached_common_prefix_tokens
        return self.num_tokens + extra if extra else 0


NO_HIT = CacheHit((), 0)
"""The empty hit: no blocks for any group, 0 tokens."""


def find_longest_cache_hit(
    managers: Sequence[SingleTypeManager],
    pool: BlockPool,
    block_hashes: Sequence[BlockHash],
    hash_block_size: int,
    max_length: int,
) -> CacheHit:
    """The longest prefix of at most ``max_length`` tokens that every group accepts. Pure.

    ``block_hashes`` are taken every ``hash_block_size`` tokens. Post: each group's own search
    bounded by ``num_tokens`` returns ``num_tokens`` (stability), and no longer such length exists;
    ``num_uncached_common_prefix_tokens`` is the longest answer any group gave minus
    ``num_tokens`` (the first group asked, full attention, gives the longest).
    """
    order = sorted(range(len(managers)), key=lambda g: managers[g].spec.kind is not GroupKind.FULL)
    views = [coarse_hashes(block_hashes, hash_block_size, m.block_size) for m in managers]
    hits: dict[int, GroupHit] = {}
    length = max_length
    longest = 0
    while True:
        candidate = length
        for group in order:
            hits[group] = managers[group].find_longest_cache_hit(pool, views[group], candidate)
            candidate = hits[group].num_tokens
            longest = max(longest, candidate)
        if candidate >= length:
            break
        length = candidate
    blocks = tuple(hits[g].blocks for g in range(len(managers)))
    return CacheHit(blocks, length, longest - length)


def find_longest_cache_hit_per_group(
    managers: Sequence[SingleTypeManager],
    pool: BlockPool,
    block_hashes: Sequence[BlockHash],
    hash_block_size: int,
    max_length: int,
) -> tuple[int, ...]:
    """Each group's own longest hit length, unreconciled (``kv_cache_coordinator.py:943-987``).

    Pure. A group reporting more than the reconciled hit shows what the others cost.
    """
    return tuple(
        m.find_longest_cache_hit(
            pool, coarse_hashes(block_hashes, hash_block_size, m.block_size), max_length
        ).num_tokens
        for m in managers
    )
