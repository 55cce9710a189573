"""Sliding-window attention: only the last ``sliding_window`` tokens are read.

vLLM 0.33, ``SlidingWindowManager`` (``v1/core/single_type_kv_cache_manager.py``):

- skipped tokens ``max(0, n - sliding_window + 1 - extra_retained_tokens)`` (1148-1183);
- a hit needs ``cdiv(sliding_window - 1, block_size)`` contiguous cached blocks, found right to
  left; the run's last block must end on the alignment; when no full run exists, a cached run from
  position 0 still counts, cut back to the alignment (969-1065);
- only blocks some aligned hit could read get cache entries (``reachable_block_mask``,
  1067-1146): with dense retention a window's worth before every aligned boundary, with vLLM's
  default sparse retention (``prefix_cache_retention_interval=0``) only before the request's
  resume boundaries.

External tokens get real blocks for the window only; the skipped prefix is null from the start.
"""

from __future__ import annotations

from collections.abc import Sequence

from spec.block_pool import NULL_BLOCK, BlockHash, BlockId, BlockPool
from spec.managers.base import GroupHit, SingleTypeManager
from spec.managers.group_spec import cdiv

__all__ = ["SlidingWindowManager"]


class SlidingWindowManager(SingleTypeManager):
    """A sliding-window group: positions before the window hold the null block."""

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """``max(0, n - sliding_window + 1 - extra_retained_tokens)``.

        Pure."""
        window = self.spec.sliding_window
        return max(0, num_computed_tokens - window + 1 - self.spec.extra_retained_tokens)

    def _blocks_for_hit(self) -> int:
        return cdiv(self.spec.sliding_window - 1, self.block_size)

    def find_longest_cache_hit(
        self, pool: BlockPool, block_hashes: Sequence[BlockHash], max_length: int
    ) -> GroupHit:
        """The rightmost window's worth of cached blocks ending at most ``max_length`` tokens in.

        Pure. Post: ``blocks`` is null-padded up to the run, ``num_tokens`` equals
        ``len(blocks) * block_size`` and is a multiple of ``alignment_tokens``.
        """
        need = self._blocks_for_hit()
        max_blocks = min(max_length // self.block_size, len(block_hashes))
        found: list[BlockId] = [NULL_BLOCK] * max_blocks
        run = 0
        for index in range(max_blocks - 1, -1, -1):
            hit = pool.get_cached_block(block_hashes[index], (self.kv_cache_group_id,))
            if not hit:
                run = 0
                continue
            if run == 0 and ((index + 1) * self.block_size) % self.alignment_tokens:
                continue  # a run must end on an aligned boundary
            found[index] = hit[0]
            run += 1
            if run >= need:
                return self._hit(found[: index + run])
        # No full window: the cached run starting at position 0 (possibly empty) still counts.
        found = found[:run]
        while (len(found) * self.block_size) % self.alignment_tokens:
            found.pop()
        return self._hit(found)

    def _hit(self, blocks: list[BlockId]) -> GroupHit:
        return GroupHit(tuple(blocks), len(blocks) * self.block_size)

    def block_mask(
        self, start_block: int, end_block: int, boundaries: Sequence[int] = ()
    ) -> list[bool] | None:
        """Which new blocks a later hit can read (vLLM's ``reachable_block_mask``, 1067-1146).

        Dense retention (``retention_interval`` None): the last ``need`` blocks of each
        alignment segment (all when ``need`` covers a segment). Sparse retention (0, vLLM's
        default): only the ``need`` blocks ending at each resume boundary (floored to the
        alignment). Alignment that is not whole blocks: every block.

        Pure.
        """
        if self.alignment_tokens % self.block_size:
            return None
        need = self._blocks_for_hit()
        if self.retention_interval is None:
            per_segment = self.alignment_tokens // self.block_size
            if need >= per_segment:
                return None
            return [i % per_segment >= per_segment - need for i in range(start_block, end_block)]
        mask = [False] * (end_block - start_block)
        for boundary in boundaries:
            end = boundary // self.alignment_tokens * self.alignment_tokens // self.block_size
            for index in range(max(start_block, end - need), min(end_block, end)):
                mask[index - start_block] = True
        return mask
