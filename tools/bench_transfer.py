"""CPU transfer engine throughput vs one large torch copy of the same bytes, side by side.

For each block size (16 KB to 2 MB) one cache of flat pages is stored to host slots and loaded
back, in two patterns: ``contiguous`` (block i <-> slot i, which coalescing turns into one copy)
and ``scattered`` (a random slot per block: one copy per block). A ``hybrid`` row moves an
attention group (split K/V, 4 layers) and a mamba group (conv + ssm in padded pages, 4 layers)
in one job each. Every ratio is engine GB/s over the GB/s of ``dst.copy_(src)`` of the same
total bytes, measured in the same run (best of ``--repeats``). Content is checked once.
Usage: ``python tools/bench_transfer.py [--quick] [--total-mb N] [--repeats N] [--plot F.png]``
(``--plot`` draws GB/s against block size; it needs matplotlib).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch

from hybridkv.cache_layouts import mamba_states
from hybridkv.canonical import CacheGroupSpec, CanonicalCaches, build_canonical_caches
from hybridkv.hostmem import HostMemory, PinMode
from hybridkv.kinds import GroupKind
from hybridkv.transfer import CpuTransferEngine, Direction, TransferPair

SIZES_KB = (16, 32, 64, 256, 1024, 2048)


def _best(repeats: int, fn: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _run_job(engine: CpuTransferEngine, direction: Direction, pairs: list[TransferPair]) -> None:
    job = engine.submit(direction, pairs)
    engine.wait([job])
    assert all(r.success for r in engine.poll())


def _flat(num_blocks: int, block: int) -> CanonicalCaches:
    t = torch.randint(-128, 127, (num_blocks, block), dtype=torch.int8)
    spec = CacheGroupSpec(GroupKind.FULL, 16, block, block, ("flat",))
    return build_canonical_caches({"flat": t}, [spec], num_blocks)


def _hybrid(num_blocks: int) -> tuple[CanonicalCaches, list[TransferPair]]:
    """4 attention layers (2, B, 16, 8, 128) bf16 and 4 mamba layers in 160 KB padded pages."""
    caches: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = {}
    for i in range(4):
        caches[f"attn.{i}"] = torch.randn(2, num_blocks, 16, 8, 128).to(torch.bfloat16)
        raw = torch.randint(-128, 127, (num_blocks * 163840,), dtype=torch.int8)
        conv, ssm = ((3, 4096), torch.bfloat16), ((8, 64, 64), torch.float32)
        caches[f"gdn.{i}"] = mamba_states(raw, num_blocks, 163840, conv, ssm)
    attn_real = 2 * 16 * 8 * 128 * 2
    mamba_real = 2 * 3 * 4096 + 4 * 8 * 64 * 64
    groups = [
        CacheGroupSpec(
            GroupKind.FULL, 16, attn_real, attn_real, tuple(f"attn.{i}" for i in range(4))
        ),
        CacheGroupSpec(
            GroupKind.MAMBA, 16, 163840, mamba_real, tuple(f"gdn.{i}" for i in range(4))
        ),
    ]
    cc = build_canonical_caches(caches, groups, num_blocks)
    slots = random.Random(0).sample(range(num_blocks), num_blocks)
    half = num_blocks // 2
    pairs = [TransferPair(0, b, slots[b]) for b in range(half)]
    pairs += [TransferPair(1, b, slots[b]) for b in range(half, num_blocks)]
    return cc, pairs


def _measure(
    cc: CanonicalCaches, pairs: list[TransferPair], slot: int, repeats: int
) -> tuple[float, float, float]:
    """(store GB/s, load GB/s, single-copy GB/s) for one job of ``pairs``."""
    host = HostMemory(cc.num_blocks * slot, slot, PinMode.OFF)
    moved = sum(cc.group_bytes(p.group) for p in pairs)
    src = torch.randint(-128, 127, (moved,), dtype=torch.int8)
    dst = torch.empty_like(src)
    with CpuTransferEngine(cc, host) as engine:
        _run_job(engine, Direction.STORE, pairs)  # warm up, and check content once
        p = pairs[0]
        ref = cc.group_refs[p.group][0]
        row = cc.tensors[ref.tensor_index].view[p.block]
        n = ref.runs[0].length
        got = host.slot(p.slot)[:n].view(torch.int8)
        assert torch.equal(got, row[ref.runs[0].offset : ref.runs[0].offset + n]), "bad content"
        store = _best(repeats, lambda: _run_job(engine, Direction.STORE, pairs))
        load = _best(repeats, lambda: _run_job(engine, Direction.LOAD, pairs))
    single = _best(repeats, lambda: dst.copy_(src))
    gb = moved / 1e9
    return gb / store, gb / load, gb / single


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 MB per row, 3 repeats")
    parser.add_argument("--total-mb", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--plot", metavar="FILE.png", help="draw GB/s against block size")
    args = parser.parse_args()
    total = (16 if args.quick else args.total_mb) << 20
    repeats = 3 if args.quick else args.repeats
    torch.manual_seed(0)
    print(
        f"CPU transfer engine vs one torch copy (torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads), {total >> 20} MB per row, best of {repeats}"
    )
    print(f"{'row':<22}" + "".join(f"{h:>11}" for h in HEADERS))
    rows: dict[str, list[tuple[int, float, float, float]]] = {"contiguous": [], "scattered": []}
    for kb in SIZES_KB:
        block = kb << 10
        n = max(2, total // block)
        cc = _flat(n, block)
        slots = random.Random(kb).sample(range(n), n)
        for pattern, pairs in (
            ("contiguous", [TransferPair(0, b, b) for b in range(n)]),
            ("scattered", [TransferPair(0, b, slots[b]) for b in range(n)]),
        ):
            measured = _measure(cc, pairs, block, repeats)
            _row(f"{kb} KB {pattern}", *measured)
            rows[pattern].append((kb, *measured))
    cc, pairs = _hybrid(max(4, total // (4 * 163840)))
    slot = max(cc.group_bytes(0), cc.group_bytes(1))
    _row("hybrid mix", *_measure(cc, pairs, slot, repeats))
    if args.plot:
        _plot(rows, args.plot, f"CPU transfer engine, torch {torch.__version__}")


def _plot(rows: dict[str, list[tuple[int, float, float, float]]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, (pattern, points) in zip(axes, rows.items(), strict=True):
        sizes = [p[0] for p in points]
        for index, label in ((1, "engine store"), (2, "engine load"), (3, "one torch copy")):
            ax.plot(sizes, [p[index] for p in points], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (KiB)")
        ax.set_title(f"{pattern} slots")
    axes[0].set_ylabel("GB/s")
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


HEADERS = ("store GB/s", "load GB/s", "copy GB/s", "store/copy", "load/copy")


def _row(name: str, store: float, load: float, copy: float) -> None:
    values = (store, load, copy, store / copy, load / copy)
    print(f"{name:<22}" + "".join(f"{v:>11.2f}" for v in values))


if __name__ == "__main__":
    main()
