"""Why a connector lowers vLLM 0.33's GPU prefix hits on sliding + full, measured per request.

Issue 11's goal "no loss of GPU prefix hits against the no-connector run" is missed by every
connector on ``tools/bench_vs_native.py``'s sliding + full chat. This tool replays that trace
(4-token answers, copy delay 1, host tier 2x the working set) with no connector, the native
``OffloadingConnector`` (LRU) and HybridKVConnector (LRU, one-block chunk), on vLLM 0.33's real
``Scheduler``, and records at each request's first allocation:

- ``gpu``: vLLM's local prefix hit (``Scheduler._get_local_prefix_cache_hit``);
- ``full``: the leading run of the request's blocks cached in the full-attention group alone
  (``BlockPool.get_cached_block``), so ``full > gpu`` means the sliding group cut the hit;
- ``sw``: how many of those ``full // block`` blocks the sliding group still has cached;
- ``ext``: the connector's tokens (``num_external_computed_tokens`` of ``allocate_slots``);
- ``null``: the sliding group's null blocks inside the computed prefix right after the
  allocation: positions a request holds no sliding block for, so nothing of it is cached there.

Printed: per variant the sums and the requests whose GPU hit the sliding group cut, then per
request the three variants side by side.

Usage: ``python tools/gpu_hit_loss.py [--answers 4]``; needs vLLM 0.33.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_vs_native, _vllm_tool
import bench_vs_native as bench


@dataclass(frozen=True, slots=True)
class Admission:
    """One request's first allocation (module docstring)."""

    gpu: int
    full: int
    sliding_cached: int
    ext: int
    null: int
    sliding_blocks: int


class HitProbe:
    """Wraps a scheduler's local-hit lookup and its ``allocate_slots`` (module docstring)."""

    def __init__(self, scheduler: Any) -> None:
        self.admissions: dict[str, Admission] = {}
        manager = scheduler.kv_cache_manager
        pool = manager.block_pool
        groups = manager.kv_cache_config.kv_cache_groups
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        self.full_gid = next(i for i, k in enumerate(kinds) if k == "FullAttentionSpec")
        self.sliding_gid = next(i for i, k in enumerate(kinds) if k == "SlidingWindowSpec")
        block = groups[self.full_gid].kv_cache_spec.block_size
        sliding = manager.coordinator.single_type_managers[self.sliding_gid]
        self._seen: dict[str, tuple[int, int, int]] = {}
        lookup, allocate = scheduler._get_local_prefix_cache_hit, manager.allocate_slots
        signature = inspect.signature(allocate)

        def looked(request: Any, *args: Any, **kwargs: Any) -> Any:
            found = lookup(request, *args, **kwargs)
            full = 0
            for block_hash in request.block_hashes:
                if pool.get_cached_block(block_hash, [self.full_gid]) is None:
                    break
                full += block
            # The sliding group's cached blocks among those the full group's hit spans.
            window = sum(
                pool.get_cached_block(h, [self.sliding_gid]) is not None
                for h in request.block_hashes[: full // block]
            )
            self._seen[request.request_id] = (found[1], min(full, request.num_tokens - 1), window)
            return found

        def allocated(*args: Any, **kwargs: Any) -> Any:
            out = allocate(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            request = bound.arguments["request"]
            rid = request.request_id
            seen = self._seen.pop(rid, None)
            if out is not None and seen is not None and rid not in self.admissions:
                ext = bound.arguments.get("num_external_computed_tokens", 0)
                computed = (seen[0] + ext) // block
                blocks = sliding.req_to_blocks.get(rid, [])[:computed]
                null = sum(1 for b in blocks if b.is_null)
                self.admissions[rid] = Admission(
                    seen[0], seen[1], seen[2], ext, null, len(blocks) - null
                )
            return out

        scheduler._get_local_prefix_cache_hit = looked
        manager.allocate_slots = allocated


def probe(case: Any, trace: Any, variant: Any, chunk_bytes: int) -> tuple[Any, HitProbe]:
    """One run of ``variant`` with the probe in place: its report and the probe."""
    engine, _ = bench._engine(case, variant, chunk_bytes)
    hits = HitProbe(engine.scheduler)
    report = bench.run_trace(engine, trace)
    return report, hits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--answers", type=int, default=4, help="answer tokens per turn")
    args = parser.parse_args(argv)
    (case,) = (c for c in bench._cases(False) if c.name == "sliding+full")
    trace = replace(case.trace, output_len=args.answers)
    probe_engine = bench.InProcessEngine(case.config_json, case.settings)
    block, chunk_bytes = probe_engine.block_size, bench.native_chunk_bytes(probe_engine)
    host = 2 * bench.working_set_chunks(trace, probe_engine)  # the bench's equal bytes
    probe_engine.close()
    variants = {
        "none": bench.Variant("none"),
        "native": bench.Variant("native", "lru", 1, host),
        "hybridkv": bench.Variant("hybridkv", "lru", 1, host),  # its default chunk: one block
    }
    runs = {name: probe(case, trace, v, chunk_bytes) for name, v in variants.items()}
    print(
        f"== sliding+full, {trace.convs} conversations x {trace.turns} turns, answers "
        f"{trace.output_len}; block {block}; lru d=1, host 2x; per request at its first allocation"
    )
    print(
        f"{'variant':<9} {'gpu hit':>7} {'loaded':>7} {'hit+load':>8} {'computed':>8} "
        f"{'cut by sliding':>14} {'tokens cut':>10} {'sliding null':>12} {'sliding real':>12}"
    )
    for name, (report, hits) in runs.items():
        a = hits.admissions.values()
        cut = [x for x in a if x.full > x.gpu]
        print(
            f"{name:<9} {sum(x.gpu for x in a):7d} {sum(x.ext for x in a):7d} "
            f"{sum(x.gpu + x.ext for x in a):8d} {report.prefill_computed:8d} "
            f"{len(cut):14d} {sum(x.full - x.gpu for x in cut):10d} "
            f"{sum(x.null for x in a):12d} {sum(x.sliding_blocks for x in a):12d}"
        )
        assert sum(x.gpu for x in a) == report.gpu_prefix_hits, name
    print("request   " + "  ".join(f"{n + ' gpu/full/sw/ext/null':>26}" for n in runs))
    for rid in runs["none"][1].admissions:
        cells = []
        for _, hits in runs.values():
            x = hits.admissions.get(rid)
            cells.append(
                f"{x.gpu:>5d}/{x.full:>4d}/{x.sliding_cached:>2d}/{x.ext:>4d}/{x.null:>2d}"
                if x
                else "-"
            )
        print(f"{rid:<9} " + "  ".join(f"{c:>26}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
