"""The in-process random fault traces: one seed -> one trace played inside vLLM 0.33's real
``Scheduler`` (:mod:`hybridkv.vllm.harness.inprocess`) with HybridKVConnector, the spec's invariants
checked after every step (:mod:`_invariants_on_vllm`).

Shared by ``test_hybridkv_inprocess.py`` (a batch per layout under pytest) and the soak runner
(``tools/soak.py``, thousands of seeds over worker processes), so it imports no pytest. A trace
is a pure function of its seed and its layout's :class:`Shape`: replaying a seed replays the
trace.

What a trace draws (:func:`play`): 4-7 requests over two shared prompt bases, a GPU pool from
tight (preemptions) to roomy, load and store failures injected before submission and inside
the copy (:class:`hybridkv.vllm.harness.cpu_worker.FaultPlan`), copies 0-3 steps late, a host
tier of 64 MB or of six prompts, a load deadline of none, 1 or 2 steps, aborts of requests
waiting for their load (1 in 4 per step) and random aborts (1 in 100 per step).

:func:`play` reports what it observed (:class:`Outcome`) and asserts nothing; it raises
:class:`hybridkv.vllm.harness.engine_config.WedgedError` past ``max_steps`` and
:class:`spec.errors.InvariantViolation` at the first step that breaks an invariant.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from _invariants_on_vllm import InvariantChecker
from diffharness.layouts import RECIPES, Layout
from vllm.config import KVTransferConfig

from hybridkv.vllm.harness.cpu_worker import FaultPlan, HybridKVOnCPU
from hybridkv.vllm.harness.engine_config import (
    EngineSettings,
    WedgedError,
    default_async_scheduling,
)
from hybridkv.vllm.harness.inprocess import InProcessEngine
from hybridkv.vllm.harness.report import InProcessReport
from spec.kinds import GroupKind

__all__ = [
    "HOST_BYTES",
    "SHAPES",
    "Arrival",
    "Outcome",
    "Shape",
    "play",
    "random_trace",
    "residue",
    "shared_prefix_trace",
    "smallest_pool",
    "step_budget",
    "transfer",
]

HOST_BYTES = 64 << 20


def transfer(
    chunk_size: int, host_bytes: int = HOST_BYTES, deadline: int | None = None
) -> KVTransferConfig:
    """HybridKVConnector's transfer config: recompute on a failed load, ``deadline`` steps
    per load (None: no deadline)."""
    return KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "host_memory_bytes": host_bytes,
            "chunk_size": chunk_size,
            "load_deadline_steps": deadline,
        },
    )


def residue(engine: InProcessEngine) -> Counter[str]:
    """What an engine still holds once every request is done: each nonzero count is a leak
    (transfers pending, core jobs, held blocks or requests, store entries pinned or storing,
    GPU blocks not back in vLLM's pool). Empty when quiescent."""
    core = engine.scheduler.connector.core
    stats = core.stats()
    store = core.store.stats()
    found = Counter(
        pending_transfers=engine.adapter.pending(),
        jobs_in_flight=stats.jobs_in_flight,
        held_blocks=stats.held_blocks,
        core_requests=stats.requests,
        store_pinned=store.pinned,
        store_storing=store.storing,
        leaked_gpu_blocks=engine.leaked_blocks(),
    )
    return +found  # drop the zeros


@dataclass(frozen=True, slots=True)
class Shape:
    """One layout's random-trace geometry: the budget, the chunk, prompt and output lengths
    (sliding windows free blocks as a prompt advances, so only decoding past the pool
    preempts there: longer outputs). ``budget`` is the tokens in flight; a step's is
    :func:`step_budget`."""

    layout: Layout
    budget: int
    chunk: int
    max_prompt: int
    max_seqs: int
    max_tokens: int


SHAPES = {
    s.layout: s
    for s in (
        Shape(Layout.MAMBA_FULL, 1280, 640, 2400, 2, 3),
        Shape(Layout.SLIDING_FULL, 128, 32, 400, 3, 40),
        Shape(Layout.THREE_GROUPS, 128, 32, 400, 3, 24),
    )
}


def _batches() -> int:
    """The steps the engine loop in use keeps in flight (``HYBRIDKV_ENGINE_LOOP``): vLLM's
    ``max_concurrent_batches``, 2 under async scheduling."""
    return 2 if default_async_scheduling() else 1


def step_budget(shape: Shape) -> int:
    """``max_num_batched_tokens`` for ``shape`` under the engine loop in use.

    A sliding window's smallest pool reserves its admission cap over the tokens in flight, one
    step's budget per concurrent batch (``VllmConfig.max_in_flight_tokens``), so under async
    scheduling the layouts with a window schedule ``budget / 2`` a step: the tokens in flight,
    and the tight pools that make them preempt, stay those of the sync loop (with the whole
    budget, vLLM's minimum grows by four blocks and preemptions with a store in flight all but
    vanish). The mamba + full pool does not depend on the budget: it keeps the whole of it.
    """
    windowed = any(g.kind is GroupKind.SLIDING for g in RECIPES[shape.layout].spec_groups())
    return shape.budget // _batches() if windowed else shape.budget


def smallest_pool(shape: Shape) -> int:
    """The smallest GPU pool vLLM's start-up check accepts for ``shape`` under the engine loop
    in use: ``LayoutRecipe.min_blocks`` of the tokens in flight (:func:`step_budget` per
    batch), since a sliding window reserves for every batch in flight."""
    return RECIPES[shape.layout].min_blocks(step_budget(shape) * _batches())


@dataclass(frozen=True, slots=True)
class Arrival:
    step: int
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int


def random_trace(shape: Shape, rng: random.Random) -> list[Arrival]:
    """4-7 requests over two shared bases: prefixes of a base (repeats, extensions) plus a few
    own tokens, arriving over the first steps so later ones find earlier ones' chunks stored."""
    bases = [[rng.randint(3, 999) for _ in range(shape.max_prompt)] for _ in range(2)]
    arrivals = []
    for i in range(rng.randint(4, 7)):
        base = rng.choice(bases)
        length = rng.randint(shape.chunk // 2, shape.max_prompt - 8)
        own = [rng.randint(3, 999) for _ in range(rng.choice((0, 0, 3, shape.chunk // 2)))]
        prompt = (base[:length] + own)[: shape.max_prompt]
        arrivals.append(
            Arrival(rng.randint(0, 10), f"r{i}", tuple(prompt), rng.randint(1, shape.max_tokens))
        )
    return sorted(arrivals, key=lambda a: (a.step, a.request_id))


def shared_prefix_trace(shape: Shape, rng: random.Random) -> list[Arrival]:
    """4-7 requests sharing one long prefix (issue 29's workload in small): 60-90% of the
    longest prompt (several sliding windows), then each request's own tail of at least half the
    rest (what a loaded request still has to allocate to run), 1-4 output tokens (the issue's
    16 after 2,000), all arriving within the first 3 steps: the first request finishes right
    after its prompt while its stores run, and the others then find the prefix on the host at
    once, with nothing running."""
    prefix_len = rng.randint(shape.max_prompt * 6 // 10, shape.max_prompt * 9 // 10)
    prefix = [rng.randint(3, 999) for _ in range(prefix_len)]
    rest = shape.max_prompt - prefix_len
    arrivals = []
    for i in range(rng.randint(4, 7)):
        own = [rng.randint(3, 999) for _ in range(rng.randint(rest // 2, rest))]
        arrivals.append(
            Arrival(
                rng.randint(0, 3),
                f"r{i}",
                tuple(prefix + own),
                rng.randint(1, min(4, shape.max_tokens)),
            )
        )
    return sorted(arrivals, key=lambda a: (a.step, a.request_id))


@dataclass(slots=True)
class Outcome:
    """One trace's observations (every figure counted from what the engine did).

    Attributes:
        report: the engine's own report (wrong reads, preemptions, slots checked...).
        faults: faults the worker adapter fired (loads and stores).
        failed_loads: requests vLLM got in ``failed_recving``.
        recovered: of those, the ones not aborted that finished by length (recomputed).
        aborted_loading / aborted: aborts of requests waiting for their load / all aborts.
        situations: the checker's tally of exercised states and checked steps.
        deadlines: load deadlines the connector fired.
        load_jobs / failed_jobs: the core's load jobs, and its load and store jobs that failed.
        unfinished: requests not finished when the engine went idle.
        residue: :func:`residue` at the end (empty: no leak).
    """

    report: InProcessReport
    faults: int
    failed_loads: set[str]
    recovered: int
    aborted_loading: int
    aborted: int
    situations: Counter[str]
    deadlines: int
    load_jobs: int = 0
    failed_jobs: int = 0
    unfinished: int = 0
    residue: Counter[str] = field(default_factory=Counter)


def _engine(shape: Shape, rng: random.Random, seed: int) -> InProcessEngine:
    recipe = RECIPES[shape.layout]
    settings_ = EngineSettings(
        num_gpu_blocks=smallest_pool(shape) + rng.choice((0, 1, 3, 8)),
        max_model_len=recipe.max_model_len,
        block_size=recipe.block_size,
        max_num_seqs=shape.max_seqs,
        max_num_batched_tokens=step_budget(shape),
        max_steps=600,
    )
    plan = FaultPlan(seed, load_rate=rng.choice((0.0, 0.3, 0.6)), store_rate=rng.choice((0.0, 0.3)))
    host = rng.choice((HOST_BYTES, 6 * RECIPES[shape.layout].max_model_len * 4096))
    # Drawn apart, so the traces' other draws stay those of the runs before deadlines existed.
    deadline = random.Random(seed * 7919 + 1).choice((None, 1, 2))
    return InProcessEngine(
        recipe.config_json(),
        settings_,
        transfer(shape.chunk, host, deadline),
        HybridKVOnCPU(faults=plan, delay=rng.choice((0, 1, 2, 3))),
    )


def _watch_failed_loads(engine: InProcessEngine, failed: set[str]) -> None:
    worker = engine.worker
    real = worker.get_transfer_results

    def results(finished: Any) -> Any:
        out = real(finished)
        failed.update(out.failed_recving)
        return out

    worker.get_transfer_results = results


def play(shape: Shape, seed: int) -> Outcome:
    """Play trace ``seed`` of ``shape`` (module docstring); the engine is closed after."""
    rng = random.Random(seed)
    engine = _engine(shape, rng, seed)
    try:
        return _drive(engine, shape, seed, rng)
    finally:
        engine.close()  # the worker's copy thread would keep the engine's memory (nightly: OOM)


def _drive(engine: InProcessEngine, shape: Shape, seed: int, rng: random.Random) -> Outcome:
    invariants = InvariantChecker(engine)
    failed: set[str] = set()
    _watch_failed_loads(engine, failed)
    arrivals = random_trace(shape, rng)
    aborted: set[str] = set()
    aborted_loading = 0
    step = 0
    while arrivals or engine.busy():
        while arrivals and arrivals[0].step <= step:
            a = arrivals.pop(0)
            engine.add(a.request_id, list(a.prompt), a.max_tokens)
        step += 1
        if not engine.busy():
            continue
        if engine.tally.steps >= engine.settings.max_steps:
            live = {
                rid: (engine.status(rid), r.num_computed_tokens, r.num_prompt_tokens)
                for rid, r in engine.requests.items()
                if not r.is_finished()
            }
            core = engine.scheduler.connector.core.stats()
            raise WedgedError(f"seed {seed}: max_steps={engine.settings.max_steps} {live} {core}")
        for rid, request in engine.requests.items():
            if request.is_finished() or rid in aborted:
                continue
            loading = engine.status(rid) == "WAITING_FOR_REMOTE_KVS"
            if rng.random() < (0.25 if loading else 0.01) and engine.abort(rid):
                aborted.add(rid)
                aborted_loading += loading
        engine.step()
        invariants.after_step()
    finished = sum(r.is_finished() for r in engine.requests.values())
    report = engine.report(finished)
    recovered = sum(
        engine.status(rid) == "FINISHED_LENGTH_CAPPED" for rid in failed if rid not in aborted
    )
    faults = engine.adapter.stats()
    deadlines = engine.scheduler.connector.deadlines
    core = engine.scheduler.connector.core.stats()
    return Outcome(
        report,
        faults.get("load_faults", 0) + faults.get("store_faults", 0),
        failed,
        recovered,
        aborted_loading,
        len(aborted),
        invariants.situations,
        0 if deadlines is None else deadlines.fired,
        load_jobs=core.load_jobs,
        failed_jobs=core.load_jobs_failed + core.store_jobs_failed,
        unfinished=report.requests - report.finished,
        residue=residue(engine),
    )
