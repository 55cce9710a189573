"""A request finished while its load is in flight: both connectors drop its load record once
the load's last job reports (they kept it forever before), and agree on every snapshot."""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.simulator.engine_adapter import build_engine
from spec.connector_api import RequestId
from spec.kinds import GroupKind
from spec.managers.group_spec import GroupSpec
from spec.scheduler import Request, SchedulerConfig
from spec.system import parts
from spec.system.engine import Engine, EngineConfig, RequestSpec

R0 = RequestId("r0")


def _config() -> EngineConfig:
    groups = (GroupSpec(GroupKind.FULL, 2), GroupSpec(GroupKind.MAMBA, 2))
    return EngineConfig(
        SchedulerConfig(groups, 13, 8, 2, 2),
        (RequestSpec(R0, tuple(range(1, 10)), 1),),
        chunk_size=2,
        store_capacity=16,
        max_model_len=32,
    )


def _connector(engine: Any) -> Any:
    return engine.scheduler.connector


def _seed(engine: Any) -> None:
    """The host holds r0's first 8 tokens READY (both connectors' ``seed``)."""
    spec = engine.config.requests[0]
    view = Request(spec.request_id, spec.prompt, spec.max_tokens).view()
    assert _connector(engine).seed(view, 8) > 0


@pytest.mark.parametrize("side", ["reference", "core"])
@pytest.mark.parametrize("ok", [True, False])
def test_the_record_of_a_load_whose_request_finished_is_dropped_when_it_reports(
    side: str, ok: bool
) -> None:
    engine = Engine.create(_config()) if side == "reference" else build_engine(_config())
    _seed(engine)
    engine.arrive(R0)
    engine.step()  # r0 claims 8 and waits for its load
    assert [row[0] for row in _connector(engine).snapshot()["loads"]] == [R0]
    engine.abort(R0)  # finished during the load: the record must outlive the abort...
    assert [row[0] for row in _connector(engine).snapshot()["loads"]] == [R0]
    for job_id in sorted(engine.in_flight):
        engine.complete(job_id, ok)
    engine.step()  # ...until the load's jobs report
    assert _connector(engine).snapshot()["loads"] == ()
    assert engine.statuses()[R0] == "FINISHED_ABORTED"
    assert engine.scheduler.kv.pool.get_num_free_blocks() == 12  # every block came back


def test_both_connectors_agree_on_the_snapshots() -> None:
    ref, fast = Engine.create(_config()), build_engine(_config())
    for engine in (ref, fast):
        _seed(engine)
        engine.arrive(R0)
        engine.step()
        engine.abort(R0)
        for job_id in sorted(engine.in_flight):
            engine.complete(job_id, False)
        engine.step()
    assert _connector(fast).snapshot() == _connector(ref).snapshot()
    reference = parts.connector_of(ref.scheduler)
    assert reference.freeze() == reference.clone().freeze()
