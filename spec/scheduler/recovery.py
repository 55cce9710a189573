"""The two recovery models for a failed load, and the report shared truncation needs.

vLLM 0.33 (``v1/core/sched/scheduler.py``) recovers per request only: ``_handle_failed_recving``
(3688-3701) restarts a failed async load from 0 computed tokens under ``recompute`` (every group
freed at the next schedule, ``_update_waiting_for_remote_kv`` 3467-3517, and the connector asked
again) or finishes it FINISHED_ERROR under ``fail``; ``_handle_invalid_blocks`` (3703-3721)
raises ``RuntimeError`` when a block-level report arrives with several KV cache groups.

Shared truncation (the seed's LightBits PR 7, divergence D6) reads a block-level report
(:class:`FailureReport`), iterates every group's blocks, and truncates ALL groups at one point:
the largest multiple of the claim unit at or below the first invalid block's boundary where
every group can resume: full attention needs every block below it, a sliding window the blocks
of its window, mamba a real, valid state block exactly at that point. Every request whose table
holds an invalid block is truncated the same way (shared bookkeeping), and the invalid blocks'
cache entries are dropped so no later hit adopts them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spec.block_pool import NULL_BLOCK, BlockId
from spec.connector_api import RequestId
from spec.kinds import GroupKind
from spec.managers.group_spec import GroupSpec
from spec.scheduler.config import RecoveryMode

__all__ = [
    "BlockLevelReportError",
    "FailureReport",
    "RecoveryRecord",
    "Truncation",
    "group_bound",
    "shared_truncation",
    "valid_at",
]


@dataclass(frozen=True, slots=True)
class FailureReport:
    """A block-level load failure: which of the request's blocks hold no valid content.

    The scheduler-side query that shared truncation needs and vLLM's request-level
    ``failed_recving`` cannot express. Block ids name bytes of the one shared pool, so a block
    id is unambiguous across groups.

    Attributes:
        request_id: the request whose load failed.
        invalid_blocks: the blocks the failed transfer left without valid content.
    """

    request_id: RequestId
    invalid_blocks: frozenset[BlockId]


class BlockLevelReportError(RuntimeError):
    """vLLM 0.33's refusal of block-level reports on a multi-group layout.

    ``scheduler.py:3712-3721`` raises ``RuntimeError`` from ``update_from_output``: an engine
    error, not a per-request one. The model raises it before changing anything.
    """


@dataclass(frozen=True, slots=True)
class Truncation:
    """Where shared truncation puts a request: ``point`` and each group's valid points."""

    point: int
    valid_points: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class RecoveryRecord:
    """One recovered request, for ``SC-4`` and the recomputation counters.

    Attributes:
        request_id: the recovered request.
        mode: the recovery model applied.
        computed_before: the computed (or claimed) tokens before the failure.
        truncated_to: the computed tokens after recovery (0 for the vLLM models).
        valid_points: per group, the positions at which that group alone could resume.
    """

    request_id: RequestId
    mode: RecoveryMode
    computed_before: int
    truncated_to: int
    valid_points: tuple[tuple[int, ...], ...]

    @property
    def discarded(self) -> int:
        """Tokens that must be computed again because of this recovery."""
        return self.computed_before - self.truncated_to


def group_bound(spec: GroupSpec, table: Sequence[BlockId], invalid: frozenset[BlockId]) -> int:
    """The furthest position this group's invalid blocks leave resumable. Pure.

    An invalid attention block at position ``p`` spoils tokens from ``p * bs``; an invalid
    mamba state at ``p`` spoils the state after ``(p + 1) * bs`` tokens, so the bound is one
    token short of it. Without invalid blocks: the table's extent.
    """
    for index, block in enumerate(table):
        if block != NULL_BLOCK and block in invalid:
            if spec.kind is GroupKind.MAMBA:
                return (index + 1) * spec.block_size - 1
            return index * spec.block_size
    return len(table) * spec.block_size


def valid_at(
    spec: GroupSpec, table: Sequence[BlockId], invalid: frozenset[BlockId], point: int
) -> bool:
    """Whether this group can resume at ``point`` (a multiple of its block size). Pure.

    Full attention: every block below ``point`` real and valid. Sliding window: the blocks of
    the window ending at ``point``. Mamba: a real, valid state block exactly at ``point``.
    Every group can resume at 0.
    """
    if point == 0:
        return True
    bs = spec.block_size
    end = point // bs
    if end > len(table):
        return False
    if spec.kind is GroupKind.MAMBA:
        first = end - 1
    elif spec.kind is GroupKind.SLIDING:
        skipped = max(0, point - spec.sliding_window + 1 - spec.extra_retained_tokens)
        first = skipped // bs
    else:
        first = 0
    return all(b != NULL_BLOCK and b not in invalid for b in table[first:end])


def shared_truncation(
    groups: Sequence[GroupSpec],
    tables: Sequence[Sequence[BlockId]],
    invalid: frozenset[BlockId],
    limit: int,
    unit: int,
) -> Truncation:
    """The one point every group truncates to. Pure.

    Pre: ``unit`` is a multiple of every group's block size; ``limit >= 0`` is the request's
    computed (or claimed) count. Post: ``point`` is a multiple of ``unit``, at most ``limit``
    and every group's bound, and every group is valid at it; no larger such point exists.
    """
    bound = min([limit] + [group_bound(g, t, invalid) for g, t in zip(groups, tables, strict=True)])
    candidates = range(bound // unit * unit, -1, -unit)
    valid = tuple(
        tuple(p for p in candidates if valid_at(g, t, invalid, p))
        for g, t in zip(groups, tables, strict=True)
    )
    common = set(valid[0]).intersection(*valid[1:]) if valid else {0}
    return Truncation(max(common), tuple(tuple(sorted(v)) for v in valid))
