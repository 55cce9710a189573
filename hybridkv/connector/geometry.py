"""The connector's geometry, precomputed: per group its kind, unit, block, hash stride, reach.

Written from docs/explanation/geometry.md; ``spec.connector.geometry.Geometry`` states the
same rules on its own (never imported here). Unit ``j`` of group ``g`` covers tokens
``[j * u_g, (j + 1) * u_g)``, sits in table slot ``j * u_g // block_g`` and is keyed by
``fine_hash[(j + 1) * f_g - 1] + suffix_g`` (``f_g = u_g / hash_block_size``, ``suffix_g`` the
4-byte big-endian group index). What a claim ending at ``t`` from a computed
prefix ``s`` needs per group is a unit range ``[first, t / u_g)``:

- FULL: ``first = s / u_g`` (every unit);
- SLIDING: ``first = max(s, t - reach_g) // u_g`` (the window's units; an unknown window
  reaches ``max_model_len``, so it needs every unit, the reference's conservative choice);
- MAMBA: ``first = t / u_g - 1`` (the one state at exactly ``t``).

An EAGLE/MTP group (``eagle_groups``) needs one unit more, ``[first, t / u_g + 1)``, which it
does not load: its proof. vLLM's prefix cache matches such a group one block past a hit and
drops that block (``eagle_proof_margin``, ``v1/core/kv_cache_coordinator.py:958-978``), because
the drafter's KV at a block's last token was computed from the token after it, which the
block's hash does not cover; the stored unit after ``t`` proves the request's token at ``t``
is the one the stored KV saw. The proof unit must be a full unit of the request's tokens, so
a claim of ``n`` tokens ends at most one unit below the last full unit (:meth:`claim_limit`).
Mamba groups carry no proof (vLLM's coordinator applies the margin to attention groups only).

A MAMBA group's ``checkpoints`` rule (:mod:`hybridkv.connector.checkpoints`) says which states a
step writes and at which positions; the stores read it.

Everything the reference derives through properties on each call is a plain tuple here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.connector.checkpoints import NO_CHECKPOINTS, CheckpointRule
from hybridkv.errors import HybridKVConfigError, int_at_least
from hybridkv.kinds import GroupKind
from hybridkv.planner import HybridOffloadPlanner

__all__ = ["ConnectorGeometry", "PlanRow"]

PlanRow = tuple[int, int, GroupKind, int, int]
"""A claim search's row per group: ``(group, unit, kind, reach, proof)``."""


@dataclass(frozen=True, slots=True)
class ConnectorGeometry:
    """Per-group tables, then whole-model numbers, all derived once by :meth:`build`.

    Construct it with :meth:`build`, which checks the inputs; the fields are its output.

    Attributes:
        kinds: the kind of each group.
        reaches: per group, tokens before a position a SLIDING group reads to compute it.
        checkpoints: per group, where a step leaves mamba states (:class:`CheckpointRule`;
            :data:`NO_CHECKPOINTS` for attention groups and mamba groups exporting none).
        units, blocks: offload unit and GPU block size per group, in tokens.
        strides: fine hashes per unit (``u_g / hash_block_size``).
        suffixes: the 4-byte big-endian group index that ends each group's offload keys.
        proofs: per group, units past a claim end it needs stored, not loaded: 1 for an
            EAGLE/MTP group (module docstring), else 0.
        planner: the offload geometry (units, claim unit, hash contract).
        scheduler_block: ``lcm`` of the block sizes (the scheduler's computed-count alignment).
        align: where a claim may end: ``lcm(claim_unit, scheduler_block)``.
        scan_order: group indices MAMBA first, then FULL, then SLIDING: the claim search asks
            the cheapest, most selective groups first (a mamba group reads one state per
            candidate; a full-attention group is read from the bottom, once per search, and
            ends it at the first unit the host lacks: :mod:`hybridkv.connector.claims`).
        scan_plan: per group of ``scan_order``, ``(group, unit, kind, reach, proof)``: everything
            the claim search reads of the geometry, in one row, so a search builds nothing
            per group (:meth:`plan_of` for another choice of groups).
        distinct_units: the different unit sizes, ascending (a step completes a unit of some
            group exactly when it crosses a multiple of one of them).
    """

    # one entry per KV cache group
    kinds: tuple[GroupKind, ...]
    reaches: tuple[int, ...]
    checkpoints: tuple[CheckpointRule, ...]
    proofs: tuple[int, ...]
    units: tuple[int, ...]
    blocks: tuple[int, ...]
    strides: tuple[int, ...]
    suffixes: tuple[bytes, ...]
    # the model as a whole
    planner: HybridOffloadPlanner
    scheduler_block: int
    align: int
    scan_order: tuple[int, ...]
    scan_plan: tuple[PlanRow, ...]
    distinct_units: tuple[int, ...]

    @classmethod
    def build(
        cls,
        planner: HybridOffloadPlanner,
        group_kinds: Sequence[GroupKind],
        sliding_windows: Sequence[int] = (),
        checkpoints: Sequence[CheckpointRule] = (),
        eagle_groups: Sequence[int] = (),
    ) -> ConnectorGeometry:
        """Check ``group_kinds`` against the planner and derive everything.

        Pre: one kind per planner group, equal to the planner's (field ``group_kinds``);
        ``sliding_windows`` empty or one int >= 0 per group, the reach
        ``sliding_window - 1 + extra_retained_tokens`` of each SLIDING group (field
        ``sliding_windows``); ``checkpoints`` empty (no group exports a checkpoint) or one
        :class:`CheckpointRule` per group (field ``checkpoints``); ``eagle_groups`` the
        indices of the groups vLLM drops EAGLE's block from (field ``eagle_groups``; mamba
        groups among them carry no proof). Agrees with
        ``spec.connector.geometry.Geometry.build``.
        """
        if not isinstance(planner, HybridOffloadPlanner):
            raise HybridKVConfigError(
                "planner", planner, "is not a hybridkv HybridOffloadPlanner", "build one"
            )
        kinds = tuple(group_kinds)
        if kinds != tuple(kind for kind, _ in planner.groups):
            raise HybridKVConfigError(
                "group_kinds", kinds, "differ from the planner's groups", "pass the same groups"
            )
        reaches = _reaches(sliding_windows, len(kinds), planner.max_model_len)
        proofs = _proofs(eagle_groups, kinds)
        blocks = tuple(block for _, block in planner.groups)
        scheduler_block = math.lcm(*blocks)
        rank = {GroupKind.MAMBA: 0, GroupKind.FULL: 1, GroupKind.SLIDING: 2}
        order = tuple(sorted(range(len(kinds)), key=lambda g: (rank[kinds[g]], g)))
        return cls(
            kinds=kinds,
            reaches=reaches,
            checkpoints=_checkpoints(checkpoints, len(kinds)),
            proofs=proofs,
            units=planner.units,
            blocks=blocks,
            strides=planner.hash_factors,
            suffixes=tuple(g.to_bytes(4, "big") for g in range(len(kinds))),
            planner=planner,
            scheduler_block=scheduler_block,
            align=math.lcm(planner.claim_unit, scheduler_block),
            scan_order=order,
            scan_plan=tuple((g, planner.units[g], kinds[g], reaches[g], proofs[g]) for g in order),
            distinct_units=tuple(sorted(set(planner.units))),
        )

    @property
    def num_groups(self) -> int:
        """How many KV cache groups."""
        return len(self.kinds)

    def plan_of(self, groups: Sequence[int]) -> tuple[PlanRow, ...]:
        """The claim search's rows (:attr:`scan_plan`) for ``groups``, in that order.

        Pre: each entry is a group index (IndexError otherwise)."""
        units, kinds, reaches, proofs = self.units, self.kinds, self.reaches, self.proofs
        return tuple((g, units[g], kinds[g], reaches[g], proofs[g]) for g in groups)

    def completes_a_unit(self, start: int, end: int) -> bool:
        """Whether computing ``[start, end)`` completes a unit of some group."""
        for u in self.distinct_units:  # noqa: SIM110 (a loop: asked per request per step)
            if start // u != end // u:
                return True
        return False

    def claim_limit(self, num_tokens: int) -> int:
        """The largest claim end the claim rule considers for ``num_tokens`` tokens: the
        planner's ``claimable_prefix_tokens``, and for an EAGLE/MTP group one unit below its
        last full unit (the proof unit must be one of the request's), rounded down to
        ``align``.

        Pre: ``num_tokens`` is an int >= 0 (a request's token count): the planner's argument
        check is skipped, since a claim search asks this once per group scanned."""
        claim = self.planner.claim_unit
        if num_tokens <= claim:
            return 0
        limit = (num_tokens - 1) // claim * claim
        for u, proof in zip(self.units, self.proofs, strict=True):
            if proof:
                limit = min(limit, (num_tokens // u - proof) * u)
        return max(0, limit - limit % self.align)

    def first_needed(self, group_idx: int, start: int, end: int) -> int:
        """The first unit index group ``group_idx`` needs to resume at ``end`` from ``start``.

        Pre: ``0 <= start < end``, ``end`` a multiple of the group's unit. The needed units
        are ``[first_needed, end // unit)`` (module docstring).
        """
        u = self.units[group_idx]
        kind = self.kinds[group_idx]
        if kind is GroupKind.MAMBA:
            return end // u - 1
        if kind is GroupKind.SLIDING:
            return max(start, end - self.reaches[group_idx]) // u
        return start // u


def _proofs(eagle_groups: Sequence[int], kinds: tuple[GroupKind, ...]) -> tuple[int, ...]:
    if isinstance(eagle_groups, (str, bytes)) or not all(
        type(g) is int and 0 <= g < len(kinds) for g in eagle_groups
    ):
        raise HybridKVConfigError(
            "eagle_groups", eagle_groups, "must name KV cache group indices", _FIX_EAGLE
        )
    eagle = set(eagle_groups)
    return tuple(int(g in eagle and kind is not GroupKind.MAMBA) for g, kind in enumerate(kinds))


_FIX_EAGLE = "pass the indices of the groups vLLM drops EAGLE's block from (or none)"


def _checkpoints(
    checkpoints: Sequence[CheckpointRule], num_groups: int
) -> tuple[CheckpointRule, ...]:
    if not checkpoints:
        return tuple(NO_CHECKPOINTS for _ in range(num_groups))
    rules = tuple(checkpoints)
    if len(rules) != num_groups or not all(isinstance(r, CheckpointRule) for r in rules):
        raise HybridKVConfigError(
            "checkpoints", checkpoints, "must give one CheckpointRule per group", _FIX_RULE
        )
    return rules


_FIX_RULE = "pass hybridkv.connector.checkpoints.NO_CHECKPOINTS for groups exporting none"


def _reaches(
    sliding_windows: Sequence[int], num_groups: int, max_model_len: int
) -> tuple[int, ...]:
    if isinstance(sliding_windows, (str, bytes)):
        raise HybridKVConfigError(
            "sliding_windows", sliding_windows, "must give one int >= 0 per group", _FIX_REACH
        )
    if not sliding_windows:
        return tuple(max_model_len for _ in range(num_groups))
    reaches = tuple(sliding_windows)
    if len(reaches) != num_groups or not all(int_at_least(r, 0) for r in reaches):
        raise HybridKVConfigError(
            "sliding_windows", sliding_windows, "must give one int >= 0 per group", _FIX_REACH
        )
    return reaches


_FIX_REACH = "pass sliding_window - 1 + extra_retained_tokens per group (0 if none)"
