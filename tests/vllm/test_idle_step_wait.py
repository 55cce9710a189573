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

from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _held_reports import (  # noqa: E402
    HoldingAdapter,
    held_load_engine,
    hold_loads_of,
    start_a_held_load,
)

from hybridkv.transfer.api import EngineWrapper  # noqa: E402
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
        super().__init__(hold_loads_of("b"))
        self.log = log

    def _wrap(self, engine: Any) -> Any:
        # Outermost, where the worker role calls it; self.hold stays the held reports.
        return _RecordsWaits(super()._wrap(engine), self.log)


def test_the_worker_waits_on_steps_without_a_forward_only() -> None:
    log: Log = []
    adapter = _Adapter(log)
    engine = held_load_engine(adapter)
    forward = engine._forward

    def logged_forward(output: Any) -> Any:
        log.append(("step", output.total_num_scheduled_tokens))
        return forward(output)

    engine._forward = logged_forward  # type: ignore[method-assign]
    try:
        start_a_held_load(engine, adapter, steps=30)
        assert adapter.hold is not None
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
