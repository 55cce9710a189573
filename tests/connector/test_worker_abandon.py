"""TransferWorker.abandon: a load past its deadline is stopped, and only then reported failed.

Two engines: :class:`CopiesWhenWaited` (a copy not started yet: cancelled, no byte moves) and
the threaded CPU engine with the contract's default ``abandon``, the CUDA engine's (a copy
already handed over is waited for). Either way the load reports ``failed_recving`` at the next
fold, whether or not its bytes landed, and the core unpins its keys and remembers them failed.
The CPU engine's own ``abandon`` (cancel what is queued) is tested in tests/transfer.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
from test_transfer_worker import (
    FOLLOW,
    LAYOUTS,
    PROMPT,
    Driver,
    block_bytes,
    make,
    make_waited,
    randomize,
    store_a,
    view,
)

from hybridkv.connector import ClaimKind, LoadMode, ScheduledRequest, StepView, TransferKind
from hybridkv.connector.worker import TransferWorker
from hybridkv.errors import HybridKVConfigError
from hybridkv.transfer import CpuTransferEngine, Direction, TransferEngine

LAYOUT = "full_mamba"


class WaitsOnAbandon(CpuTransferEngine):
    """The CPU engine with the contract's default ``abandon`` (wait; the CUDA engine's)."""

    abandon = TransferEngine.abandon


def test_a_load_not_copied_yet_is_cancelled_and_reports_failed() -> None:
    case, stack, driver, engine = make_waited(LAYOUT, mode=LoadMode.ASYNC)
    store_a(case, driver, LAYOUT)
    randomize(case, seed=3)
    stale = {(g, b): block_bytes(case, g, b) for g, _, b in LAYOUTS[LAYOUT][4]}
    driver.claim(view("B", FOLLOW), LAYOUTS[LAYOUT][3])
    meta = stack.core.build_connector_meta(StepView(9, ()))
    stack.worker.bind_connector_metadata(meta)
    loads = tuple(job.job_id for job in meta.load_jobs)
    assert loads
    assert stack.worker.abandon(loads) == tuple(sorted(loads))
    assert len(engine.cancelled) == len(loads)
    out = stack.worker.get_transfer_results(wait=True)
    assert out.finished_recving == out.failed_recving == {"B"}
    assert [r.success for r in out.completed_jobs] == [False] * len(loads)
    for g, _, b_block in LAYOUTS[LAYOUT][4]:  # cancelled: B's blocks never written
        assert block_bytes(case, g, b_block) == stale[(g, b_block)]
    stack.core.update_connector_output(out)
    assert stack.store.stats().pinned == 0
    # The core took the abandoned load for a failed one: its keys left the host, B claims none.
    assert stack.core.get_num_new_matched_tokens(view("B", FOLLOW), 0).kind is ClaimKind.NONE
    stats = stack.worker.stats()
    assert stats.jobs_abandoned == len(loads)
    assert stats.jobs_failed == len(loads)  # the engine reported each cancelled copy failed


def test_a_copy_already_running_is_waited_for_and_the_load_still_reports_failed() -> None:
    def slow_loads(job: Any, direction: Direction, run: int) -> None:
        if direction is Direction.LOAD and run == 0:
            time.sleep(0.2)  # far longer than the bind-to-poll gap of this test

    case, stack, _ = make(LAYOUT)
    stack.engine.close()
    engine = WaitsOnAbandon(stack.caches, stack.host, fault_hook=slow_loads)
    worker = TransferWorker(engine, stack.store, stack.caches, stack.host)
    stack = dataclasses.replace(stack, engine=engine, worker=worker)
    driver = Driver(stack)
    with stack.engine:
        before = store_a(case, driver, LAYOUT)
        randomize(case, seed=3)
        driver.claim(view("B", FOLLOW), LAYOUTS[LAYOUT][3])
        meta = stack.core.build_connector_meta(StepView(9, ()))
        stack.worker.bind_connector_metadata(meta)
        loads = [job.job_id for job in meta.load_jobs]
        stack.worker.abandon(loads)
        # The default abandon waited: every copy is over, so a poll without waiting sees them.
        out = stack.worker.get_transfer_results(wait=False)
        assert sorted(r.job_id for r in out.completed_jobs) == sorted(loads)
        assert not any(r.success for r in out.completed_jobs)
        assert out.failed_recving == {"B"}
        for g, a_block, b_block in LAYOUTS[LAYOUT][4]:  # the copies ran to the end
            assert block_bytes(case, g, b_block) == before[(g, a_block)]
        assert stack.worker.stats().jobs_failed == 0  # the copies succeeded; abandoned anyway


def test_a_store_is_never_abandoned_and_ids_not_in_flight_are_skipped() -> None:
    case, stack, _, engine = make_waited(LAYOUT, mode=LoadMode.ASYNC)
    randomize(case, seed=1)
    row = ScheduledRequest(view("A", PROMPT), LAYOUTS[LAYOUT][2], 0, len(PROMPT))
    meta = stack.core.build_connector_meta(StepView(1, (row,)))
    stack.worker.bind_connector_metadata(meta)
    store = meta.store_jobs[0]
    assert store.kind is TransferKind.STORE
    with pytest.raises(HybridKVConfigError) as caught:
        stack.worker.abandon([store.job_id])
    assert caught.value.field == "job_id"
    assert stack.worker.abandon([store.job_id + 100]) == ()  # never bound: nothing to stop
    assert engine.cancelled == []
    assert stack.worker.stats().jobs_abandoned == 0
    stack.worker.wait_for_save()  # the only hook that submits a store (worker.py)
    out = stack.worker.get_transfer_results(wait=True)
    assert [r.success for r in out.completed_jobs] == [True]
    assert stack.worker.abandon([store.job_id]) == ()  # reported: past abandoning
