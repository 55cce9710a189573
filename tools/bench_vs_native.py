"""hybridkv's HybridKVConnector beside vLLM 0.33's native OffloadingConnector, in one process.

Every variant plays the same multi-turn chat trace on vLLM 0.33's real ``Scheduler`` through
:class:`hybridkv.vllm.harness.inprocess.InProcessEngine` (both connector roles in-process on CPU
tensors, content-checked): (a) no connector; (b) the native ``OffloadingConnector`` (CPU
offloading spec, LRU and ARC, both built into vLLM 0.33's ``CachePolicyFactory``) with its
worker on :class:`hybridkv.vllm.harness.native_cpu.NativeOffloadOnCPU`; (c) ``HybridKVConnector``
(``eviction_policy`` lru and arc; ``chunk_size`` left to its default, which on every layout
here is one scheduler block, native's chunk) with its real CPU transfer engine under
:class:`hybridkv.vllm.harness.cpu_worker.HybridKVOnCPU`. Both connectors' copies report ``delay``
steps after submission by the same rule (0, 1, 4).

Layouts: mamba align + full (Qwen3-Next cut to 4 layers, the platform's block) and sliding +
full (gpt-oss cut to 2 layers, block 32); ``mamba+full-tight`` is mamba + full with more
conversations on the smallest GPU pool vLLM accepts (``TIGHT_POOL``), a third of the working
set, so the host tier carries the hits. Traces: multi-turn chat over a shared system prompt
with 4-token and 40-token answers. A host-tier sweep (delay 1, 4-token answers) gives each
connector 0.5x, 1x and 2x the trace's working set: the distinct full blocks of every
conversation's final context (system prompt once), each a block of every group
(:func:`block_bytes`), in bytes. Native sizes its tier in chunks of one GPU block
(``kv_cache_tensors[0].size // num_blocks``, 4 KiB aligned: :func:`native_chunk_bytes`), and
the KV cache groups overlay one allocation, so a chunk holds one group's block and a token
block of every group takes one chunk per group; hybridkv gets the same bytes
(``host_memory_bytes`` = chunks x chunk bytes, one slot per group block on these layouts).

Printed per variant: prefill tokens computed and their ratio to the floor, tokens loaded by the
connector, GPU prefix hits, continuation hits (cached prompt tokens at positions of an earlier
turn's answer: loaded by the connector, the part of those in the previous turn's answer, and
GPU prefix hits; :class:`Continuation`), engine steps, scheduler-side connector µs per step and
its share of the scheduler's time, wall clock, then the same calls' CPU time per step (``cpu
us``: the calling thread's CPU time, which a shared machine's other jobs do not inflate; the
wall figure charges a call for every moment another job held the core) (medians over repeats,
which run in rounds over a trace's variants so that native and hybridkv meet the same load;
every repeat's counters must agree),
evictions and dropped stores (counted at the host store's ``prepare_store``), and hybridkv /
native ratios at the same policy and delay. The floor is what no cache can supply, from the
trace: the system prompt once, each turn's new user tokens, what claim alignment rounds off
(hits come in whole scheduler blocks of what the previous turn computed), and the one token
every prompt computes.
Each trace also names the variants where computed + loaded + GPU prefix hits differ from the
prompt tokens (a preempted request is admitted again, a failed load recomputed:
:func:`identity_breaks`).

Traffic traces (:class:`TrafficTrace`, every layout; ``--no-traffic`` skips them): 16
conversations x 6 turns over two system prompts, seeded random gaps between conversation starts
and between turns, 10% of the requests aborted (half of them while a connector load is in
flight where the variant loads one), on a GPU pool small enough to preempt
(``TRAFFIC_POOL``, ``SLIDING_TRAFFIC_POOL``); the seed is printed in the header. Their floor
(:func:`traffic_floor`) leaves aborted requests out, as does their ``computed`` column: an
aborted request's tokens are what its abort left it (printed apart per variant), and the turn
after it may find its prompt computed (the floor assumes so: a lower bound). Per variant the
bench prints the aborts (with a load in flight), preemptions, the per-request identity
(computed + loaded + GPU hit = prompt, except for requests preempted or aborted) and, above the
floor, where the tokens above it go by cause (:func:`over_floor`: preempted, after an abort,
a partial hit, no hit), with the requests themselves past 1.05x.

Every trace runs under each of vLLM's engine loops named by ``--loops`` (default both, async
first): async scheduling (``EngineCore.step_with_batch_queue`` with the ``AsyncScheduler``,
vLLM's default on a GPU server) and the synchronous ``EngineCore.step``
(:mod:`hybridkv.vllm.harness.engine_loop`); the sliding traffic pool is 2 blocks larger under
async scheduling, the smallest vLLM accepts there (:func:`for_loop`).

The traffic rows' counts depend on Python's string hashing: under a random ``PYTHONHASHSEED``
native's own sliding + full traffic at 0.5x computed 7,675 to 8,091 tokens from one run to the
next (the order vLLM's engine walks some sets of request ids follows str hashes), so the bench
runs under ``--hash-seed`` (default 0), starting itself again when the environment names
another seed, and prints it; within one run every repeat agrees.

Usage: ``python tools/bench_vs_native.py [--quick] [--no-traffic] [--repeats N]
[--layouts sliding+full] [--loops async,sync] [--plot PATH]``; needs vLLM 0.33 (``nox -s vllm``
or ``nox -s bench`` install it) and, for ``--plot`` (per trace: prefill computed with the floor,
connector µs per step), matplotlib (the ``plot`` extra). Exit 1 when a run leaks blocks or reads
wrong KV; a failed HybridKVConnector variant is printed as failed with its
reason.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's hybridkv and spec, not another install's

from spec.presets import tiny_config  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/_vllm_tool.py, _vs_native_*
from _vllm_tool import require_vllm, torchvision_shim  # noqa: E402

_SHIM = torchvision_shim("bench_vs_native")  # kept alive (tools/_vllm_tool.py)
require_vllm("bench_vs_native")

# The bench's ideas, one module each (tools/_vs_native_*.py); their names stay this module's,
# which the tests and the other tools (bench_native_plugins, host_tier_bound, ...) read.
from _vs_native_cases import (  # noqa: E402
    ASYNC_SLIDING_EXTRA,
    SLIDING_TRAFFIC_POOL,
    TIGHT_POOL,
    TRAFFIC_POOL,
    Case,
    _cases,
    _contexts,
    floor_tokens,
    for_loop,
    working_set_blocks,
)
from _vs_native_report import (  # noqa: E402
    _COLOURS,
    HEADER,
    TraceOutcome,
    _bad,
    _figures,
    _ratio,
    _ratios,
    _row,
    _traffic_lines,
    _variants,
    identity_breaks,
    plot,
)
from _vs_native_runs import (  # noqa: E402
    Continuation,
    Result,
    Variant,
    _Admissions,
    _combined,
    _counters,
    _engine,
    _one_run,
    _overlap,
    _play,
    _StoreCounter,
    _transfer,
    block_bytes,
    continuation_hits,
    default_chunk,
    native_chunk_bytes,
    run_variant,
    run_variants,
    working_set_chunks,
)
from _vs_native_traffic import (  # noqa: E402
    Abort,
    Ledger,
    TrafficTrace,
    _abort_due,
    over_floor,
    play_traffic,
    traffic_floor,
    traffic_identity,
    traffic_working_blocks,
)
from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.vllm.harness.chat import ChatTrace, run_trace  # noqa: E402
from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.engine_config import EngineSettings, WedgedError  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402
from hybridkv.vllm.harness.native_cpu import NativeOffloadOnCPU  # noqa: E402
from hybridkv.vllm.harness.report import InProcessReport  # noqa: E402
from hybridkv.vllm.layout import read_layout, recommended_chunk_size  # noqa: E402

__all__ = [
    "ASYNC_SLIDING_EXTRA",
    "HEADER",
    "ROOT",
    "SLIDING_TRAFFIC_POOL",
    "TIGHT_POOL",
    "TRAFFIC_POOL",
    "_COLOURS",
    "Abort",
    "Case",
    "ChatTrace",
    "Continuation",
    "EngineSettings",
    "HybridKVOnCPU",
    "InProcessEngine",
    "InProcessReport",
    "KVTransferConfig",
    "Ledger",
    "NativeOffloadOnCPU",
    "Result",
    "TraceOutcome",
    "TrafficTrace",
    "Variant",
    "WedgedError",
    "_Admissions",
    "_StoreCounter",
    "_abort_due",
    "_bad",
    "_cases",
    "_combined",
    "_contexts",
    "_counters",
    "_engine",
    "_figures",
    "_one_run",
    "_overlap",
    "_play",
    "_ratio",
    "_ratios",
    "_row",
    "_traffic_lines",
    "_transfer",
    "_variants",
    "bench_trace",
    "block_bytes",
    "continuation_hits",
    "default_chunk",
    "disk_main",
    "floor_tokens",
    "for_loop",
    "identity_breaks",
    "main",
    "native_chunk_bytes",
    "over_floor",
    "play_traffic",
    "plot",
    "read_layout",
    "recommended_chunk_size",
    "run_trace",
    "run_variant",
    "run_variants",
    "tiny_config",
    "traffic_floor",
    "traffic_identity",
    "traffic_working_blocks",
    "working_set_blocks",
    "working_set_chunks",
]


def bench_trace(
    case: Case, trace: ChatTrace | TrafficTrace, args: argparse.Namespace, sweep: bool
) -> TraceOutcome:
    traffic = isinstance(trace, TrafficTrace)
    settings = case.traffic_settings if traffic else case.settings
    probe = InProcessEngine(case.config_json, settings)
    probe.close()
    block = probe.block_size
    floor, working, words = _figures(trace, probe)
    chunk_bytes = native_chunk_bytes(probe)
    delays = [1] if traffic else args.delays
    variants = _variants(working, delays, sweep)
    results = run_variants(case, trace, variants, chunk_bytes, args.repeats)
    plain = results[Variant("none")].report
    assert plain is not None
    lines = [
        f"== {case.name}, {words}; GPU pool {settings.num_gpu_blocks} blocks, max_num_seqs "
        f"{settings.max_num_seqs}; block {block}; prompt {plain.prompt_tokens} tokens; floor "
        f"{floor}{' (aborted requests left out)' if traffic else ''}; working set {working} "
        f"native chunks of {chunk_bytes} B = {working * chunk_bytes} B; host tier 2x = "
        f"{2 * working} chunks (hybridkv: the same bytes) unless named; "
        f"hybridkv chunk_size the default ({default_chunk(probe)} tokens) unless named",
        HEADER,
    ]
    for variant, result in results.items():
        lines.append(_row(variant.name(), result, floor))
    lines += _ratios(results)
    lost = [
        v.name()
        for v, r in results.items()
        if r.report is not None and r.report.gpu_prefix_hits < plain.gpu_prefix_hits
    ]
    lines.append(f"  GPU prefix hits below the no-connector run: {', '.join(lost) or 'none'}")
    if isinstance(trace, TrafficTrace):
        lines += _traffic_lines(trace, results, block)
    else:
        broken = identity_breaks(results)
        lines.append(
            f"  computed + loaded + gpu hit != prompt tokens: {', '.join(broken) or 'none'}"
        )
    problems = _bad(results)
    lines += [f"  ERROR {p}" for p in problems]
    print("\n".join(lines), flush=True)
    kind = "traffic" if traffic else "chat"
    title = f"{case.name}, {kind}, answers {trace.output_len} tokens"
    return TraceOutcome(title, floor, results, lines, problems)


def disk_main(args: argparse.Namespace, layouts: list[str]) -> int:
    """``--disk``: the disk tier side by side (tools/_disk_vs_native.py), per engine loop."""
    import _disk_vs_native as disk

    print(f"PYTHONHASHSEED={os.environ.get('PYTHONHASHSEED', 'random')}")
    print(
        "tier wrote/read: each tier's own byte counters; dir bytes/files: left in its directory "
        "at the end; dev wrote/read: /proc/self/io write_bytes/read_bytes over the run"
    )
    problems = []
    for loop in args.loops.split(","):
        print(f"\n==== engine loop: {loop}")
        for base in _cases(args.quick):
            if base.name not in layouts:
                continue
            case = for_loop(base, loop == "async")
            lines, found = disk.bench_disk(case, args.disk_root, args.small, args.repeats)
            print("\n".join(lines), flush=True)
            problems += [f"{loop}: {p}" for p in found]
    for problem in problems:
        print(f"  ERROR {problem}")
    return 1 if problems else 0


def main(argv: list[str] | None = None, *, rerun: bool = False) -> int:
    """The bench (module docstring); ``rerun``: start again under ``--hash-seed`` when the
    environment's ``PYTHONHASHSEED`` differs (the command line does; a caller in-process
    keeps its own)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small traces, one repeat")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per variant")
    parser.add_argument("--delays", default="0,1,4", help="copy delays in steps")
    names = [case.name for case in _cases(False)]
    parser.add_argument(
        "--layouts", default=",".join(names), help=f"comma-separated, of {', '.join(names)}"
    )
    parser.add_argument(
        "--plot", type=Path, default=None, help="write the figure there (needs matplotlib)"
    )
    parser.add_argument(
        "--loops",
        default="async,sync",
        help="vLLM's engine loops to run, of async (async scheduling, vLLM's GPU default) and sync",
    )
    parser.add_argument(
        "--traffic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also play each layout's traffic trace (TrafficTrace)",
    )
    parser.add_argument(
        "--hash-seed",
        type=int,
        default=0,
        help="PYTHONHASHSEED the bench runs under (it starts itself again under it when the "
        "environment names another; module docstring)",
    )
    parser.add_argument(
        "--disk",
        action="store_true",
        help="instead: a disk tier under a host tier of 0.5x the working set, hybridkv beside "
        "native's fs tier (tools/_disk_vs_native.py)",
    )
    parser.add_argument(
        "--disk-root",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="with --disk: where the tiers' directories are made (a real filesystem)",
    )
    parser.add_argument(
        "--small",
        type=float,
        default=0.5,
        help="with --disk: the small directory's size, a multiple of the working set",
    )
    args = parser.parse_args(argv)
    if rerun and os.environ.get("PYTHONHASHSEED") != str(args.hash_seed):
        # The order vLLM's engine walks some sets of request ids follows str hashes, so under a
        # random seed the traffic rows move from one run to the next (module docstring).
        os.execve(
            sys.executable,
            [sys.executable, *sys.argv],
            {**os.environ, "PYTHONHASHSEED": str(args.hash_seed)},
        )
    layouts = args.layouts.split(",")
    unknown = sorted(set(layouts) - set(names))
    if unknown:
        parser.error(f"--layouts: unknown {', '.join(unknown)}; use some of {', '.join(names)}")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'hybridkv[plot]'")
    loops = args.loops.split(",")
    if not loops or set(loops) - {"async", "sync"}:
        parser.error(f"--loops: {args.loops!r}; use async, sync or async,sync")
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.disk:
        return disk_main(args, layouts)
    args.delays = [int(d) for d in args.delays.split(",")]
    print(f"PYTHONHASHSEED={os.environ.get('PYTHONHASHSEED', 'random')}")
    print(
        "copies: both connectors' jobs report `d` polls (steps) after submission, FIFO per "
        "direction; native's bytes move at completion, hybridkv's on its CPU engine's thread "
        "at submission (only the report waits)"
    )
    print(
        "cont ld / cont gpu: prompt tokens at positions of an earlier turn's answer that the "
        "connector loaded / the GPU prefix cache hit (each request's first admission); ld prev: "
        "the part of cont ld in the previous turn's answer (KV only its decode computed)"
    )
    outcomes = []
    for loop in loops:
        print(
            f"\n==== engine loop: {loop} ("
            + (
                "EngineCore.step_with_batch_queue, AsyncScheduler: step N+1 scheduled before "
                "step N's token is applied"
                if loop == "async"
                else "EngineCore.step, Scheduler"
            )
            + ")"
        )
        for base in _cases(args.quick):
            if base.name not in layouts:
                continue
            case = for_loop(base, loop == "async")
            long = replace(case.trace, output_len=40)
            outcomes.append(bench_trace(case, case.trace, args, sweep=True))
            outcomes.append(bench_trace(case, long, args, sweep=False))
            if args.traffic:
                outcomes.append(bench_trace(case, case.traffic, args, sweep=True))
    if args.plot is not None:
        plot(outcomes, args.plot)
        print(f"figure: {args.plot}")
    return 1 if any(o.problems for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main(rerun=True))
