"""vLLM's prefix-cache reset with ``HybridKVConnector`` (issue 17, :mod:`hybridkv.vllm.reset`), in
vLLM's real ``Scheduler`` (the in-process engine, :mod:`hybridkv.vllm.harness.inprocess`).

- 2b: after ``reset_prefix_cache(reset_connector=True)`` (a weight update), a prompt stored
  before the reset gets no external hit: the host tier forgot it (vLLM took the base class's
  ``None`` as success and kept serving the old KV before). Stores still in flight at the reset
  never become READY; entries pinned by a load in flight are never claimed again.
- 2c: ``reset_prefix_cache(reset_running_requests=True)`` while stores are in flight: the core's
  pins on their source blocks, and the frees it delays for aborted requests still storing (the
  RL loop's ``pause_generation(mode="abort")``), made vLLM's block pool refuse and the scheduler
  raise; now both are released first, the reset succeeds, those stores are dropped when they
  report, and the engine serves on with 0 wrong reads and 0 leaked blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from diffharness.layouts import RECIPES, Layout  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.v1.core.sched.interface import PauseState  # noqa: E402

from hybridkv.store import LookupResult  # noqa: E402
from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.engine_config import EngineSettings  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402

# Sliding window + full attention, one 32-token block per chunk (test_hybridkv_inprocess's).
SETTINGS = EngineSettings(
    num_gpu_blocks=30, max_model_len=512, block_size=32, max_num_seqs=3, max_num_batched_tokens=128
)
# Mamba (align) + full attention: one 640-token block per chunk, two prompts fit the pool.
MAMBA_SETTINGS = EngineSettings(
    num_gpu_blocks=16, max_model_len=2560, max_num_seqs=2, max_num_batched_tokens=1280
)
SHAPES = {Layout.SLIDING_FULL: (SETTINGS, 32), Layout.MAMBA_FULL: (MAMBA_SETTINGS, 640)}
PROMPT = list(range(1, 200))  # 199 tokens: 6 whole blocks stored


def _engine(delay: int, layout: Layout = Layout.SLIDING_FULL) -> InProcessEngine:
    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"host_memory_bytes": 64 << 20, "chunk_size": 32},
    )
    settings, chunk = SHAPES[layout]
    transfer.kv_connector_extra_config["chunk_size"] = chunk
    config = RECIPES[layout].config_json()
    return InProcessEngine(config, settings, transfer, HybridKVOnCPU(delay=delay))


def _drain(engine: InProcessEngine) -> None:
    while engine.busy() or engine.pending():
        assert engine.tally.steps < 500, "wedged"
        engine.step()


def _step_until(engine: InProcessEngine, done: Callable[[Any], bool]) -> None:
    """Step until ``done(core)`` (a store in flight, mostly); fail past 100 steps."""
    while not done(engine.scheduler.connector.core):
        assert engine.tally.steps < 100, "never reached"
        engine.step()


def _serve(engine: InProcessEngine, rid: str, prompt: list[int] = PROMPT) -> int:
    """Serve one request to its end; the external hit vLLM counted for it."""
    before = engine.tally.external_hits
    engine.add(rid, prompt, 4)
    _drain(engine)
    return engine.tally.external_hits - before


def _quiet(engine: InProcessEngine) -> None:
    core = engine.scheduler.connector.core
    stats, store = core.stats(), core.store.stats()
    assert engine.pending() == 0
    assert (stats.jobs_in_flight, stats.held_blocks) == (0, 0), stats
    assert (store.pinned, store.storing) == (0, 0), store
    assert engine.leaked_blocks() == 0
    assert engine.tally.wrong == 0
    assert engine.tally.checked > 0


def _reset(engine: InProcessEngine, **kw: Any) -> bool:
    return bool(engine.scheduler.reset_prefix_cache(reset_connector=True, **kw))


def _pause_until_landed(engine: InProcessEngine) -> None:
    """``pause_generation(mode="keep")`` as vLLM's engine core runs it: ``PAUSED_ALL`` schedules
    nothing while the loop keeps turning (the connector's stores in flight keep it busy), until
    every step that wrote KV has landed (``processed_step_seq`` reaches ``sched_step_seq``).

    Under async scheduling a step is always in the batch queue between two turns while requests
    run, and vLLM defers a preempted request's block frees until it lands, so its own
    ``reset_prefix_cache(reset_running_requests=True)`` raises before then, connector or not; a
    client's reset that arrives during the pause finds them landed. Under sync scheduling they
    have landed already."""
    scheduler = engine.scheduler
    scheduler.set_pause_state(PauseState.PAUSED_ALL)
    while scheduler.processed_step_seq < scheduler.sched_step_seq:
        assert engine.tally.steps < 500, "wedged"
        engine.step()


# ------------------------------------------------------------------ 2b


def test_a_prompt_stored_before_a_reset_gets_no_external_hit_after_it() -> None:
    engine = _engine(delay=1)
    assert _serve(engine, "before") == 0
    engine.scheduler.reset_prefix_cache()  # vLLM's own cache only: the host tier still serves
    assert _serve(engine, "control") > 0  # so the prompt was stored and a hit is possible
    assert engine.scheduler.connector.core.store.stats().ready > 0
    assert _reset(engine)  # a weight update: the connector too
    core = engine.scheduler.connector.core
    left = core.store.stats().used
    assert _serve(engine, "after") == 0
    assert left == 0
    # The engine stores afresh after the reset, and that KV is served.
    engine.scheduler.reset_prefix_cache()
    assert _serve(engine, "fresh") > 0
    _quiet(engine)
    engine.close()


def test_stores_in_flight_at_a_reset_never_become_ready() -> None:
    """A reset between steps while the prompt's stores are still copying (reports 4 polls
    late): without the pins given back the reset leaves them; either way they are dropped."""
    engine = _engine(delay=4)
    engine.add("before", PROMPT, 4)
    _step_until(engine, lambda core: core.stats().jobs_in_flight > 0)
    core = engine.scheduler.connector.core
    storing = [bytes.fromhex(k) for k, s, _ in core.store.snapshot()["entries"] if s == "storing"]
    assert storing
    assert not _reset(engine)  # the request holds its blocks: vLLM's own reset refuses
    _drain(engine)
    # Nothing being stored at the reset landed (the request went on storing later blocks).
    assert all(core.store.status(key) is LookupResult.MISS for key in storing)
    assert core.store.stats().stored > 0
    assert core.stats().store_jobs_failed == 0  # dropped, not failed
    engine.scheduler.reset_prefix_cache()  # vLLM's cache (refused above while it ran)
    assert _serve(engine, "after") == 0
    _quiet(engine)
    engine.close()


def test_keys_a_load_pins_at_a_reset_are_never_claimed_again() -> None:
    engine = _engine(delay=4)
    assert _serve(engine, "stored") == 0
    engine.scheduler.reset_prefix_cache()  # vLLM's cache only: the next prompt loads
    engine.add("loading", PROMPT, 4)
    engine.step()
    assert engine.status("loading") == "WAITING_FOR_REMOTE_KVS"
    core = engine.scheduler.connector.core
    assert core.store.stats().pinned > 0
    assert not _reset(engine)  # vLLM refuses: a request waits for its load
    _drain(engine)
    assert core.store.stats().used == 0  # evicted as the load reported
    engine.scheduler.reset_prefix_cache()
    assert _serve(engine, "after") == 0
    _quiet(engine)
    engine.close()


# ------------------------------------------------------------------ 2c


@pytest.mark.parametrize("reset_connector", [True, False], ids=["connector", "vllm-only"])
def test_reset_with_running_requests_succeeds_while_stores_are_in_flight(
    reset_connector: bool,
) -> None:
    engine = _engine(delay=4)
    engine.add("a", PROMPT, 8)
    engine.add("b", list(range(500, 700)), 8)
    _step_until(engine, lambda core: core.stats().held_blocks > 0)
    _pause_until_landed(engine)
    core = engine.scheduler.connector.core
    assert core.stats().jobs_in_flight > 0
    assert core.stats().held_blocks > 0
    assert engine.status("a") == "RUNNING"
    in_flight = core.store.stats().storing
    removed_before = core.store.stats().removed
    reset = engine.scheduler.reset_prefix_cache(
        reset_running_requests=True, reset_connector=reset_connector
    )
    assert reset is True
    engine.scheduler.set_pause_state(PauseState.UNPAUSED)  # resume_generation
    assert core.stats().held_blocks == 0
    assert engine.status("a") in ("WAITING", "PREEMPTED")
    # The preempted requests resume, recompute and finish; the dropped stores report.
    _drain(engine)
    # Every store whose pins went back was dropped (no fault is injected: nothing else is).
    assert core.store.stats().removed - removed_before == in_flight > 0
    assert core.stats().store_jobs_failed == 0
    for rid in ("a", "b"):
        assert engine.requests[rid].is_finished()
    _quiet(engine)
    engine.close()


@pytest.mark.parametrize("layout", [Layout.SLIDING_FULL, Layout.MAMBA_FULL], ids=lambda x: x.value)
def test_abort_then_reset_succeeds_while_the_aborted_requests_store(layout: Layout) -> None:
    """``pause_generation(mode="abort", clear_cache=True)``, an RL loop's weight update: every
    request is aborted (those storing get a delayed free), then the caches reset with
    ``reset_running_requests=True``. vLLM raised while the delayed frees held their blocks."""
    from vllm.v1.request import RequestStatus

    engine = _engine(delay=4, layout=layout)
    length = 3 * SHAPES[layout][1]  # three chunks each, stored over several steps
    engine.add("a", list(range(1, 1 + length)), 8)
    engine.add("b", list(range(5000, 5000 + length)), 8)
    core = engine.scheduler.connector.core
    _step_until(engine, lambda core: core.stats().held_blocks > 0)
    in_flight = core.store.stats().storing
    removed_before = core.store.stats().removed
    engine.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)  # pause_scheduler
    assert core.stats().delayed_frees > 0
    assert engine.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    _drain(engine)  # the dropped stores report; vLLM's free at finished_sending finds nothing
    assert core.store.stats().removed - removed_before == in_flight > 0
    assert core.store.stats().used == 0
    assert core.snapshot()["delayed"] == ()
    assert _serve(engine, "after", list(range(1, 1 + length))) == 0
    _quiet(engine)
    engine.close()


def test_a_reset_refused_for_other_blocks_keeps_the_store_pins() -> None:
    """A request waiting for its load holds blocks: vLLM's reset fails whatever the pins do,
    so the pins stay and the stores in flight complete READY as usual."""
    engine = _engine(delay=4)
    assert _serve(engine, "stored") == 0
    engine.scheduler.reset_prefix_cache()
    engine.add("loading", PROMPT, 4)
    engine.add("storing", list(range(500, 700)), 4)
    core = engine.scheduler.connector.core
    _step_until(engine, lambda core: core.stats().held_blocks > 0)
    assert engine.status("loading") == "WAITING_FOR_REMOTE_KVS"
    held = core.stats().held_blocks
    assert engine.scheduler.reset_prefix_cache() is False
    assert core.stats().held_blocks == held
    failed_before = core.stats().store_jobs_failed
    stored_before = core.store.stats().stored
    _drain(engine)
    assert core.store.stats().stored > stored_before
    assert core.stats().store_jobs_failed == failed_before
    _quiet(engine)
    engine.close()
