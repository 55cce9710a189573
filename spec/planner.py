"""The hybrid offload planner: which token spans each KV cache group offloads, as a reference.

A hybrid model has several KV cache groups, each with its own GPU block size. The offload tier
stores prompts in chunks of ``chunk_size`` tokens. This model says, for one geometry, what each
group stores per chunk and which prefixes a lookup may claim. It is the oracle the optimized
:class:`hybridkv.planner.HybridOffloadPlanner` is tested against: plain loops, no shortcuts.

Contract (shared with the optimized planner, word for word):

Inputs: ``groups``, a sequence of ``(kind, block_size)`` pairs (one per KV cache group, in
``kv_cache_group_id`` order); ``hash_block_size`` h (the fine hash granularity); ``chunk_size``
c (the offload chunk); ``max_model_len`` M.

Validation, in this order (the first failure is raised as :class:`~spec.errors.ConfigError`
with ``field`` set to the user-facing name):

1. ``groups``: a list or tuple of at least one ``(GroupKind, block_size)`` pair.
2. ``block_size`` of each group: a positive int (bool is not an int); the message names the
   group index.
3. ``hash_block_size``, ``chunk_size``, ``max_model_len``: positive ints, in that order.
4. ``hash_block_size`` divides every group's block size (vLLM's hash contract).
5. ``chunk_size`` is a multiple of ``hash_block_size`` (so c >= h).
6. ``max_model_len``: the shortest prompt that can hit, ``claim_unit + 1``, fits in M. The
   message gives the smallest M that works, suggests a smaller ``chunk_size`` and, when a mamba
   block is as long as M (vLLM's ``mamba_cache_mode='none'`` layout), says to enable prefix
   caching (``mamba_cache_mode='align'``).

Derived geometry, per group g:

- offload unit ``u_g``: a MAMBA group is never split (its recurrent state exists only at its own
  block boundaries), so ``u_g = block_size``. A FULL or SLIDING group is split into chunks when
  the chunk divides its block (``u_g = c``), and otherwise keeps its whole block
  (``u_g = block_size``, unsplittable).
- hash factor ``f_g = u_g / h``; unit j of group g ends at token ``(j + 1) * u_g`` and is keyed
  by fine hash index ``(j + 1) * f_g - 1``.
- ``splittable_g = u_g < block_size``.
- first storable chunk: chunks k = 0, 1, ... cover tokens ``[k*c, (k+1)*c)``; the first k whose
  end ``(k+1)*c`` is a multiple of ``u_g``.
- ``claim_unit = lcm(c, u_g for every g)``: the positions where every group, mamba state
  included, can be restored; ``shortest_hit_prompt = claim_unit + 1``.

Every query is pure: it changes nothing, and a refused call (bad argument) changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spec.errors import ConfigError
from spec.kinds import GroupKind

__all__ = ["Group", "HybridOffloadPlanner", "make_planner"]

Group = tuple[GroupKind, int]


@dataclass(frozen=True, slots=True)
class HybridOffloadPlanner:
    """The offload geometry of one hybrid model, checked eagerly at construction.

    Pre: none (any input is accepted or refused with :class:`ConfigError`, see the module
    contract). Post: ``groups`` is a tuple of ``(GroupKind, int)`` pairs and the geometry is
    valid. Frame: a refused construction builds nothing.

    Attributes:
        groups: ``(kind, block_size)`` per KV cache group, in group id order.
        hash_block_size: fine hash granularity h in tokens.
        chunk_size: offload chunk c in tokens.
        max_model_len: longest sequence M in tokens.
    """

    groups: tuple[Group, ...]
    hash_block_size: int
    chunk_size: int
    max_model_len: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", _checked_groups(self.groups))
        for field in ("hash_block_size", "chunk_size", "max_model_len"):
            _check_positive_int(field, getattr(self, field), field)
        self._check_hash_contract()
        self._check_reachable()

    # ----------------------------------------------------------------- derived geometry

    @property
    def units(self) -> tuple[int, ...]:
        """Offload unit u_g in tokens, per group (mamba: block; attention: c or block)."""
        return tuple(self._unit(kind, block) for kind, block in self.groups)

    @property
    def hash_factors(self) -> tuple[int, ...]:
        """Fine hashes per offload unit, ``u_g / h``, per group."""
        return tuple(unit // self.hash_block_size for unit in self.units)

    @property
    def splittable(self) -> tuple[bool, ...]:
        """Per group: does the chunk split its GPU block (unit smaller than the block)?"""
        return tuple(unit < block for unit, (_, block) in zip(self.units, self.groups, strict=True))

    @property
    def first_storable_chunks(self) -> tuple[int, ...]:
        """Per group: the first chunk index whose end is a multiple of the group's unit."""
        return tuple(self._first_chunk_ending_on(unit) for unit in self.units)

    @property
    def claim_unit(self) -> int:
        """``lcm(c, every u_g)``: the prefix lengths at which every group can be restored."""
        return math.lcm(self.chunk_size, *self.units)

    @property
    def shortest_hit_prompt(self) -> int:
        """The shortest prompt that can hit: one claim unit plus the token always computed."""
        return self.claim_unit + 1

    # ----------------------------------------------------------------- queries

    def chunk_count_for_tokens(self, num_tokens: int) -> int:
        """Leading chunks that every group covers with complete units within ``num_tokens``.

        Pre: ``num_tokens`` is an int >= 0 (else :class:`ConfigError`, field ``"num_tokens"``).
        Post: the largest K such that for every chunk k < K, every group's complete units
        inside the first ``num_tokens`` tokens reach the chunk's end. Frame: nothing changes.
        """
        _check_count("num_tokens", num_tokens)
        # Chunk by chunk: the oracle asks "do the units this chunk needs fit?" for each group.
        count = 0
        while self._every_group_covers(count + 1, num_tokens):
            count += 1
        return count

    def group_covered_tokens(self, num_chunks: int) -> tuple[int, ...]:
        """Per group, the tokens its complete units must span to cover the first chunks.

        Pre: ``num_chunks`` is an int >= 0 (else :class:`ConfigError`, field
        ``"num_chunks"``). Post: entry g is the smallest multiple of u_g that is
        >= ``num_chunks * c``. Frame: nothing changes.
        """
        _check_count("num_chunks", num_chunks)
        return tuple(_round_up(num_chunks * self.chunk_size, unit) for unit in self.units)

    def storable_prefix_tokens(self, num_tokens: int) -> int:
        """Tokens of the longest chunk-aligned prefix every group can store.

        Pre: ``num_tokens`` is an int >= 0 (else :class:`ConfigError`, field ``"num_tokens"``).
        Post: ``chunk_count_for_tokens(num_tokens) * c``. Frame: nothing changes.
        """
        return self.chunk_count_for_tokens(num_tokens) * self.chunk_size

    def claimable_prefix_tokens(self, num_tokens: int) -> int:
        """Longest prefix a lookup may claim for a prompt of ``num_tokens`` tokens.

        Pre: ``num_tokens`` is an int >= 0 (else :class:`ConfigError`, field ``"num_tokens"``).
        Post: the largest multiple of ``claim_unit`` that is <= ``num_tokens - 1`` (the last
        prompt token is always computed), 0 when ``num_tokens <= claim_unit``. Frame: nothing.
        """
        _check_count("num_tokens", num_tokens)
        claimed = 0
        while claimed + self.claim_unit <= num_tokens - 1:
            claimed += self.claim_unit
        return claimed

    def unit_hash_index(self, group_index: int, unit_index: int) -> int:
        """The fine hash index that keys unit ``unit_index`` of group ``group_index``.

        Pre: ``group_index`` is an int in ``[0, len(groups))`` (else field ``"group_index"``)
        and ``unit_index`` an int >= 0 (else field ``"unit_index"``). Post: the index of the
        fine hash block that ends where the unit ends, ``(unit_index + 1) * f_g - 1``.
        Frame: nothing changes.
        """
        _check_count("group_index", group_index)
        if group_index >= len(self.groups):
            raise ConfigError(
                "group_index",
                group_index,
                f"there are only {len(self.groups)} groups",
                f"use an index below {len(self.groups)}",
            )
        _check_count("unit_index", unit_index)
        unit_end = (unit_index + 1) * self.units[group_index]
        return unit_end // self.hash_block_size - 1

    def snapshot(self) -> dict[str, Any]:
        """Every input and derived field as plain data, for the ``PL-*`` predicates.

        Post: a fresh dict of ints, bools, strings and tuples (group kinds as their string
        values). Frame: nothing changes.
        """
        return {
            "groups": tuple((kind.value, block) for kind, block in self.groups),
            "hash_block_size": self.hash_block_size,
            "chunk_size": self.chunk_size,
            "max_model_len": self.max_model_len,
            "units": self.units,
            "hash_factors": self.hash_factors,
            "splittable": self.splittable,
            "first_storable_chunks": self.first_storable_chunks,
            "claim_unit": self.claim_unit,
            "shortest_hit_prompt": self.shortest_hit_prompt,
        }

    # ----------------------------------------------------------------- helpers

    def _unit(self, kind: GroupKind, block: int) -> int:
        if kind is GroupKind.MAMBA:
            return block
        return self.chunk_size if block % self.chunk_size == 0 else block

    def _first_chunk_ending_on(self, unit: int) -> int:
        chunk = 0
        while (chunk + 1) * self.chunk_size % unit != 0:
            chunk += 1
        return chunk

    def _every_group_covers(self, num_chunks: int, num_tokens: int) -> bool:
        return all(covered <= num_tokens for covered in self.group_covered_tokens(num_chunks))

    def _check_hash_contract(self) -> None:
        h = self.hash_block_size
        for index, (_, block) in enumerate(self.groups):
            if block % h != 0:
                raise ConfigError(
                    "hash_block_size",
                    h,
                    f"does not divide group {index}'s block_size {block}",
                    f"use a divisor of every group block size, e.g. {_gcd_of_blocks(self.groups)}",
                )
        if self.chunk_size % h != 0:
            raise ConfigError(
                "chunk_size",
                self.chunk_size,
                f"is not a multiple of hash_block_size {h}",
                f"use a multiple of {h}, e.g. {_round_up(self.chunk_size, h)}",
            )

    def _check_reachable(self) -> None:
        needed = self.shortest_hit_prompt
        if needed <= self.max_model_len:
            return
        for index, (kind, block) in enumerate(self.groups):
            if kind is GroupKind.MAMBA and block >= self.max_model_len:
                raise ConfigError(
                    "max_model_len",
                    self.max_model_len,
                    f"mamba group {index} has block_size {block} >= max_model_len (the "
                    "mamba_cache_mode='none' layout): its state exists only at the end",
                    "enable prefix caching (mamba_cache_mode='align') so mamba state is kept "
                    f"at block boundaries, or set max_model_len >= {needed}",
                )
        raise ConfigError(
            "max_model_len",
            self.max_model_len,
            f"no prompt can hit: the shortest that can is claim_unit + 1 = {needed} tokens",
            f"set max_model_len >= {needed}, or a smaller chunk_size",
        )


def make_planner(
    groups: Sequence[Group], hash_block_size: int, chunk_size: int, max_model_len: int
) -> HybridOffloadPlanner:
    """Build a checked planner from any sequence of groups (see :class:`HybridOffloadPlanner`).

    Pre: none (any input is accepted or refused, in the module contract's order). Post: a
    planner of ``groups`` copied into a tuple of pairs. Refusal: :class:`ConfigError` naming
    the field, nothing built. Pure.
    """
    return HybridOffloadPlanner(_checked_groups(groups), hash_block_size, chunk_size, max_model_len)


def _checked_groups(groups: object) -> tuple[Group, ...]:
    if not isinstance(groups, (list, tuple)) or not groups:
        raise ConfigError(
            "groups",
            groups,
            "must be a non-empty list or tuple of (GroupKind, block_size) pairs",
            "pass one (kind, block_size) pair per KV cache group",
        )
    checked: list[Group] = []
    for index, entry in enumerate(groups):
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            raise ConfigError(
                "groups",
                groups,
                f"group {index} is {entry!r}, not a (kind, block_size) pair",
                "pass one (kind, block_size) pair per KV cache group",
            )
        kind, block = entry
        if not isinstance(kind, GroupKind):
            raise ConfigError(
                "groups",
                groups,
                f"group {index} kind {kind!r} is not a GroupKind",
                "use GroupKind.FULL, GroupKind.SLIDING or GroupKind.MAMBA",
            )
        _check_positive_int("block_size", block, f"group {index} block_size")
        checked.append((kind, block))
    return tuple(checked)


def _check_positive_int(field: str, value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(
            field, value, f"{what} must be a positive int", f"pass {what} as an int >= 1"
        )


def _check_count(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(field, value, f"{field} must be an int >= 0", f"pass {field} >= 0")


def _round_up(value: int, multiple: int) -> int:
    quotient, remainder = divmod(value, multiple)
    return (quotient + (remainder > 0)) * multiple


def _gcd_of_blocks(groups: tuple[Group, ...]) -> int:
    return math.gcd(*(block for _, block in groups))
