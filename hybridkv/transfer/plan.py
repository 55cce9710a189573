"""A job's copy plan: validated pairs turned into coalesced (device, host) byte runs, as arrays.

Both engines build their plans here, so they validate and coalesce identically. A run names a
canonical tensor and byte offsets into its ``flat`` view and into host memory. Planning is
vectorised with torch (no Python per block): the pairs become one int64 tensor, every group's
runs are a template broadcast over its pairs, and adjacent runs merge by a sort and a
cumulative sum. Only a refused job walks its pairs in Python, to name the first bad one.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from hybridkv.canonical import CanonicalCaches
from hybridkv.errors import HybridKVConfigError
from hybridkv.transfer.api import Direction, TransferPair

__all__ = [
    "CopyPlan",
    "CopyPlanner",
    "CopyRun",
    "check_fits",
    "coalesce",
    "plan_copies",
    "take",
]

_I64 = torch.int64


class CopyRun(NamedTuple):
    """``nbytes`` bytes at ``device_offset`` of tensor ``tensor``'s flat view and at
    ``host_offset`` of host memory."""

    tensor: int
    device_offset: int
    host_offset: int
    nbytes: int


@dataclass(frozen=True, slots=True, eq=False)
class CopyPlan:
    """A job's runs as four parallel int64 CPU tensors, sorted by (tensor, device offset)."""

    tensor: torch.Tensor
    device_offset: torch.Tensor
    host_offset: torch.Tensor
    nbytes: torch.Tensor

    def __len__(self) -> int:
        return int(self.nbytes.numel())

    def runs(self) -> list[CopyRun]:
        """The runs as tuples (for run-by-run copies and tests)."""
        cols = torch.stack((self.tensor, self.device_offset, self.host_offset, self.nbytes))
        return [CopyRun(*row) for row in cols.t().tolist()]


class _Template(NamedTuple):
    """One block of one group: its runs' tensor, offset in the row, offset in the slot, size
    and the tensor's block stride, each an int64 tensor of the group's run count."""

    tensor: torch.Tensor
    row_offset: torch.Tensor
    slot_offset: torch.Tensor
    nbytes: torch.Tensor
    stride: torch.Tensor


def check_fits(caches: CanonicalCaches, slot_bytes: int) -> None:
    """Refuse host slots too small for one block of some group (at engine construction)."""
    for g in range(len(caches.group_refs)):
        need = caches.group_bytes(g)
        if need > slot_bytes:
            raise HybridKVConfigError(
                "slot_bytes",
                slot_bytes,
                f"is smaller than one block of group {g} ({need} bytes)",
                "size host slots for the largest group (max of CanonicalCaches.group_bytes)",
            )


class CopyPlanner:
    """Plans jobs over one set of caches and one host memory (built once per engine).

    ``host_region_bytes``: host memory is pinned in separate registrations of this many bytes
    (the last may be shorter); a merged run never crosses from one into the next. None: one
    region. ``scalar_runs``: jobs of at most this many pairs are validated, and of at most this
    many uncoalesced runs merged, by a plain loop, because each torch call costs microseconds:
    a vectorised plan of a few runs (about 30 calls, 90 us) is ten times slower than the loop.
    0 vectorises every job.
    """

    def __init__(
        self,
        caches: CanonicalCaches,
        num_slots: int,
        slot_bytes: int,
        host_region_bytes: int | None = None,
        scalar_runs: int = 128,
    ) -> None:
        self._caches = caches
        self._scalar_runs = scalar_runs
        self._num_slots = num_slots
        self._slot_bytes = slot_bytes
        self._region = host_region_bytes
        self._limits = torch.tensor(
            [len(caches.group_refs), caches.num_blocks, num_slots], dtype=_I64
        )
        self._templates = [_template(caches, g) for g in range(len(caches.group_refs))]
        self._scalar_templates = [
            [tuple(int(x) for x in row) for row in torch.stack(tpl[:4], 1).tolist()]
            for tpl in self._templates
        ]
        self._max_template = max((len(t) for t in self._scalar_templates), default=0)
        # A run's sort key is its byte address in one line of all tensors laid end to end.
        sizes = [t.flat.numel() for t in caches.tensors]
        self._tensor_base = torch.tensor([0, *itertools.accumulate(sizes)][:-1], dtype=_I64)

    def plan(self, direction: Direction, pairs: Sequence[TransferPair]) -> CopyPlan:
        """Validate ``pairs`` and return the job's coalesced copy runs.

        Pre: none (everything is checked). Post: the runs cover exactly the bytes of the named
        blocks of the named groups and of the slots' first ``group_bytes`` bytes, destinations
        are pairwise disjoint, no run crosses a host region boundary. Frame: a refused call
        (HybridKVConfigError) returns nothing.
        """
        return self.coalesced(self.validated(direction, pairs))

    def coalesced(self, table: torch.Tensor) -> CopyPlan:
        """The coalesced runs of a table :meth:`validated` returned."""
        if table.shape[0] * self._max_template <= self._scalar_runs:
            return self._merge_scalar(table.tolist())
        return self._merge(self._expand(table))

    def _merge_scalar(self, rows: list[list[int]]) -> CopyPlan:
        """:meth:`_merge` over :meth:`_expand` for a few runs, as a loop (same result)."""
        raw: list[tuple[int, int, int, int]] = []
        slot_bytes, region = self._slot_bytes, self._region
        for group, block, slot in rows:
            host = slot * slot_bytes
            for tensor, row_offset, slot_offset, nbytes in self._scalar_templates[group]:
                stride = self._caches.tensors[tensor].block_stride_bytes
                raw.append((tensor, block * stride + row_offset, host + slot_offset, nbytes))
        raw.sort()
        out: list[list[int]] = []
        for t, d, h, n in raw:
            if out:
                last = out[-1]
                joins = last[0] == t and last[1] + last[3] == d and last[2] + last[3] == h
                if joins and (region is None or h % region != 0):
                    last[3] += n
                    continue
            out.append([t, d, h, n])
        cols = torch.tensor(out, dtype=_I64).reshape(-1, 4).t()
        return CopyPlan(cols[0], cols[1], cols[2], cols[3])

    def validated(self, direction: Direction, pairs: Sequence[TransferPair]) -> torch.Tensor:
        """The pairs as an (n, 3) int64 tensor of (group, block, slot) rows, or the error
        naming the first bad pair (HybridKVConfigError)."""
        if not isinstance(direction, Direction):
            raise HybridKVConfigError(
                "direction", direction, "is not a Direction", "pass STORE or LOAD"
            )
        if len(pairs) > self._scalar_runs:
            table = _as_table(pairs)
            if table is not None and self._all_valid(direction, table):
                return table
        # A short job, or some pair is malformed, out of range or a repeated destination (or
        # merely not a TransferPair): the sequential check raises the exact error, or accepts.
        _check_pairs(self._caches, self._num_slots, direction, pairs)
        return torch.tensor([tuple(p) for p in pairs], dtype=_I64).reshape(-1, 3)

    def _all_valid(self, direction: Direction, table: torch.Tensor) -> bool:
        if not bool(((table >= 0) & (table < self._limits)).all()):
            return False
        # The destination must be written once: a store's slot, a load's block (a block id is
        # owned by one group at a time, and overlaid groups share bytes).
        dest = table[:, 2 if direction is Direction.STORE else 1]
        # In range (checked above), so counting per value is cheap and needs no sort.
        return dest.numel() == 0 or int(torch.bincount(dest).max()) <= 1

    def _expand(self, table: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every run of every pair, uncoalesced: (tensor, device offset, host offset, size)."""
        parts: list[tuple[torch.Tensor, ...]] = []
        groups = table[:, 0]
        only = int(groups[0]) if table.shape[0] and bool((groups == groups[0]).all()) else None
        for g, tpl in enumerate(self._templates):
            if only is not None and g != only:
                continue
            rows = table if only is not None else _take(table, (groups == g).nonzero()[:, 0])
            if rows.shape[0] == 0 or tpl.nbytes.numel() == 0:
                continue
            block, slot = rows[:, 1:2], rows[:, 2:3]
            shape = (rows.shape[0], tpl.nbytes.numel())
            parts.append(
                (
                    tpl.tensor.expand(shape).reshape(-1),
                    (block * tpl.stride + tpl.row_offset).reshape(-1),
                    (slot * self._slot_bytes + tpl.slot_offset).reshape(-1),
                    tpl.nbytes.expand(shape).reshape(-1),
                )
            )
        if not parts:
            empty = torch.empty(0, dtype=_I64)
            return empty, empty, empty, empty
        if len(parts) == 1:
            return parts[0]
        return tuple(torch.cat(cols) for cols in zip(*parts, strict=True))

    def _merge(self, cols: tuple[torch.Tensor, ...]) -> CopyPlan:
        return _merge(self._tensor_base, self._region, cols)


def plan_copies(
    caches: CanonicalCaches,
    num_slots: int,
    slot_bytes: int,
    direction: Direction,
    pairs: Sequence[TransferPair],
) -> list[CopyRun]:
    """Validate ``pairs`` and return the job's coalesced copy runs as tuples (one region)."""
    return CopyPlanner(caches, num_slots, slot_bytes).plan(direction, pairs).runs()


def coalesce(runs: Sequence[CopyRun]) -> list[CopyRun]:
    """Merge runs that continue each other on both sides into maximal runs (one region)."""
    cols = torch.tensor([tuple(r) for r in runs], dtype=_I64).reshape(-1, 4).t()
    if cols.shape[1] == 0:
        return []
    # Each tensor gets a span past every offset named, so one key orders (tensor, offset).
    span = int((cols[1] + cols[3]).max()) + 1
    bases = torch.arange(int(cols[0].max()) + 1, dtype=_I64) * span
    return _merge(bases, None, tuple(cols)).runs()


def _merge(
    tensor_base: torch.Tensor, region: int | None, cols: tuple[torch.Tensor, ...]
) -> CopyPlan:
    """Merge runs that continue each other on both sides into maximal runs.

    Runs are sorted by (tensor, device offset, host offset) first: a job's copies are
    independent (their destinations are disjoint), so their order is free, and sorting finds
    every merge. ``cols`` are (tensor, device offset, host offset, size); ``tensor_base`` lays
    the tensors end to end so one key orders (tensor, offset); a run starting at a multiple of
    ``region`` host bytes starts a new run.
    """
    tensor, dev, host, size = cols
    if dev.numel() == 0:
        return CopyPlan(tensor, dev, host, size)
    order = torch.argsort(host, stable=True)
    key = _take(_take(tensor_base, tensor) + dev, order)
    order = _take(order, torch.argsort(key, stable=True))
    tensor, dev, host, size = (_take(c, order) for c in (tensor, dev, host, size))
    joins = (
        (tensor[1:] == tensor[:-1])
        & (dev[:-1] + size[:-1] == dev[1:])
        & (host[:-1] + size[:-1] == host[1:])
    )
    if region is not None:
        joins &= host[1:] % region != 0
    starts = torch.cat((torch.ones(1, dtype=torch.bool), ~joins)).nonzero().reshape(-1)
    ends = torch.cat((starts[1:], torch.tensor([dev.numel()], dtype=_I64)))
    total = torch.cat((torch.zeros(1, dtype=_I64), size.cumsum(0)))
    return CopyPlan(
        _take(tensor, starts),
        _take(dev, starts),
        _take(host, starts),
        _take(total, ends) - _take(total, starts),
    )


def take(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[index]`` along the first dimension, by ``index_select``.

    Advanced indexing (``values[index]``) runs its loop on torch's intra-op threads: on a
    busy 2-core machine with a second thread of this process alive, one gather of 8,192
    elements took 15.8 ms that way and 0.03 ms by ``index_select`` (a whole plan: 110 ms
    against 2).
    """
    return torch.index_select(values, 0, index)


_take = take


def _template(caches: CanonicalCaches, group: int) -> _Template:
    cols: list[tuple[int, int, int, int, int]] = []
    slot_offset = 0
    for ref in caches.group_refs[group]:
        stride = caches.tensors[ref.tensor_index].block_stride_bytes
        for run in ref.runs:
            cols.append((ref.tensor_index, run.offset, slot_offset, run.length, stride))
            slot_offset += run.length
    t = torch.tensor(cols, dtype=_I64).reshape(-1, 5).t()
    return _Template(t[0], t[1], t[2], t[3], t[4])


def _as_table(pairs: Sequence[TransferPair]) -> torch.Tensor | None:
    """The pairs as an (n, 3) int64 tensor when every one is a TransferPair of plain ints (no
    bools, no floats; checked at C speed), else None."""
    if len(pairs) == 0:
        return torch.empty((0, 3), dtype=_I64)
    if set(map(type, pairs)) != {TransferPair}:
        return None
    flat = list(itertools.chain.from_iterable(pairs))  # walked twice below: a list is fastest
    if set(map(type, flat)) != {int}:
        return None
    try:
        packed = array.array("q", flat)
    except OverflowError:
        return None
    return torch.frombuffer(packed, dtype=_I64).reshape(-1, 3)


def _check_pairs(
    caches: CanonicalCaches, num_slots: int, direction: Direction, pairs: Sequence[TransferPair]
) -> None:
    """Walk the pairs in order and raise the error naming the first bad one."""
    limits = (("group", len(caches.group_refs)), ("block", caches.num_blocks), ("slot", num_slots))
    dest_index = 2 if direction is Direction.STORE else 1
    seen: set[int] = set()
    for i, pair in enumerate(pairs):
        if not isinstance(pair, tuple) or len(pair) != 3:
            raise HybridKVConfigError(
                f"pairs[{i}]", pair, "is not a (group, block, slot) triple", "pass TransferPairs"
            )
        for (name, limit), value in zip(limits, pair, strict=True):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
                raise HybridKVConfigError(
                    f"pairs[{i}].{name}",
                    value,
                    f"is outside 0..{limit - 1}",
                    f"name a {name} that exists (the cache has {caches.num_blocks} blocks, "
                    f"host memory {num_slots} slots)",
                )
        dest = pair[dest_index]
        if dest in seen:
            what = "slot" if direction is Direction.STORE else "block"
            raise HybridKVConfigError(
                f"pairs[{i}].{what}",
                dest,
                f"is a destination twice in one {direction.value}",
                "write each destination once per job",
            )
        seen.add(dest)
