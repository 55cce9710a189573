"""``offload_decode_state: false`` and a preempted request that recomputes its prompt and its
output in one chunk (issue 28): the mamba states that step leaves are keyed by the positions
they hold (MB-8), not by the prompt's end.

The model is the Nemotron-H ``M*M*`` of ``test_hybridkv_checkpoints.py`` (block 1,152 tokens,
Mamba-2 exports a prefill checkpoint) with MTP, so EAGLE's block drop puts the checkpoint one
block before its slot's own end. Request ``a`` has a two-block prompt (2,304 tokens) and decodes
10 tokens; then ``reset_prefix_cache(reset_running_requests=True, reset_connector=True)``
preempts it and empties vLLM's prefix cache and the host tier, so ``a`` resumes with no hit and
computes ``[0, 2314)`` in one chunk. Two fillers then push ``a``'s blocks out of vLLM's prefix
cache, so ``b`` can only hit the host. vLLM's worker leaves the running state after 2,314 tokens in
slot 2 and the checkpoint after 1,152 tokens in slot 1 (``compute_mamba_prefill_checkpoints``).

On main before the fix the connector clipped the step to the prompt, ``[0, 2304)``, and so read
slot 1 as the state after 2,304 tokens: request ``b``, sharing ``a``'s prompt, loaded the
state after 1,152 tokens as the state after 2,304 (wrong reads). Now the step keeps its range
and only the units past the prompt are left out (``ScheduledRequest.store_limit``): slot 1 is
stored under 1,152, and ``b``'s host hit stops there.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _invariants_on_vllm import InvariantChecker  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.engine_config import EngineSettings  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402
from spec.presets import tiny_config  # noqa: E402

BLOCK = 1152
PROMPT = 2 * BLOCK
DECODED = 10


def _engine(async_scheduling: bool) -> InProcessEngine:
    cfg = tiny_config("nemotron-h-8b", 4)
    cfg["hybrid_override_pattern"] = "M*M*"
    cfg["num_nextn_predict_layers"] = 1
    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "host_memory_bytes": 256 << 20,
            "chunk_size": BLOCK,
            "offload_decode_state": False,
        },
    )
    settings = EngineSettings(
        num_gpu_blocks=12,
        max_model_len=4608,
        max_num_seqs=1,
        max_num_batched_tokens=4608,
        speculative={"method": "mtp", "num_speculative_tokens": 1},
        async_scheduling=async_scheduling,
    )
    return InProcessEngine(cfg, settings, transfer, HybridKVOnCPU())


def _steps(engine: InProcessEngine, checker: InvariantChecker, done: Any, limit: int = 200) -> None:
    for _ in range(limit):
        if done():
            return
        engine.step()
        checker.after_step()
    raise AssertionError("the run did not get there")


def test_a_recompute_of_prompt_and_output_keys_states_by_their_positions() -> None:
    """Under the synchronous loop: with async scheduling a step is always in vLLM's batch queue
    while a request decodes, and vLLM defers the preempted request's block frees until it
    lands, so ``reset_prefix_cache(reset_running_requests=True)`` raises (vLLM's own
    RuntimeError, with or without a connector). The path under test is the connector's
    ``build_connector_meta`` on the recompute step, which both loops reach alike."""
    engine = _engine(async_scheduling=False)
    try:
        rng = random.Random(7)
        checker = InvariantChecker(engine)
        prompt = [rng.randint(3, 999) for _ in range(PROMPT)]
        engine.add("a", prompt, 40)
        request = engine.requests["a"]
        _steps(engine, checker, lambda: request.num_output_tokens >= DECODED)
        resumed_at = request.num_tokens
        assert engine.scheduler.reset_prefix_cache(
            reset_running_requests=True, reset_connector=True
        )
        assert request.num_computed_tokens == 0
        before = engine.tally.external_hits + engine.tally.gpu_hits
        # a resumes: one chunk of its prompt and output, no hit anywhere.
        _steps(engine, checker, lambda: request.num_computed_tokens >= resumed_at)
        assert engine.tally.external_hits + engine.tally.gpu_hits == before
        _steps(engine, checker, lambda: not engine.busy())
        for i in range(2):  # push a's blocks out of vLLM's prefix cache: b can only hit the host
            engine.add(f"filler{i}", [rng.randint(3, 999) for _ in range(3 * BLOCK + 100)], 3)
            _steps(engine, checker, lambda: not engine.busy())
        stored = engine.scheduler.connector.core.stats()
        hits, gpu_hits = engine.tally.external_hits, engine.tally.gpu_hits
        engine.add("b", prompt + [rng.randint(3, 999) for _ in range(50)], 2)
        _steps(engine, checker, lambda: not engine.busy())
        b_hit = engine.tally.external_hits - hits
        assert engine.tally.gpu_hits == gpu_hits
    finally:
        engine.close()
    print(f"\nb's host hit {b_hit}; {engine.tally.checked} slots checked; stats {stored}")
    assert engine.tally.checked > 0
    assert engine.tally.wrong == 0, engine.tally.wrong_by
    # The only mamba state at a unit end that a's recompute left is the checkpoint at 1,152.
    assert b_hit == BLOCK
    assert checker.evaluated["MB-8"] == checker.steps > 0
