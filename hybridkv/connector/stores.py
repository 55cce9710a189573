"""Which units a step stores: those its forward completes, prompt and decode tokens alike.

The twin of ``spec.connector.stores`` (never imported here), item for item: a scheduled request
computing ``[c, c + n)`` stores, per group, each unit whose end lies in ``(c, c + n]`` from the
block at its table slot, if that slot holds a real block. A mamba group stores only the states
the step writes (:meth:`CheckpointRule.states_written`: the running state at ``c + n`` and
vLLM's prefill checkpoint), each under the unit that ends at the position it holds, and only if
that position is a unit end in ``(c, c + n]`` and its slot is a real block (MB-2, MB-8).
Decode-phase tokens count, so a follow-up turn can hit them (field note #56972).

The work is proportional to the units the step completes, not to the request's length: a
decode step that completes no unit costs one range test per group.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from hybridkv.connector.api import BlockTable, TransferItem
from hybridkv.connector.geometry import ConnectorGeometry
from hybridkv.connector.requests import RequestKeys
from hybridkv.kinds import GroupKind

__all__ = ["items_by_end", "low_priority", "store_items"]

_BY_END_THEN_GROUP = attrgetter("end_token", "group_idx")


def store_items(
    geometry: ConnectorGeometry,
    keys: RequestKeys,
    block_ids: BlockTable,
    start: int,
    end: int,
) -> list[TransferItem]:
    """Items of every unit completed in ``(start, end]`` that has a real block.

    Agrees with ``spec.connector.stores.store_items``. Pre: ``block_ids`` is the request's
    table after this step's allocation; ``keys`` has hashed past ``end``. Post: sorted by unit
    end, then group; no null block.
    """
    found: list[TransferItem] = []
    for g in range(geometry.num_groups):
        u = geometry.units[g]
        first, last = start // u, end // u
        if first >= last:
            continue
        table = block_ids[g] if g < len(block_ids) else ()
        per_block = geometry.blocks[g]
        if geometry.kinds[g] is GroupKind.MAMBA:
            # Keyed by the position each state holds, not by its slot (MB-8).
            for slot, at in geometry.checkpoints[g].states_written(start, end, per_block):
                if at % u == 0 and start < at and slot < len(table) and table[slot]:
                    found.append(TransferItem(g, table[slot], keys.key(g, at // u - 1), at))
            continue
        for j in range(first, last):
            index = j * u // per_block
            if index < len(table) and table[index]:
                found.append(TransferItem(g, table[index], keys.key(g, j), (j + 1) * u))
    if len(found) > 1:
        found.sort(key=_BY_END_THEN_GROUP)
    return found


def items_by_end(items: Sequence[TransferItem]) -> list[Sequence[TransferItem]]:
    """Items (sorted by end) grouped by ``end_token``, ascending: one prefix step each."""
    parts: list[Sequence[TransferItem]] = []
    first = 0
    for i in range(1, len(items) + 1):
        if i == len(items) or items[i].end_token != items[first].end_token:
            parts.append(items[first:i])
            first = i
    return parts


def low_priority(geometry: ConnectorGeometry, item: TransferItem, prompt_tokens: int) -> bool:
    """Whether ``item`` is stored LOW (``hybridkv.store.StorePriority``): less likely claimed
    than the prompt's prefix, so it takes free host slots only (issue 18 item 2).

    Two kinds qualify. A continuation unit, ending past the prompt: only its own conversation's
    next turn can claim it. A sliding-window unit ending at or before ``last - reach``, where
    ``last`` is the furthest claim end inside the prompt (the largest multiple of the alignment
    below ``prompt_tokens``): no claim of this request, nor of a later turn extending it, reads
    it; only another request whose prompt stops just after it could. Everything else is NORMAL.
    """
    if item.end_token > prompt_tokens:
        return True
    group = item.group_idx
    if geometry.kinds[group] is not GroupKind.SLIDING:
        return False
    last = (prompt_tokens - 1) // geometry.align * geometry.align
    return item.end_token <= last - geometry.reaches[group]
