"""The copy planner as it was before vectorising (per-pair Python), kept as the oracle of a
differential test: the vectorised planner must return the same runs and refuse with the same
errors."""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.canonical import CanonicalCaches
from hybridkv.errors import HybridKVConfigError
from hybridkv.transfer.api import Direction, TransferPair
from hybridkv.transfer.plan import CopyRun


def reference_plan(
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
    # The hot path of every transfer: per-pair work is plain tuples and local lookups, runs
    # become CopyRuns only once merged (a job of thousands of small blocks is planned on the
    # submitting thread, ahead of its copies).
    per_group = [
        tuple(
            (ref.tensor_index, caches.tensors[ref.tensor_index].block_stride_bytes, runs)
            for ref in refs
            for runs in (ref.runs,)
        )
        for refs in caches.group_refs
    ]
    raw: list[tuple[int, int, int, int]] = []
    append = raw.append
    for group, block, slot in pairs:
        host = slot * slot_bytes
        for tensor, stride, runs in per_group[group]:
            row = block * stride
            for offset, length in runs:
                append((tensor, row + offset, host, length))
                host += length
    return _merge(raw)


def _merge(raw: list[tuple[int, int, int, int]]) -> list[CopyRun]:
    raw.sort()
    out: list[CopyRun] = []
    if not raw:
        return out
    tensor, dev, host, size = raw[0]
    for t, d, h, n in raw[1:]:
        if t == tensor and dev + size == d and host + size == h:
            size += n
            continue
        out.append(CopyRun(tensor, dev, host, size))
        tensor, dev, host, size = t, d, h, n
    out.append(CopyRun(tensor, dev, host, size))
    return out


def _check_pairs(
    caches: CanonicalCaches, num_slots: int, direction: Direction, pairs: Sequence[TransferPair]
) -> None:
    if not isinstance(direction, Direction):
        raise HybridKVConfigError(
            "direction", direction, "is not a Direction", "pass STORE or LOAD"
        )
    num_groups, num_blocks = len(caches.group_refs), caches.num_blocks
    # The destination must be written once: a store's slot, a load's block (a block id is
    # owned by one group at a time, and overlaid groups share bytes).
    dest_index = 2 if direction is Direction.STORE else 1
    seen: set[int] = set()
    for i, pair in enumerate(pairs):
        # Fast path: a well-formed triple of plain ints in range (``type(x) is int`` also
        # rejects bools); anything else is diagnosed by the slow path below.
        if (
            type(pair) is TransferPair
            and type(pair[0]) is int
            and type(pair[1]) is int
            and type(pair[2]) is int
            and 0 <= pair[0] < num_groups
            and 0 <= pair[1] < num_blocks
            and 0 <= pair[2] < num_slots
        ):
            dest = pair[dest_index]
            if dest not in seen:
                seen.add(dest)
                continue
        _refuse_pair(caches, num_slots, direction, index=i, pair=pair, seen=seen)


def _refuse_pair(
    caches: CanonicalCaches,
    num_slots: int,
    direction: Direction,
    *,
    index: int,
    pair: object,
    seen: set[int],
) -> None:
    """Raise the error that names what is wrong with ``pairs[i]`` (or accept it: a valid
    triple that is not a TransferPair)."""
    i = index
    if not isinstance(pair, tuple) or len(pair) != 3:
        raise HybridKVConfigError(
            f"pairs[{i}]", pair, "is not a (group, block, slot) triple", "pass TransferPairs"
        )
    limits = (("group", len(caches.group_refs)), ("block", caches.num_blocks), ("slot", num_slots))
    for (name, limit), value in zip(limits, pair, strict=True):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
            raise HybridKVConfigError(
                f"pairs[{i}].{name}",
                value,
                f"is outside 0..{limit - 1}",
                f"name a {name} that exists (the cache has {caches.num_blocks} blocks, "
                f"host memory {num_slots} slots)",
            )
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
