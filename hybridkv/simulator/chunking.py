"""Chunk-size options for ``hybridkv plan`` and the rule that recommends one.

The recommendation is the connector's default (:func:`hybridkv.default_chunk.default_chunk_size`):
among the chunks that keep every group's offload unit its whole block (``whole_blocks``; the
connector refuses the others), the smallest with the finest claim unit. A larger chunk only
coarsens claims: copies are whole blocks whatever the chunk. Every feasible option is shown
beside the recommendation, a chunk that splits a block too (``whole_blocks`` false: finer units
that ``hybridkv simulate`` can model but the vLLM connector refuses).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from hybridkv.default_chunk import chunk_candidates
from hybridkv.errors import HybridKVConfigError
from hybridkv.kinds import GroupKind
from hybridkv.planner import HybridOffloadPlanner
from spec.layout import Layout

__all__ = ["ChunkOption", "chunk_options", "recommend"]


@dataclass(frozen=True, slots=True)
class ChunkOption:
    """One feasible chunk size and what it implies."""

    chunk_size: int
    claim_unit: int
    shortest_hit_prompt: int
    host_bytes_per_chunk: int
    keys_per_claim_unit: int
    whole_blocks: bool

    def as_json(self) -> dict[str, Any]:
        """Plain dict form for ``--json``."""
        return asdict(self)


def chunk_options(layout: Layout, max_model_len: int) -> list[ChunkOption]:
    """Every feasible candidate chunk size, smallest first (empty when offload is impossible).

    Candidates: :func:`hybridkv.default_chunk.chunk_candidates`; a candidate the planner refuses
    (claim unit beyond ``max_model_len``) is left out.
    """
    h = layout.hash_block_size
    groups = [(GroupKind(g.kind.value), g.block_size) for g in layout.groups]
    options = []
    for c in chunk_candidates(groups, h):
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
                whole_blocks=not any(planner.splittable),
            )
        )
    return options


def recommend(options: list[ChunkOption]) -> ChunkOption | None:
    """The recommended option by the module's rule, or None when no option is whole-block."""
    whole = [o for o in options if o.whole_blocks]
    return min(whole, key=lambda o: (o.claim_unit, o.chunk_size)) if whole else None
