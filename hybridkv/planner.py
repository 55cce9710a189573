"""HybridOffloadPlanner: per-group offload units and fast chunk counting for hybrid models.

A hybrid model's KV cache groups have different GPU block sizes; the offload tier works in
chunks of ``chunk_size`` tokens. A chunk that divides an attention group's block splits it into
chunk-sized units; a group the chunk cannot split keeps its whole block; a mamba group is never
split, because its recurrent state exists only at its own block boundaries.

Everything is derived once at construction into tuples, so the per-step queries are
arithmetic over a handful of ints. The reference model is ``spec.planner`` (never imported
here); the two agree on every method, every error ``field`` and the ``snapshot()`` that the
``PL-*`` invariants check (tests/differential/test_planner_agreement.py).

Contract (same as the reference model):

- Inputs: ``groups`` (a list or tuple of ``(GroupKind, block_size)`` pairs, one per KV cache
  group), ``hash_block_size`` h, ``chunk_size`` c, ``max_model_len`` M.
- Validation order and fields of :class:`~hybridkv.errors.HybridKVConfigError`: ``groups``
  (shape, kinds), ``block_size`` (a positive int per group; the message names the group),
  ``hash_block_size``, ``chunk_size``, ``max_model_len`` (positive ints); ``hash_block_size``
  divides every block; ``chunk_size`` is a multiple of h; ``max_model_len`` >=
  ``claim_unit + 1`` (the message gives that minimum, suggests a smaller chunk and, for a mamba
  block as long as M, prefix caching with ``mamba_cache_mode='align'``).
- Unit u_g: mamba: block; attention: c if c divides the block, else the block.
- ``hash_factors[g] = u_g / h``; unit j of group g is keyed by fine hash ``(j+1)*f_g - 1``.
- ``splittable[g] = u_g < block``; ``first_storable_chunks[g] = lcm(c, u_g)/c - 1``.
- ``claim_unit = lcm(c, every u_g)``; ``shortest_hit_prompt = claim_unit + 1``.

Every query is pure; a refused call (bad argument) changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridkv.errors import HybridKVConfigError, int_at_least
from hybridkv.kinds import GroupKind

# GroupKind is re-exported: a caller names its groups with it.
__all__ = ["Group", "GroupKind", "HybridOffloadPlanner"]

Group = tuple[GroupKind, int]


@dataclass(frozen=True, slots=True)
class HybridOffloadPlanner:
    """The offload geometry of one hybrid model, validated and precomputed at construction.

    Pre: none (bad input raises :class:`HybridKVConfigError`, see the module contract).
    Post: every derived attribute below is set. Frame: a refused construction builds nothing.

    Attributes:
        groups: ``(kind, block_size)`` per KV cache group, as a tuple.
        hash_block_size, chunk_size, max_model_len: the inputs.
        units: offload unit u_g per group.
        hash_factors: ``u_g / hash_block_size`` per group.
        splittable: per group, ``u_g < block_size``.
        first_storable_chunks: per group, the first chunk index whose end u_g divides.
        claim_unit: ``lcm(chunk_size, every u_g)``.
        shortest_hit_prompt: ``claim_unit + 1``.
    """

    groups: Sequence[Group]
    hash_block_size: int
    chunk_size: int
    max_model_len: int
    units: tuple[int, ...] = field(init=False, repr=False)
    hash_factors: tuple[int, ...] = field(init=False, repr=False)
    splittable: tuple[bool, ...] = field(init=False, repr=False)
    first_storable_chunks: tuple[int, ...] = field(init=False, repr=False)
    claim_unit: int = field(init=False, repr=False)
    shortest_hit_prompt: int = field(init=False, repr=False)
    # Units that do not divide the chunk: only these can stop coverage short of n // c.
    _binding_units: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        groups = _validated_groups(self.groups)
        h, c, max_len = self.hash_block_size, self.chunk_size, self.max_model_len
        for name, value in (("hash_block_size", h), ("chunk_size", c), ("max_model_len", max_len)):
            _positive_int(name, value, name)
        _require_hash_contract(groups, h, c)
        units = tuple(_unit_of(kind, block, c) for kind, block in groups)
        claim = math.lcm(c, *units)
        _require_reachable(groups, claim, max_len)
        derived: dict[str, object] = {
            "groups": groups,
            "units": units,
            "hash_factors": tuple(unit // h for unit in units),
            "splittable": tuple(
                unit < block for unit, (_, block) in zip(units, groups, strict=True)
            ),
            "first_storable_chunks": tuple(math.lcm(c, unit) // c - 1 for unit in units),
            "claim_unit": claim,
            "shortest_hit_prompt": claim + 1,
            "_binding_units": tuple(sorted({unit for unit in units if c % unit != 0})),
        }
        for name, derived_value in derived.items():
            object.__setattr__(self, name, derived_value)

    def chunk_count_for_tokens(self, num_tokens: int) -> int:
        """Leading chunks every group covers with complete units within ``num_tokens``.

        Pre: ``num_tokens`` is an int >= 0 (else field ``"num_tokens"``). Post:
        ``min over g of floor(floor(n / u_g) * u_g / c)``. Frame: nothing changes.
        Agrees with ``spec.planner.HybridOffloadPlanner.chunk_count_for_tokens``.
        """
        if not int_at_least(num_tokens, 0):
            raise _bad_count("num_tokens", num_tokens)
        c = self.chunk_size
        # A unit that divides c covers every whole chunk, so n // c bounds the answer and
        # only the units that do not divide c need a look (none on uniform geometries).
        count = num_tokens // c
        for unit in self._binding_units:
            covered = num_tokens // unit * unit // c
            count = min(count, covered)
        return count

    def group_covered_tokens(self, num_chunks: int) -> tuple[int, ...]:
        """Per group, tokens its complete units must span to cover the first ``num_chunks``.

        Pre: ``num_chunks`` is an int >= 0 (else field ``"num_chunks"``). Post: entry g is
        ``ceil(num_chunks * c / u_g) * u_g``. Frame: nothing changes.
        """
        if not int_at_least(num_chunks, 0):
            raise _bad_count("num_chunks", num_chunks)
        span = num_chunks * self.chunk_size
        return tuple(-(-span // unit) * unit for unit in self.units)

    def storable_prefix_tokens(self, num_tokens: int) -> int:
        """``chunk_count_for_tokens(num_tokens) * chunk_size``; same pre, post and frame."""
        return self.chunk_count_for_tokens(num_tokens) * self.chunk_size

    def claimable_prefix_tokens(self, num_tokens: int) -> int:
        """Longest prefix a lookup may claim for a prompt of ``num_tokens`` tokens.

        Pre: ``num_tokens`` is an int >= 0 (else field ``"num_tokens"``). Post: the largest
        multiple of ``claim_unit`` <= ``num_tokens - 1`` (the last prompt token is always
        computed); 0 when ``num_tokens <= claim_unit``. Frame: nothing changes.
        """
        if not int_at_least(num_tokens, 0):
            raise _bad_count("num_tokens", num_tokens)
        claim = self.claim_unit
        if num_tokens <= claim:
            return 0
        return (num_tokens - 1) // claim * claim

    def unit_hash_index(self, group_index: int, unit_index: int) -> int:
        """The fine hash index keying unit ``unit_index`` of group ``group_index``.

        Pre: ``group_index`` an int in ``[0, len(groups))`` (else field ``"group_index"``);
        ``unit_index`` an int >= 0 (else field ``"unit_index"``). Post:
        ``(unit_index + 1) * hash_factors[group_index] - 1``. Frame: nothing changes.
        """
        if not int_at_least(group_index, 0):
            raise _bad_count("group_index", group_index)
        if group_index >= len(self.units):
            raise HybridKVConfigError(
                "group_index",
                group_index,
                f"there are only {len(self.units)} groups",
                f"use an index below {len(self.units)}",
            )
        if not int_at_least(unit_index, 0):
            raise _bad_count("unit_index", unit_index)
        return (unit_index + 1) * self.hash_factors[group_index] - 1

    def snapshot(self) -> dict[str, Any]:
        """Inputs and derived fields as plain data (kinds as strings) for the PL-* predicates.

        Post: a fresh dict of ints, bools, strings and tuples. Frame: nothing changes.
        """
        plain: dict[str, Any] = {"groups": tuple((k.value, block) for k, block in self.groups)}
        plain.update((name, getattr(self, name)) for name in _PLAIN_FIELDS)
        return plain


# What ``snapshot`` exports beside ``groups``, in the snapshot schema's order (the PL-*
# predicates read these keys): every input and derived field is already plain data.
_PLAIN_FIELDS = (
    "hash_block_size",
    "chunk_size",
    "max_model_len",
    "units",
    "hash_factors",
    "splittable",
    "first_storable_chunks",
    "claim_unit",
    "shortest_hit_prompt",
)


def _unit_of(kind: GroupKind, block: int, chunk: int) -> int:
    """Mamba keeps its block; attention splits into chunks only when the chunk divides it."""
    if kind is not GroupKind.MAMBA and block % chunk == 0:
        return chunk
    return block


_PAIR_FIX = "pass one (kind, block_size) pair per KV cache group"


def _validated_groups(groups: object) -> tuple[Group, ...]:
    if not isinstance(groups, (list, tuple)) or len(groups) == 0:
        raise HybridKVConfigError(
            "groups", groups, "must be a non-empty list or tuple of (kind, block_size)", _PAIR_FIX
        )
    return tuple(_validated_group(groups, index, entry) for index, entry in enumerate(groups))


def _validated_group(groups: Sequence[object], index: int, entry: object) -> Group:
    """Entry ``index`` as a ``(kind, block_size)`` pair; an error names the whole ``groups``.

    Only a list or a tuple of two is a pair (a ``range`` or a string is not), hence the
    ``isinstance`` in front of the sequence patterns.
    """
    match entry if isinstance(entry, (list, tuple)) else None:
        case (GroupKind() as kind, block):
            return kind, _positive_int("block_size", block, f"group {index} block_size")
        case (kind, _):
            raise HybridKVConfigError(
                "groups",
                groups,
                f"group {index} kind {kind!r} is not a GroupKind",
                "use GroupKind.FULL, GroupKind.SLIDING or GroupKind.MAMBA",
            )
        case _:
            raise HybridKVConfigError(
                "groups", groups, f"group {index} is {entry!r}, not a pair", _PAIR_FIX
            )


def _positive_int(name: str, value: object, what: str) -> int:
    if not int_at_least(value, 1):
        raise HybridKVConfigError(
            name, value, f"{what} must be a positive int", f"set {what} to an int >= 1"
        )
    return value


def _require_hash_contract(groups: tuple[Group, ...], h: int, c: int) -> None:
    for index, (_, block) in enumerate(groups):
        if block % h:
            common = math.gcd(*(b for _, b in groups))
            raise HybridKVConfigError(
                "hash_block_size",
                h,
                f"does not divide group {index}'s block_size {block}",
                f"use a divisor of every group block size, e.g. {common}",
            )
    if c % h:
        raise HybridKVConfigError(
            "chunk_size",
            c,
            f"is not a multiple of hash_block_size {h}",
            f"use a multiple of {h}, e.g. {-(-c // h) * h}",
        )


def _require_reachable(groups: tuple[Group, ...], claim: int, max_len: int) -> None:
    if claim + 1 <= max_len:
        return
    for index, (kind, block) in enumerate(groups):
        if kind is GroupKind.MAMBA and block >= max_len:
            raise HybridKVConfigError(
                "max_model_len",
                max_len,
                f"mamba group {index} block_size {block} >= max_model_len "
                "(mamba_cache_mode='none'): its state exists only at the end",
                "enable prefix caching (mamba_cache_mode='align'), "
                f"or set max_model_len >= {claim + 1}",
            )
    raise HybridKVConfigError(
        "max_model_len",
        max_len,
        f"no prompt can hit: the shortest that can is claim_unit + 1 = {claim + 1} tokens",
        f"set max_model_len >= {claim + 1}, or a smaller chunk_size",
    )


def _bad_count(name: str, value: object) -> HybridKVConfigError:
    return HybridKVConfigError(name, value, f"{name} must be an int >= 0", f"pass {name} >= 0")
