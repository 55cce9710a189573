"""The index-kernel copy path on CPU tensors (:class:`hybridkv.transfer.cuda_kernels.
IndexCopier`): the CUDA engine's kernel copies run this same code over mapped host memory, so
CI covers their chunking and scratch use without a GPU (tests/gpu runs it on CUDA).

- Byte-exact against the CPU engine on every layout, with scratch of exactly one row per
  direction (every row its own chunk) and with the default scratch (one chunk).
- The scratch is allocated once, when the copier is built, and a copy allocates no buffer of
  its rows' size (torch's profiler on CPU; the old path allocated every chunk's gather).
- Scratch too small for one row, or not an int, is refused naming ``gpu_scratch_bytes``.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from layout_oracle import fill_random, storages
from torch.profiler import ProfilerActivity, profile

from hybridkv.cache_layouts import LayoutCase, all_layout_cases
from hybridkv.canonical import CacheGroupSpec, CanonicalCaches, build_canonical_caches
from hybridkv.errors import HybridKVConfigError
from hybridkv.hostmem import HostMemory, PinMode
from hybridkv.kinds import GroupKind
from hybridkv.transfer import (
    CpuTransferEngine,
    Direction,
    FinishedJob,
    TransferEngine,
    TransferPair,
)
from hybridkv.transfer.cuda_kernels import DEFAULT_SCRATCH_BYTES, IndexCopier
from hybridkv.transfer.plan import CopyPlanner

NUM_BLOCKS = 6
CASES = all_layout_cases(NUM_BLOCKS)


def _setup(case: LayoutCase) -> tuple[CanonicalCaches, HostMemory]:
    cc = build_canonical_caches(case.kv_caches, case.groups, case.num_blocks)
    slot = max(cc.group_bytes(g) for g in range(len(case.groups)))
    return cc, HostMemory(8 * slot, slot, PinMode.OFF)


def _widest_row(cc: CanonicalCaches) -> int:
    return max(n for refs in cc.group_refs for ref in refs for _, n in ref.runs)


def _copy(copier: IndexCopier, planner: CopyPlanner, d: Direction, pairs: list[Any]) -> None:
    copier.copy(d, planner.validated(d, pairs))


def _engine_run(engine: TransferEngine, d: Direction, pairs: list[TransferPair]) -> None:
    job = engine.submit(d, pairs)
    engine.wait([job])
    assert engine.poll() == [FinishedJob(job, True)]


@pytest.mark.parametrize("scratch", ["one_row", "default"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_index_copies_move_the_cpu_engines_bytes(case: LayoutCase, scratch: str) -> None:
    cc, host = _setup(case)
    size = 2 * _widest_row(cc) if scratch == "one_row" else DEFAULT_SCRATCH_BYTES
    copier = IndexCopier(cc, host, host.tensor, size)
    assert copier.scratch_bytes == size
    planner = CopyPlanner(cc, host.num_slots, host.slot_bytes)
    reference = HostMemory(host.nbytes, host.slot_bytes, PinMode.OFF)
    rng = random.Random(3)
    with CpuTransferEngine(cc, reference) as engine:
        for g in range(len(case.groups)):
            fill_random(case, seed=10 + g)
            slots = rng.sample(range(host.num_slots), NUM_BLOCKS)
            pairs = [TransferPair(g, b, slots[b]) for b in rng.sample(range(NUM_BLOCKS), 4)]
            _copy(copier, planner, Direction.STORE, pairs)
            _engine_run(engine, Direction.STORE, pairs)
            for p in pairs:
                width = cc.group_bytes(g)
                assert torch.equal(host.slot(p.slot)[:width], reference.slot(p.slot)[:width])
            for s in storages(case):
                s.zero_()
            back = [TransferPair(g, p.block, p.slot) for p in pairs]
            _copy(copier, planner, Direction.LOAD, back)
            mine = [s.clone() for s in storages(case)]
            for s in storages(case):
                s.zero_()
            _engine_run(engine, Direction.LOAD, back)
            for ours, theirs in zip(mine, storages(case), strict=True):
                assert torch.equal(ours, theirs)  # the same bytes where the engine wrote
            assert any(bool(o.any()) for o in mine)  # and it wrote some


def _flat(num_blocks: int, page: int) -> CanonicalCaches:
    t = torch.randint(-128, 127, (num_blocks, page), dtype=torch.int8)
    spec = CacheGroupSpec(GroupKind.FULL, 16, page, page, ("flat",))
    return build_canonical_caches({"flat": t}, [spec], num_blocks)


def _allocated_during(fn: Any) -> int:
    """Bytes torch allocated on CPU while ``fn`` ran (its profiler's memory events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(0, e.cpu_memory_usage) for e in prof.events())


def test_scratch_is_allocated_once_and_a_copy_allocates_no_rows() -> None:
    page, blocks = 4096, 64
    cc = _flat(blocks, page)
    host = HostMemory(blocks * page, page, PinMode.OFF)
    planner = CopyPlanner(cc, host.num_slots, host.slot_bytes)
    made = _allocated_during(lambda: IndexCopier(cc, host, host.tensor, 8 * page))
    assert made >= 8 * page  # the scratch, both halves, at construction
    copier = IndexCopier(cc, host, host.tensor, 8 * page)
    assert copier.rows_per_chunk(page) == 4
    slots = random.Random(5).sample(range(blocks), blocks)
    table = planner.validated(
        Direction.STORE, [TransferPair(0, b, slots[b]) for b in range(blocks)]
    )
    used = _allocated_during(lambda: copier.copy(Direction.STORE, table))
    # 16 chunks of 4 rows went through the scratch: what the copy allocated is its index
    # tensors (8 bytes per pair each), nowhere near one chunk of rows (16 KiB), let alone the
    # job (256 KiB) that the old path gathered chunk by chunk into fresh tensors.
    assert used < 4 * page, used
    rows = host.tensor.view(torch.int8).view(blocks, page)
    assert torch.equal(rows[torch.tensor(slots)], cc.tensors[0].flat.view(blocks, page))
    # The old path's allocation, measured the same way, for scale.
    src, idx = cc.tensors[0].flat.view(blocks, page), torch.arange(4)
    assert _allocated_during(lambda: src.index_select(0, idx)) >= 4 * page


@pytest.mark.parametrize("size", [0, 1, "64MiB", True])
def test_scratch_too_small_for_one_row_is_refused_naming_the_setting(size: object) -> None:
    cc, host = _setup(CASES[0])
    with pytest.raises(HybridKVConfigError) as caught:
        IndexCopier(cc, host, host.tensor, size)  # type: ignore[arg-type]
    assert caught.value.field == "gpu_scratch_bytes"
    assert str(2 * _widest_row(cc)) in str(caught.value)
    IndexCopier(cc, host, host.tensor, 2 * _widest_row(cc))  # the smallest accepted
