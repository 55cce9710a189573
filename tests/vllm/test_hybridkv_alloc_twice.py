"""vLLM 0.33 calls ``update_state_after_alloc`` twice for a request that loads asynchronously.

First when the request is scheduled from the waiting queue with the connector's claim
(``scheduler.py:1482``, ``num_external_tokens`` > 0: the request goes to
``WAITING_FOR_REMOTE_KVS``); then again once its load finished and it is scheduled from
``kv_holding_waiting``: its ``num_computed_tokens`` is no longer 0, so the scheduler skips every
lookup and calls the hook with ``num_external_tokens`` = 0 (``scheduler.py:1103-1110``, the
same call site). ``HybridKVConnector`` decides by the count: the second call builds no job,
pins nothing and leaves the finished load's record alone, so the request runs on the blocks the
first load filled (every read content-checked).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from diffharness.layouts import RECIPES, Layout  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.engine_config import EngineSettings  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402

CHUNK = 32
PROMPT = [random.Random(9).randint(3, 999) for _ in range(200)]


@pytest.mark.parametrize("delay", [0, 2], ids=["reported-next-poll", "reported-2-polls-late"])
def test_second_call_with_zero_external_tokens_changes_nothing(delay: int) -> None:
    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"host_memory_bytes": 64 << 20, "chunk_size": CHUNK},
    )
    settings = EngineSettings(
        num_gpu_blocks=40, max_model_len=512, block_size=32, max_num_batched_tokens=256
    )
    recipe = RECIPES[Layout.SLIDING_FULL]
    engine = InProcessEngine(recipe.config_json(), settings, transfer, HybridKVOnCPU(delay=delay))
    connector = engine.scheduler.connector
    core = connector.core
    calls: list[tuple[Any, ...]] = []  # rid, count, (load jobs, pinned) before, after
    real = connector.update_state_after_alloc

    def recorded(request: Any, blocks: Any, num_external_tokens: int) -> None:
        before = (core.stats().load_jobs, core.store.stats().pinned)
        real(request, blocks, num_external_tokens)
        after = (core.stats().load_jobs, core.store.stats().pinned)
        calls.append((request.request_id, num_external_tokens, *before, *after))

    connector.update_state_after_alloc = recorded
    engine.add("first", list(PROMPT), 2)
    while engine.busy():
        engine.step()
    assert engine.scheduler.reset_prefix_cache()  # only the host can serve the prompt again
    engine.add("again", list(PROMPT), 2)
    while engine.busy():
        engine.step()

    host = (len(PROMPT) - 1) // CHUNK * CHUNK
    again = [c for c in calls if c[0] == "again"]
    assert [c[1] for c in again] == [host, 0], again
    first_call, second_call = again
    assert first_call[4] > first_call[2]  # the first call built the load's jobs ...
    assert first_call[5] > first_call[3]  # ... and pinned its keys
    assert second_call[2:4] == second_call[4:6]  # the second built and pinned nothing
    assert second_call[3] == 0  # the load had reported: nothing pinned any more
    assert [c[1] for c in calls if c[0] == "first"] == [0]
    assert engine.tally.external_hits == host
    assert engine.tally.checked > 0
    assert engine.tally.wrong == 0
    assert engine.leaked_blocks() == 0
    assert core.stats().jobs_in_flight == 0
