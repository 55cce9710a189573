"""Chunk-size options for ``hybridkv plan`` and the rule that recommends one.

The trade-off: a smaller chunk gives finer hits (a shorter claim unit, more prompts that can
hit) but more offload keys and smaller copies; a larger chunk moves more bytes per copy, where
per-copy submission cost (about 2.3 us per cudaMemcpyAsync) stops mattering, but claims become
coarser. The rule: take the smallest feasible chunk that moves at least
:data:`TARGET_CHUNK_BYTES` of host data, else the largest feasible chunk. Every feasible option
is shown beside the recommendation so the user can trade the other way.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from hybridkv.errors import HybridKVConfigError
from hybridkv.kinds import GroupKind
from hybridkv.planner import HybridOffloadPlanner
from spec.layout import Layout

__all__ = ["TARGET_CHUNK_BYTES", "ChunkOption", "chunk_options", "recommend"]

#: One MiB per chunk: at about 50 GB/s it takes ~20 us, so a few us of submission are < 10%.
TARGET_CHUNK_BYTES = 1 << 20
#: Candidates are the hash block size times powers of two, up to this many doublings.
MAX_DOUBLINGS = 8


@dataclass(frozen=True, slots=True)
class ChunkOption:
    """One feasible chunk size and what it implies."""

    chunk_size: int
    claim_unit: int
    shortest_hit_prompt: int
    host_bytes_per_chunk: int
    keys_per_claim_unit: int

    def as_json(self) -> dict[str, Any]:
        """Plain dict form for ``--json``."""
        return asdict(self)


def chunk_options(layout: Layout, max_model_len: int) -> list[ChunkOption]:
    """Every feasible candidate chunk size, smallest first (empty when offload is impossible).

    Candidates: ``hash_block_size * 2**k`` for k in 0..MAX_DOUBLINGS, plus each group's block
    size; a candidate the planner refuses (claim unit beyond ``max_model_len``) is left out.
    """
    h = layout.hash_block_size
    candidates = {h << k for k in range(MAX_DOUBLINGS + 1)}
    candidates |= {g.block_size for g in layout.groups if g.block_size % h == 0}
    groups = [(GroupKind(g.kind.value), g.block_size) for g in layout.groups]
    options = []
    for c in sorted(candidates):
        try:
            planner = HybridOffloadPlanner(groups, h, c, max_model_len)
        except HybridKVConfigError:
            continue
        per_chunk = sum(
            g.num_layers * g.real_page_size_bytes * c / g.block_size for g in layout.groups
        )
        options.append(
            ChunkOption(
                chunk_size=c,
                claim_unit=planner.claim_unit,
                shortest_hit_prompt=planner.shortest_hit_prompt,
                host_bytes_per_chunk=math.ceil(per_chunk),
                keys_per_claim_unit=sum(planner.claim_unit // u for u in planner.units),
            )
        )
    return options


def recommend(options: list[ChunkOption]) -> ChunkOption | None:
    """The recommended option by the module's rule, or None when there is none."""
    if not options:
        return None
    big_enough = [o for o in options if o.host_bytes_per_chunk >= TARGET_CHUNK_BYTES]
    return big_enough[0] if big_enough else options[-1]
