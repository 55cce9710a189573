"""Claims under EAGLE's block drop (issue 28, item 3): the host tier serves the hit vLLM's own
prefix cache would serve, no more.

With EAGLE or MTP, vLLM's prefix cache matches one block past a hit and drops it
(``use_eagle_block_drop``; ``FullAttentionManager.find_longest_cache_hit``,
``v1/core/single_type_kv_cache_manager.py:826-830``): the drafter's KV at a block's last token
was computed from the token after it, which the block's hash does not cover, so a block is
reused only when the next block matched too. vLLM's native OffloadingConnector does the same
for its external hits (``offloading/scheduler.py:929-986``: one chunk queried past the hit,
then popped).

On main (4fee86c) hybridkv claimed up to the request's last full unit with no such proof: a
request ``b`` that shares ``a``'s first three blocks and diverges exactly at the block boundary
got all three loaded, though the third block's last slot holds the drafter's KV of ``a``'s next
token, not ``b``'s. vLLM's own cache gives ``b`` two blocks. Now a claim of an EAGLE group needs
the unit after its end stored too (:class:`hybridkv.connector.geometry.ConnectorGeometry`), and
the hits equal vLLM's own, for a diverging request and for a resent prompt (where the proof
exists and nothing is lost).

The comparison: the same requests on an engine with no connector, each following ``a`` with
``a`` still in vLLM's prefix cache (vLLM's own hit), and on an engine with hybridkv, where
vLLM's prefix cache is reset before each (every hit is the host tier's). Under both engine
loops (``HYBRIDKV_ENGINE_LOOP``), with every slot the forward reads content-checked.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _explorer import eagle_speculative  # noqa: E402
from diffharness.layouts import RECIPES, Layout  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.engine_config import (  # noqa: E402
    EngineSettings,
    default_async_scheduling,
)
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402

BLOCK = 32


def _eagle(config: dict[str, Any], method: str) -> dict[str, Any]:
    """EAGLE or EAGLE-3 with two drafts (the explorer's draft config; never built)."""
    return eagle_speculative(config, method, 2)


def _engine(method: str) -> InProcessEngine:
    config = RECIPES[Layout.SLIDING_FULL].config_json()
    settings = EngineSettings(
        num_gpu_blocks=64,
        max_model_len=512,
        block_size=BLOCK,
        max_num_seqs=1,
        max_num_batched_tokens=256,
        async_scheduling=default_async_scheduling(),
        speculative=_eagle(config, method),
    )
    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"host_memory_bytes": 256 << 20, "eviction_policy": "lru"},
    )
    return InProcessEngine(config, settings, transfer, HybridKVOnCPU())


def _run(engine: InProcessEngine, rid: str, prompt: list[int]) -> None:
    engine.add(rid, prompt, 3)
    for _ in range(500):
        if not engine.busy():
            return
        engine.step()
    raise AssertionError(f"{rid} did not finish")


def _workload() -> dict[str, list[int]]:
    """``b``: ``a``'s first three blocks, then other tokens (it diverges exactly at a block
    boundary); ``c``: ``a``'s prompt again."""
    rng = random.Random(7)
    shared = [rng.randint(3, 999) for _ in range(3 * BLOCK)]
    a = shared + [rng.randint(3, 999) for _ in range(BLOCK + 8)]
    b = shared + [rng.randint(3, 999) for _ in range(BLOCK + 8)]
    return {"a": a, "b": b, "c": list(a)}


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_host_hits_under_eagle_are_the_hits_vllms_own_cache_serves(method: str) -> None:
    engine = _engine(method)
    own, host = {}, {}
    try:
        assert engine.scheduler.use_eagle_block_drop  # a connector turns lookahead hashes off
        workload = _workload()
        _run(engine, "a", workload.pop("a"))
        manager = engine.scheduler.kv_cache_manager
        for rid, prompt in workload.items():
            # vLLM's own hit for the request, from its prefix cache holding a.
            own[rid] = manager.get_computed_blocks(engine.make_request(rid, prompt, 3))[1]
        for rid, prompt in workload.items():
            # The host tier's alone: vLLM's cache is reset before the request runs.
            assert engine.scheduler.reset_prefix_cache()
            before = engine.tally.external_hits
            _run(engine, rid, prompt)
            host[rid] = engine.tally.external_hits - before
        tally = engine.tally
    finally:
        engine.close()
    print(f"\n{method}: vLLM's own hits {own}, hybridkv's host hits {host}")
    assert tally.checked > 0
    assert tally.wrong == 0, tally.wrong_by
    assert tally.gpu_hits == 0  # every hit came from the host
    assert own == {"b": 2 * BLOCK, "c": 3 * BLOCK}  # the block past each hit dropped
    # b diverges at a block boundary: the third block's proof (b's fourth block) is not
    # stored, so it is not loaded (main loaded it: 96 tokens).
    assert host["b"] == own["b"]
    # c resends a's prompt: the proof of its third block is stored (main loaded the fourth
    # block too, whose proof is past c's last full block).
    assert host["c"] == own["c"]
