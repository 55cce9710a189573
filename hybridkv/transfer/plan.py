"""A job's copy plan: validated pairs turned into coalesced (device, host) byte runs.

Both engines build their plans here, so they validate and coalesce identically. A run names a
canonical tensor and byte offsets into its ``flat`` view and into host memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from hybridkv.canonical import CanonicalCaches
from hybridkv.errors import HybridKVConfigError
from hybridkv.transfer.api import Direction, TransferPair

__all__ = ["CopyRun", "check_fits", "coalesce", "plan_copies"]


class CopyRun(NamedTuple):
    """``nbytes`` bytes at ``device_offset`` of tensor ``tensor``'s flat view and at
    ``host_offset`` of host memory."""

    tensor: int
    device_offset: int
    host_offset: int
    nbytes: int


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


def plan_copies(
    caches: CanonicalCaches,
    num_slots: int,
    slot_bytes: int,
    direction: Direction,
    pairs: Sequence[TransferPair],
) -> list[CopyRun]:
    """Validate ``pairs`` and return the job's coalesced copy runs.

    Pre: none (everything is checked). Post: the runs cover exactly the bytes of the named
    blocks of the named groups and of the slots' first ``group_bytes`` bytes, destinations are
    pairwise disjoint. Frame: a refused call (HybridKVConfigError) returns nothing.
    """
    _check_pairs(caches, num_slots, direction, pairs)
    runs: list[CopyRun] = []
    for group, block, slot in pairs:
        host = slot * slot_bytes
        for ref in caches.group_refs[group]:
            row = block * caches.tensors[ref.tensor_index].block_stride_bytes
            for offset, length in ref.runs:
                runs.append(CopyRun(ref.tensor_index, row + offset, host, length))
                host += length
    return coalesce(runs)


def coalesce(runs: Sequence[CopyRun]) -> list[CopyRun]:
    """Merge runs that continue each other on both sides into maximal runs.

    Runs are sorted by (tensor, device offset) first: a job's copies are independent (their
    destinations are disjoint), so their order is free, and sorting finds every merge.
    """
    out: list[CopyRun] = []
    for r in sorted(runs):
        if out:
            last = out[-1]
            if (
                last.tensor == r.tensor
                and last.device_offset + last.nbytes == r.device_offset
                and last.host_offset + last.nbytes == r.host_offset
            ):
                out[-1] = last._replace(nbytes=last.nbytes + r.nbytes)
                continue
        out.append(r)
    return out


def _check_pairs(
    caches: CanonicalCaches, num_slots: int, direction: Direction, pairs: Sequence[TransferPair]
) -> None:
    if not isinstance(direction, Direction):
        raise HybridKVConfigError(
            "direction", direction, "is not a Direction", "pass STORE or LOAD"
        )
    limits = (("group", len(caches.group_refs)), ("block", caches.num_blocks), ("slot", num_slots))
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
        # The destination must be written once: a store's slot, a load's block (a block id is
        # owned by one group at a time, and overlaid groups share bytes).
        dest = pair[2] if direction is Direction.STORE else pair[1]
        if dest in seen:
            what = "slot" if direction is Direction.STORE else "block"
            raise HybridKVConfigError(
                f"pairs[{i}].{what}",
                dest,
                f"is a destination twice in one {direction.value}",
                "write each destination once per job",
            )
        seen.add(dest)
