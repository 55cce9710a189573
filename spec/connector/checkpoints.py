"""Mamba prefill checkpoints: which states a step writes, and the position each one holds.

vLLM 0.33 (align mode) writes a mamba group's state in two places during a step that computes
tokens ``[start, end)``:

1. the running state, after exactly ``end`` tokens, in table slot ``ceil(end / block) - 1``;
2. for a group whose layers export prefill checkpoints (a ``MambaSpec`` with
   ``num_prefill_checkpoint_blocks > 0``: GDN on FlashInfer, Mamba-2, KDA), the checkpoint: the
   state after ``p`` tokens in slot ``ceil(end / block) - 2``, the block the ``MambaManager``
   reserved and re-keys at ``p``. The position (``get_mamba_prefill_checkpoint_position``,
   ``v1/kv_cache_interface.py:1169-1186``) is the last multiple of the cache-hit grid ``a`` at
   most ``end - max(1, lookahead)``; with EAGLE/MTP's block drop it is the last multiple at most
   ``end``, minus ``a``. The step exports it only where ``is_mamba_prefill_checkpoint_valid``
   (1189-1210) holds: ``start`` on the hash grid, the checkpoint slot past the slot holding the
   initial state, ``start + hash_block <= p``, ``start < p < end``, and ``p - start`` a multiple
   of the spec's ``prefill_checkpoint_alignment``.

So a slot does not name the position of the state in it: under EAGLE/MTP the checkpoint is one
grid step before the slot's own end, and with a grid finer than the block it is mid-block. The
connector keys a stored state by its position (MB-8). No other slot is written by the step.

Not modelled here (as in vLLM's scheduler model, :mod:`spec.scheduler`): the split a scheduler
makes around the checkpoint, and draft tokens. Pure values and functions.
"""

from __future__ import annotations

from dataclasses import dataclass

from spec.errors import ConfigError

__all__ = ["NONE", "CheckpointRule", "StateAt", "checkpoint_position", "states_written"]


@dataclass(frozen=True, slots=True)
class CheckpointRule:
    """One mamba group's checkpoint inputs, as vLLM resolves them.

    Attributes:
        alignment: ``prefill_checkpoint_alignment``, or ``None`` when the group exports no
            checkpoint.
        hash_block_size: ``hash_block_size``.
        cache_hit_alignment: ``cache_hit_alignment_tokens``, the grid positions are floored to.
        drop_eagle_block: ``use_eagle_block_drop()`` with no lookahead hashes.
        hash_lookahead: ``num_hash_lookahead_tokens`` (0 with any KV connector in vLLM 0.33).
    """

    alignment: int | None = None
    hash_block_size: int = 1
    cache_hit_alignment: int = 1
    drop_eagle_block: bool = False
    hash_lookahead: int = 0

    def __post_init__(self) -> None:
        checks = (
            ("hash_block_size", self.hash_block_size, 1),
            ("cache_hit_alignment", self.cache_hit_alignment, 1),
            ("hash_lookahead", self.hash_lookahead, 0),
            ("alignment", 1 if self.alignment is None else self.alignment, 1),
        )
        for name, value, least in checks:
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(name, value, f"must be an int >= {least}", "pass vLLM's value")
        if not isinstance(self.drop_eagle_block, bool):
            raise ConfigError(
                "drop_eagle_block", self.drop_eagle_block, "must be a bool", "pass a bool"
            )


NONE = CheckpointRule()
"""No checkpoint export: a step writes its running state only."""


@dataclass(frozen=True, slots=True)
class StateAt:
    """A state a step wrote: table ``slot`` holds the recurrent state after ``position`` tokens."""

    slot: int
    position: int


def checkpoint_position(rule: CheckpointRule, num_tokens: int) -> int:
    """vLLM's ``get_mamba_prefill_checkpoint_position(num_tokens, grid, eagle, lookahead)``.

    Pure. Pre: ``num_tokens >= 0``. Post: a multiple of ``rule.cache_hit_alignment``, ``>= 0``.
    """
    grid = rule.cache_hit_alignment
    limit = num_tokens if rule.drop_eagle_block else num_tokens - max(1, rule.hash_lookahead)
    floored = (limit // grid) * grid
    if rule.drop_eagle_block:
        floored -= grid
    return floored if floored > 0 else 0


def _exports(rule: CheckpointRule, start: int, end: int, block: int, position: int) -> bool:
    """vLLM's ``is_mamba_prefill_checkpoint_valid`` for a step computing ``[start, end)``."""
    if rule.alignment is None:
        return False
    initial_slot = (start - 1) // block
    checkpoint_slot = -(-end // block) - 2
    return (
        start % rule.hash_block_size == 0
        and checkpoint_slot > initial_slot
        and start + rule.hash_block_size <= position
        and start < position < end
        and (position - start) % rule.alignment == 0
    )


def states_written(rule: CheckpointRule, start: int, end: int, block: int) -> tuple[StateAt, ...]:
    """The states a step computing ``[start, end)`` writes in a group of ``block``-token blocks.

    Pure. Pre: ``0 <= start < end``, ``block >= 1``. Post: the running state, then the
    checkpoint where the step exports one (module docstring).
    """
    last = -(-end // block) - 1
    found = [StateAt(last, end)]
    position = checkpoint_position(rule, end)
    if _exports(rule, start, end, block, position):
        found.append(StateAt(last - 1, position))
    return tuple(found)
