"""Where a step leaves mamba states: the running state and vLLM 0.33's prefill checkpoint.

Written from vLLM 0.33's rule (cited below); ``spec.connector.checkpoints`` models the same
rule on its own (never imported here). In align mode a step that computes tokens
``[start, end)`` writes a mamba group's state in at most two table slots:

- the running state after ``end`` tokens, in slot ``cdiv(end, block) - 1``;
- the prefill checkpoint, when the layers export one (``num_prefill_checkpoint_blocks`` > 0):
  the state after ``position`` tokens in slot ``cdiv(end, block) - 2``, where ``position`` is
  ``get_mamba_prefill_checkpoint_position(end, cache_hit_alignment, drop_eagle_block,
  hash_lookahead)`` (``vllm/v1/kv_cache_interface.py:1169-1186``) and the step exports it only if
  ``is_mamba_prefill_checkpoint_valid`` holds (1189-1210; the worker's
  ``compute_mamba_prefill_checkpoints``, ``model_executor/layers/mamba/checkpoint.py:21-63``).

The checkpoint slot is not the slot of ``position``: under EAGLE/MTP the position is one hash
block earlier than the slot's own end (``(cdiv(end, block) - 1) * block``), and with a hash block
below the block size it is mid-block. A store keys each state by the position it holds (MB-8),
never by the slot it sits in. Every other slot holds nothing this step wrote.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.errors import HybridKVConfigError, int_at_least

__all__ = ["NO_CHECKPOINTS", "CheckpointRule"]

# The integer inputs and the least value vLLM can hand each, checked in this order (a
# differential test expects the reference's first failing field when several are wrong).
_LEAST_VALUES = (
    ("hash_block_size", 1),
    ("cache_hit_alignment", 1),
    ("hash_lookahead", 0),
    ("alignment", 1),
)


@dataclass(frozen=True, slots=True)
class CheckpointRule:
    """How vLLM places one mamba group's prefill checkpoint (its scheduler and worker agree).

    Attributes:
        alignment: the spec's ``prefill_checkpoint_alignment``; ``None`` when the group exports
            no checkpoint (``num_prefill_checkpoint_blocks == 0``): only the running state.
        hash_block_size: the hash block (``request.block_hashes`` granularity).
        cache_hit_alignment: ``cache_hit_alignment_tokens`` (the hash block with partial hash
            hits, else the scheduler block): the grid the checkpoint position is floored to.
        drop_eagle_block: EAGLE/MTP's trailing block drop (``use_eagle_block_drop`` and no
            lookahead hashes): the position is one grid step earlier.
        hash_lookahead: ``num_hash_lookahead_tokens`` (0 whenever a KV connector is configured,
            ``config/vllm.py:678-692``; kept so the rule is vLLM's whole formula).
    """

    alignment: int | None = None
    hash_block_size: int = 1
    cache_hit_alignment: int = 1
    drop_eagle_block: bool = False
    hash_lookahead: int = 0

    def __post_init__(self) -> None:
        for name, least in _LEAST_VALUES:
            value = getattr(self, name)
            if value is None and name == "alignment":
                continue  # no checkpoint export: nothing to align
            if not int_at_least(value, least):
                raise HybridKVConfigError(
                    name, value, f"must be an int >= {least}", "pass vLLM's value"
                )
        if not isinstance(self.drop_eagle_block, bool):
            raise HybridKVConfigError(
                "drop_eagle_block", self.drop_eagle_block, "must be a bool", "pass True or False"
            )

    def position(self, num_tokens: int) -> int:
        """vLLM's ``get_mamba_prefill_checkpoint_position(num_tokens, ...)``."""
        grid = self.cache_hit_alignment
        if self.drop_eagle_block:
            return max(num_tokens // grid * grid - grid, 0)
        return max((num_tokens - max(1, self.hash_lookahead)) // grid * grid, 0)

    def exported(self, start: int, end: int, block: int) -> int:
        """The checkpoint position a step computing ``[start, end)`` exports, 0 if none.

        vLLM's ``is_mamba_prefill_checkpoint_valid`` at ``position(end)``. Pre: ``0 <= start <
        end``, ``block`` the group's block size.
        """
        if self.alignment is None:
            return 0
        position = self.position(end)
        exported = (
            start % self.hash_block_size == 0
            and -(-end // block) - 2 > (start - 1) // block
            and start + self.hash_block_size <= position
            and start < position < end
            and (position - start) % self.alignment == 0
        )
        return position if exported else 0

    def states_written(self, start: int, end: int, block: int) -> tuple[tuple[int, int], ...]:
        """``(slot, position)`` of each state a step computing ``[start, end)`` writes.

        Post: the running state first, then the checkpoint if exported (module docstring).
        """
        running = -(-end // block) - 1
        position = self.exported(start, end, block)
        if position:
            return ((running, end), (running - 1, position))
        return ((running, end),)


NO_CHECKPOINTS = CheckpointRule()
"""A group that exports no checkpoint: a step leaves only its running state."""
