"""Load jobs of a claim, the record of a load, and where a partly failed load can resume.

A claim from ``start`` to ``end`` is split into one job per alignment segment
``(a_{i-1}, a_i]`` (``a_i`` multiples of :attr:`Geometry.align`): each item goes to the segment
holding its ``end_token``. A job failure then names the segment that failed, and the failure
memory keeps only that segment's keys, so the re-ask can still claim the prefix before it.
The mamba state at ``end`` is in the last segment.

Pure functions and frozen values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from spec.block_pool import NULL_BLOCK
from spec.connector.claims import needed_keys
from spec.connector.geometry import Geometry, UnitRef
from spec.connector_api import BlockTable, JobId, TransferItem
from spec.kinds import GroupKind

__all__ = ["LoadRecord", "load_items", "restored_units", "resume_point", "segments"]


@dataclass(frozen=True, slots=True)
class LoadRecord:
    """One load of a request: its claim, its jobs and what they reported.

    Attributes:
        start: the computed prefix the claim started from.
        end: the claim end (``start`` + the external tokens).
        num_tokens: the request's token count when it claimed.
        sync: loaded before the step's forward (True) or while the request waits (False).
        cache_salt: the salt of the loading request (for SEC-1).
        items: every item of every job of the load.
        jobs: the job ids, one per non-empty segment, ascending.
        reported: jobs that reported (success or not).
        failed: jobs that reported failure.
        good_keys: keys of the jobs that reported success.
        bad_blocks: destination blocks of the jobs that reported failure.
    """

    start: int
    end: int
    num_tokens: int
    sync: bool
    cache_salt: str | None
    items: tuple[TransferItem, ...]
    jobs: tuple[JobId, ...]
    reported: frozenset[JobId] = frozenset()
    failed: frozenset[JobId] = frozenset()
    good_keys: frozenset[bytes] = field(default_factory=frozenset)
    bad_blocks: frozenset[int] = frozenset()

    @property
    def in_flight(self) -> bool:
        """Whether some job of the load has not reported yet."""
        return len(self.reported) < len(self.jobs)

    def with_result(
        self, job_id: JobId, items: Sequence[TransferItem], *, success: bool
    ) -> LoadRecord:
        """The record after job ``job_id`` (with ``items``) reported ``success``.

        Pure: a new record, ``self`` unchanged. Pre: ``job_id`` is one of ``jobs``, not yet
        reported, and ``items`` are its items (not checked). Post: ``job_id`` is reported; on
        success the items' keys joined ``good_keys``; on failure ``job_id`` joined ``failed``
        and the items' blocks joined ``bad_blocks``.
        """
        if success:
            return replace(
                self,
                reported=self.reported | {job_id},
                good_keys=self.good_keys | {item.key for item in items},
            )
        return replace(
            self,
            reported=self.reported | {job_id},
            failed=self.failed | {job_id},
            bad_blocks=self.bad_blocks | {item.block_id for item in items},
        )


def load_items(
    geometry: Geometry,
    block_hashes: Sequence[bytes],
    block_ids: BlockTable,
    start: int,
    end: int,
    *,
    loadable: Callable[[bytes], bool],
) -> tuple[TransferItem, ...]:
    """Items restoring every group at ``end`` from ``start``, into the request's real blocks.

    Per group the needed units of :meth:`Geometry.needed_units`; an attention group of an
    unaligned ``end`` needs the units below it, a mamba group the state at exactly ``end`` (none
    if ``end`` is not a unit end: MB-1 reports such a load). Units whose key is not
    ``loadable`` or whose table slot is null or missing are left out. Post: items sorted by
    ``end_token`` then group.
    """
    items: list[TransferItem] = []
    for ref in restored_units(geometry, start, end):
        g = ref.group_idx
        table = block_ids[g] if g < len(block_ids) else ()
        key = geometry.key(block_hashes, ref)
        slot_ok = ref.block_index < len(table) and table[ref.block_index] != NULL_BLOCK
        if slot_ok and loadable(key):
            items.append(TransferItem(g, table[ref.block_index], key, ref.end))
    items.sort(key=lambda item: (item.end_token, item.group_idx))
    return tuple(items)


def restored_units(geometry: Geometry, start: int, end: int) -> list[UnitRef]:
    """The units a load from ``start`` to ``end`` restores, whatever the block table: per group
    the needed units (:meth:`Geometry.needed_units`) below its last unit end at or before
    ``end``, a mamba group only when that is ``end`` itself. Sorted by unit end, then group
    (head first). Pure."""
    refs: list[UnitRef] = []
    for g, kind in enumerate(geometry.kinds):
        u = geometry.planner.units[g]
        group_end = end - end % u
        if group_end <= start or (kind is GroupKind.MAMBA and group_end != end):
            continue
        refs.extend(geometry.needed_units(g, start, group_end))
    refs.sort(key=lambda ref: (ref.end, ref.group_idx))
    return refs


def segments(items: Sequence[TransferItem], align: int) -> list[tuple[TransferItem, ...]]:
    """Items split by alignment segment (``ceil(end_token / align)``), ascending, none empty.

    Pure. Pre: ``align >= 1`` (``ZeroDivisionError`` at 0). Post: every item in exactly one
    segment, in input order within it; empty ``items`` give no segment.
    """
    by_segment: dict[int, list[TransferItem]] = {}
    for item in items:
        by_segment.setdefault(-(-item.end_token // align), []).append(item)
    return [tuple(by_segment[s]) for s in sorted(by_segment)]


def resume_point(geometry: Geometry, block_hashes: Sequence[bytes], record: LoadRecord) -> int:
    """The largest position a partly failed load leaves every group valid at.

    Candidates are ``record.start`` and the aligned positions up to ``record.end``; a candidate
    above ``start`` is valid when every group's needed keys for it (mamba: the state exactly
    there) were loaded by jobs that succeeded. Without a failure this is ``record.end`` once
    every job reported. Pure.
    """
    align = geometry.align
    lowest = (record.start // align + 1) * align
    for point in range(record.end - record.end % align, lowest - 1, -align):
        needed = needed_keys(geometry, block_hashes, record.start, point)
        if all(key in record.good_keys for key in needed):
            return point
    return record.start
