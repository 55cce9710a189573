"""The two scheduler-side hooks vLLM 0.33 reads around preemption, on ``HybridKVConnector`` in
vLLM's real Scheduler (issue 17, item 2e).

- ``requires_kv_delivery`` (``base.py:197-207``): read once (``scheduler.py:203``); True makes
  every preemption drop the request's in-flight output (``drop_stale_output``,
  ``scheduler.py:975`` and ``1832``; ``2338`` discards it under async scheduling or pipeline
  parallelism, and the request recomputes that position). The default is the producer role,
  True for ``kv_both``; vLLM's own OffloadingConnector answers False (a best-effort cache,
  ``offloading_connector.py:73-77``), and so must hybridkv: a preemption voids none of its
  stores (their sources stay pinned in the pool until each reports).
- ``has_pending_block_frees`` (``base.py:674-676``): asked when a running request cannot get a
  block (``scheduler.py:924-928``); True makes vLLM wait a step instead of preempting. hybridkv
  has such frees while a store in flight holds blocks that return to the pool when it reports
  (a finished request's delayed free, or a source only the store's pin still holds).

Layout: sliding window + full attention, block 32; each test's GPU pool (19 and 18 blocks) is a
point where its scenario holds under both engine loops (vLLM refuses the 16 blocks these tests
once used under async scheduling: the sliding window must hold two steps in flight).
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
from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.engine_config import EngineSettings  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402

UNIT = 32
MAX_LEN = 256


def _engine(adapter: Any, budget: int, pool: int) -> InProcessEngine:
    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"host_memory_bytes": 64 << 20, "chunk_size": UNIT},
    )
    settings = EngineSettings(
        num_gpu_blocks=pool,
        max_model_len=MAX_LEN,
        block_size=UNIT,
        max_num_seqs=2,
        max_num_batched_tokens=budget,
    )
    recipe = RECIPES[Layout.SLIDING_FULL]
    return InProcessEngine(recipe.config_json(), settings, transfer, adapter)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(3, 999) for _ in range(n)]


def test_a_preempted_request_keeps_its_in_flight_output() -> None:
    """Q (60 prompt tokens) decodes, R prefills 200 tokens one unit a step; Q's next block
    preempts R. vLLM marks R's in-flight output to keep (``drop_stale_output`` False), as with
    its own offloading connector. Fails on main (5025a37): the inherited True dropped it."""
    engine = _engine(HybridKVOnCPU(), UNIT + 1, 19)
    rng = random.Random(1)
    engine.add("Q", _tokens(rng, 60), MAX_LEN - 60 - 2)
    engine.step()
    engine.add("R", _tokens(rng, 200), 4)
    for _ in range(20):
        engine.step()
        if engine.status("R") == "PREEMPTED":
            break
    assert engine.status("R") == "PREEMPTED"
    assert engine.requests["R"].drop_stale_output is False
    assert engine.scheduler.requires_kv_delivery is False  # what vLLM read at start-up
    while engine.busy():
        engine.step()
    assert engine.requests["R"].is_finished()
    assert engine.leaked_blocks() == 0
    engine.close()


def _hold_a(job: TransferJob) -> Direction | None:
    return Direction.STORE if job.request_id == "A" and job.kind is TransferKind.STORE else None


def test_a_store_that_will_free_blocks_defers_preemption() -> None:
    """R decodes; A (160 tokens, one output token) finishes while its stores are held, so its
    free is delayed and its blocks return only when they report. When R needs a block the pool
    is empty: vLLM asks ``has_pending_block_frees``, and with True R waits instead of being
    preempted; once A's stores report, R runs on. Fails on main (5025a37): the inherited False
    preempted R (and with it all its computed tokens)."""
    adapter = HoldingAdapter(_hold_a)
    engine = _engine(adapter, 2 * UNIT, 18)
    hold = adapter.hold
    assert hold is not None
    rng = random.Random(2)
    engine.add("R", _tokens(rng, 20), MAX_LEN - 20 - 2)
    engine.step()
    engine.add("A", _tokens(rng, 160), 1)
    connector = engine.scheduler.connector
    stalled = 0
    for _ in range(80):
        before = engine.requests["R"].num_computed_tokens
        engine.step()
        assert engine.tally.preemptions == 0
        if engine.requests["R"].num_computed_tokens == before:
            assert connector.has_pending_block_frees()
            stalled += 1
        if stalled == 3:
            break
    assert stalled == 3  # R waited for A's blocks
    assert engine.status("A") == "FINISHED_LENGTH_CAPPED"
    assert "A" in engine.scheduler.requests  # its free is delayed for its stores
    hold.release()
    while engine.busy():
        engine.step()
    assert engine.tally.preemptions == 0
    assert engine.requests["R"].is_finished()
    assert not connector.has_pending_block_frees()
    assert engine.leaked_blocks() == 0
    engine.close()
