"""Block hashing of a long prompt that arrives in prefill chunks, three ways side by side.

- ``incremental``: hybridkv's RequestHashList, one ``append_tokens`` per chunk (each block
  hashed once).
- ``naive``: spec.hashing recomputing the whole request's hashes from scratch after every chunk,
  as a connector that re-derives hashes each step does (seed PR #38261's bug).
- ``spec once``: spec.hashing over the whole prompt once (the floor for the plain algorithm).

All three must produce the same hashes; the script checks that before printing ratios.
Usage: ``python tools/bench_hashing.py [--quick] [--tokens N] [--piece N] [--hash-block-size N]``.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Sequence

from hybridkv.hashing import RequestHashList
from spec.hashing import request_block_hashes


def _best_of(repeats: int, fn: Callable[[], list[bytes]]) -> tuple[float, list[bytes]]:
    best, result = float("inf"), []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def _incremental(tokens: Sequence[int], piece: int, h: int) -> list[bytes]:
    hashes = RequestHashList(h)
    for lo in range(0, len(tokens), piece):
        hashes.append_tokens(tokens[lo : lo + piece])
    return list(hashes.hashes)


def _naive(tokens: Sequence[int], piece: int, h: int) -> list[bytes]:
    hashes: list[bytes] = []
    for hi in range(piece, len(tokens) + piece, piece):
        hashes = request_block_hashes(tokens[:hi], h)
    return hashes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="16k tokens, one repeat of each")
    parser.add_argument("--tokens", type=int, default=128 * 1024)
    parser.add_argument("--piece", type=int, default=512, help="tokens per prefill chunk")
    parser.add_argument("--hash-block-size", type=int, default=16)
    args = parser.parse_args(argv)
    n = 16 * 1024 if args.quick else args.tokens
    repeats = 1 if args.quick else 7
    piece, h = args.piece, args.hash_block_size
    rng = random.Random(0)
    tokens = [rng.randrange(152_000) for _ in range(n)]

    _incremental(tokens[: 64 * piece], piece, h)  # warm up caches and the allocator
    t_inc, inc = _best_of(repeats, lambda: _incremental(tokens, piece, h))
    t_once, once = _best_of(repeats, lambda: request_block_hashes(tokens, h))
    t_naive, naive = _best_of(1, lambda: _naive(tokens, piece, h))
    if not inc == once == naive:
        print("MISMATCH: the three ways disagree")
        return 1

    print(f"{n} tokens in {piece}-token pieces, hash_block_size {h}, {len(inc)} block hashes")
    for name, t in (("incremental", t_inc), ("spec once", t_once), ("naive", t_naive)):
        print(f"  {name:<12} {t * 1e3:9.1f} ms  {t / len(inc) * 1e6:7.2f} us/block")
    print(f"naive / incremental     = {t_naive / t_inc:7.1f}x")
    print(f"spec once / incremental = {t_once / t_inc:7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
