"""Mamba (and gated-delta-net) groups in ``align`` mode: one recurrent state, kept at boundaries.

In align mode the block at position ``p`` holds the state after exactly ``(p + 1) * block_size``
tokens, or, for the last block, after the last computed token. A request reads only its latest
state, so everything before that state's block is skipped (nulls). Facts from vLLM 0.33
(``v1/core/single_type_kv_cache_manager.py``):

- skipped tokens ``n - 1`` (1971-1976), so an external claim of ``total`` tokens gets exactly one
  real block, at index ``cdiv(total, block_size) - 1`` (the base external path, 327-368);
- ``get_num_blocks_to_allocate`` in align mode (1742-1795): ``required = cdiv(n, bs) + spec``,
  ``new = required - hit - held``, capped at ``1 (+ spec on the first allocation)`` when positive;
- ``allocate_new_blocks`` in align mode (1797-1923): a table already long enough (after an
  over-allocation or a truncation) gets NOTHING (1824-1832); otherwise nulls up to
  ``required - spec - 1``, speculative scratch blocks that fall below that move to the end
  (``_relocate_speculative_block``), then the missing blocks are taken;
- ``remove_skipped_blocks`` frees every real block below ``cdiv(P, bs) - 1``, skipping nulls
  (1608-1657). vLLM also frees the state block of two steps ago (``last_state_block_idx``); that
  index is always below the same bound, so the model needs no extra rule for it;
- a hit is the rightmost cached block whose end is aligned, padded with nulls (1470-1533);
- a hit whose state block another request cached in THIS step cannot be admitted this step
  (1704-1712): the state is written only by this step's forward, so the count asks for more
  blocks than the pool has and the request waits a step; the set is filled by ``cache_blocks``
  (2000-2010) and cleared when a step starts (``new_step_starts``, 2025-2026, called from
  ``v1/core/sched/scheduler.py:746``).

Divergence D1 (catalogued in :mod:`spec.scheduler.config`): vLLM 0.33 does not clamp the
align-mode count: at ``v1/core/single_type_kv_cache_manager.py:1743-1747`` it computes
``num_required_blocks - len(new_computed_blocks) - len(req_blocks)`` and only caps it when positive
(1785), so after a truncation or a rejected speculative step it returns a NEGATIVE count (1795)
that the coordinator adds to the other groups' counts, under-reserving them. The spec clamps the
count at 0 (:meth:`MambaManager._clamp`).

Not modelled: prefill checkpoint blocks (reserving and re-keying them; where they sit and which
state they hold is :mod:`spec.connector.checkpoints`, the connector's side), partial (sub-block)
hits and their copy-on-write, boundary-state hand-offs to connectors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from spec.block_pool import NULL_BLOCK, BlockHash, BlockId, BlockPool, HashKey
from spec.managers.base import GroupHit, SingleTypeManager, _num_evictable
from spec.managers.group_spec import cdiv

__all__ = ["MambaManager"]


class MambaManager(SingleTypeManager):
    """A mamba group in align mode.

    Extra state: ``allocated``, the requests that have had a first allocation (vLLM's
    ``_allocated_block_reqs``): only a first allocation takes the speculative scratch blocks;
    ``cached_this_step``, the cache keys of the states cached since the step started (vLLM's
    ``cached_blocks_this_step``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.allocated: set[str] = set()
        self.cached_this_step: set[HashKey] = set()

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """``n - 1``: only the state after the last computed token is read (0 for ``n = 0``).

        Pure."""
        return max(0, num_computed_tokens - 1)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        hit_blocks: Sequence[BlockId],
        *,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        pool: BlockPool,
        admission_cap: int | None = None,
    ) -> int:
        """Blocks an allocation takes: one new state (+ scratch on the first), never < 0.

        ``admission_cap`` is ignored: a mamba group has no admission cap (vLLM gives one to
        recycling attention specs only, ``single_type_kv_cache_manager.py:2646-2655``).

        Pure. Post: the count is >= 0 (see :meth:`_clamp`), includes evictable hit blocks and,
        on a first allocation that adopts external tokens, the external state block on its own
        (see :meth:`_adopts_external`). A hit on a state cached in this step counts more blocks
        than the pool has, so the allocation is refused this step (vLLM 1704-1712).
        """
        del admission_cap
        if hit_blocks and pool.block_hash(hit_blocks[-1]) in self.cached_this_step:
            return pool.num_blocks + 1
        spec_blocks = self.spec.num_speculative_blocks
        required = cdiv(num_tokens, self.block_size) + spec_blocks
        held = len(self.req_to_blocks.get(request_id, ()))
        external = self._adopts_external(
            request_id, total_computed_tokens, num_local_computed_tokens
        )
        # Positions the table holds when allocate_new_blocks runs.
        base = cdiv(total_computed_tokens, self.block_size) if external else len(hit_blocks) + held
        num_new = required - base
        if num_new > 0:
            first = request_id not in self.allocated
            num_new = min(num_new, 1 + (spec_blocks if first else 0))
        return self._clamp(num_new) + int(external) + _num_evictable(pool, hit_blocks)

    def _adopts_external(self, request_id: str, total: int, num_local: int) -> bool:
        """Whether this first allocation takes an external state block before the new state.

        Divergence D8 (:mod:`spec.scheduler.config`; ``vllm_exact`` turns it off): vLLM 0.33
        counts ``required - hit - held`` capped at ``1 + spec`` on a first allocation
        (``single_type_kv_cache_manager.py:1743-1790``), yet a first allocation that adopts
        external tokens AND schedules new tokens past their block takes two blocks: the
        external state at ``cdiv(total, bs) - 1`` (``allocate_external_computed_blocks``,
        327-368) and the new state (``allocate_new_blocks``, 1797-1923). Running vLLM's own
        ``MambaManager`` (block 8, 8 external + 4 new tokens) reserves 1 and takes 2; with no
        slack in the pool ``get_new_blocks`` raises (finding F1 of ``tests/vllm``). The spec
        counts the external block on its own, ``1 + min(required - cdiv(total, bs), 1 + spec)``:
        exactly what is taken.
        """
        fresh = request_id not in self.req_to_blocks and request_id not in self.num_cached_block
        return fresh and total > num_local

    def _clamp(self, num_new: int) -> int:
        """The spec's clamp at 0; vLLM 0.33 returns ``num_new`` as is (the divergence)."""
        return max(num_new, 0)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, pool: BlockPool
    ) -> tuple[BlockId, ...]:
        """Place the new state block (and scratch) at the end; nothing if the table suffices.

        Pre: the coordinator reserved the blocks. Post: the table has ``cdiv(n, bs) + spec``
        positions, nulls between the old and the new state; a table that is already that long
        (over-allocated, or truncated since) is left as it is and nothing is taken.
        """
        spec_blocks = self.spec.num_speculative_blocks
        required = cdiv(num_tokens, self.block_size) + spec_blocks
        table = self.req_to_blocks.setdefault(request_id, [])
        first = request_id not in self.allocated
        self.allocated.add(request_id)
        if required <= len(table):
            return ()
        prev_len = len(table)
        state_index = required - spec_blocks - 1
        table.extend([NULL_BLOCK] * max(0, state_index - prev_len))
        if not first:
            self._relocate_scratch(table, prev_len, state_index)
        new = self._take(pool, max(required - len(table), 0))
        table.extend(new)
        return new

    def _relocate_scratch(self, table: list[BlockId], prev_len: int, state_index: int) -> None:
        """Move scratch blocks now below the new state position to the end of the table."""
        for index in range(prev_len - self.spec.num_speculative_blocks, prev_len):
            if index >= state_index:
                break
            table.append(table[index])
            table[index] = NULL_BLOCK

    def _null_out(self, table: list[BlockId], end: int) -> list[BlockId]:
        """Null every real block below ``end``, highest first; prefill leaves null gaps."""
        freed: list[BlockId] = []
        for index in range(end - 1, -1, -1):
            if table[index] != NULL_BLOCK:
                freed.append(table[index])
                table[index] = NULL_BLOCK
        return freed

    def block_mask(
        self, start_block: int, end_block: int, boundaries: Sequence[int] = ()
    ) -> list[bool] | None:
        """Which new states a later hit can resume from (vLLM's ``reachable_block_mask``,
        1553-1605): every one under dense retention; under sparse retention (0) only the state
        block ending at each resume boundary, floored to the alignment.

        Pure."""
        if self.retention_interval is None:
            return None
        mask = [False] * (end_block - start_block)
        for boundary in boundaries:
            aligned = boundary // self.alignment_tokens * self.alignment_tokens
            index = aligned // self.block_size - 1
            if start_block <= index < end_block:
                mask[index - start_block] = True
        return mask

    def cache_blocks(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        pool: BlockPool,
        boundaries: Sequence[int] = (),
    ) -> None:
        """As the base, and remember the keys of the states cached now (this step).

        Post: every real block newly cached for the request has its key in
        ``cached_this_step``.
        """
        before = self.num_cached_block.get(request_id, 0)
        super().cache_blocks(request_id, block_hashes, num_tokens, pool, boundaries)
        after = self.num_cached_block.get(request_id, 0)
        for block in self.req_to_blocks.get(request_id, [])[before:after]:
            key = pool.block_hash(block) if block != NULL_BLOCK else None
            if key is not None:
                self.cached_this_step.add(key)

    def new_step_starts(self) -> None:
        """A step starts: states cached from now on are this step's.

        Post: no state counts as cached in this step (a hit may use it again). Never refuses."""
        self.cached_this_step.clear()

    def find_longest_cache_hit(
        self, pool: BlockPool, block_hashes: Sequence[BlockHash], max_length: int
    ) -> GroupHit:
        """The rightmost cached state at an aligned block end, at most ``max_length`` tokens in.

        Pure. Post: ``blocks`` is ``[null] * i + [state]`` and ``num_tokens == (i + 1) * bs``, or
        empty with 0 tokens.
        """
        max_blocks = min(max_length // self.block_size, len(block_hashes))
        for index in range(max_blocks - 1, -1, -1):
            if ((index + 1) * self.block_size) % self.alignment_tokens:
                continue
            hit = pool.get_cached_block(block_hashes[index], (self.kv_cache_group_id,))
            if hit:
                return GroupHit((NULL_BLOCK,) * index + hit, (index + 1) * self.block_size)
        return GroupHit((), 0)

    def free(self, request_id: str, pool: BlockPool) -> None:
        """As the base, and forget the first-allocation mark.

        Pre and refusal: those of :meth:`SingleTypeManager.free`. Post: as the base, and the
        request's first-allocation mark is gone."""
        self.allocated.discard(request_id)
        super().free(request_id, pool)

    def _clone_extra(self, twin: Any) -> None:
        twin.allocated = set(self.allocated)
        twin.cached_this_step = set(self.cached_this_step)

    def _freeze_extra(self) -> tuple[Any, ...]:
        # cached_this_step is left out: every step starts by clearing it, so two states between
        # steps that differ only in it behave the same.
        return tuple(sorted(self.allocated))
