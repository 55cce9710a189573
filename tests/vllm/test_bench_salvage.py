"""tools/bench_salvage.py's figures, asserted where every term is non-zero.

The tool plays chat traces on vLLM 0.33's real Scheduler (in-process, CPU tensors) with load
jobs failing by a keyed draw, once with HybridKVConnector's re-claim after a failed load
(salvage) and once with it switched off (vLLM's whole-request recompute), and counts from the
scheduler's own outputs and the worker's ``failed_recving``. Asserted here, on sliding + full
(seeds 1-3: a restarted request finds a local prefix hit in one, the re-claim loads in two) and
on mamba + full (seed 1: the re-claim loads one 640-token unit; a mamba request has no local
hit after its restart, so that term is 0 there):

- per run, the identity of every recovered failure: the failed loads' ends == local hit +
  reloaded + recomputed (no preemption hit a recovery, so the last restart is the only one);
- salvage reloads tokens and the whole-request run reloads none (the switch is observed);
- fewer tokens recomputed with salvage, and 0 wrong reads, 0 leaked blocks in both runs.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

_PATH = Path(__file__).resolve().parents[2] / "tools" / "bench_salvage.py"


def _tool() -> ModuleType:
    found = importlib.util.spec_from_file_location("bench_salvage", _PATH)
    assert found is not None
    assert found.loader is not None
    module = importlib.util.module_from_spec(found)
    sys.modules["bench_salvage"] = module  # its dataclasses resolve names through it
    found.loader.exec_module(module)
    return module


bench = _tool()


def _case(name: str) -> object:
    (case,) = (c for c in bench.cases(quick=False) if c.name == name)
    return case


@pytest.mark.parametrize(
    ("name", "seeds", "local"),
    [("sliding+full", range(1, 4), True), ("mamba+full", range(1, 2), False)],
)
def test_salvage_recomputes_less_and_every_recovery_adds_up(
    name: str, seeds: range, local: bool
) -> None:
    on, off, wedged = bench.bench_case(_case(name), seeds)
    print(f"\n{bench.row(name, 'salvage', on)}\n{bench.row(name, 'whole', off)}")
    assert wedged == []
    for run in (on, off):
        t = run.tally
        assert t.failed_loads > 0
        assert t.failed_claimed > 0
        assert t.windows > 0
        assert t.broken == [], t.broken
        assert t.preempted_in_window == 0
        assert t.recomputed == t.recomputed_last > 0
        assert t.local + t.reloaded + t.recomputed == t.restored > 0
        assert (t.local > 0) is local
        assert (run.wrong_reads, run.leaked_blocks, run.unfinished) == (0, 0, 0)
        assert run.slots_checked > 0
        assert run.load_faults >= t.failed_loads
        assert run.traces == len(seeds)
    assert on.tally.reloaded > 0
    assert off.tally.reloaded == 0
    assert on.tally.recomputed < off.tally.recomputed
    assert bench.problems(name, "salvage", on) == bench.problems(name, "whole", off) == []


def test_a_salvaged_re_claim_can_wedge_vllm_on_a_tight_pool() -> None:
    """vLLM 0.33 finding, reached through salvage: a request whose async load failed keeps its
    entry in the scheduler's ``_inflight_prefills`` after ``_update_waiting_for_remote_kv``
    freed its blocks (only preemption, the end of its prefill and its finish remove it). Its
    async re-claim then reserves its own remaining blocks on top of allocating them
    (``reserved_blocks`` counts every in-flight prefill), fails, and, at the head of
    ``kv_holding_waiting``, ``break``s the waiting loop before a request behind it whose load
    has finished: nothing runs, nothing frees, the engine wedges. sliding + full, seed 5, with
    40 GPU blocks instead of the tool's 48; the same trace without the re-claim finishes.
    """
    from dataclasses import replace

    case = _case("sliding+full")
    tight = replace(case, settings=replace(case.settings, num_gpu_blocks=40, max_steps=300))
    adapter = bench.KeyedLoadFaults(5, tight.load_rate)
    engine = bench.InProcessEngine(
        tight.config_json, tight.settings, bench._transfer(tight.chunk), adapter
    )
    trace = replace(tight.trace, seed=5)
    with pytest.raises(bench.WedgedError):
        bench.run_trace(engine, trace)
    scheduler = engine.scheduler
    head = scheduler.kv_holding_waiting.peek_request()
    assert head.status.name == "WAITING"
    assert head.num_computed_tokens == 0  # restarted by the failed load; no block held
    assert head in scheduler._inflight_prefills  # the stale reservation
    assert scheduler.running == []
    behind = [r for r in scheduler.kv_holding_waiting if r is not head]
    assert any(r.request_id in scheduler.finished_recving_kv_req_ids for r in behind)
    whole = bench.play(tight, 5, salvage=False)
    assert whole.unfinished == 0
    assert whole.tally.failed_loads > 0
