"""A request aborted in WAITING_FOR_REMOTE_KVS while a store of its own is still in flight,
inside vLLM 0.33's real Scheduler (issue 17, item 2j).

vLLM holds a request aborted during its load until the load's ``finished_recving``
(``finish_requests``, ``scheduler.py:3016-3025``), and a connector that answers True from
``request_finished_all_groups`` holds it until ``finished_sending``. At the FIRST of the two
reports vLLM frees the blocks and deletes the request; the second fails
``assert req_id in self.requests`` in ``update_from_output`` (``scheduler.py:3565-3581``), an
engine crash. So the connector must never report ``finished_sending`` for such a request: it
answers False while the request's load is in flight, and the stores' sources stay pinned in
vLLM's block pool until each store reports.

How the state is reached, with vLLM's own scheduling on sliding window + full attention (block 32,
one unit a step, 19 GPU blocks): Q (60 prompt tokens) decodes; R prefills 200 tokens, its stores of
the units ending at 32 and 64 succeed, the one ending at 96 fails (the job hook), the one ending at
128 is held unreported (``_held_reports``); Q's next block preempts R (vLLM preempts the last
running request); Q's decode then evicts R's cached GPU blocks; when Q finishes R is admitted again
with no local hit, and the host tier serves it the 64 tokens before the failed unit: an async load,
so R waits in WAITING_FOR_REMOTE_KVS with its own store (ending at 128) still in flight. Its load is
held too, and R is aborted (``Scheduler.finish_requests``, ``FINISHED_ABORTED``). The held reports
are then released in each order. The pool and Q's prompt are a point where this holds under both
engine loops (vLLM refuses the 16-block pool this test once used under async scheduling: its
sliding-window group must hold two in-flight steps' tokens).
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
from hybridkv.vllm.harness.engine_config import EngineSettings  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402

UNIT = 32


def _job_hook(job: TransferJob) -> Direction | bool | None:
    """R's store ending at 96 fails before submission; its store ending at 128 and its loads
    are held."""
    if job.request_id != "R":
        return None
    if job.kind is TransferKind.LOAD:
        return Direction.LOAD
    end = max(item.end_token for item in job.items)
    if end == 3 * UNIT:
        return True
    return Direction.STORE if end == 4 * UNIT else None


def _engine() -> tuple[InProcessEngine, HoldingAdapter]:
    adapter = HoldingAdapter(_job_hook)
    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"host_memory_bytes": 64 << 20, "chunk_size": UNIT},
    )
    settings = EngineSettings(
        num_gpu_blocks=19,
        max_model_len=256,
        block_size=UNIT,
        max_num_seqs=2,
        max_num_batched_tokens=UNIT + 1,
    )
    recipe = RECIPES[Layout.SLIDING_FULL]
    engine = InProcessEngine(recipe.config_json(), settings, transfer, adapter)
    return engine, adapter


def _reach_the_state(engine: InProcessEngine) -> None:
    rng = random.Random(1)
    engine.add("Q", [rng.randint(3, 999) for _ in range(60)], 256 - 60 - 2)
    engine.step()
    engine.add("R", [rng.randint(3, 999) for _ in range(200)], 4)
    preempted = False
    for _ in range(400):
        engine.step()
        preempted |= engine.status("R") == "PREEMPTED"
        if engine.status("R") == "WAITING_FOR_REMOTE_KVS":
            break
    assert preempted
    assert engine.status("R") == "WAITING_FOR_REMOTE_KVS"
    assert engine.requests["R"].num_computed_tokens == 2 * UNIT  # the units before the failure


@pytest.mark.parametrize("first", [Direction.STORE, Direction.LOAD, None], ids=str)
def test_an_abort_during_the_load_never_reports_finished_sending(first: Direction | None) -> None:
    """Fails on main (5025a37): vLLM's ``update_from_output`` raises AssertionError at the
    second report, whichever comes first."""
    engine, adapter = _engine()
    _reach_the_state(engine)
    hold = adapter.hold
    assert hold is not None
    assert {d.value for d in hold.held.values()} == {"load", "store"}
    sent: list[set[str]] = []
    worker = engine.worker
    real = worker.get_transfer_results

    def results(finished: Any) -> Any:
        out = real(finished)
        sent.append(set(out.finished_sending))
        return out

    worker.get_transfer_results = results
    assert engine.abort("R")
    hold.release(first)
    for _ in range(3):
        engine.step()
    core = engine.scheduler.connector.core
    pool = engine.scheduler.kv_cache_manager.block_pool
    if first is Direction.STORE:  # vLLM frees R at its load's report only
        assert "R" in engine.scheduler.requests
    else:
        assert "R" not in engine.scheduler.requests
    if first is Direction.LOAD:  # the store still runs after vLLM freed R: sources pinned
        sources = core.busy_blocks()
        assert sources
        assert all(pool.blocks[b].ref_cnt > 0 for b in sources)
    hold.release(None)  # whatever is still held reports now
    for _ in range(3):
        engine.step()
    assert "R" not in engine.scheduler.requests
    assert not any("R" in names for names in sent)
    assert hold.held == {}
    stats = core.stats()
    assert (stats.jobs_in_flight, stats.held_blocks, stats.requests) == (0, 0, 0), stats
    # Q runs to its end; every block is back (R's store pinned its sources until it reported).
    while engine.busy():
        engine.step()
    assert engine.leaked_blocks() == 0
    engine.close()
