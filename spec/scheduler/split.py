"""The mamba block-aligned split: during prefill a chunk ends on a block boundary.

vLLM 0.33 ``_mamba_block_aligned_split`` (``v1/core/sched/scheduler.py:546-661``), with the
parts the model has: no EAGLE, no lookahead, no partial hash hits, no prefill checkpoint blocks;
the shared-prefix junction (``request.shared_prefix_boundary``, 632-660) is a stop, floored to a
block from the chunk start (the block-floored form, since without partial hash hits
``mamba_shared_prefix_checkpoint`` is off). In align mode the state block at position ``p``
holds the state after exactly ``(p + 1) * block_size`` tokens, and state is written at chunk
ends, so a prefill chunk must end on a block boundary; only the prompt's last chunk may end
elsewhere.
"""

from __future__ import annotations

__all__ = ["last_cache_position", "mamba_block_aligned_split"]


def last_cache_position(num_tokens: int, block_size: int) -> int:
    """The last block boundary strictly before ``num_tokens`` (vLLM's checkpoint position).

    ``get_mamba_prefill_checkpoint_position`` without EAGLE or lookahead
    (``v1/kv_cache_interface.py:1169-1186``): ``max((num_tokens - 1) // bs * bs, 0)``.

    Pure. Pre: ``block_size > 0``.
    """
    return max((num_tokens - 1) // block_size * block_size, 0)


def mamba_block_aligned_split(
    *,
    start: int,
    num_new_tokens: int,
    num_prompt_tokens: int,
    num_tokens: int,
    block_size: int,
    max_prefill_tokens: int,
    shared_prefix_boundary: int = 0,
) -> int:
    """The chunk length that keeps mamba states on block boundaries. Pure.

    ``start`` is the first token of the chunk (computed + newly hit + external tokens);
    ``shared_prefix_boundary`` the request's junction (0: none).

    Pre: ``0 <= start`` and ``num_new_tokens >= 0``; ``block_size > 0``.
    Post: the result is ``<= num_new_tokens``; when the chunk ends before the prefill end it ends
    on a block boundary or at the last cacheable position, unless no boundary fits and the block
    is larger than ``max_prefill_tokens``; past the prefill end the chunk is unchanged. 0 means
    "cannot make aligned progress this step".
    """
    prefill_end = max(num_prompt_tokens, num_tokens - 1)
    if start >= prefill_end:
        return num_new_tokens
    end = start + num_new_tokens
    if end < prefill_end:
        aligned_end = end // block_size * block_size
        if aligned_end > start or block_size <= max_prefill_tokens:
            end = aligned_end
    next_boundary = (start // block_size + 1) * block_size
    junction = shared_prefix_boundary
    block_floored = start + (junction - start) // block_size * block_size
    stops = (
        next_boundary if start % block_size else 0,
        last_cache_position(num_tokens, block_size),
        block_floored if start < junction < end else 0,
    )
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)
