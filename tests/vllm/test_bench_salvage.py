"""tools/bench_salvage.py's figures, asserted where every term is non-zero.

The tool plays chat traces on vLLM 0.33's real Scheduler (in-process, CPU tensors) with load jobs
failing by a keyed draw, once with HybridKVConnector's re-claim after a failed load (salvage) and
once with it switched off (vLLM's whole-request recompute), and counts from the scheduler's own
outputs and the worker's ``failed_recving``. Asserted here, on sliding + full (seeds 1-4: under
either engine loop, restarted requests find a local prefix hit in some and the re-claim loads in
others) and on mamba + full (seed 1: the re-claim loads one 640-token unit; a mamba request has no
local hit after its restart, so that term is 0 there):

- per run, the identity of every recovered failure: the failed loads' ends == local hit +
  reloaded + recomputed (no preemption hit a recovery, so the last restart is the only one);
- salvage reloads tokens and the whole-request run reloads none (the switch is observed);
- fewer tokens recomputed with salvage, and 0 wrong reads, 0 leaked blocks in both runs.

Then the facade's restart guard (hybridkv.vllm.reclaim). Two vLLM 0.33 wedges after a failed load
are pinned with the guard switched off and avoided with it on. On tight pools (from the smallest
that vLLM accepts under the engine loop in use) the guard is on: 0 wedges, and salvage still
recomputes less.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _inprocess import load_tool  # noqa: E402

bench = load_tool("bench_salvage")


def _case(name: str) -> object:
    (case,) = (c for c in bench.cases(quick=False) if c.name == name)
    return case


@pytest.mark.parametrize(
    ("name", "seeds", "local"),
    [("sliding+full", range(1, 5), True), ("mamba+full", range(1, 2), False)],
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


def _engine(pool: int, seed: int, *, salvage: bool, guard: bool) -> object:
    """The tool's sliding + full case on ``pool`` GPU blocks, its faults keyed by ``seed``."""
    from dataclasses import replace

    case = _case("sliding+full")
    tight = replace(case, settings=replace(case.settings, num_gpu_blocks=pool, max_steps=300))
    engine = bench.InProcessEngine(
        tight.config_json,
        tight.settings,
        bench._transfer(tight.chunk),
        bench.KeyedLoadFaults(seed, tight.load_rate),
    )
    engine.scheduler.connector.core._set_salvage(salvage)
    engine.scheduler.connector._reclaim.enabled = guard
    # The load admission rule (hybridkv.vllm.admission) defers these claims before vLLM can
    # refuse them: off, so the guard alone meets vLLM's wedge (it has tests of its own).
    engine.scheduler.connector._admission.enabled = False
    return engine, replace(tight.trace, seed=seed)


def _remaining(scheduler: object, request: object) -> int:
    return scheduler._request_remaining_blocks(request)


def _wedged_head(engine: object) -> tuple[object, int, int]:
    """vLLM's state at the wedge, asserted: the head of ``kv_holding_waiting`` is a request
    restarted by a failed load (no block held, its stale ``_inflight_prefills`` entry kept),
    nothing runs, and a request behind it finished its load and holds blocks. Returns the head,
    the free blocks and the other in-flight prefills' reservations."""
    scheduler = engine.scheduler
    head = scheduler.kv_holding_waiting.peek_request()
    assert head.status.name == "WAITING"
    assert head.num_computed_tokens == 0  # restarted by the failed load; no block held
    assert head in scheduler._inflight_prefills  # the stale reservation
    assert scheduler.running == []
    behind = [r for r in scheduler.kv_holding_waiting if r is not head]
    assert any(r.request_id in scheduler.finished_recving_kv_req_ids for r in behind)
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    others = sum(_remaining(scheduler, r) for r in scheduler._inflight_prefills if r is not head)
    return head, free, others


def test_a_salvaged_re_claim_wedges_vllm_unless_the_guard_defers_it() -> None:
    """vLLM 0.33 finding, reached through salvage (hybridkv.vllm.reclaim): a request whose
    async load failed keeps its entry in the scheduler's ``_inflight_prefills`` after
    ``_update_waiting_for_remote_kv`` freed its blocks. Its async re-claim then reserves its own
    remaining blocks on top of allocating them (``reserved_blocks`` counts every in-flight
    prefill), is refused, and, at the head of ``kv_holding_waiting``, ``break``s the waiting
    loop before a request behind it whose load has finished: nothing runs, nothing frees, the
    engine wedges. sliding + full, seed 14, 39 GPU blocks (a point where this holds under
    either engine loop).

    With the facade's guard switched off the wedge is pinned: without its own stale entry even
    the head's whole remaining sequence would fit; with it, not one block per group does. With
    the guard on (the default), the refused re-claim is deferred once, vLLM moves the request
    to ``waiting``, the request behind runs, the re-claim is offered again and reloads tokens,
    and the trace finishes with every read content-checked.
    """
    engine, trace = _engine(39, 14, salvage=True, guard=False)
    with pytest.raises(bench.WedgedError):
        bench.run_trace(engine, trace)
    head, free, others = _wedged_head(engine)
    own = _remaining(engine.scheduler, head)
    groups = len(engine.scheduler.kv_cache_config.kv_cache_groups)
    assert free - others >= own
    assert free - others - own < groups

    engine, trace = _engine(39, 14, salvage=True, guard=True)
    watch = bench.SalvageWatch(engine)
    report = bench.run_trace(engine, trace)
    guard = engine.scheduler.connector._reclaim
    tally = watch.finish()
    assert report.finished == report.requests
    assert (report.wrong_reads, report.leaked_blocks) == (0, 0)
    assert report.slots_checked > 0
    assert guard.deferred > 0
    assert tally.failed_loads > 0
    assert tally.reloaded > 0  # salvage kept after the deferral
    assert tally.broken == []
    assert len(guard) == 0  # every restart admitted or finished
    # The deferrals reach vLLM's stats pipeline as counted (hybridkv.vllm.metrics).
    payloads = engine.connector_stats
    assert sum(p.get("restarts_deferred", 0) for p in payloads) == guard.deferred
    assert sum(p.get("restarts_whole", 0) for p in payloads) == guard.whole


def test_whole_request_recompute_wedges_vllm_unless_the_guard_defers_it() -> None:
    """vLLM 0.33 finding, without salvage: the restarted request at the head of
    ``kv_holding_waiting`` claims nothing, so it reserves nothing, but the default
    ``scheduler_reserve_full_isl`` admission needs its whole sequence to fit in the free
    blocks, and the request behind it (load finished) holds too many: refused, ``break``,
    nothing runs. sliding + full, seed 6, salvage off, on the smallest pool vLLM accepts
    under the engine loop in use (34 GPU blocks under sync scheduling, 38 under async, where
    the sliding window reserves for two steps in flight). The guard defers the head (vLLM moves
    it to ``waiting``: it holds no block) and the trace finishes.
    """
    pool = bench.smallest_pool(_case("sliding+full"))
    engine, trace = _engine(pool, 6, salvage=False, guard=False)
    with pytest.raises(bench.WedgedError):
        bench.run_trace(engine, trace)
    head, free, _ = _wedged_head(engine)
    assert engine.scheduler.scheduler_reserve_full_isl
    assert _remaining(engine.scheduler, head) > free

    engine, trace = _engine(pool, 6, salvage=False, guard=True)
    report = bench.run_trace(engine, trace)
    assert report.finished == report.requests
    assert (report.wrong_reads, report.leaked_blocks) == (0, 0)
    assert engine.scheduler.connector._reclaim.deferred > 0


@pytest.mark.parametrize(
    ("name", "extra", "seeds"),
    [("sliding+full", (0, 2, 4, 6, 8), range(8)), ("mamba+full", (0, 1), range(4))],
)
def test_tight_pools_never_wedge_and_salvage_still_recomputes_less(
    name: str, extra: tuple[int, ...], seeds: range
) -> None:
    """Pools below the tool's, ``extra`` blocks above the smallest that serves max_model_len
    under the engine loop in use (``bench.smallest_pool``: sliding + full 34 under sync
    scheduling, 38 under async; mamba + full 11), load faults keyed per seed: with the guard on,
    no run wedges, 0 wrong reads, 0 leaked blocks, every recovery adds up, and salvage
    recomputes fewer tokens than whole-request recompute."""
    from dataclasses import replace

    case = _case(name)
    smallest = bench.smallest_pool(case)
    deferred = 0
    for pool in (smallest + n for n in extra):
        tight = replace(case, settings=replace(case.settings, num_gpu_blocks=pool, max_steps=400))
        on, off, wedged = bench.bench_case(tight, seeds)
        print(f"\n{bench.row(name, 'salvage', on)} pool {pool}\n{bench.row(name, 'whole', off)}")
        assert wedged == []
        assert on.traces == len(seeds)
        assert bench.problems(name, "salvage", on) == bench.problems(name, "whole", off) == []
        assert on.tally.failed_loads > 0
        assert on.tally.reloaded > 0
        assert on.tally.recomputed < off.tally.recomputed
        deferred += on.deferred
    if name == "sliding+full":
        assert deferred > 0  # the guard acted on these pools
