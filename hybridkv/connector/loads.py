"""Load jobs of a claim, the record of a load, and where a partly failed load can resume.

The twin of ``spec.connector.loads`` (never imported here), which it must agree with item for
item: a claim from ``start`` to ``end`` loads, per group, the units it needs
(:meth:`ConnectorGeometry.first_needed`) into the request's real blocks, leaving out units whose
key is not loadable or whose table slot is null or missing (a mamba group only when ``end`` is
its unit end: MB-1). Items are sorted by ``end_token`` then group and split into one job per
alignment segment ``(a_{i-1}, a_i]``, so a failed job names the segment that failed and the
failure memory keeps only its keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from operator import attrgetter

from hybridkv.connector.api import BlockTable, JobId, TransferItem
from hybridkv.connector.geometry import ConnectorGeometry
from hybridkv.connector.requests import RequestKeys
from hybridkv.kinds import GroupKind

__all__ = ["LoadRecord", "claimed_keys", "load_items", "resume_point", "segments"]

_BY_END_THEN_GROUP = attrgetter("end_token", "group_idx")


class LoadRecord:
    """One load of a request: its claim, its jobs and what they reported (mutable, unlike the
    reference's frozen record: the core updates it in place as jobs report).

    Attributes: those of ``spec.connector.loads.LoadRecord``: ``start``, ``end``,
    ``num_tokens``, ``sync``, ``cache_salt``, ``items``, ``jobs``; ``reported``, ``failed``
    (job ids), ``good_keys`` (keys of jobs that succeeded), ``bad_blocks`` (destination blocks
    of jobs that failed).
    """

    __slots__ = (
        "bad_blocks",
        "cache_salt",
        "end",
        "failed",
        "good_keys",
        "items",
        "jobs",
        "num_tokens",
        "reported",
        "start",
        "sync",
    )

    def __init__(
        self,
        *,
        start: int,
        end: int,
        num_tokens: int,
        sync: bool,
        cache_salt: str | None,
        items: tuple[TransferItem, ...],
        jobs: tuple[JobId, ...],
    ) -> None:
        self.start, self.end, self.num_tokens = start, end, num_tokens
        self.sync, self.cache_salt = sync, cache_salt
        self.items, self.jobs = items, jobs
        self.reported: set[JobId] = set()
        self.failed: set[JobId] = set()
        self.good_keys: set[bytes] = set()
        self.bad_blocks: set[int] = set()

    @property
    def in_flight(self) -> bool:
        """Whether some job of the load has not reported yet."""
        return len(self.reported) < len(self.jobs)

    def job_failed(self, job_id: JobId, items: Sequence[TransferItem]) -> None:
        """Record that job ``job_id`` (with ``items``) failed: reported, failed, and its
        destination blocks bad."""
        self.reported.add(job_id)
        self.failed.add(job_id)
        self.bad_blocks.update(item.block_id for item in items)

    def jobs_succeeded(self, job_ids: Sequence[JobId], keys: Iterable[bytes]) -> None:
        """Record that the jobs ``job_ids``, whose items have ``keys``, all succeeded: reported,
        and their keys good."""
        self.reported.update(job_ids)
        self.good_keys.update(keys)


def load_items(
    geometry: ConnectorGeometry,
    keys: RequestKeys,
    block_ids: BlockTable,
    start: int,
    end: int,
    *,
    loadable: Callable[[list[bytes]], Sequence[bool]],
) -> tuple[TransferItem, ...]:
    """Items restoring every group at ``end`` from ``start``, into the request's real blocks.

    Agrees with ``spec.connector.loads.load_items`` (module docstring). ``loadable`` answers for
    a list of keys at once, one flag per key: it is asked once per load, for every unit with a
    real block (one pass over the store's states instead of a lookup per unit). Post: items
    sorted by ``end_token`` then group.
    """
    found: list[TransferItem] = []
    key_of = keys.key
    for g, units in _needed_units(geometry, start, end):
        u = geometry.units[g]
        table = block_ids[g] if g < len(block_ids) else ()
        per_block = geometry.blocks[g]
        for j in units:
            index = j * u // per_block
            if index < len(table) and table[index]:  # a null or missing slot: left out
                found.append(TransferItem(g, table[index], key_of(g, j), (j + 1) * u))
    if not found:
        return ()
    flags = loadable([item.key for item in found])
    # An unloadable key leaves its unit out (rare: the claim asked for READY keys).
    items = [item for item, ok in zip(found, flags, strict=True) if ok]
    items.sort(key=_BY_END_THEN_GROUP)
    return tuple(items)


def claimed_keys(
    geometry: ConnectorGeometry, keys: RequestKeys, start: int, end: int
) -> tuple[bytes, ...]:
    """The keys a load of the claim ``[start, end)`` reads, whatever their blocks: per group
    the units :func:`load_items` would restore (a mamba group only when ``end`` is its unit
    end), head first (by ``end_token``, then group), the order ``HostStore.refresh`` takes
    to leave the head the most recent. Pure but for the hash chain growing."""
    key_of = keys.key
    ranked = sorted(
        ((j + 1) * geometry.units[g], g, key_of(g, j))
        for g, units in _needed_units(geometry, start, end)
        for j in units
    )
    return tuple(key for _, _, key in ranked)


def _needed_units(geometry: ConnectorGeometry, start: int, end: int) -> Iterator[tuple[int, range]]:
    """Per group a load from ``start`` to ``end`` restores, the group and the indices of the
    units it needs (:meth:`ConnectorGeometry.first_needed`) below its last unit end at or
    before ``end``; a mamba group only when that is ``end`` itself (MB-1)."""
    for g, kind in enumerate(geometry.kinds):
        u = geometry.units[g]
        group_end = end - end % u
        if group_end <= start or (kind is GroupKind.MAMBA and group_end != end):
            continue
        yield g, range(geometry.first_needed(g, start, group_end), group_end // u)


def segments(items: Sequence[TransferItem], align: int) -> list[tuple[TransferItem, ...]]:
    """Items (sorted by end) split by alignment segment ``ceil(end_token / align)``, ascending,
    none empty."""
    parts: list[tuple[TransferItem, ...]] = []
    first, current = 0, None
    for i, item in enumerate(items):
        segment = -(-item.end_token // align)
        if segment != current:
            if i > first:
                parts.append(tuple(items[first:i]))
            first, current = i, segment
    if len(items) > first:
        parts.append(tuple(items[first:]))
    return parts


def resume_point(geometry: ConnectorGeometry, keys: RequestKeys, record: LoadRecord) -> int:
    """The largest aligned position up to ``record.end`` where every group's needed keys were
    loaded by jobs that succeeded; ``record.start`` when there is none.

    Agrees with ``spec.connector.loads.resume_point``. Pure.
    """
    align = geometry.align
    lowest = (record.start // align + 1) * align
    good = record.good_keys
    for point in range(record.end - record.end % align, lowest - 1, -align):
        if all(
            keys.key(g, j) in good
            for g in range(geometry.num_groups)
            for j in range(
                geometry.first_needed(g, record.start, point), point // geometry.units[g]
            )
        ):
            return point
    return record.start
