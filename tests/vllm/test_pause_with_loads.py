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
import random

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _held_reports import HoldingAdapter  # noqa: E402
from diffharness.layouts import RECIPES, Layout  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.connector.api import TransferJob, TransferKind  # noqa: E402
from hybridkv.transfer import Direction  # noqa: E402
from hybridkv.vllm.harness.engine_config import EngineSettings  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402


def _hold_b_loads(job: TransferJob) -> Direction | None:
    return Direction.LOAD if job.kind is TransferKind.LOAD and job.request_id == "b" else None


def _engine() -> tuple[InProcessEngine, HoldingAdapter]:
    adapter = HoldingAdapter(_hold_b_loads)
    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"host_memory_bytes": 64 << 20, "chunk_size": 32},
    )
    settings = EngineSettings(
        num_gpu_blocks=48, max_model_len=512, block_size=32, max_num_batched_tokens=128
    )
    engine = InProcessEngine(
        RECIPES[Layout.SLIDING_FULL].config_json(), settings, transfer, adapter
    )
    return engine, adapter


def _entries(engine: InProcessEngine) -> tuple[object, ...]:
    return tuple(engine.scheduler.connector.core.store.snapshot()["entries"])


def test_a_pause_with_a_load_in_flight_fails_before_the_host_tier_is_touched(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine, adapter = _engine()
    try:
        rng = random.Random(1)
        prompt = [rng.randint(3, 999) for _ in range(200)]
        engine.add("a", prompt, 2)
        while engine.busy():
            engine.step()
        assert engine.scheduler.reset_prefix_cache()  # vLLM's GPU cache only: b loads
        engine.add("b", [*prompt, 5, 6, 7], 3)
        for _ in range(10):
            engine.step()
            if engine.status("b") == "WAITING_FOR_REMOTE_KVS":
                break
        assert engine.status("b") == "WAITING_FOR_REMOTE_KVS"
        assert adapter.hold is not None
        assert adapter.hold.held
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
