"""``HybridKVConnector`` in the runner's speculative-decoding hook order, inside vLLM 0.33's
real Scheduler (:mod:`hybridkv.vllm.harness.inprocess`, ``EngineSettings.speculative_hooks``).

With a drafter vLLM collects the step's transfer results right after the target forward and
calls ``wait_for_save`` only after the drafter wrote its layers' KV
(``v1/worker/kv_connector_model_runner_mixin.py:91-96`` with ``defer_finalize``, then
``finalize_kv_connector`` from ``v1/worker/gpu_model_runner.py:4471-4475``). The in-process
engine's stand-in drafter writes the model's last attention layer in between. A store that
starts before ``wait_for_save`` copies that layer's slots before the drafter wrote them, and a
later load hands the stale slots to the forward: its content check counts them as wrong reads.

To make the race deterministic the stores copy at submission (:class:`_StoresCopyAtSubmit`):
the worst a copy stream running beside the drafter can do. Issue 17, item 2d.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from diffharness.layouts import RECIPES, Layout  # noqa: E402
from test_hybridkv_inprocess import CHAT, _transfer  # noqa: E402

from hybridkv.transfer import Direction, TransferEngine, TransferPair  # noqa: E402
from hybridkv.transfer.api import EngineWrapper, JobId  # noqa: E402
from hybridkv.vllm.harness.chat import run_trace  # noqa: E402
from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.delayed import DelayedCompletion  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402


class _StoresCopyAtSubmit(EngineWrapper):
    """The CPU engine, each store's copy finished inside its submission (the source is read at
    the moment the connector issues the store); hook calls and store submissions logged."""

    def __init__(self, inner: TransferEngine, log: list[str]) -> None:
        super().__init__(inner)
        self.log = log

    def submit(self, direction: Direction, pairs: Sequence[TransferPair]) -> JobId:
        job = self.inner.submit(direction, pairs)
        if direction is Direction.STORE:
            self.inner.wait([job])
            self.log.append("store submitted")
        return job


class _Adapter(HybridKVOnCPU):
    """:class:`HybridKVOnCPU` over :class:`_StoresCopyAtSubmit`, logging the worker's hooks."""

    def __init__(self) -> None:
        super().__init__(delay=1)
        self.log: list[str] = []

    def _delayed(self, engine: Any) -> DelayedCompletion:
        return super()._delayed(_StoresCopyAtSubmit(engine, self.log))

    def attach(self, connector: Any, kv_caches: Any) -> None:
        super().attach(connector, kv_caches)
        for hook in ("bind_connector_metadata", "get_transfer_results", "wait_for_save"):
            real = getattr(connector, hook)

            def logged(*args: Any, _real: Any = real, _hook: str = hook) -> Any:
                self.log.append(_hook)
                return _real(*args)

            setattr(connector, hook, logged)


@pytest.mark.parametrize("layout", list(CHAT), ids=lambda lay: lay.value)
def test_stores_capture_the_drafters_writes_and_start_only_in_wait_for_save(
    layout: Layout,
) -> None:
    settings, trace, chunk = CHAT[layout]  # host hits on every later turn
    settings = dataclasses.replace(settings, speculative_hooks=True)
    adapter = _Adapter()
    engine = InProcessEngine(RECIPES[layout].config_json(), settings, _transfer(chunk), adapter)
    report = run_trace(engine, trace)
    print(f"\n{layout.value} speculative order: {report}")
    # Every host copy holds the drafter's layer: loads hand the forward no stale slot.
    assert report.external_loaded > 0
    assert report.slots_checked > 0
    assert report.wrong_reads == 0
    assert report.finished == report.requests
    # The hook order is the speculative one: results before save in a step that ran the model.
    hooks = [entry for entry in adapter.log if entry != "store submitted"]
    assert "get_transfer_results" in hooks
    assert any(
        a == "get_transfer_results" and b == "wait_for_save" for a, b in itertools.pairwise(hooks)
    )
    # No store starts between a step's results and its wait_for_save (the drafter's window).
    last_hook = ""
    for entry in adapter.log:
        if entry == "store submitted":
            assert last_hook in ("wait_for_save", "bind_connector_metadata"), last_hook
        else:
            last_hook = entry
    assert adapter.log.count("store submitted") > 0
    # Liveness: every store a step left for after its results reported; nothing stranded.
    connector = engine.scheduler.connector
    stats = connector.core.stats()
    assert engine.pending() == 0
    assert (stats.jobs_in_flight, stats.held_blocks, stats.requests) == (0, 0, 0), stats
    assert connector.core.store.stats().storing == 0
    assert engine.leaked_blocks() == 0
    engine.close()
