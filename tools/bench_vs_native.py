"""hybridkv's HybridKVConnector beside vLLM 0.33's native OffloadingConnector, in one process.

Every variant plays the same multi-turn chat trace on vLLM 0.33's real ``Scheduler`` through
:class:`hybridkv.vllm.inprocess.InProcessEngine` (both connector roles in-process on CPU
tensors, content-checked): (a) no connector; (b) the native ``OffloadingConnector`` (CPU
offloading spec, LRU and ARC, both built into vLLM 0.33's ``CachePolicyFactory``) with its
worker on :class:`hybridkv.vllm.native_cpu.NativeOffloadOnCPU`; (c) ``HybridKVConnector``
(``eviction_policy`` lru and arc; ``chunk_size`` one scheduler block, native's chunk, plus
one row at hybridkv's recommended chunk) with its real CPU transfer engine under
:class:`hybridkv.vllm.cpu_worker.HybridKVOnCPU`. Both connectors' copies report ``delay`` steps
after submission by the same rule (0, 1, 4).

Layouts: mamba align + full (Qwen3-Next cut to 4 layers, the platform's block) and sliding +
full (gpt-oss cut to 2 layers, block 32). Traces: multi-turn chat over a shared system prompt
with 4-token and 40-token answers. A host-tier sweep (delay 1, 4-token answers) gives each
connector 0.5x, 1x and 2x the trace's working set: the distinct full blocks of every
conversation's final context (system prompt once), in native chunks (one block of every layer)
and, for hybridkv, the same bytes.

Printed per variant: prefill tokens computed and their ratio to the floor, tokens loaded by the
connector, GPU prefix hits, engine steps, scheduler-side connector µs per step and its share of
the scheduler's time (medians over repeats; every repeat's counters must agree), evictions and
dropped stores (counted at the host store's ``prepare_store``), and hybridkv / native ratios at
the same policy and delay. The floor is what no cache can supply, from the trace: the system
prompt once, each turn's new user tokens, what claim alignment rounds off (hits come in whole
scheduler blocks of what the previous turn computed), and the one token every prompt computes.

Usage: ``python tools/bench_vs_native.py [--quick] [--repeats N] [--layouts sliding+full]``;
needs vLLM 0.33 (``nox -s vllm`` or ``nox -s bench`` install it). Exit 1 when a run leaks
blocks or reads wrong KV; a failed HybridKVConnector variant is printed as failed with its
reason.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's hybridkv and spec, not another install's

from spec.presets import tiny_config  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/_vllm_tool.py
from _vllm_tool import require_vllm, torchvision_shim  # noqa: E402

_SHIM = torchvision_shim("bench_vs_native")  # kept alive (tools/_vllm_tool.py)
require_vllm("bench_vs_native")

from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.vllm.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.inprocess import (  # noqa: E402
    ChatTrace,
    EngineSettings,
    InProcessEngine,
    InProcessReport,
    run_trace,
)
from hybridkv.vllm.native_cpu import NativeOffloadOnCPU  # noqa: E402


@dataclass(frozen=True, slots=True)
class Case:
    """One layout: its config.json, the engine's knobs and the short-answer trace."""

    name: str
    config_json: dict[str, Any]
    settings: EngineSettings
    trace: ChatTrace


def _cases(quick: bool) -> list[Case]:
    mamba_trace = ChatTrace(
        convs=3 if quick else 4,
        turns=3,
        system_len=700,
        user_min=150,
        user_max=300,
        think=2,
        stagger=2,
    )
    sliding_trace = ChatTrace(convs=4 if quick else 8, turns=3 if quick else 4, system_len=128)
    return [
        Case(
            "mamba+full",
            tiny_config("qwen3-next-80b-a3b", 4),
            EngineSettings(
                num_gpu_blocks=16, max_model_len=2560, max_num_seqs=2, max_num_batched_tokens=1280
            ),
            mamba_trace,
        ),
        Case(
            "sliding+full",
            tiny_config("gpt-oss-20b", 2),
            EngineSettings(
                num_gpu_blocks=40,
                max_model_len=768,
                block_size=32,
                max_num_seqs=3,
                max_num_batched_tokens=128,
            ),
            sliding_trace,
        ),
    ]


# ------------------------------------------------------------------ the trace's own figures


def _contexts(trace: ChatTrace) -> list[list[tuple[int, ...]]]:
    """Per conversation, per turn: the prompt as tokens, outputs as distinct placeholders."""
    system = [(t,) for t in trace.system()]
    out = []
    for conv in range(trace.convs):
        turns, context = [], list(system)
        for turn in range(trace.turns):
            if turn:
                context += [(-1, conv, turn, i) for i in range(trace.output_len)]
            context = context + [(t,) for t in trace.user(conv, turn)]
            turns.append(tuple(context))
        out.append(turns)
    return out


def working_set_blocks(trace: ChatTrace, block: int) -> int:
    """Distinct full blocks of every conversation's final context (prompt and answer)."""
    keys = set()
    for turns in _contexts(trace):
        final = turns[-1] + tuple((-1, -1, i) for i in range(trace.output_len))
        keys.update(final[: k * block] for k in range(1, len(final) // block + 1))
    return len(keys)


def floor_tokens(trace: ChatTrace, block: int) -> int:
    """Prompt tokens no cache can supply (module docstring)."""
    total, first = 0, True
    for turns in _contexts(trace):
        previous = 0  # tokens whose KV the previous turn computed
        for turn, prompt in enumerate(turns):
            reach = trace.system_len if turn == 0 and not first else previous
            supplied = min(reach, len(prompt) - 1) // block * block
            total += len(prompt) - supplied
            previous = len(prompt) + trace.output_len - 1
        first = False
    return total


# ------------------------------------------------------------------ variants


@dataclass(frozen=True, slots=True)
class Variant:
    """A connector setting: ``kind`` none | native | hybridkv; host tier in native chunks.

    ``chunk_size``: hybridkv's ``chunk_size`` extra config in tokens; ``None`` leaves it to
    :func:`hybridkv.vllm.layout.recommended_chunk_size` (named "default chunk"). The bench
    gives hybridkv one scheduler block, native's chunk: claims end on multiples of the chunk
    (``claim_unit``), so the 1 MiB default (256 tokens on sliding + full) rounds every claim
    down to 256 tokens where native's rounds to 32 (docs/benchmarks, "Why").
    """

    kind: str
    policy: str = "lru"
    delay: int = 1
    chunks: int = 0
    label: str = ""
    chunk_size: int | None = None

    def name(self) -> str:
        if self.kind == "none":
            return "no connector"
        default = " default chunk" if self.kind == "hybridkv" and self.chunk_size is None else ""
        return f"{self.kind} {self.policy} d={self.delay}{self.label}{default}"


@dataclass(frozen=True, slots=True)
class Result:
    report: InProcessReport | None
    connector_us: float = 0.0
    share: float = 0.0
    evictions: int = 0
    dropped: int = 0
    error: str = ""


class _StoreCounter:
    """Counts evictions and refused stores at a host store's ``prepare_store``."""

    def __init__(self, store: Any) -> None:
        self.evictions = 0
        self.dropped = 0
        inner = store.prepare_store

        def counted(*args: Any, **kwargs: Any) -> Any:
            result = inner(*args, **kwargs)
            evicted = getattr(result, "evicted_keys", None)
            if evicted is None:
                self.dropped += 1
            else:
                self.evictions += len(evicted)
            return result

        store.prepare_store = counted


def _transfer(variant: Variant) -> Any:
    if variant.kind == "native":
        extra = {"eviction_policy": variant.policy}
        return KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
        )
    extra = {"eviction_policy": variant.policy}
    if variant.chunk_size is not None:
        extra["chunk_size"] = variant.chunk_size
    return KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )


def block_bytes(engine_probe: InProcessEngine) -> int:
    """Bytes of one block of every layer (what one native host chunk holds)."""
    config = engine_probe.kv_cache_config
    return sum(t.size // config.num_blocks for t in config.kv_cache_tensors)


def _engine(case: Case, variant: Variant, chunk_bytes: int) -> tuple[InProcessEngine, Any]:
    if variant.kind == "none":
        return InProcessEngine(case.config_json, case.settings), None
    adapter: Any
    if variant.kind == "native":
        adapter = NativeOffloadOnCPU(variant.chunks, variant.delay)
    else:
        adapter = HybridKVOnCPU(host_bytes=variant.chunks * chunk_bytes, delay=variant.delay)
    engine = InProcessEngine(case.config_json, case.settings, _transfer(variant), adapter)
    connector = engine.scheduler.connector
    store = (
        connector.connector_scheduler.manager if variant.kind == "native" else connector.core.store
    )
    return engine, _StoreCounter(store)


def _counters(report: InProcessReport) -> tuple[int, ...]:
    return (
        report.prefill_computed,
        report.external_loaded,
        report.gpu_prefix_hits,
        report.steps,
        report.preemptions,
    )


def run_variant(
    case: Case, trace: ChatTrace, variant: Variant, chunk_bytes: int, repeats: int
) -> Result:
    """``repeats`` fresh runs; timing medians; counters must agree across repeats."""
    reports, counts = [], []
    try:
        for _ in range(repeats):
            engine, counter = _engine(case, variant, chunk_bytes)
            reports.append(run_trace(engine, trace))
            counts.append((counter.evictions, counter.dropped) if counter else (0, 0))
    except Exception as error:  # a failing connector is a result to print, not a crash
        if variant.kind != "hybridkv":
            raise
        return Result(None, error=f"{type(error).__name__}: {str(error).splitlines()[0][:90]}")
    first = reports[0]
    if any(_counters(r) != _counters(first) for r in reports) or len(set(counts)) > 1:
        return Result(first, error="counters differ between repeats")
    return Result(
        first,
        connector_us=statistics.median(r.connector_us for r in reports),
        share=statistics.median(r.connector_share for r in reports),
        evictions=counts[0][0],
        dropped=counts[0][1],
    )


# ------------------------------------------------------------------ printing

HEADER = (
    f"{'variant':<30} {'computed':>8} {'/floor':>6} {'loaded':>7} {'gpu hit':>7} {'steps':>5} "
    f"{'conn us/step':>12} {'share':>6} {'evict':>6} {'dropped':>7} {'wrong':>5}"
)


def _row(name: str, result: Result, floor: int) -> str:
    r = result.report
    if r is None:
        return f"{name:<30} failed: {result.error}"
    us = f"{result.connector_us:12.0f}" if r.connector else f"{'-':>12}"
    share = f"{result.share:6.0%}" if r.connector else f"{'-':>6}"
    line = (
        f"{name:<30} {r.prefill_computed:8d} {r.prefill_computed / floor:6.2f} "
        f"{r.external_loaded:7d} {r.gpu_prefix_hits:7d} {r.steps:5d} {us} {share} "
        f"{result.evictions:6d} {result.dropped:7d} {r.wrong_reads:5d}"
    )
    return line + (f"  ({result.error})" if result.error else "")


def _ratio(ours: Result, theirs: Result, field: Callable[[Result], float]) -> str:
    if ours.report is None or theirs.report is None or not field(theirs):
        return "  n/a"
    return f"{field(ours) / field(theirs):5.2f}"


def _ratios(results: dict[Variant, Result]) -> list[str]:
    lines = []
    for variant, ours in results.items():
        if variant.kind != "hybridkv":
            continue
        peer = results.get(replace(variant, kind="native", chunk_size=None))
        if peer is None:
            continue
        cost = _ratio(ours, peer, lambda x: x.connector_us)
        computed = _ratio(ours, peer, lambda x: x.report.prefill_computed if x.report else 0)
        hits = _ratio(ours, peer, lambda x: x.report.gpu_prefix_hits if x.report else 0)
        lines.append(
            f"  hybridkv/native {variant.name().removeprefix('hybridkv ')}: "
            f"connector us/step {cost}, prefill computed {computed}, GPU prefix hits {hits}"
        )
    return lines


def _bad(results: dict[Variant, Result]) -> list[str]:
    bad = []
    for variant, result in results.items():
        r = result.report
        if r is not None and (r.wrong_reads or r.leaked_blocks or r.finished != r.requests):
            bad.append(f"{variant.name()}: {r.wrong_reads} wrong reads, {r.leaked_blocks} leaked")
    return bad


def bench_trace(case: Case, trace: ChatTrace, args: argparse.Namespace, sweep: bool) -> list[str]:
    probe = InProcessEngine(case.config_json, case.settings)
    block = probe.block_size
    working = working_set_blocks(trace, block)
    floor = floor_tokens(trace, block)
    chunk_bytes = block_bytes(probe)
    big = 2 * working
    variants = [Variant("none")]
    for kind in ("native", "hybridkv"):
        chunk = block if kind == "hybridkv" else None  # one block: native's chunk (Variant)
        for delay in args.delays:
            variants.append(Variant(kind, "lru", delay, big, chunk_size=chunk))
        variants.append(Variant(kind, "arc", 1, big, chunk_size=chunk))
    variants.append(Variant("hybridkv", "lru", 1, big))  # the recommended chunk, for contrast
    if sweep:
        for factor in (0.5, 1.0):
            for kind in ("native", "hybridkv"):
                chunk = block if kind == "hybridkv" else None
                for policy in ("lru", "arc"):
                    chunks = max(1, round(factor * working))
                    variants.append(
                        Variant(kind, policy, 1, chunks, f" host={factor}x", chunk_size=chunk)
                    )
    results: dict[Variant, Result] = {}
    for variant in variants:
        results[variant] = run_variant(case, trace, variant, chunk_bytes, args.repeats)
    lines = [
        f"== {case.name}, {trace.convs} conversations x {trace.turns} turns, system "
        f"{trace.system_len}, user {trace.user_min}-{trace.user_max}, answers "
        f"{trace.output_len} tokens; block {block}; floor {floor} prompt tokens; working set "
        f"{working} blocks = {working * chunk_bytes} B; host tier 2x = {big} chunks unless "
        f"named; hybridkv chunk_size {block} (one block, native's chunk) unless named",
        HEADER,
    ]
    for variant, result in results.items():
        lines.append(_row(variant.name(), result, floor))
    lines += _ratios(results)
    plain = results[Variant("none")].report
    assert plain is not None
    lost = [
        v.name()
        for v, r in results.items()
        if r.report is not None and r.report.gpu_prefix_hits < plain.gpu_prefix_hits
    ]
    lines.append(f"  GPU prefix hits below the no-connector run: {', '.join(lost) or 'none'}")
    problems = _bad(results)
    lines += [f"  ERROR {p}" for p in problems]
    print("\n".join(lines), flush=True)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small traces, one repeat")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per variant")
    parser.add_argument("--delays", default="0,1,4", help="copy delays in steps")
    names = [case.name for case in _cases(False)]
    parser.add_argument(
        "--layouts", default=",".join(names), help=f"comma-separated, of {', '.join(names)}"
    )
    args = parser.parse_args(argv)
    layouts = args.layouts.split(",")
    unknown = sorted(set(layouts) - set(names))
    if unknown:
        parser.error(f"--layouts: unknown {', '.join(unknown)}; use some of {', '.join(names)}")
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.delays = [int(d) for d in args.delays.split(",")]
    print(
        "copies: both connectors' jobs report `d` polls (steps) after submission, FIFO per "
        "direction; native's bytes move at completion, hybridkv's on its CPU engine's thread "
        "at submission (only the report waits)"
    )
    problems = []
    for case in _cases(args.quick):
        if case.name not in layouts:
            continue
        long = replace(case.trace, output_len=40)
        problems += bench_trace(case, case.trace, args, sweep=True)
        problems += bench_trace(case, long, args, sweep=False)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
