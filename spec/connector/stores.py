"""Which units a step stores: those its forward completes, prompt and decode tokens alike.

A scheduled request computes tokens ``[c, c + n)``. Every group stores each unit whose end lies
in ``(c, c + n]``, from the block that holds it after this step's forward:

- an attention unit from the block at its table slot (never the null block: a sliding window
  nulls only blocks it no longer reads, which a unit ending at or after ``c`` never is);
- a mamba unit only from a state the step's forward writes, keyed by the position that state
  holds: the running state at ``c + n`` (slot ``ceil((c + n) / block) - 1``) and vLLM's prefill
  checkpoint (:mod:`spec.connector.checkpoints`), each only if its position is a unit end and
  its slot holds a real block. Any other slot holds no state of this step; the checkpoint slot
  holds the state of an earlier position than its own end under EAGLE/MTP (MB-2, MB-8).

Decode-phase tokens count: a follow-up turn that extends the conversation can hit them. (vLLM
0.33's native connector stores the prompt only by default and mamba states only at prefill
boundaries, so such continuations miss; field note #56972.)

Pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby

from spec.block_pool import NULL_BLOCK
from spec.connector.geometry import Geometry, UnitRef
from spec.connector_api import BlockTable, TransferItem
from spec.kinds import GroupKind

__all__ = ["items_by_end", "store_items", "store_units", "stored_low"]


def store_units(
    geometry: Geometry, block_ids: BlockTable, start: int, end: int
) -> tuple[tuple[UnitRef, int], ...]:
    """``(unit, block_id)`` for every unit completed in ``(start, end]`` that has a real block.

    Pre: ``block_ids`` is the request's table after this step's allocation. Post: pairs sorted
    by unit end, then group index; no null block.
    """
    found: list[tuple[UnitRef, int]] = []
    for g in range(geometry.num_groups):
        table = block_ids[g] if g < len(block_ids) else ()
        if geometry.kinds[g] is GroupKind.MAMBA:
            refs = geometry.mamba_states_ending_in(g, start, end)
        else:
            refs = geometry.units_ending_in(g, start, end)
        for ref in refs:
            if ref.block_index < len(table) and table[ref.block_index] != NULL_BLOCK:
                found.append((ref, table[ref.block_index]))
    found.sort(key=lambda pair: (pair[0].end, pair[0].group_idx))
    return tuple(found)


def store_items(
    geometry: Geometry,
    block_hashes: Sequence[bytes],
    block_ids: BlockTable,
    start: int,
    end: int,
) -> tuple[TransferItem, ...]:
    """:func:`store_units` as transfer items keyed by the request's salted hashes.

    Pure. Pre: those of :func:`store_units`; ``block_hashes`` reach every unit end
    (``IndexError`` otherwise). Post: one item per pair, in the same order.
    """
    return tuple(
        TransferItem(ref.group_idx, block, geometry.key(block_hashes, ref), ref.end)
        for ref, block in store_units(geometry, block_ids, start, end)
    )


def items_by_end(items: Sequence[TransferItem]) -> list[tuple[TransferItem, ...]]:
    """Items grouped by ``end_token``, ascending (input sorted by end): one prefix step each.

    Pure. Pre: ``items`` sorted by ``end_token`` (not checked: an unsorted input splits one
    end into several groups). Post: the groups concatenate to ``items``.
    """
    return [tuple(group) for _, group in groupby(items, key=lambda item: item.end_token)]


def stored_low(geometry: Geometry, item: TransferItem, num_prompt_tokens: int) -> bool:
    """Whether a store sends ``item`` at ``StorePriority.LOW`` (:mod:`spec.store`, admission).

    The prompt's own claims end at the multiples of ``geometry.align`` below
    ``num_prompt_tokens``, the furthest at ``reach_end``; a later turn extending the prompt
    claims past it. Hence two kinds of unit are less likely claimed than the prompt's prefix:

    - a unit ending after the prompt (written by decode steps): only a later turn reads it;
    - a SLIDING unit ending ``reach`` tokens or more before ``reach_end``: outside the window
      of every such claim (a claim ending at ``e`` reads the units ending after ``e - reach``).

    Pure: reads ``geometry`` and ``item``, changes nothing.
    """
    past_prompt = item.end_token > num_prompt_tokens
    if past_prompt or geometry.kinds[item.group_idx] is not GroupKind.SLIDING:
        return past_prompt
    reach_end = ((num_prompt_tokens - 1) // geometry.align) * geometry.align
    return reach_end - item.end_token >= geometry.reaches[item.group_idx]
