"""Which host keys a group needs for a claim, and where its units sit in its block table.

The connector works in the planner's offload units (:class:`spec.planner.HybridOffloadPlanner`):
unit ``j`` of group ``g`` covers tokens ``[j * u_g, (j + 1) * u_g)`` and is keyed by
``offload_key(block_hashes[unit_hash_index(g, j)], g)``. For an attention group the unit is KV of
those tokens; for a mamba group it is the recurrent state after exactly ``(j + 1) * u_g`` tokens.
Where every ``u_g`` is a multiple of ``chunk_size`` (the usual case, chunk dividing the attention
block) these are exactly the keys of :func:`spec.hashing.chunk_keys`.

What a claim ending at token ``t`` (starting from a computed prefix ``s``) needs per group:

- FULL: every unit in ``[s, t)``;
- SLIDING: the units holding the tokens the window reads before ``t``: ``[max(s, t - r), t)``
  with reach ``r = sliding_window - 1 + extra_retained_tokens`` (vLLM's skipped tokens
  ``max(0, t - sliding_window + 1 - extra)``); a SLIDING group of unknown window needs all;
- MAMBA: the one state at exactly ``t``.

EAGLE's block drop. Under EAGLE/MTP speculation vLLM's own prefix cache never serves a hit
without the block after it: an EAGLE group looks one block (one hash block when fine-grained)
past the candidate hit and drops the last block it matched
(``v1/core/kv_cache_coordinator.py:958-978`` with ``eagle_proof_margin``,
``v1/core/kv_cache_utils.py:804-813``; the drop itself in
``v1/core/single_type_kv_cache_manager.py:829-830`` for full attention and ``:1051-1053`` for a
sliding window). The reason is the drafter: its KV at a block's last token was computed from the
token after it, which the block's hash does not cover, so only a stored next block proves the
request continues as the writer did. The groups are those vLLM flags ``is_eagle_group``, or every
group when none is flagged (``kv_cache_coordinator.py:129-135``), and none when lookahead hashes
prove the boundary token (``kv_cache_coordinator.py:136-137``,
``v1/core/sched/scheduler.py:341-345``). vLLM adds no margin for a mamba group (its finder
never drops: draft models have no mamba layers, ``kv_cache_coordinator.py:870-875``). The
connector's rule, in offload units: a claim ending at ``t`` also needs, for each EAGLE attention
group, the unit after ``t`` (the unit starting at ``t``) stored, its proof
(:meth:`Geometry.proof_unit`). The proof is read, never loaded: the claim restores ``[s, t)``
only, and the proof unit must be a full unit of the request's own tokens
(``t + u_g <= num_tokens``).

Which states a step writes, and where, is a MAMBA group's ``checkpoints`` rule
(:mod:`spec.connector.checkpoints`): :meth:`Geometry.mamba_states_ending_in`.

Every function is pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from spec.connector.checkpoints import NONE, CheckpointRule, states_written
from spec.errors import ConfigError
from spec.hashing import offload_key
from spec.kinds import GroupKind
from spec.managers.group_spec import GroupSpec
from spec.planner import HybridOffloadPlanner

__all__ = ["Geometry", "UnitRef"]


@dataclass(frozen=True, slots=True)
class UnitRef:
    """One unit of one group: ``group_idx``, unit ``index``, its ``end`` token and table slot."""

    group_idx: int
    index: int
    end: int
    block_index: int


@dataclass(frozen=True, slots=True)
class Geometry:
    """The planner plus what it lacks: each group's kind and the reach of a sliding window.

    Attributes:
        planner: the offload geometry (units, claim unit, hash contract).
        kinds: the kind of each group (as the planner's groups).
        reaches: per group, tokens before a position that the group reads to compute it:
            FULL and MAMBA ignore it; SLIDING reads ``reach`` tokens back.
        checkpoints: per group, vLLM's prefill-checkpoint rule (``NONE`` where none is
            exported, and for attention groups).
        eagle: per group, whether a claim needs the unit after its end stored (module
            docstring: an attention group vLLM drops EAGLE's block from); empty: none does.
    """

    planner: HybridOffloadPlanner
    kinds: tuple[GroupKind, ...]
    reaches: tuple[int, ...]
    checkpoints: tuple[CheckpointRule, ...] = ()
    eagle: tuple[bool, ...] = ()

    @classmethod
    def build(
        cls,
        planner: HybridOffloadPlanner,
        group_kinds: Sequence[GroupKind],
        sliding_windows: Sequence[int] = (),
        checkpoints: Sequence[CheckpointRule] = (),
        eagle_groups: Sequence[int] = (),
    ) -> Geometry:
        """Check ``group_kinds`` against the planner and derive the reaches.

        Pre: one kind per planner group, equal to the planner's; ``sliding_windows`` empty (a
        SLIDING group then needs every unit, the conservative choice) or one int per group,
        the window reach ``sliding_window - 1 + extra_retained_tokens`` for SLIDING groups.
        ``checkpoints`` empty (no group exports a checkpoint) or one
        :class:`~spec.connector.checkpoints.CheckpointRule` per group. ``eagle_groups`` the
        indices of the groups vLLM drops EAGLE's block from (empty without EAGLE/MTP or with
        lookahead hashes); a mamba group among them needs no proof (module docstring).
        Refusal: :class:`ConfigError` (field ``group_kinds``, ``sliding_windows``,
        ``checkpoints`` or ``eagle_groups``).
        """
        kinds = tuple(group_kinds)
        if kinds != tuple(kind for kind, _ in planner.groups):
            raise ConfigError(
                "group_kinds", kinds, "differ from the planner's groups", "pass the same groups"
            )
        if not sliding_windows:
            reaches = tuple(planner.max_model_len for _ in kinds)
        else:
            reaches = tuple(sliding_windows)
            if len(reaches) != len(kinds) or any(
                isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in reaches
            ):
                raise ConfigError(
                    "sliding_windows",
                    sliding_windows,
                    "must give one int >= 0 per group",
                    "pass sliding_window - 1 + extra_retained_tokens per group (0 if none)",
                )
        rules = tuple(checkpoints) or tuple(NONE for _ in kinds)
        if len(rules) != len(kinds) or not all(isinstance(r, CheckpointRule) for r in rules):
            raise ConfigError(
                "checkpoints",
                checkpoints,
                "must give one CheckpointRule per group",
                "pass spec.connector.checkpoints.NONE for groups that export none",
            )
        named = tuple(eagle_groups)
        if not all(type(g) is int and 0 <= g < len(kinds) for g in named):
            raise ConfigError(
                "eagle_groups",
                eagle_groups,
                "must name KV cache group indices",
                "pass the groups vLLM drops EAGLE's block from, or none",
            )
        eagle = tuple(g in named and kind is not GroupKind.MAMBA for g, kind in enumerate(kinds))
        return cls(planner, kinds, reaches, rules, eagle)

    @classmethod
    def from_groups(cls, planner: HybridOffloadPlanner, groups: Sequence[GroupSpec]) -> Geometry:
        """:meth:`build` with kinds and window reaches read off vLLM-shaped group specs.

        Pure. Pre: one spec per planner group, of the planner's kinds. Post: a SLIDING group's
        reach is ``sliding_window - 1 + extra_retained_tokens``, every other group's 0.
        Refusal: that of :meth:`build` (:class:`ConfigError`, nothing built).
        """
        reaches = tuple(
            g.sliding_window - 1 + g.extra_retained_tokens if g.kind is GroupKind.SLIDING else 0
            for g in groups
        )
        return cls.build(planner, tuple(g.kind for g in groups), reaches)

    # ----------------------------------------------------------------- derived

    @property
    def num_groups(self) -> int:
        """How many KV cache groups."""
        return len(self.kinds)

    @property
    def scheduler_block(self) -> int:
        """``lcm`` of the group block sizes: the alignment of the scheduler's computed count."""
        return math.lcm(*(block for _, block in self.planner.groups))

    @property
    def align(self) -> int:
        """Where a claim may end: multiples of the claim unit and of the scheduler block."""
        return math.lcm(self.planner.claim_unit, self.scheduler_block)

    @property
    def proof_groups(self) -> tuple[int, ...]:
        """The groups whose claims need a proof unit (:attr:`eagle`), ascending."""
        return tuple(g for g, eagle in enumerate(self.eagle) if eagle)

    @property
    def has_mamba(self) -> bool:
        """Whether some group holds a recurrent state."""
        return GroupKind.MAMBA in self.kinds

    # ----------------------------------------------------------------- units

    def unit(self, group_idx: int, index: int) -> UnitRef:
        """Unit ``index`` of group ``group_idx`` and the table slot of the block holding it.

        An attention unit lies in block ``index * u // block``; a mamba unit is the state block
        at slot ``end // block - 1`` (its unit is its block). Pure. Pre: ``group_idx`` names a
        group (``IndexError`` otherwise); ``index >= 0``.
        """
        u = self.planner.units[group_idx]
        block = self.planner.groups[group_idx][1]
        end = (index + 1) * u
        return UnitRef(group_idx, index, end, index * u // block)

    def needed_units(self, group_idx: int, start: int, end: int) -> tuple[UnitRef, ...]:
        """The units group ``group_idx`` needs to resume at ``end`` from a computed ``start``.

        Pre: ``0 <= start < end``, both multiples of the group's unit (``end`` must be, for a
        mamba group). Post: units in ascending order (module docstring rule).
        """
        u = self.planner.units[group_idx]
        kind = self.kinds[group_idx]
        if kind is GroupKind.MAMBA:
            first = end // u - 1
        elif kind is GroupKind.SLIDING:
            first = max(start, end - self.reaches[group_idx]) // u
        else:
            first = start // u
        return tuple(self.unit(group_idx, j) for j in range(first, end // u))

    def proof_unit(self, group_idx: int, end: int) -> UnitRef | None:
        """The unit a claim ending at ``end`` needs stored past its end: for an EAGLE group
        the one starting at ``end`` (module docstring), else ``None``.

        Pure. Pre: ``end`` is a multiple of the group's unit (every claim end is: the claim
        unit is a multiple of each); ``group_idx`` names a group (``IndexError`` otherwise).
        """
        if not self.eagle or not self.eagle[group_idx]:
            return None
        return self.unit(group_idx, end // self.planner.units[group_idx])

    def units_ending_in(self, group_idx: int, start: int, end: int) -> tuple[UnitRef, ...]:
        """The units of the group whose end lies in ``(start, end]`` (newly completed ones).

        Pure. Pre: ``0 <= start``; ``group_idx`` names a group (``IndexError`` otherwise).
        Post: ascending by index; empty when ``end <= start`` or no unit ends in the span.
        """
        u = self.planner.units[group_idx]
        return tuple(self.unit(group_idx, j) for j in range(start // u, end // u))

    def mamba_states_ending_in(self, group_idx: int, start: int, end: int) -> tuple[UnitRef, ...]:
        """The units of a MAMBA group whose state a step computing ``[start, end)`` writes.

        A written state counts if its position is a unit end in ``(start, end]``; the unit's
        ``block_index`` is the slot the state was written in, which for vLLM's prefill
        checkpoint is not the slot of the unit's end (:mod:`spec.connector.checkpoints`; MB-8).
        Pure. Pre: ``0 <= start < end``; the group is MAMBA. Post: ascending by end.
        """
        u = self.planner.units[group_idx]
        block = self.planner.groups[group_idx][1]
        rule = self.checkpoints[group_idx] if self.checkpoints else NONE
        running, *checkpoint = states_written(rule, start, end, block)
        found = []
        if running.position % u == 0:  # its slot is the unit's own (:meth:`unit`)
            found.append(self.unit(group_idx, running.position // u - 1))
        for state in checkpoint:  # its slot is the reserved one, whatever its position
            if state.position % u == 0 and state.position > start:
                ref = self.unit(group_idx, state.position // u - 1)
                found.append(replace(ref, block_index=state.slot))
        return tuple(sorted(found, key=lambda ref: ref.end))

    def key(self, block_hashes: Sequence[bytes], ref: UnitRef) -> bytes:
        """The offload key of a unit. Pre: ``block_hashes`` reach the unit's end."""
        fine = self.planner.unit_hash_index(ref.group_idx, ref.index)
        return offload_key(block_hashes[fine], ref.group_idx)
