"""``HybridKVConnector`` under vLLM 0.33's async scheduling, the default on every GPU server
(issue 28): vLLM's own ``EngineCore.step_with_batch_queue`` and ``AsyncScheduler`` schedule step
N+1 before step N's sampled token is applied, so a decode step computes a token the request
does not hold yet and the unit ending at it has no block hash when ``build_connector_meta`` runs.

On main before the fix, with docs/howto/serve.md's configuration, a prompt one token short of a
unit raised ``IndexError: tuple index out of range`` (``hybridkv/connector/requests.py:107``)
inside ``Scheduler.schedule`` at the first decode step that completed a unit: the server
stopped. Now that step is stored one metadata later, when its hash exists
(:mod:`hybridkv.vllm.deferred`), from the slots it wrote, and a later turn loads it back with
the right content, on a sliding window + full layout and a mamba (align) + full layout.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _invariants_on_vllm import InvariantChecker  # noqa: E402
from diffharness.layouts import RECIPES, Layout  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.engine_config import EngineSettings  # noqa: E402
from hybridkv.vllm.harness.engine_loop import LoopKind  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402

# docs/howto/serve.md's extra config (8 GiB of host there; 256 MiB holds these runs whole).
SERVE_EXTRA = {"host_memory_bytes": 256 << 20, "eviction_policy": "lru"}

# (settings, the unit a claim counts in): pools large enough that nothing is preempted, small
# enough that the second request's prefix is gone from vLLM's prefix cache (fillers evict it).
CASES = {
    Layout.SLIDING_FULL: EngineSettings(
        num_gpu_blocks=48,
        max_model_len=512,
        block_size=32,
        max_num_seqs=2,
        max_num_batched_tokens=256,
    ),
    Layout.MAMBA_FULL: EngineSettings(
        num_gpu_blocks=16, max_model_len=2560, max_num_seqs=1, max_num_batched_tokens=2560
    ),
}


def _engine(layout: Layout, async_scheduling: bool) -> InProcessEngine:
    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=dict(SERVE_EXTRA),
    )
    settings = CASES[layout]
    settings = EngineSettings(
        **{
            **{f: getattr(settings, f) for f in settings.__dataclass_fields__},
            "async_scheduling": async_scheduling,
        }
    )
    return InProcessEngine(RECIPES[layout].config_json(), settings, transfer, HybridKVOnCPU())


def _finish(engine: InProcessEngine, checker: InvariantChecker) -> None:
    for _ in range(2000):
        if not engine.busy():
            return
        engine.step()
        checker.after_step()
    raise AssertionError("the run did not finish")


def _conversation(engine: InProcessEngine, unit: int) -> tuple[list[int], Any]:
    """Request ``a``: a prompt one token short of a unit, decoding past two unit ends; then
    fillers to push its blocks out of vLLM's prefix cache; then ``b``, a next turn whose prompt
    is ``a``'s prompt and answer plus a question. Returns ``(a's tokens, b's request)``."""
    rng = random.Random(3)
    checker = InvariantChecker(engine)
    prompt = [rng.randint(3, 999) for _ in range(unit - 1)]
    engine.add("a", prompt, 2 * unit + 5)
    _finish(engine, checker)
    a_tokens = list(engine.requests["a"].all_token_ids)
    for i in range(3):
        engine.add(f"filler{i}", [rng.randint(3, 999) for _ in range(unit * 3 + 7)], 2)
        _finish(engine, checker)
    engine.add("b", a_tokens + [rng.randint(3, 999) for _ in range(9)], 2)
    _finish(engine, checker)
    return a_tokens, checker


@pytest.mark.parametrize("layout", list(CASES), ids=lambda lay: lay.value)
def test_a_unit_completed_on_a_placeholder_token_is_stored_and_loaded_back(
    layout: Layout,
) -> None:
    engine = _engine(layout, async_scheduling=True)
    try:
        assert engine.loop.kind is LoopKind.BATCH_QUEUE
        assert type(engine.scheduler).__name__ == "AsyncScheduler"
        unit = max(engine.scheduler.connector.core.geometry.units)
        external_before = engine.tally.external_hits
        a_tokens, checker = _conversation(engine, unit)
        deferred = engine.scheduler.connector._deferred
        b_hit = engine.tally.external_hits - external_before
    finally:
        engine.close()
    print(
        f"\n{layout.value}: unit {unit}, b's host hit {b_hit}, replayed {deferred.replayed}, "
        f"dropped {deferred.dropped}, {engine.tally.checked} slots checked"
    )
    assert engine.tally.checked > 0
    assert engine.tally.wrong == 0, engine.tally.wrong_by
    assert engine.leaked_blocks() == 0
    # Every decode step that completed a unit waited for its hash and was stored next time.
    assert deferred.replayed >= 2
    assert deferred.dropped == 0
    # b's hit reaches past a's prompt into its answer: units completed on placeholder tokens.
    assert b_hit >= 2 * unit > len(a_tokens) - 2 * unit - 5
    assert checker.steps > 0


def test_the_synchronous_loop_never_waits_for_a_hash() -> None:
    """The same conversation under ``EngineCore.step``: no step is held, and b's hit is the
    same as under async scheduling's replays."""
    engine = _engine(Layout.SLIDING_FULL, async_scheduling=False)
    try:
        assert engine.loop.kind is LoopKind.SYNC
        unit = max(engine.scheduler.connector.core.geometry.units)
        _conversation(engine, unit)
        deferred = engine.scheduler.connector._deferred
    finally:
        engine.close()
    assert engine.tally.wrong == 0
    assert (deferred.replayed, deferred.dropped) == (0, 0)
    assert engine.tally.external_hits >= 2 * unit
