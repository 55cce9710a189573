"""CUDA transfer engine throughput vs one pinned cudaMemcpy of the same bytes, side by side.

For each block size (16 KB to 2 MB), one cache of flat pages on the GPU is stored to pinned
(registered) host slots and loaded back, ``scattered`` (a random slot per block: coalescing
cannot help) and ``contiguous`` (coalesced into one copy), as one job each, through every copy
method: batched DMA (cuMemcpyBatchAsync), DMA run by run (cudaMemcpyAsync per run), index
kernels over mapped host memory, and the engine's AUTO choice; AUTO also with the scattered
blocks split into 8 jobs in flight at once (the steady state of a serving loop, where planning
one job overlaps the copies of the previous ones). The reference is one
``copy_(non_blocking=True)`` of the same total bytes between the GPU and pinned host memory.
``submit us/blk`` is the host time of ``submit`` alone per block (planning and issuing).
Goal: >= 0.90 of the single-copy rate at 2 MB blocks and >= 0.70 at 32 KB.
Exits with status 2 and a message when no CUDA device is visible.
Usage: ``python tools/bench_gpu_transfer.py [--quick] [--total-mb N] [--repeats N]``.
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import time
from collections.abc import Callable

import torch

from hybridkv.canonical import CacheGroupSpec, CanonicalCaches, build_canonical_caches
from hybridkv.hostmem import HostMemory, PinMode
from hybridkv.kinds import GroupKind
from hybridkv.transfer import Direction, TransferPair
from hybridkv.transfer.cuda_engine import BatchMode, CopyMethod, CudaTransferEngine

SIZES_KB = (16, 32, 64, 256, 1024, 2048)
HEADERS = (
    "store GB/s",
    "load GB/s",
    "d2h GB/s",
    "h2d GB/s",
    "store/copy",
    "load/copy",
    "submit us/blk",
)


def _best(repeats: int, fn: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


WAYS = (
    ("batched DMA", BatchMode.AUTO, CopyMethod.DMA),
    ("per-run DMA", BatchMode.OFF, CopyMethod.DMA),
    ("kernel", BatchMode.AUTO, CopyMethod.KERNEL),
    ("auto", BatchMode.AUTO, CopyMethod.AUTO),
)
IN_FLIGHT = 8


def _job(
    engine: CudaTransferEngine, direction: Direction, pairs: list[TransferPair], jobs: int = 1
) -> None:
    """Submit ``pairs`` as ``jobs`` jobs back to back, then wait for all of them."""
    step = -(-len(pairs) // jobs)
    ids = [engine.submit(direction, pairs[i : i + step]) for i in range(0, len(pairs), step)]
    engine.wait(ids)
    if not all(r.success for r in engine.poll()):
        raise SystemExit("a transfer job failed")


def _measure(
    engine: CudaTransferEngine,
    label: str,
    pairs: list[TransferPair],
    *,
    jobs: int,
    repeats: int,
    reference: tuple[float, float],
) -> None:
    _job(engine, Direction.STORE, pairs, jobs)  # warm up
    gb = len(pairs) * engine_block_bytes(engine) / 1e9
    st = gb / _best(repeats, functools.partial(_job, engine, Direction.STORE, pairs, jobs))
    ld = gb / _best(repeats, functools.partial(_job, engine, Direction.LOAD, pairs, jobs))
    cpu = _submit_us(engine, pairs, repeats)
    d2h, h2d = reference
    _row(label, (st, ld, d2h, h2d, st / d2h, ld / h2d, cpu))


def engine_block_bytes(engine: CudaTransferEngine) -> int:
    """Bytes one block of group 0 moves (the benchmark's caches have one group)."""
    return engine.caches.group_bytes(0)


def _submit_us(engine: CudaTransferEngine, pairs: list[TransferPair], repeats: int) -> float:
    """Host time of ``submit`` alone (planning and issuing), best of ``repeats``, per block:
    the part of a job's time the copy engines cannot overlap."""
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        job = engine.submit(Direction.STORE, pairs)
        best = min(best, time.perf_counter() - start)
        engine.wait([job])
        engine.poll()
    return best / len(pairs) * 1e6


def _flat(num_blocks: int, block: int) -> CanonicalCaches:
    t = torch.randint(-128, 127, (num_blocks, block), dtype=torch.int8, device="cuda")
    spec = CacheGroupSpec(GroupKind.FULL, 16, block, block, ("flat",))
    return build_canonical_caches({"flat": t}, [spec], num_blocks)


def _reference(nbytes: int, repeats: int) -> tuple[float, float]:
    dev = torch.empty(nbytes, dtype=torch.int8, device="cuda")
    host = HostMemory(nbytes, nbytes, PinMode.REQUIRED)
    h = host.tensor.view(torch.int8)
    d2h = _best(repeats, lambda: h.copy_(dev, non_blocking=True))
    h2d = _best(repeats, lambda: dev.copy_(h, non_blocking=True))
    host.close()
    return nbytes / 1e9 / d2h, nbytes / 1e9 / h2d


def _row(name: str, values: tuple[float, ...]) -> None:
    print(f"{name:<40}" + "".join(f"{v:>14.2f}" for v in values))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 MB per row, 3 repeats")
    parser.add_argument("--total-mb", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "bench_gpu_transfer: no CUDA device visible to torch; run it on a GPU machine "
            "with a CUDA build of torch (`nox -s gpu`)",
            file=sys.stderr,
        )
        return 2
    total = (128 if args.quick else args.total_mb) << 20
    repeats = 3 if args.quick else args.repeats
    print(
        f"CUDA transfer engine vs one pinned copy on {torch.cuda.get_device_name()}, "
        f"{total >> 20} MB per row, best of {repeats}"
    )
    d2h, h2d = _reference(total, repeats)
    ref = (d2h, h2d)
    print(f"{'row':<40}" + "".join(f"{h:>14}" for h in HEADERS))
    for kb in SIZES_KB:
        block = kb << 10
        n = max(2, total // block)
        cc = _flat(n, block)
        host = HostMemory(n * block, block, PinMode.REQUIRED)
        slots = random.Random(kb).sample(range(n), n)
        patterns = {
            "scattered": [TransferPair(0, b, slots[b]) for b in range(n)],
            "contiguous": [TransferPair(0, b, b) for b in range(n)],
        }
        for way, batch, method in WAYS:
            with CudaTransferEngine(cc, host, batch, method=method) as engine:
                name = way
                if method is CopyMethod.DMA and batch is BatchMode.AUTO and not engine.uses_batch:
                    name = "per-run DMA (no batch API)"
                for pattern, pairs in patterns.items():
                    if name.startswith("per-run") and pattern == "contiguous":
                        continue  # one run either way: the batched row shows it
                    label = f"{kb} KB {pattern} {name}"
                    _measure(engine, label, pairs, jobs=1, repeats=repeats, reference=ref)
                if method is CopyMethod.AUTO:
                    # Steady state: several jobs in flight, planning overlaps earlier copies.
                    label = f"{kb} KB scattered {name}, {IN_FLIGHT} jobs"
                    pairs = patterns["scattered"]
                    _measure(engine, label, pairs, jobs=IN_FLIGHT, repeats=repeats, reference=ref)
        host.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
