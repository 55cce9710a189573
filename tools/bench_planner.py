"""Benchmark the planner: the reference model against the optimized library, in one run.

    python tools/bench_planner.py           # full run (about five seconds)
    python tools/bench_planner.py --quick   # a smoke run (well under a second)

Each measurement is a function ``(quick: bool) -> list[Row]`` registered in ``MEASUREMENTS``;
``main`` runs them all and prints one table whose ``speedup`` column is the optimized/spec
speed ratio (spec time per call divided by optimized time per call). Each measurement also
checks that both sides returned the same answers, so a fast wrong answer cannot win.

Parts: chunk counting on two realistic geometries, and hashing a 128k-token prompt that
arrives in 512-token prefill chunks (the optimized per-request hash list appends; the spec has no
incremental structure, so it rehashes the prefix after every chunk, as a connector that
re-derives hashes each step does; a second row compares against the spec hashing once).
``tools/bench_hashing.py`` breaks the hashing part down further.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import hybridkv.kinds
import hybridkv.planner
import spec.kinds
import spec.planner
from hybridkv.hashing import RequestHashList
from spec.hashing import request_block_hashes

MAX_TOKENS = 128 * 1024


class Row(NamedTuple):
    """One side-by-side measurement: the same ``calls`` made on both sides."""

    name: str
    calls: int
    spec_seconds: float
    fast_seconds: float

    @property
    def spec_us_per_call(self) -> float:
        return self.spec_seconds / self.calls * 1e6

    @property
    def fast_us_per_call(self) -> float:
        return self.fast_seconds / self.calls * 1e6

    @property
    def speedup(self) -> float:
        """Optimized speed / spec speed (how many times faster the optimized side is)."""
        return self.spec_seconds / self.fast_seconds


Measurement = Callable[[bool], list[Row]]

# Realistic geometries, as (kind, block_size) groups, hash_block_size, chunk_size,
# max_model_len: Qwen3.5-like (attention and GDN at the 544-token unified block, fine hashes
# of 16 tokens, chunk of half a block) and gpt-oss-like (full + sliding, 16-token blocks).
GEOMETRIES: dict[str, tuple[list[tuple[str, int]], int, int, int]] = {
    "qwen3.5-like": ([("full", 544), ("mamba", 544)], 16, 272, MAX_TOKENS),
    "gpt-oss-like": ([("full", 16), ("sliding", 16)], 16, 256, MAX_TOKENS),
}


def _planners(name: str) -> tuple[Any, Any]:
    groups, h, c, max_len = GEOMETRIES[name]
    slow = spec.planner.make_planner(
        [(spec.kinds.GroupKind(kind), block) for kind, block in groups], h, c, max_len
    )
    fast = hybridkv.planner.HybridOffloadPlanner(
        [(hybridkv.kinds.GroupKind(kind), block) for kind, block in groups], h, c, max_len
    )
    return slow, fast


def _token_counts(quick: bool) -> list[int]:
    """Prompt lengths spread over [0, 128k]: an even sweep plus seeded random ones."""
    count = 50 if quick else 1000
    rng = random.Random(0)
    sweep = [i * MAX_TOKENS // count for i in range(count)]
    return sweep + [rng.randrange(MAX_TOKENS + 1) for _ in range(count)]


def _time_calls(method: Callable[[int], int], args: Sequence[int], repeats: int) -> float:
    """Best total seconds of ``repeats`` passes of ``method`` over ``args``."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for arg in args:
            method(arg)
        best = min(best, time.perf_counter() - start)
    return best


def measure_chunk_counting(quick: bool) -> list[Row]:
    """``chunk_count_for_tokens`` on each geometry, the same token counts on both sides."""
    counts = _token_counts(quick)
    rows = []
    for name in GEOMETRIES:
        slow, fast = _planners(name)
        expected = [slow.chunk_count_for_tokens(n) for n in counts]
        if [fast.chunk_count_for_tokens(n) for n in counts] != expected:
            raise SystemExit(f"{name}: the optimized planner disagrees with the spec")
        spec_s = _time_calls(slow.chunk_count_for_tokens, counts, 1 if quick else 2)
        fast_s = _time_calls(fast.chunk_count_for_tokens, counts, 3 if quick else 20)
        rows.append(Row(f"chunk_count_for_tokens / {name}", len(counts), spec_s, fast_s))
    return rows


def _hash_incrementally(tokens: Sequence[int], piece: int, h: int) -> list[bytes]:
    hashes = RequestHashList(h)
    for lo in range(0, len(tokens), piece):
        hashes.append_tokens(tokens[lo : lo + piece])
    return list(hashes.hashes)


def _spec_rehash_per_chunk(tokens: Sequence[int], piece: int, h: int) -> list[bytes]:
    hashes: list[bytes] = []
    for hi in range(piece, len(tokens) + piece, piece):
        hashes = request_block_hashes(tokens[:hi], h)
    return hashes


def _best_seconds(repeats: int, fn: Callable[[], list[bytes]]) -> tuple[float, list[bytes]]:
    best, result = float("inf"), []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def measure_hashing(quick: bool) -> list[Row]:
    """Hash a prompt arriving in 512-token chunks at hash block 16; calls = block hashes."""
    n, piece, h = (16 * 1024 if quick else MAX_TOKENS), 512, 16
    rng = random.Random(1)
    tokens = [rng.randrange(152_000) for _ in range(n)]
    fast_s, fast = _best_seconds(1 if quick else 5, lambda: _hash_incrementally(tokens, piece, h))
    rehash_s, rehashed = _best_seconds(1, lambda: _spec_rehash_per_chunk(tokens, piece, h))
    once_s, once = _best_seconds(1 if quick else 3, lambda: request_block_hashes(tokens, h))
    if not fast == rehashed == once:
        raise SystemExit("hashing: the optimized hash list disagrees with the spec")
    label = f"hash {n // 1024}k tokens"
    return [
        Row(f"{label} / spec rehash per chunk", len(fast), rehash_s, fast_s),
        Row(f"{label} / spec hashing once", len(fast), once_s, fast_s),
    ]


MEASUREMENTS: list[Measurement] = [measure_chunk_counting, measure_hashing]


def render(rows: Sequence[Row]) -> str:
    """The rows as a fixed-width table."""
    header = (
        f"{'measurement':<44} {'calls':>7} {'spec us/call':>13} {'opt us/call':>12} {'speedup':>9}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row.name:<44} {row.calls:>7} {row.spec_us_per_call:>13.2f} "
            f"{row.fast_us_per_call:>12.3f} {row.speedup:>8.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few calls, for a smoke run")
    args = parser.parse_args(argv)
    rows = [row for measure in MEASUREMENTS for row in measure(args.quick)]
    print(f"python {platform.python_version()} on {platform.machine()}; quick={args.quick}")
    print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
