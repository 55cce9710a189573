"""Issue 29: a step that runs no forward gives the copy thread a turn; a step with one never
waits.

The worker calls ``TransferEngine.wait_progress`` from ``get_transfer_results`` on a step whose
metadata says it runs no forward (vLLM scheduled no token: the loop spins while loads are in
flight). Through vLLM's engine loop (sync or async, ``HYBRIDKV_ENGINE_LOOP``) on the in-process
engine: request ``b`` loads ``a``'s prompt from the host tier, its load held so the loop spins
through steps that run nothing; the engine under the connector records every wait and the
runner every forward, in one log, so each wait is matched to the step it ran in.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _held_reports import HoldingAdapter  # noqa: E402
from diffharness.layouts import RECIPES, Layout  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.connector.api import TransferJob, TransferKind  # noqa: E402
from hybridkv.transfer import Direction  # noqa: E402
from hybridkv.transfer.api import EngineWrapper  # noqa: E402
from hybridkv.vllm.harness.engine_config import EngineSettings  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402
from hybridkv.vllm.worker_role import IDLE_STEP_WAIT_S  # noqa: E402

Log = list[tuple[str, int]]


class _RecordsWaits(EngineWrapper):
    """Logs each ``wait_progress`` with its timeout, in microseconds."""

    def __init__(self, inner: Any, log: Log) -> None:
        super().__init__(inner)
        self.log = log

    def wait_progress(self, timeout_s: float) -> None:
        self.log.append(("wait", round(timeout_s * 1e6)))
        super().wait_progress(timeout_s)


class _Adapter(HoldingAdapter):
    def __init__(self, log: Log) -> None:
        super().__init__(_hold_b_loads)
        self.log = log

    def _wrap(self, engine: Any) -> Any:
        # Outermost, where the worker role calls it; self.hold stays the held reports.
        return _RecordsWaits(super()._wrap(engine), self.log)


def _hold_b_loads(job: TransferJob) -> Direction | None:
    return Direction.LOAD if job.kind is TransferKind.LOAD and job.request_id == "b" else None


def test_the_worker_waits_on_steps_without_a_forward_only() -> None:
    log: Log = []
    adapter = _Adapter(log)
    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"host_memory_bytes": 64 << 20, "chunk_size": 32},
    )
    settings = EngineSettings(
        num_gpu_blocks=48, max_model_len=512, block_size=32, max_num_batched_tokens=128
    )
    config = RECIPES[Layout.SLIDING_FULL].config_json()
    engine = InProcessEngine(config, settings, transfer, adapter)
    forward = engine._forward

    def logged_forward(output: Any) -> Any:
        log.append(("step", output.total_num_scheduled_tokens))
        return forward(output)

    engine._forward = logged_forward  # type: ignore[method-assign]
    try:
        rng = random.Random(1)
        prompt = [rng.randint(3, 999) for _ in range(200)]
        engine.add("a", prompt, 2)
        while engine.busy():
            engine.step()
        assert engine.scheduler.reset_prefix_cache()  # vLLM's GPU cache only: b loads
        engine.add("b", [*prompt, 5, 6, 7], 3)
        for _ in range(30):
            engine.step()
            if engine.status("b") == "WAITING_FOR_REMOTE_KVS":
                break
        assert engine.status("b") == "WAITING_FOR_REMOTE_KVS"
        assert adapter.hold is not None
        assert adapter.hold.held
        for _ in range(5):  # the load is held: the loop spins through steps that run nothing
            engine.step()
        adapter.hold.release(None)
        for _ in range(30):
            if not engine.busy():
                break
            engine.step()
        assert not engine.busy()
    finally:
        engine.close()
    steps = [(i, tokens) for i, (kind, tokens) in enumerate(log) if kind == "step"]
    waits = [i for i, (kind, _) in enumerate(log) if kind == "wait"]
    assert {timeout for kind, timeout in log if kind == "wait"} == {round(IDLE_STEP_WAIT_S * 1e6)}
    # Each step's hooks run after its forward: a wait belongs to the step logged before it.
    waited = {max(i for i, _ in steps if i < w) for w in waits}
    assert len(waited) == len(waits), "one wait per step at most"
    idle = {i for i, tokens in steps if tokens == 0}
    assert waited == idle, (waited, idle)  # every step without a forward, none with one
    assert len(idle) >= 5, "the held load made the loop spin"
