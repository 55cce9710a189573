"""The scheduler side's fast paths inside vLLM 0.33's real Scheduler answer as the plain
computation does.

- ``build_connector_meta`` names the requests whose step completes no unit by id
  (``StepView.no_unit_ids``, or ``ConnectorCore.build_unit_free_meta`` when no request of the
  step completes one) instead of building their views and asking vLLM for their block
  tables. A twin engine on the same trace hands its core every scheduled request as a full row
  (view and table read from vLLM, as before the fast path): every step's metadata, the core's
  final state and counts, and the run's figures must be equal.
- ``get_kv_connector_stats`` returns None without building the counters while nothing they are
  read from changed (``_stats_mark``). The twin reads the counters every call: every stats
  payload vLLM produced must be equal.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from diffharness.layouts import RECIPES, Layout  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.connector import ScheduledRequest, StepView  # noqa: E402
from hybridkv.vllm.deferred import keyable  # noqa: E402
from hybridkv.vllm.harness.chat import ChatTrace, run_trace  # noqa: E402
from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.engine_config import EngineSettings  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402
from hybridkv.vllm.metrics import SCHEDULER_COUNTERS  # noqa: E402
from hybridkv.vllm.views import block_table  # noqa: E402

SETTINGS = EngineSettings(
    num_gpu_blocks=64, max_model_len=1024, block_size=32, max_num_seqs=3, max_num_batched_tokens=128
)
TRACE = ChatTrace(convs=3, turns=3, system_len=128, output_len=40)


def _engine() -> InProcessEngine:
    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"host_memory_bytes": 64 << 20, "chunk_size": 32},
    )
    adapter = HybridKVOnCPU(delay=1)
    return InProcessEngine(RECIPES[Layout.SLIDING_FULL].config_json(), SETTINGS, transfer, adapter)


def _record_metas(connector: Any) -> list[Any]:
    """Every metadata the connector builds, in order."""
    metas: list[Any] = []
    build = connector.build_connector_meta

    def recorded(scheduler_output: Any) -> Any:
        meta = build(scheduler_output)
        metas.append(meta)
        return meta

    connector.build_connector_meta = recorded
    return metas


def _plain_rows(connector: Any, named: list[int]) -> None:
    """Turn every id the fast path names into the full row it stood for, read from vLLM, in
    the scheduler's order; ``named`` counts them.

    Under async scheduling a named id may also be a step held for its block hashes (its unit
    ends on a token the request does not hold yet, :mod:`hybridkv.vllm.deferred`): the plain
    computation holds it too, so it stays named; the rows of the held steps replayed in this
    metadata come first, as given."""
    core = connector.core
    completes = core.geometry.completes_a_unit
    hash_block = core.geometry.planner.hash_block_size
    seen: dict[str, Any] = {}
    build_meta = connector.build_connector_meta
    build_core = core.build_connector_meta

    def outer(scheduler_output: Any) -> Any:
        seen["output"] = scheduler_output
        return build_meta(scheduler_output)

    def inner(step: StepView) -> Any:
        output = seen["output"]
        current = [rid for rid in output.num_scheduled_tokens if rid not in step.no_unit_ids]
        split = len(step.scheduled) - len(current)
        rows = list(step.scheduled[:split])  # replayed held steps
        given = dict(zip(current, step.scheduled[split:], strict=True))
        assert all(str(row.request.request_id) == rid for rid, row in given.items())
        held = set()
        for rid, num in output.num_scheduled_tokens.items():
            if rid in given:
                rows.append(given[rid])
                continue
            assert rid in step.no_unit_ids
            request = connector._requests[rid]
            computed = int(request.num_computed_tokens)
            end = computed + int(num)
            if completes(computed, end) and not keyable(end, hash_block, len(request.block_hashes)):
                held.add(rid)  # held for its hashes by both paths
                continue
            tables = block_table(connector._kv_cache_manager.get_block_ids(rid))
            view = connector._views.view(request)
            rows.append(ScheduledRequest(view, tables, computed, int(num)))
            named[0] += 1
        return build_core(replace(step, scheduled=tuple(rows), no_unit_ids=frozenset(held)))

    def unit_free(scheduled_ids: Any) -> Any:
        # A step where no request completes a unit: the same rows through the full path.
        return inner(StepView(0, (), no_unit_ids=frozenset(scheduled_ids)))

    connector.build_connector_meta = outer
    core.build_connector_meta = inner
    core.build_unit_free_meta = unit_free


def _scheduler_part(engine: InProcessEngine) -> list[dict[str, Any]]:
    return [
        {name: value for name, value in payload.items() if name in SCHEDULER_COUNTERS}
        for payload in engine.connector_stats
    ]


def _untimed(report: Any) -> Any:
    return replace(report, schedule_us=0, connector_us=0, schedule_cpu_us=0, connector_cpu_us=0)


def test_naming_unit_free_requests_by_id_changes_nothing_in_vllm() -> None:
    # One engine at a time: an engine sets vLLM's process-wide config when it is built.
    fast = _engine()
    fast_metas = _record_metas(fast.scheduler.connector)
    unit_free = [0]
    free_meta = fast.scheduler.connector.core.build_unit_free_meta

    def counted(scheduled_ids: Any) -> Any:
        unit_free[0] += 1
        return free_meta(scheduled_ids)

    fast.scheduler.connector.core.build_unit_free_meta = counted
    fast_report = run_trace(fast, TRACE)
    plain = _engine()
    named = [0]
    _plain_rows(plain.scheduler.connector, named)
    plain.scheduler.connector._stats_mark = lambda: None  # the counters read every call
    plain_metas = _record_metas(plain.scheduler.connector)
    plain_report = run_trace(plain, TRACE)
    assert fast_metas == plain_metas
    assert _untimed(fast_report) == _untimed(plain_report)
    fast_core, plain_core = fast.scheduler.connector.core, plain.scheduler.connector.core
    assert fast_core.snapshot() == plain_core.snapshot()
    assert fast_core.stats() == plain_core.stats()
    # The scheduler's part of every payload (the workers' part holds measured seconds).
    fast_counts, plain_counts = _scheduler_part(fast), _scheduler_part(plain)
    assert fast_counts == plain_counts
    assert sum(bool(counts) for counts in fast_counts) > 10
    # Both paths were taken: most decode steps complete no 32-token unit; some do and store.
    stores = sum(len(m.meta.store_jobs) for m in fast_metas)
    assert named[0] > len(fast_metas) // 2, (named[0], len(fast_metas))
    assert unit_free[0] > len(fast_metas) // 4, (unit_free[0], len(fast_metas))
    assert stores > 10
    fast.close()
    plain.close()
