"""``pause_generation(clear_cache=True)`` while a host-tier load is in flight (issue 28), through
vLLM's own ``EngineCore.pause_scheduler`` on the in-process engine (as ``LLM`` and offline RL
loops reach it).

``mode="abort"`` aborts every request; one waiting for its load keeps its blocks until the load
lands (its copy may still write them), so vLLM's prefix-cache reset fails and vLLM raises
``RuntimeError``. The connector must not have reset by then: the host tier keeps its entries,
the remote tier its namespace, and the log names the requests still loading and what to do.
Once the engine has stepped and the loads landed, the same pause succeeds and the host tier is
empty.
"""

from __future__ import annotations

import logging

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _held_reports import (  # noqa: E402
    HoldingAdapter,
    held_load_engine,
    hold_loads_of,
    start_a_held_load,
)

from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402


def _engine() -> tuple[InProcessEngine, HoldingAdapter]:
    adapter = HoldingAdapter(hold_loads_of("b"))
    return held_load_engine(adapter), adapter


def _entries(engine: InProcessEngine) -> tuple[object, ...]:
    return tuple(engine.scheduler.connector.core.store.snapshot()["entries"])


def test_a_pause_with_a_load_in_flight_fails_before_the_host_tier_is_touched(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine, adapter = _engine()
    try:
        start_a_held_load(engine, adapter, steps=10)
        assert adapter.hold is not None
        core = engine.scheduler.connector.core
        entries = _entries(engine)
        assert entries  # a's units
        with (
            caplog.at_level(logging.WARNING, logger="vllm.hybridkv"),
            pytest.raises(RuntimeError, match="Failed to reset KV cache"),
        ):
            engine.loop.core.pause_scheduler(mode="abort", clear_cache=True)
        assert _entries(engine) == entries  # the connector never reset
        assert core.loading_requests() == {"b"}
        warned = [r.getMessage() for r in caplog.records if "hybridkv" in r.getMessage()]
        assert len(warned) == 1
        assert "1 request(s) wait for their host-tier loads (b)" in warned[0]
        assert "untouched" in warned[0]
        # The loads land once the engine steps; then the same pause resets everything.
        engine.loop.core.resume_scheduler()
        adapter.hold.release(None)
        for _ in range(10):
            if not engine.busy():
                break
            engine.step()
        assert not core.loading_requests()
        assert engine.loop.core.pause_scheduler(mode="abort", clear_cache=True) is None
        assert _entries(engine) == ()
        assert engine.loop.core.model_executor.calls.count("synchronize_device") == 2
    finally:
        engine.close()
