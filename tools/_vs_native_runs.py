"""bench_vs_native's variants and their runs: a connector setting (:class:`Variant`), the
engine built for it, the counts observed while a trace plays (evictions, first admissions,
continuation hits) and the repeats combined into one :class:`Result`.

A module of ``tools/bench_vs_native.py`` (its module docstring says what the bench measures);
imported after that tool has put this checkout and ``tools/`` on ``sys.path``, loaded its
torchvision shim and checked that vLLM 0.33 imports.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any

from _vs_native_cases import Case, working_set_blocks
from _vs_native_traffic import Ledger, TrafficTrace, play_traffic
from vllm.config import KVTransferConfig

from hybridkv.vllm.harness.chat import ChatTrace, run_trace
from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU
from hybridkv.vllm.harness.inprocess import InProcessEngine
from hybridkv.vllm.harness.native_cpu import NativeOffloadOnCPU
from hybridkv.vllm.harness.report import InProcessReport
from hybridkv.vllm.layout import read_layout, recommended_chunk_size


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
    ledger: Ledger | None = None

    def computed(self) -> int:
        """Prompt tokens computed, aborted requests left out (what the floor is for)."""
        if self.report is None:
            return 0
        if self.ledger is None:
            return self.report.prefill_computed
        aborted = self.ledger.aborted
        return sum(n for rid, n in self.ledger.computed.items() if rid not in aborted)


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


def continuation_hits(
    engine: InProcessEngine,
    cached: dict[str, tuple[int, int]],
    skip: frozenset[str] | set[str] = frozenset(),
) -> Continuation:
    """Cached prompt tokens lying in an earlier turn's answer, from what the run observed.

    The answer of request ``c{conv}-t{k}`` (``run_trace``'s names) is the positions of its
    output tokens, ``[num_prompt_tokens, num_tokens)``, as vLLM's request holds them; every
    later turn of the conversation repeats them at the same positions. A request's hit ranges
    are ``[0, local)`` (GPU prefix cache) and ``[local, local + external)`` (the connector).
    ``skip``: aborted requests, whose answers no later prompt repeats.
    """
    turns: dict[str, list[tuple[int, Any]]] = {}
    for rid, request in engine.requests.items():
        if rid in skip:
            continue
        conv, _, turn = rid.partition("-t")
        turns.setdefault(conv, []).append((int(turn), request))
    loaded = gpu = previous = 0
    for rid, (local, external) in cached.items():
        conv, _, turn = rid.partition("-t")
        earlier = [
            (k, (r.num_prompt_tokens, r.num_tokens))
            for k, r in turns.get(conv, [])
            if k < int(turn)
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


def _play(engine: InProcessEngine, trace: ChatTrace | TrafficTrace) -> tuple[Any, Ledger | None]:
    if isinstance(trace, TrafficTrace):
        return play_traffic(engine, trace)
    return run_trace(engine, trace), None


def run_variant(
    case: Case,
    trace: ChatTrace | TrafficTrace,
    variant: Variant,
    chunk_bytes: int,
    repeats: int,
) -> Result:
    """``repeats`` fresh runs; timing medians; counters must agree across repeats."""
    return run_variants(case, trace, [variant], chunk_bytes, repeats)[variant]


def run_variants(
    case: Case,
    trace: ChatTrace | TrafficTrace,
    variants: list[Variant],
    chunk_bytes: int,
    repeats: int,
) -> dict[Variant, Result]:
    """``repeats`` fresh runs of each variant, in rounds: every round runs each variant once,
    in order, so the repeats of native and hybridkv meet the same load on a shared machine
    (run one variant after the other, a load that changed between them moved their CPU
    ratio: docs/benchmarks, "Scheduler-side cost: round 3"). Timing medians; counters must
    agree across repeats."""
    settings = case.traffic_settings if isinstance(trace, TrafficTrace) else case.settings
    case = replace(case, settings=settings)
    runs: dict[Variant, list[tuple[InProcessReport, Any, tuple[Any, ...]]]] = {
        variant: [] for variant in variants
    }
    failed: dict[Variant, Result] = {}
    for _ in range(repeats):
        for variant in variants:
            if variant in failed:
                continue
            try:
                runs[variant].append(_one_run(case, trace, variant, chunk_bytes))
            except Exception as error:  # a failing connector is a result to print, not a crash
                if variant.kind != "hybridkv":
                    raise
                reason = f"{type(error).__name__}: {str(error).splitlines()[0][:90]}"
                failed[variant] = Result(None, error=reason)
    return {v: failed[v] if v in failed else _combined(runs[v]) for v in variants}


def _one_run(
    case: Case, trace: ChatTrace | TrafficTrace, variant: Variant, chunk_bytes: int
) -> tuple[InProcessReport, Any, tuple[Any, ...]]:
    """One fresh run: its report, its per-request ledger and its store and continuation counts."""
    engine, counter = _engine(case, variant, chunk_bytes)
    try:
        admissions = _Admissions(engine)
        report, ledger = _play(engine, trace)
        skip = set(ledger.aborted) if ledger else set()
        continuation = continuation_hits(engine, admissions.cached, skip)
    finally:
        engine.close()  # a worker's copy thread would keep its memory (inprocess)
    evicted = (counter.evictions, counter.dropped) if counter else (0, 0)
    return report, ledger, (*evicted, continuation)


def _combined(runs: list[tuple[InProcessReport, Any, tuple[Any, ...]]]) -> Result:
    """One variant's repeats as one result: timing medians, counters that must agree."""
    reports = [report for report, _, _ in runs]
    ledgers = [ledger for _, ledger, _ in runs]
    counts = [count for _, _, count in runs]
    first = reports[0]
    if any(_counters(r) != _counters(first) for r in reports) or len(set(counts)) > 1:
        return Result(first, error="counters differ between repeats")
    if any(ledger != ledgers[0] for ledger in ledgers):
        return Result(first, error="per-request counts differ between repeats")
    return Result(
        first,
        ledger=ledgers[0],
        connector_us=statistics.median(r.connector_us for r in reports),
        share=statistics.median(r.connector_share for r in reports),
        connector_cpu_us=statistics.median(r.connector_cpu_us for r in reports),
        evictions=counts[0][0],
        dropped=counts[0][1],
        continuation=counts[0][2],
    )
