"""``HybridKVConnector`` inside the in-process vLLM 0.33 engine
(:mod:`hybridkv.vllm.harness.inprocess`): vLLM's real Scheduler with HMA on, the caches vLLM's own
``allocate_kv_cache`` builds (the hybrid stride, mamba pages viewed as vLLM's runner registers
them), every read content-checked.

- The multi-turn chat of ``test_inprocess_engine.py`` on mamba-align + full and sliding + full:
  host hits, 0 wrong reads, 0 leaked GPU blocks, and at the end nothing in flight, no store
  entry pinned or storing, no block held, no request left in the core.
- Random traces (a seeded generator; ``max_examples`` of the Hypothesis profile, split over three
  layouts: ``ci`` 201 traces, ``nightly`` 2,001) with load and store failures injected before
  submission and inside the copy (:class:`hybridkv.vllm.harness.cpu_worker.FaultPlan`), tight GPU
  pools (preemptions on every layout), aborts of requests waiting for their load, random aborts, and
  load deadlines (a third of the traces draw ``load_deadline_steps`` 1 or 2 against copies 0-3
  steps late, so some loads outlive it: abandoned, their copies cancelled, their requests
  recomputed): 0 wrong reads, 0 wedges, 0 leaks, 0 violations of the spec's invariants
  evaluated on vLLM's and the connector's state after every step (:mod:`_invariants_on_vllm`),
  and across each layout's batch failures injected, loads failed, deadlines fired and the
  requests they hit recovered by recompute, preemptions, and the states the invariants exist
  for (stores and loads in flight, a store reading a preempted request's blocks, delayed frees,
  parked loads).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _invariants_on_vllm import EXERCISED, InvariantChecker  # noqa: E402
from diffharness.layouts import RECIPES, Layout  # noqa: E402
from hypothesis import settings  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.vllm.harness.chat import ChatTrace, run_trace  # noqa: E402
from hybridkv.vllm.harness.cpu_worker import FaultPlan, HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.engine_config import EngineSettings, WedgedError  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402
from hybridkv.vllm.harness.report import InProcessReport  # noqa: E402

HOST_BYTES = 64 << 20


def _transfer(
    chunk_size: int, host_bytes: int = HOST_BYTES, deadline: int | None = None
) -> KVTransferConfig:
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


def _quiescent(engine: InProcessEngine) -> None:
    """Nothing in flight, pinned, storing, held or remembered once every request is done."""
    core = engine.scheduler.connector.core
    stats = core.stats()
    store = core.store.stats()
    assert engine.adapter.pending() == 0
    assert (stats.jobs_in_flight, stats.held_blocks, stats.requests) == (0, 0, 0), stats
    assert (store.pinned, store.storing) == (0, 0), store
    assert engine.leaked_blocks() == 0


# ------------------------------------------------------------------ the chat trace

# The GPU pools of test_inprocess_engine.py; chunk = one block of the layout.
CHAT = {
    Layout.MAMBA_FULL: (
        EngineSettings(
            num_gpu_blocks=16, max_model_len=2560, max_num_seqs=2, max_num_batched_tokens=1280
        ),
        ChatTrace(convs=3, turns=3, system_len=700, user_min=150, user_max=300),
        640,
    ),
    Layout.SLIDING_FULL: (
        EngineSettings(
            num_gpu_blocks=30,
            max_model_len=512,
            block_size=32,
            max_num_seqs=3,
            max_num_batched_tokens=128,
        ),
        ChatTrace(convs=4, turns=3, system_len=128),
        32,
    ),
}


@pytest.mark.parametrize("sized", [False, True], ids=["extra-config", "host-bytes-delay0"])
@pytest.mark.parametrize("layout", list(CHAT), ids=lambda lay: lay.value)
def test_hybridkv_hits_the_host_tier_with_correct_content(layout: Layout, sized: bool) -> None:
    """Sized: the adapter's ``host_bytes`` replaces an extra config of 1 byte (too small to
    build the connector) and copies report at the first poll (delay 0, as the native rule)."""
    settings_, trace, chunk = CHAT[layout]
    adapter = HybridKVOnCPU(host_bytes=HOST_BYTES, delay=0) if sized else HybridKVOnCPU()
    transfer = _transfer(chunk, 1 if sized else HOST_BYTES)
    engine = InProcessEngine(RECIPES[layout].config_json(), settings_, transfer, adapter)
    assert engine.scheduler.connector.hybridkv_config.host_memory_bytes == HOST_BYTES
    report = run_trace(engine, trace)
    print(f"\n{layout.value} HybridKVConnector d={adapter.delay}: {report}")
    assert report.connector == "HybridKVConnector"
    assert report.finished == report.requests > 0
    assert report.slots_checked > 0
    assert report.wrong_reads == 0
    assert report.external_loaded > 0
    assert report.external_hits == report.external_loaded
    assert report.preemptions == 0  # the identity below holds without recompute
    total = report.prefill_computed + report.gpu_prefix_hits + report.external_hits
    assert total == report.prompt_tokens
    assert report.transfers["bytes_loaded"] > 0
    assert report.transfers["bytes_stored"] > 0
    assert engine.scheduler.connector.core.stats().loaded_tokens == report.external_loaded
    _quiescent(engine)


def test_every_load_drawn_to_fail_in_its_copy_fails_one_run_copies_included() -> None:
    """``load_rate=1.0, mid_copy=1.0``: every load fails inside its copy. Most loads of mamba +
    full carry one full-attention block, one copy run: with no second run to raise in, such a
    load moves its bytes and reports failed (it used to succeed, so ``--faults`` fell short of
    its rate); vLLM recomputes every request whose load failed, and no read is wrong. A system
    prompt of two chunks makes a load of two jobs: the first chunk's full block alone, then the
    second's with the mamba states."""
    settings_, _, chunk = CHAT[Layout.MAMBA_FULL]
    trace = ChatTrace(convs=3, turns=3, system_len=1400, user_min=150, user_max=300)
    adapter = HybridKVOnCPU(faults=FaultPlan(3, load_rate=1.0, mid_copy=1.0))
    engine = InProcessEngine(
        RECIPES[Layout.MAMBA_FULL].config_json(), settings_, _transfer(chunk), adapter
    )
    report = run_trace(engine, trace)
    core = engine.scheduler.connector.core.stats()
    assert report.finished == report.requests > 0
    assert report.wrong_reads == 0
    assert core.load_jobs > 0
    assert adapter.stats()["load_faults"] == core.load_jobs_failed == core.load_jobs
    assert adapter.stats().get("store_faults", 0) == core.store_jobs_failed == 0
    assert report.failed_loads > 0
    assert report.transfers["faults_injected"] == 0  # none failed before submission
    _quiescent(engine)


# ------------------------------------------------------------------ random traces


@dataclass(frozen=True, slots=True)
class Shape:
    """One layout's random-trace geometry: the budget, the chunk, prompt and output lengths
    (sliding windows free blocks as a prompt advances, so only decoding past the pool
    preempts there: longer outputs)."""

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
TRACES_PER_LAYOUT = max(10, -(-settings.default.max_examples // len(SHAPES)))


@dataclass(frozen=True, slots=True)
class Arrival:
    step: int
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int


def _random_trace(shape: Shape, rng: random.Random) -> list[Arrival]:
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


@dataclass(slots=True)
class Outcome:
    """One trace's observations."""

    report: InProcessReport
    faults: int
    failed_loads: set[str]
    recovered: int
    aborted_loading: int
    aborted: int
    situations: Counter[str]
    deadlines: int


def _engine(shape: Shape, rng: random.Random, seed: int) -> InProcessEngine:
    recipe = RECIPES[shape.layout]
    settings_ = EngineSettings(
        num_gpu_blocks=recipe.min_blocks(shape.budget) + rng.choice((0, 1, 3, 8)),
        max_model_len=recipe.max_model_len,
        block_size=recipe.block_size,
        max_num_seqs=shape.max_seqs,
        max_num_batched_tokens=shape.budget,
        max_steps=600,
    )
    plan = FaultPlan(seed, load_rate=rng.choice((0.0, 0.3, 0.6)), store_rate=rng.choice((0.0, 0.3)))
    host = rng.choice((HOST_BYTES, 6 * RECIPES[shape.layout].max_model_len * 4096))
    # Drawn apart, so the traces' other draws stay those of the runs before deadlines existed.
    deadline = random.Random(seed * 7919 + 1).choice((None, 1, 2))
    return InProcessEngine(
        recipe.config_json(),
        settings_,
        _transfer(shape.chunk, host, deadline),
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


def _play(shape: Shape, seed: int) -> Outcome:
    rng = random.Random(seed)
    engine = _engine(shape, rng, seed)
    invariants = InvariantChecker(engine)
    failed: set[str] = set()
    _watch_failed_loads(engine, failed)
    arrivals = _random_trace(shape, rng)
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
    report = engine.report(sum(r.is_finished() for r in engine.requests.values()))
    assert report.finished == report.requests, f"seed {seed}: unfinished requests"
    _quiescent(engine)
    engine.close()  # the worker's copy thread would keep the engine's memory (nightly: OOM)
    recovered = sum(
        engine.status(rid) == "FINISHED_LENGTH_CAPPED" for rid in failed if rid not in aborted
    )
    faults = engine.adapter.stats()
    deadlines = engine.scheduler.connector.deadlines
    return Outcome(
        report,
        faults.get("load_faults", 0) + faults.get("store_faults", 0),
        failed,
        recovered,
        aborted_loading,
        len(aborted),
        invariants.situations,
        0 if deadlines is None else deadlines.fired,
    )


@pytest.mark.parametrize("layout", list(SHAPES), ids=lambda lay: lay.value)
def test_random_traces_with_faults_preemptions_and_aborts(layout: Layout) -> None:
    shape = SHAPES[layout]
    total: Counter[str] = Counter()
    for seed in range(TRACES_PER_LAYOUT):
        out = _play(shape, seed)
        r = out.report
        assert r.wrong_reads == 0, f"seed {seed}: {r}"
        total.update(
            traces=1,
            prompt=r.prompt_tokens,
            computed=r.prefill_computed,
            gpu_hits=r.gpu_prefix_hits,
            host_loaded=r.external_loaded,
            slots_checked=r.slots_checked,
            wrong_reads=r.wrong_reads,
            preemptions=r.preemptions,
            faults_injected=out.faults,
            failed_loads=len(out.failed_loads),
            recovered=out.recovered,
            aborted=out.aborted,
            aborted_loading=out.aborted_loading,
            deadlines_fired=out.deadlines,
        )
        total.update(out.situations)
    print(f"\n{layout.value}: {dict(total)}")
    assert total["wrong_reads"] == 0
    counted = ("slots_checked", "host_loaded", "faults_injected", "failed_loads", "recovered")
    for name in (*counted, "deadlines_fired"):
        assert total[name] > 0, (name, dict(total))
    assert total["aborted_loading"] > 0, dict(total)
    # The invariants ran after every step (0 violations, else _play raised) on states that
    # exercise them: preemptions, stores and loads in flight, pins outside the tables...
    for name in ("preemptions", *EXERCISED):
        assert total[name] > 0, (name, dict(total))
