"""The invariant checker of the in-process random traces (:mod:`_invariants_on_vllm`) can fail.

Each test drives HybridKVConnector inside vLLM 0.33's real Scheduler (sliding + full, the
in-process engine) to a state the invariant is about (a store in flight, a load in flight),
checks that the checker passes there, then either breaks vLLM's state by hand the way a bug
would, or runs the trace with a hybridkv method broken on purpose, and expects the checker to
name the invariant. A last test keeps :data:`CHECKED` and :data:`NOT_CHECKED` covering the
registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _invariants_on_vllm import (  # noqa: E402
    CHECKED,
    NOT_CHECKED,
    PROGRESS_WINDOW,
    InvariantChecker,
    planner_ids,
    snapshots,
)
from diffharness.layouts import RECIPES, Layout  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.store import HostStore  # noqa: E402
from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.engine_config import EngineSettings  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402
from hybridkv.vllm.scheduler_role import _PoolPins  # noqa: E402
from spec.errors import InvariantViolation  # noqa: E402
from spec.invariants import ALL_INVARIANTS  # noqa: E402

LAYOUT = Layout.SLIDING_FULL
Snaps = dict[str, dict[str, Any]]


def _engine() -> InProcessEngine:
    recipe = RECIPES[LAYOUT]
    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"host_memory_bytes": 64 << 20, "chunk_size": 32},
    )
    settings = EngineSettings(
        num_gpu_blocks=recipe.min_blocks(128) + 8,
        max_model_len=recipe.max_model_len,
        block_size=recipe.block_size,
        max_num_seqs=3,
        max_num_batched_tokens=128,
        max_steps=200,
    )
    # Copies report at the third poll, so stores and loads stay in flight for a few steps.
    return InProcessEngine(recipe.config_json(), settings, transfer, HybridKVOnCPU(delay=3))


# Two requests with one 300-token prompt: a1 stores it; once a1 is done and the GPU prefix
# cache is reset (vLLM's reset_prefix_cache), b1 finds the prefix on the host only and loads it
# (WAITING_FOR_REMOTE_KVS while the copy runs).
PROMPT = [3 + (i * 37) % 991 for i in range(300)]


def _steps(engine: InProcessEngine, checker: InvariantChecker) -> Iterator[Snaps]:
    """Play a1 then b1, checking after every step; yield each step's snapshots."""
    engine.add("a1", PROMPT, 2)
    added = False
    while engine.busy() or not added:
        if not added and not engine.busy():
            assert engine.scheduler.reset_prefix_cache()
            engine.add("b1", [*PROMPT, 5, 6, 7], 2)
            added = True
        engine.step()
        checker.after_step()
        yield snapshots(engine, (), {}, frozenset())


def _reach(want: Callable[[Snaps], bool]) -> tuple[InProcessEngine, InvariantChecker, Snaps]:
    """An engine stopped at the first checked step whose snapshots satisfy ``want``."""
    engine = _engine()
    checker = InvariantChecker(engine)
    for snaps in _steps(engine, checker):
        if want(snaps):
            return engine, checker, snaps
    raise AssertionError("the trace never reached the state the test needs")


def _jobs(snaps: Snaps, kind: str) -> list[tuple[Any, ...]]:
    return [job for job in snaps["connector"]["jobs"] if job[1] == kind]


def _store_in_flight(snaps: Snaps) -> bool:
    return bool(_jobs(snaps, "store"))


def _load_in_flight(snaps: Snaps) -> bool:
    return bool(_jobs(snaps, "load"))


def _pool(engine: InProcessEngine) -> Any:
    return engine.scheduler.kv_cache_manager.block_pool


# ------------------------------------------------------------------ vLLM's state broken by hand


@pytest.mark.mutation("BP-1", "BP-2", "GR-1")
def test_a_free_block_with_a_reference_breaks_bp1_bp2_and_gr1() -> None:
    """A block left in the free queue with a reference (a free that forgot to decrement)."""
    engine, checker, _ = _reach(_store_in_flight)
    assert checker.violations() == {}
    block = _pool(engine).free_block_queue.get_all_free_blocks()[0]
    block.ref_cnt += 1
    failing = checker.violations()
    assert {"BP-1", "BP-2", "GR-1"} <= set(failing), failing
    assert f"block {block.block_id} has ref_count 1 but is queued" in failing["BP-2"]


@pytest.mark.mutation("BP-5")
def test_a_miscounted_free_queue_breaks_bp5() -> None:
    engine, checker, _ = _reach(_store_in_flight)
    _pool(engine).free_block_queue.num_free_blocks += 1
    assert set(checker.violations()) == {"BP-5"}


@pytest.mark.mutation("BP-3")
def test_a_block_that_lost_its_hash_while_still_listed_breaks_bp3() -> None:
    """The hash map lists a block whose hash was reset (an eviction that forgot the map)."""
    engine, checker, _ = _reach(_store_in_flight)
    cached = next(b for b in _pool(engine).blocks if b.block_hash is not None)
    cached.reset_hash()
    assert "BP-3" in checker.violations()


@pytest.mark.mutation("GR-8", "GR-1")
def test_a_null_block_in_a_full_attention_table_breaks_gr8() -> None:
    engine, checker, _ = _reach(_store_in_flight)
    managers = engine.scheduler.kv_cache_manager.coordinator.single_type_managers
    full = next(m for m in managers if type(m).__name__ == "FullAttentionManager")
    rid = next(iter(full.req_to_blocks))
    full.req_to_blocks[rid].append(_pool(engine).null_block)
    assert "GR-8" in checker.violations()


@pytest.mark.mutation("TR-1")
def test_blocks_freed_while_their_load_copies_break_tr1() -> None:
    """vLLM frees the blocks of a request whose load is still copying into them (what an abort
    without a delayed free would do): they are back in the free queue, ready for reuse."""
    engine, checker, snaps = _reach(_load_in_flight)
    loads = _jobs(snaps, "load")
    assert {rid for _j, _k, rid, _s, _y, _i in loads} == {"b1"}
    engine.scheduler.kv_cache_manager.free(engine.requests["b1"])
    failing = checker.violations()
    assert "TR-1" in failing, failing
    blocks = sum(len(items) for *_, items in loads)
    assert len(failing["TR-1"]) == blocks, failing["TR-1"]
    assert all(" of b1: block " in m for m in failing["TR-1"])
    assert all(m.endswith("is free or the null block") for m in failing["TR-1"])


@pytest.mark.mutation("SC-5", "SC-7")
def test_a_request_waiting_for_its_load_moved_to_running_breaks_sc5_sc7() -> None:
    engine, checker, _ = _reach(_load_in_flight)
    sched = engine.scheduler
    request = sched.requests["b1"]
    assert request.status.name == "WAITING_FOR_REMOTE_KVS"
    for queue in (sched.waiting, sched.kv_holding_waiting):
        if request in queue:
            queue.remove_requests([request])
    sched.running.append(request)
    failing = checker.violations()
    assert {"SC-5", "SC-7"} <= set(failing), failing


# ------------------------------------------------------------------ hybridkv broken on purpose


def _play_broken() -> InvariantViolation:
    engine = _engine()
    checker = InvariantChecker(engine)
    with pytest.raises(InvariantViolation) as caught:
        for _ in _steps(engine, checker):
            pass
    return caught.value


@pytest.mark.mutation("GR-1")
def test_store_sources_not_pinned_in_vllms_pool_breaks_gr1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The facade forgets to pin a store's source blocks (and to unpin them): the core still
    counts them held, vLLM's reference counts do not."""
    monkeypatch.setattr(_PoolPins, "touch", lambda self, blocks: None)
    monkeypatch.setattr(_PoolPins, "free_blocks", lambda self, blocks: None)
    violation = _play_broken()
    assert violation.invariant_id == "GR-1", violation


@pytest.mark.mutation("MB-4")
def test_a_load_that_never_unpins_its_host_entries_breaks_mb4(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The host store forgets to release a finished load's pins."""
    monkeypatch.setattr(HostStore, "complete_load", lambda self, keys: None)
    violation = _play_broken()
    assert violation.invariant_id == "MB-4", violation


@pytest.mark.mutation("SC-12")
def test_a_scheduler_that_schedules_nothing_breaks_sc12() -> None:
    """vLLM's scheduler stops scheduling with requests unfinished (paused by hand): steps run
    and nothing moves, the face of issue 29's spin. Once the transfers in flight land, the
    window runs out at its last step, long before the harness's step cap."""
    from vllm.v1.core.sched.interface import PauseState

    engine, checker, _ = _reach(_store_in_flight)
    engine.scheduler.set_pause_state(PauseState.PAUSED_ALL)

    def spin() -> None:
        for _ in range(4 * PROGRESS_WINDOW):
            engine.step()
            checker.after_step()

    with pytest.raises(InvariantViolation) as raised:
        spin()
    assert raised.value.invariant_id == "SC-12"
    assert f"{PROGRESS_WINDOW + 1} steps without progress" in raised.value.detail
    assert checker.progress.idle == PROGRESS_WINDOW + 1
    assert checker.steps < engine.settings.max_steps


# ------------------------------------------------------------------ the lists


def test_checked_and_not_checked_cover_the_registry() -> None:
    checked = {inv_id for ids in CHECKED.values() for inv_id in ids}
    subjects = {ALL_INVARIANTS[i].subject for i in checked}
    assert subjects == set(CHECKED)
    assert all(ALL_INVARIANTS[i].subject == s for s, ids in CHECKED.items() for i in ids)
    listed = [*checked, *NOT_CHECKED, *planner_ids()]
    assert sorted(listed) == sorted(ALL_INVARIANTS)


def test_the_unbroken_trace_passes_every_step() -> None:
    engine = _engine()
    checker = InvariantChecker(engine)
    steps = sum(1 for _ in _steps(engine, checker))
    assert steps == checker.steps > 0
    assert engine.report(2).wrong_reads == 0
    assert checker.situations["store_in_flight"] > 0
    assert checker.situations["load_in_flight"] > 0
    assert min(checker.evaluated.values()) == steps
    # The trace's longest run of idle steps, far inside SC-12's window.
    assert checker.progress.longest < PROGRESS_WINDOW // 4
