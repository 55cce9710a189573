"""``load_deadline_steps`` of ``HybridKVConnector`` inside vLLM 0.33's real Scheduler (the
in-process engine, every read content-checked).

The multi-turn chat of ``test_hybridkv_inprocess.py`` on mamba-align + full and sliding + full, with
copies that report ``delay`` steps late (:class:`hybridkv.vllm.harness.cpu_worker.HybridKVOnCPU`; a
load's bytes land when it is due). A deadline below the delay fires on every host hit: the worker
cancels the copy (no byte moves), reports the request failed, vLLM recomputes it; 0 wrong reads, no
leaked block, nothing in flight at the end. A deadline equal to the delay never fires (the report
arrives in time) and the host hits are loaded: the rule "fires iff delay > deadline" from both
sides.

Both run on the chat's own GPU pools (16 and 30 blocks). On sliding + full at 30 blocks, once
every load fails vLLM 0.33 would wedge: a request whose load failed frees its blocks and
restarts from 0 but stays at the head of ``kv_holding_waiting``; its full-sequence admission
does not fit beside the blocks a second failed-load request holds and the loop breaks
(``scheduler.py:1455-1461``) before it reaches that second request. The connector's restart
guard (:mod:`hybridkv.vllm.reclaim`) defers the first, vLLM moves it to ``waiting`` and the
second is processed: the test asserts the guard deferred there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from diffharness.layouts import RECIPES, Layout  # noqa: E402
from test_hybridkv_inprocess import CHAT, HOST_BYTES, _quiescent  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.vllm.harness.chat import run_trace  # noqa: E402
from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402

POOL = {Layout.MAMBA_FULL: 16, Layout.SLIDING_FULL: 30}  # GPU blocks (module docstring)


def _transfer(chunk: int, deadline: int) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "host_memory_bytes": HOST_BYTES,
            "chunk_size": chunk,
            "load_deadline_steps": deadline,
        },
    )


def _record_failed(engine: InProcessEngine) -> set[str]:
    """The requests the worker reports in failed_recving, collected as they are reported."""
    failed: set[str] = set()
    real = engine.worker.get_transfer_results

    def results(finished: Any) -> Any:
        out = real(finished)
        failed.update(out.failed_recving)
        return out

    engine.worker.get_transfer_results = results
    return failed


def _record_asks_after_abandon(engine: InProcessEngine) -> dict[tuple[str, int], Any]:
    """(request id, ask number) -> the claim, for every ask of a request whose load the
    deadline abandoned before that ask."""
    connector = engine.scheduler.connector
    real = connector.get_num_new_matched_tokens
    asks: dict[tuple[str, int], Any] = {}

    def ask(request: Any, num_computed_tokens: int) -> Any:
        late = connector.deadlines.recomputing(request.request_id)
        claim = real(request, num_computed_tokens)
        if late:
            asks[(request.request_id, len(asks))] = claim
        return claim

    connector.get_num_new_matched_tokens = ask
    return asks


@pytest.mark.parametrize(("delay", "deadline"), [(3, 1), (2, 2)], ids=["fires", "in-time"])
@pytest.mark.parametrize("layout", list(CHAT), ids=lambda lay: lay.value)
def test_a_load_past_its_deadline_is_abandoned_and_recomputed(
    layout: Layout, delay: int, deadline: int
) -> None:
    settings_, trace, chunk = CHAT[layout]
    settings_ = dataclasses.replace(settings_, num_gpu_blocks=POOL[layout])
    adapter = HybridKVOnCPU(delay=delay)
    engine = InProcessEngine(
        RECIPES[layout].config_json(), settings_, _transfer(chunk, deadline), adapter
    )
    failed = _record_failed(engine)
    after_abandon = _record_asks_after_abandon(engine)
    report = run_trace(engine, trace)
    connector = engine.scheduler.connector
    core = connector.core.stats()
    fired = connector.deadlines.fired
    guard = connector._reclaim.deferred
    print(f"\n{layout.value} d={delay} deadline={deadline}: fired={fired} guard={guard} {report}")
    assert report.finished == report.requests > 0
    assert report.slots_checked > 0
    assert report.wrong_reads == 0
    assert report.preemptions == 0  # the identity below holds without a preemption's recompute
    total = report.prefill_computed + report.gpu_prefix_hits + report.external_hits
    assert total == report.prompt_tokens
    assert core.load_jobs > 0  # the chat hits the host tier either way
    assert connector._counters()["deadlines_fired"] == fired
    if delay > deadline:
        # Every load outlives the deadline: each job is named once, the worker abandons each
        # one before its due step, so no copy ever lands, and each load's request is reported
        # failed and recomputed (no external hit survives).
        assert fired == core.load_jobs == core.load_jobs_failed
        assert report.transfers["jobs_abandoned"] == fired
        assert report.transfers["loads_cancelled"] == fired
        assert failed
        assert report.external_hits == 0
        # Asked again once its load was abandoned, the connector claims nothing: recomputed
        # (or, while vLLM refuses to re-admit it in steps that run nothing, the restart guard
        # defers it).
        assert (0, False) in set(after_abandon.values())
        assert set(after_abandon.values()) <= {(0, False), (None, False)}
        deferred = sum(answer == (None, False) for answer in after_abandon.values())
        assert deferred == connector._reclaim.deferred
        # sliding + full at 30 blocks reaches vLLM's re-admission wedge (module docstring).
        assert (deferred > 0) == (layout is Layout.SLIDING_FULL)
    else:
        assert fired == 0 == report.transfers["jobs_abandoned"] == core.load_jobs_failed
        assert not failed
        assert not after_abandon
        assert report.external_hits == report.external_loaded > 0
    assert connector.deadlines.pending() == 0
    _quiescent(engine)
