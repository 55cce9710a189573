"""Prefill computed under host pressure over several trace seeds, hybridkv beside native.

One bench trace seed is one sample of a chaotic system: at a host tier below the working set,
a single different eviction moves every later request's hits, so one row can swing by
hundreds of tokens either way. This tool replays ``tools/bench_vs_native.py``'s variants
(:func:`bench_vs_native.run_variant`, delay 1, one repeat) on the chat trace (4-token answers)
and the traffic trace of one layout, under ``--seeds`` for each, at ``--host`` times the
working set, LRU and ARC, and prints per seed and policy the prefill computed by native and by
hybridkv (aborted requests left out, as in the bench), then the sums and how many rows
hybridkv computes no more than native.

Usage: ``python tools/host_pressure_seeds.py [--layout sliding+full] [--host 0.5]
[--loop async] [--chat-seeds 1234,1,2] [--traffic-seeds 2026,7]``; needs vLLM 0.33 like the
bench. ``--loop``: vLLM's engine loop, async scheduling (its GPU default) or sync, set as the
bench sets it (:func:`bench_vs_native.for_loop`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vs_native as bench

from hybridkv.vllm.harness.inprocess import InProcessEngine


def computed(case: bench.Case, trace: object, kind: str, policy: str, host: float) -> int:
    """Prefill computed by one variant (``kind`` at ``policy``) at ``host`` x working set."""
    traffic = isinstance(trace, bench.TrafficTrace)
    settings = case.traffic_settings if traffic else case.settings
    probe = InProcessEngine(case.config_json, settings)
    probe.close()
    _, working, _ = bench._figures(trace, probe)  # type: ignore[arg-type]
    chunks = max(1, round(host * working))
    variant = bench.Variant(kind, policy, 1, chunks, f" host={host}x")
    result = bench.run_variant(case, trace, variant, bench.native_chunk_bytes(probe), 1)  # type: ignore[arg-type]
    if result.report is None or result.report.wrong_reads:
        raise SystemExit(f"{variant.name()}: {result.error or 'wrong reads'}")
    return result.computed()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", default="sliding+full")
    parser.add_argument("--host", type=float, default=0.5, help="host tier x working set")
    parser.add_argument("--chat-seeds", default="1234,1,2,3,4,5")
    parser.add_argument("--traffic-seeds", default="2026,7,8,9")
    parser.add_argument("--loop", choices=("async", "sync"), default="async")
    args = parser.parse_args(argv)
    cases = {case.name: case for case in bench._cases(False)}
    if args.layout not in cases:
        parser.error(f"--layout: one of {', '.join(cases)}")
    case = bench.for_loop(cases[args.layout], args.loop == "async")
    traces: list[tuple[str, object]] = [
        (f"chat {s}", replace(case.trace, seed=int(s))) for s in args.chat_seeds.split(",") if s
    ] + [
        (f"traffic {s}", replace(case.traffic, seed=int(s)))
        for s in args.traffic_seeds.split(",")
        if s
    ]
    print(
        f"{args.layout}, {args.loop} loop, host {args.host}x: prefill computed (hybridkv - native)"
    )
    ours = theirs = wins = rows = 0
    for name, trace in traces:
        for policy in ("lru", "arc"):
            native = computed(case, trace, "native", policy, args.host)
            hybrid = computed(case, trace, "hybridkv", policy, args.host)
            delta = hybrid - native
            print(f"{name:<14} {policy}: native {native:6d} hybridkv {hybrid:6d} ({delta:+d})")
            ours, theirs, rows = ours + hybrid, theirs + native, rows + 1
            wins += hybrid <= native
    ratio = ours / theirs
    print(f"sum: hybridkv {ours} native {theirs} ({ratio:.3f}); {wins} of {rows} rows <= native")
    return 0


if __name__ == "__main__":
    sys.exit(main())
