"""hybridkv.vllm.reclaim's state machine, call by call (the module docstring gives the why;
tests/vllm/test_bench_salvage.py shows it inside vLLM's real Scheduler)."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from hybridkv.vllm.reclaim import Answer, ReclaimGuard, Restart  # noqa: E402


def _refused(guard: ReclaimGuard, rid: str, *, ran: bool) -> Answer:
    """One schedule() that asks about ``rid`` and does not admit it."""
    answer = guard.answer(rid)
    guard.schedule_ended(ran=ran)
    return answer


def test_a_request_without_a_failed_load_is_answered_by_the_core_and_not_recorded() -> None:
    guard = ReclaimGuard()
    assert guard.answer("r") is Answer.CORE
    guard.schedule_ended(ran=False)
    assert guard.state("r") is None
    assert len(guard) == 0


def test_refusals_while_something_runs_change_nothing() -> None:
    guard = ReclaimGuard()
    guard.load_failed(["r"])
    for _ in range(3):
        assert _refused(guard, "r", ran=True) is Answer.CORE
    assert guard.state("r") is Restart.FAILED
    assert (guard.retried, guard.deferred, guard.whole) == (3, 0, 0)


def test_a_refusal_while_nothing_runs_defers_then_salvages_if_the_skip_ran_something() -> None:
    guard = ReclaimGuard()
    guard.load_failed(["r"])
    assert _refused(guard, "r", ran=False) is Answer.CORE
    assert guard.state("r") is Restart.DEFER
    assert _refused(guard, "r", ran=True) is Answer.DEFER
    assert guard.state("r") is Restart.FAILED
    assert (guard.deferred, guard.whole) == (1, 0)


def test_a_deferral_that_ran_nothing_moves_to_whole_request_and_then_defers_again() -> None:
    guard = ReclaimGuard()
    guard.load_failed(["r"])
    assert _refused(guard, "r", ran=False) is Answer.CORE
    assert _refused(guard, "r", ran=False) is Answer.DEFER
    assert guard.state("r") is Restart.WHOLE
    assert _refused(guard, "r", ran=False) is Answer.NONE
    assert guard.state("r") is Restart.DEFER
    assert (guard.deferred, guard.whole) == (1, 1)


def test_admission_and_finish_forget_the_request() -> None:
    guard = ReclaimGuard()
    guard.load_failed(["a", "b"])
    assert _refused(guard, "a", ran=False) is Answer.CORE
    assert guard.answer("a") is Answer.DEFER
    guard.admitted("a")
    guard.finished("b")
    guard.schedule_ended(ran=False)  # "a" was admitted in this schedule(): no transition
    assert (guard.state("a"), guard.state("b"), len(guard)) == (None, None, 0)


def test_switched_off_it_keeps_the_record_but_answers_as_the_core() -> None:
    guard = ReclaimGuard(enabled=False)
    guard.load_failed(["r"])
    assert _refused(guard, "r", ran=False) is Answer.CORE
    assert guard.state("r") is Restart.DEFER
    assert _refused(guard, "r", ran=False) is Answer.CORE
    assert guard.state("r") is Restart.WHOLE
    assert guard.deferred == 0


def tight_pool_chat() -> tuple[Any, Any, Any]:
    """(engine, adapter, trace) of a chat that wedged vLLM 0.33 before the restart guard, first
    seen while testing tensor parallel, on one rank: sliding + full, 30 GPU blocks, half the
    loads failing, copies reported two polls late. A restarted request sat at the head of
    ``kv_holding_waiting`` holding nothing while the request behind it held 14 blocks; 8 of 16
    requests finished."""
    from diffharness.layouts import RECIPES, Layout
    from vllm.config import KVTransferConfig

    from hybridkv.vllm.harness.chat import ChatTrace
    from hybridkv.vllm.harness.cpu_worker import FaultPlan, HybridKVOnCPU
    from hybridkv.vllm.harness.engine_config import EngineSettings
    from hybridkv.vllm.harness.inprocess import InProcessEngine

    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"host_memory_bytes": 64 << 20, "chunk_size": 32},
    )
    settings_ = EngineSettings(
        num_gpu_blocks=30,
        max_model_len=512,
        block_size=32,
        max_num_seqs=3,
        max_num_batched_tokens=128,
    )
    adapter = HybridKVOnCPU(faults=FaultPlan(7, load_rate=0.5), delay=2)
    recipe = RECIPES[Layout.SLIDING_FULL]
    engine = InProcessEngine(recipe.config_json(), settings_, transfer, adapter)
    return engine, adapter, ChatTrace(convs=4, turns=4, system_len=128, seed=11)


def test_a_multi_turn_chat_with_failing_loads_on_a_tight_pool_finishes() -> None:
    """:func:`tight_pool_chat` under the guard: every request finishes, every read is correct
    and nothing leaks."""
    from hybridkv.vllm.harness.chat import run_trace

    engine, adapter, trace = tight_pool_chat()
    report = run_trace(engine, trace)
    guard = engine.scheduler.connector._reclaim
    assert report.finished == report.requests == 16
    assert (report.wrong_reads, report.leaked_blocks) == (0, 0)
    assert report.slots_checked > 0
    assert adapter.stats()["load_faults"] > 0
    assert guard.deferred > 0
    assert len(guard) == 0
