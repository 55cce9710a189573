"""The default ``chunk_size``: the finest claim a chunk that splits no block can give.

A claim ends on a multiple of the planner's ``claim_unit``, ``lcm(chunk_size, every unit)``
(PL-7), so every token past the last multiple is computed again even when the host holds it.
The transfer engine moves whole blocks, so every group's unit must be its whole block
(:func:`whole_block_planner`); then ``claim_unit >= lcm(every block)``, and the chunk
``lcm(every block)`` itself reaches that bound. The default is the smallest candidate that
reaches it: where every group has one block size (every layout of tools/bench_vs_native.py)
that is one block, the granularity of vLLM's own prefix cache, so a claim rounds off nothing
that vLLM's prefix cache would not.

A larger chunk used to be recommended to move about 1 MiB per chunk. It buys no larger copy:
with whole-block units a copy is one group's block whatever the chunk, and a request's loads
(or stores) of one step are one transfer job that the engine submits at once (the CUDA
engine batches its descriptors, ``hybridkv.transfer.cuda_batch``). It only coarsened claims.

Candidates: ``hash_block_size * 2**k`` (k = 0..:data:`MAX_DOUBLINGS`), each group's block
size that ``hash_block_size`` divides, and ``lcm(every block)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hybridkv.errors import HybridKVConfigError
from hybridkv.planner import Group, HybridOffloadPlanner

__all__ = ["MAX_DOUBLINGS", "chunk_candidates", "default_chunk_size", "whole_block_planner"]

#: Candidates are the hash block size times powers of two, up to this many doublings.
MAX_DOUBLINGS = 8


def chunk_candidates(groups: Sequence[Group], hash_block_size: int) -> tuple[int, ...]:
    """Candidate chunk sizes for ``groups``, smallest first (module docstring)."""
    h = hash_block_size
    blocks = [block for _, block in groups]
    candidates = {h << k for k in range(MAX_DOUBLINGS + 1)}
    candidates |= {block for block in blocks if block % h == 0}
    candidates.add(math.lcm(*blocks))
    return tuple(sorted(candidates))


def whole_block_planner(
    groups: Sequence[Group], hash_block_size: int, chunk_size: int, max_model_len: int
) -> HybridOffloadPlanner | None:
    """The planner for ``chunk_size`` when it accepts it and every unit is its group's whole
    block, else None (the chunk splits a block, or the planner refuses it)."""
    try:
        planner = HybridOffloadPlanner(groups, hash_block_size, chunk_size, max_model_len)
    except HybridKVConfigError:
        return None
    whole = all(u == block for u, (_, block) in zip(planner.units, planner.groups, strict=True))
    return planner if whole else None


def default_chunk_size(
    groups: Sequence[Group], hash_block_size: int, max_model_len: int
) -> int | None:
    """The smallest candidate with the smallest ``claim_unit`` among whole-block chunks; None
    when no candidate is whole-block and accepted (``lcm(every block) + 1 > max_model_len``).

    Post: no whole-block chunk has a smaller ``claim_unit`` (it is ``lcm(every block)``).
    Frame: nothing changes.
    """
    best: tuple[int, int] | None = None
    for chunk in chunk_candidates(groups, hash_block_size):
        planner = whole_block_planner(groups, hash_block_size, chunk, max_model_len)
        if planner is not None and (best is None or planner.claim_unit < best[0]):
            best = (planner.claim_unit, chunk)
    return None if best is None else best[1]
