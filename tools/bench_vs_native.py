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
wall figure charges a call for every moment another job held the core) (medians over repeats;
every repeat's counters must agree),
evictions and dropped stores (counted at the host store's ``prepare_store``), and hybridkv /
native ratios at the same policy and delay. The floor is what no cache can supply, from the
trace: the system prompt once, each turn's new user tokens, what claim alignment rounds off
(hits come in whole scheduler blocks of what the previous turn computed), and the one token
every prompt computes.
Each trace also names the variants where computed + loaded + GPU prefix hits differ from the
prompt tokens (a preempted request is admitted again, a failed load recomputed:
:func:`identity_breaks`).

Usage: ``python tools/bench_vs_native.py [--quick] [--repeats N] [--layouts sliding+full]
[--plot PATH]``; needs vLLM 0.33 (``nox -s vllm`` or ``nox -s bench`` install it) and, for
``--plot`` (per trace: prefill computed with the floor, connector µs per step), matplotlib (the
``plot`` extra). Exit 1 when a run leaks
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

from hybridkv.vllm.harness.chat import ChatTrace, run_trace  # noqa: E402
from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.engine_config import EngineSettings  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402
from hybridkv.vllm.harness.native_cpu import NativeOffloadOnCPU  # noqa: E402
from hybridkv.vllm.harness.report import InProcessReport  # noqa: E402
from hybridkv.vllm.layout import read_layout, recommended_chunk_size  # noqa: E402


@dataclass(frozen=True, slots=True)
class Case:
    """One layout: its config.json, the engine's knobs and the short-answer trace."""

    name: str
    config_json: dict[str, Any]
    settings: EngineSettings
    trace: ChatTrace


# The smallest GPU pool vLLM 0.33 accepts for mamba + full at max_model_len 2560: its planner
# (``_check_enough_kv_cache_memory``) refuses a pool that cannot hold one request of
# max_model_len, the full group's cdiv(2560, 640) = 4 blocks on top of the mamba groups' blocks
# per request (measured: 10 blocks reach 1,920 tokens, 11 reach 2,560). The 8 x 4 trace's
# working set (9 token blocks, each a block of all 4 groups: 36 pool blocks, 36 native host
# chunks) is 3x this pool.
TIGHT_POOL = 11


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
    mamba_settings = EngineSettings(
        num_gpu_blocks=16, max_model_len=2560, max_num_seqs=2, max_num_batched_tokens=1280
    )
    return [
        Case("mamba+full", tiny_config("qwen3-next-80b-a3b", 4), mamba_settings, mamba_trace),
        # The GPU pool well below the working set (TIGHT_POOL): the host tier carries the hits.
        Case(
            "mamba+full-tight",
            tiny_config("qwen3-next-80b-a3b", 4),
            replace(mamba_settings, num_gpu_blocks=TIGHT_POOL),
            replace(mamba_trace, convs=4 if quick else 8, turns=3 if quick else 4),
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

    ``chunk_size``: hybridkv's ``chunk_size`` extra config in tokens (named ``chunk=N``);
    ``None``, what the bench runs, leaves it to the default
    (:func:`hybridkv.vllm.layout.recommended_chunk_size`: one scheduler block on every layout
    here, so claims round off nothing native's one-block chunks would not).
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
        chunk = f" chunk={self.chunk_size}" if self.chunk_size is not None else ""
        return f"{self.kind} {self.policy} d={self.delay}{self.label}{chunk}"


@dataclass(frozen=True, slots=True)
class Continuation:
    """Prompt tokens served from cache at positions that held an earlier turn's answer.

    ``loaded``: inside the range the connector supplied; ``gpu``: inside vLLM's local prefix
    hit; ``loaded_previous``: the part of ``loaded`` in the immediately previous turn's answer,
    whose KV only that turn's decode steps computed (an older answer was recomputed in the
    prefill after it, so any connector that stores prefills may hold it). Counted at each
    request's first admission (vLLM's ``PrefillStats``, :func:`continuation_hits`).
    """

    loaded: int = 0
    gpu: int = 0
    loaded_previous: int = 0

    @property
    def total(self) -> int:
        return self.loaded + self.gpu


@dataclass(frozen=True, slots=True)
class Result:
    report: InProcessReport | None
    connector_us: float = 0.0
    share: float = 0.0
    connector_cpu_us: float = 0.0
    evictions: int = 0
    dropped: int = 0
    error: str = ""
    continuation: Continuation = Continuation()


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


class _Admissions:
    """Per request, the cached tokens of its first admission, as vLLM reports them in the
    request's output (``PrefillStats``: local prefix hit, then the connector's external hit,
    which starts where the local one ends)."""

    def __init__(self, engine: InProcessEngine) -> None:
        self.cached: dict[str, tuple[int, int]] = {}
        inner = engine.step

        def observed() -> list[Any]:
            outputs = inner()
            for out in outputs:
                stats = out.prefill_stats
                if stats is not None:
                    local, external = (
                        stats.num_local_cached_tokens,
                        stats.num_external_cached_tokens,
                    )
                    self.cached[out.request_id] = (local, external)
            return outputs

        engine.step = observed  # type: ignore[method-assign]


def _overlap(lo: int, hi: int, spans: list[tuple[int, int]]) -> int:
    return sum(max(0, min(hi, b) - max(lo, a)) for a, b in spans)


def continuation_hits(engine: InProcessEngine, cached: dict[str, tuple[int, int]]) -> Continuation:
    """Cached prompt tokens lying in an earlier turn's answer, from what the run observed.

    The answer of request ``c{conv}-t{k}`` (``run_trace``'s names) is the positions of its
    output tokens, ``[num_prompt_tokens, num_tokens)``, as vLLM's request holds them; every
    later turn of the conversation repeats them at the same positions. A request's hit ranges
    are ``[0, local)`` (GPU prefix cache) and ``[local, local + external)`` (the connector).
    """
    turns: dict[str, list[tuple[int, Any]]] = {}
    for rid, request in engine.requests.items():
        conv, _, turn = rid.partition("-t")
        turns.setdefault(conv, []).append((int(turn), request))
    loaded = gpu = previous = 0
    for rid, (local, external) in cached.items():
        conv, _, turn = rid.partition("-t")
        earlier = [
            (k, (r.num_prompt_tokens, r.num_tokens)) for k, r in turns[conv] if k < int(turn)
        ]
        spans = [span for _, span in earlier]
        last = [span for k, span in earlier if k == int(turn) - 1]
        gpu += _overlap(0, local, spans)
        loaded += _overlap(local, local + external, spans)
        previous += _overlap(local, local + external, last)
    return Continuation(loaded, gpu, previous)


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


def default_chunk(engine_probe: InProcessEngine) -> int:
    """hybridkv's default ``chunk_size`` on the probe's layout (what a variant without one gets)."""
    layout = read_layout(engine_probe.vllm_config, engine_probe.kv_cache_config)
    return recommended_chunk_size(layout)


def block_bytes(engine_probe: InProcessEngine) -> int:
    """Bytes of one block of every layer: one token block of every group (the tensors of the
    groups overlay one allocation, each tensor a layer)."""
    config = engine_probe.kv_cache_config
    return sum(t.size // config.num_blocks for t in config.kv_cache_tensors)


def native_chunk_bytes(engine_probe: InProcessEngine) -> int:
    """Bytes of one native host chunk, as vLLM 0.33 sizes it: one GPU block of the shared
    allocation (``OffloadingConfig.worker_kv_bytes_per_block``), rounded up to 4 KiB
    (``CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT``). On a hybrid layout that is one group's block."""
    config = engine_probe.kv_cache_config
    per_block = config.kv_cache_tensors[0].size // config.num_blocks
    return -(-per_block // 4096) * 4096


def working_set_chunks(trace: ChatTrace, engine_probe: InProcessEngine) -> int:
    """The trace's working set (:func:`working_set_blocks`, every group) in native chunks."""
    working = working_set_blocks(trace, engine_probe.block_size) * block_bytes(engine_probe)
    return -(-working // native_chunk_bytes(engine_probe))


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
        report.failed_loads,
    )


def run_variant(
    case: Case, trace: ChatTrace, variant: Variant, chunk_bytes: int, repeats: int
) -> Result:
    """``repeats`` fresh runs; timing medians; counters must agree across repeats."""
    reports, counts = [], []
    try:
        for _ in range(repeats):
            engine, counter = _engine(case, variant, chunk_bytes)
            try:
                admissions = _Admissions(engine)
                reports.append(run_trace(engine, trace))
                continuation = continuation_hits(engine, admissions.cached)
            finally:
                engine.close()  # a worker's copy thread would keep its memory (inprocess)
            evicted = (counter.evictions, counter.dropped) if counter else (0, 0)
            counts.append((*evicted, continuation))
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
        connector_cpu_us=statistics.median(r.connector_cpu_us for r in reports),
        evictions=counts[0][0],
        dropped=counts[0][1],
        continuation=counts[0][2],
    )


# ------------------------------------------------------------------ printing

HEADER = (
    f"{'variant':<30} {'computed':>8} {'/floor':>6} {'loaded':>7} {'gpu hit':>7} "
    f"{'cont ld':>7} {'ld prev':>7} {'cont gpu':>8} {'steps':>5} {'conn us/step':>12} "
    f"{'share':>6} {'cpu us':>6} "
    f"{'evict':>6} {'dropped':>7} {'wrong':>5}"
)


def _row(name: str, result: Result, floor: int) -> str:
    r = result.report
    if r is None:
        return f"{name:<30} failed: {result.error}"
    us = f"{result.connector_us:12.0f}" if r.connector else f"{'-':>12}"
    share = f"{result.share:6.0%}" if r.connector else f"{'-':>6}"
    cpu = f"{result.connector_cpu_us:6.0f}" if r.connector else f"{'-':>6}"
    cont = result.continuation
    line = (
        f"{name:<30} {r.prefill_computed:8d} {r.prefill_computed / floor:6.2f} "
        f"{r.external_loaded:7d} {r.gpu_prefix_hits:7d} {cont.loaded:7d} {cont.loaded_previous:7d} "
        f"{cont.gpu:8d} "
        f"{r.steps:5d} {us} {share} {cpu} "
        f"{result.evictions:6d} {result.dropped:7d} {r.wrong_reads:5d}"
    )
    return line + (f"  ({result.error})" if result.error else "")


def _ratio(ours: Result, theirs: Result, field: Callable[[Result], float]) -> str:
    if ours.report is None or theirs.report is None:
        return "  n/a"
    if not field(theirs):  # the count itself: a ratio to zero says nothing
        return f"{field(ours):.0f} vs 0"
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
        cpu = _ratio(ours, peer, lambda x: x.connector_cpu_us)
        computed = _ratio(ours, peer, lambda x: x.report.prefill_computed if x.report else 0)
        hits = _ratio(ours, peer, lambda x: x.report.gpu_prefix_hits if x.report else 0)
        cont = _ratio(ours, peer, lambda x: x.continuation.total)
        lines.append(
            f"  hybridkv/native {variant.name().removeprefix('hybridkv ')}: "
            f"connector us/step {cost} (cpu {cpu}), prefill computed {computed}, "
            f"GPU prefix hits {hits}, "
            f"continuation hits {cont}"
        )
    return lines


def identity_breaks(results: dict[Variant, Result]) -> list[str]:
    """Variants where computed + loaded + gpu hit != prompt tokens, with what re-counts.

    Each prompt position is computed, loaded by the connector or a GPU prefix hit, once per
    admission; a preempted request is admitted again and a failed load is recomputed, so
    those runs count some positions twice.
    """
    broken = []
    for variant, result in results.items():
        r = result.report
        if r is None:
            continue
        if r.prefill_computed + r.external_loaded + r.gpu_prefix_hits != r.prompt_tokens:
            broken.append(
                f"{variant.name()} (preemptions {r.preemptions}, failed loads {r.failed_loads})"
            )
    return broken


def _bad(results: dict[Variant, Result]) -> list[str]:
    bad = []
    for variant, result in results.items():
        r = result.report
        if r is not None and (r.wrong_reads or r.leaked_blocks or r.finished != r.requests):
            bad.append(f"{variant.name()}: {r.wrong_reads} wrong reads, {r.leaked_blocks} leaked")
    return bad


@dataclass(frozen=True, slots=True)
class TraceOutcome:
    """One trace's results, its floor and the lines printed for it."""

    title: str
    floor: int
    results: dict[Variant, Result]
    lines: list[str]
    problems: list[str]


def _variants(working: int, delays: list[int], sweep: bool) -> list[Variant]:
    big = 2 * working
    variants = [Variant("none")]
    for kind in ("native", "hybridkv"):  # hybridkv at its default chunk (Variant)
        for delay in delays:
            variants.append(Variant(kind, "lru", delay, big))
        variants.append(Variant(kind, "arc", 1, big))
    if sweep:
        for factor in (0.5, 1.0):
            for kind in ("native", "hybridkv"):
                for policy in ("lru", "arc"):
                    chunks = max(1, round(factor * working))
                    variants.append(Variant(kind, policy, 1, chunks, f" host={factor}x"))
    return variants


def bench_trace(
    case: Case, trace: ChatTrace, args: argparse.Namespace, sweep: bool
) -> TraceOutcome:
    probe = InProcessEngine(case.config_json, case.settings)
    probe.close()
    block = probe.block_size
    working = working_set_chunks(trace, probe)
    floor = floor_tokens(trace, block)
    chunk_bytes = native_chunk_bytes(probe)
    results: dict[Variant, Result] = {}
    for variant in _variants(working, args.delays, sweep):
        results[variant] = run_variant(case, trace, variant, chunk_bytes, args.repeats)
    plain = results[Variant("none")].report
    assert plain is not None
    lines = [
        f"== {case.name}, {trace.convs} conversations x {trace.turns} turns, system "
        f"{trace.system_len}, user {trace.user_min}-{trace.user_max}, answers "
        f"{trace.output_len} tokens; GPU pool {case.settings.num_gpu_blocks} blocks; block "
        f"{block}; prompt {plain.prompt_tokens} tokens; floor {floor}; working set {working} "
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
    broken = identity_breaks(results)
    lines.append(f"  computed + loaded + gpu hit != prompt tokens: {', '.join(broken) or 'none'}")
    problems = _bad(results)
    lines += [f"  ERROR {p}" for p in problems]
    print("\n".join(lines), flush=True)
    title = f"{case.name}, answers {trace.output_len} tokens"
    return TraceOutcome(title, floor, results, lines, problems)


# ------------------------------------------------------------------ the figure

_COLOURS = {"none": "0.6", "native": "tab:orange", "hybridkv": "tab:blue"}


def plot(outcomes: list[TraceOutcome], path: Path) -> None:
    """Per trace, a panel pair: prefill tokens computed per variant beside the floor, and the
    scheduler-side connector µs per step (median of the repeats). Failed variants are left
    blank and named failed."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on the machines that run the bench
    import matplotlib.pyplot as plt

    rows = len(outcomes)
    height = max(len(o.results) for o in outcomes) * 0.22 + 1.2
    figure, axes = plt.subplots(rows, 2, figsize=(13, height * rows), squeeze=False)
    for (computed_ax, cost_ax), outcome in zip(axes, outcomes, strict=True):
        variants = list(outcome.results)
        names = [v.name() + ("" if outcome.results[v].report else " (failed)") for v in variants]
        colours = [_COLOURS[v.kind] for v in variants]
        places = range(len(variants))
        computed = [r.report.prefill_computed if r.report else 0 for r in outcome.results.values()]
        cost = [
            r.connector_cpu_us if r.report and r.report.connector else 0
            for r in outcome.results.values()
        ]
        computed_ax.barh(places, computed, color=colours)
        computed_ax.axvline(
            outcome.floor,
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"floor {outcome.floor}",
        )
        computed_ax.legend(fontsize=7, loc="lower right")
        computed_ax.set_title(f"{outcome.title}: prefill tokens computed", fontsize=9)
        cost_ax.barh(places, cost, color=colours)
        cost_ax.set_title(f"{outcome.title}: connector CPU µs per step", fontsize=9)
        for ax in (computed_ax, cost_ax):
            ax.set_yticks(list(places), names, fontsize=7)
            ax.invert_yaxis()
            ax.tick_params(axis="x", labelsize=7)
        cost_ax.set_yticklabels([])
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
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
    args = parser.parse_args(argv)
    layouts = args.layouts.split(",")
    unknown = sorted(set(layouts) - set(names))
    if unknown:
        parser.error(f"--layouts: unknown {', '.join(unknown)}; use some of {', '.join(names)}")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'hybridkv[plot]'")
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.delays = [int(d) for d in args.delays.split(",")]
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
    for case in _cases(args.quick):
        if case.name not in layouts:
            continue
        long = replace(case.trace, output_len=40)
        outcomes.append(bench_trace(case, case.trace, args, sweep=True))
        outcomes.append(bench_trace(case, long, args, sweep=False))
    if args.plot is not None:
        plot(outcomes, args.plot)
        print(f"figure: {args.plot}")
    return 1 if any(o.problems for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
