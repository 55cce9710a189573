"""Store sources are pinned in the GPU block pool until the store reports (TR-1's contract).

Driven through the whole engine (scheduler, reference connector, worker): the mamba manager
drops a running request's older state block while a store of it is still in flight; the pin
keeps the block out of the free queue until the store's result is folded.
"""

from __future__ import annotations

from spec.block_pool import BlockId
from spec.connector_api import JobId, TransferKind
from spec.invariants import check_all
from spec.kinds import GroupKind
from spec.system import parts
from spec.system.engine import Engine
from spec.system.scenarios import Recovery, Scenario, Start, build_engines


def _engine() -> Engine:
    scenario = Scenario(
        num_requests=1,
        groups=(GroupKind.FULL, GroupKind.MAMBA),
        start=Start.EMPTY,
        recovery=Recovery.SHARED,
    )
    (engine,) = build_engines(scenario)
    return engine


def _mamba_source(engine: Engine) -> tuple[JobId, BlockId]:
    (job_id,) = engine.in_flight
    job = engine.in_flight[job_id].job
    assert job.kind is TransferKind.STORE
    (item,) = [i for i in job.items if i.group_idx == 1]
    return job_id, BlockId(item.block_id)


def _sound(engine: Engine) -> None:
    for subject, snapshot in parts.subject_snapshots(engine.scheduler):
        assert check_all(subject, snapshot) == {}, subject
    assert check_all("system", engine.snapshot()) == {}


def test_a_dropped_state_block_stays_pinned_until_its_store_reports() -> None:
    engine = _engine()
    pool = engine.scheduler.kv.pool
    connector = parts.connector_of(engine.scheduler)
    engine.arrive("r0")
    engine.step()  # prefill [0, 2): a store of the state after 2 tokens starts
    job_id, block = _mamba_source(engine)
    assert pool.ref_count(block) == 2  # the table and the pin
    # Align mode keeps the previous state one more step (GR-5), then drops it.
    for _ in range(3):
        engine.step()
        if block not in engine.scheduler.kv.get_blocks("r0")[1]:
            break
    assert block not in engine.scheduler.kv.get_blocks("r0")[1]
    assert job_id in engine.in_flight
    assert pool.ref_count(block) == 1
    assert block not in pool.free_queue()
    assert connector.held_blocks().count(block) == 1
    assert block in engine.scheduler.held_outside()
    _sound(engine)
    engine.complete(job_id, True)
    engine.step()  # the result is folded: the pin is dropped
    assert block not in connector.held_blocks()
    assert pool.ref_count(block) == 0 or block in engine.scheduler.kv.get_blocks("r0")[1]
    _sound(engine)


def test_a_failed_store_releases_its_pins_too() -> None:
    engine = _engine()
    pool = engine.scheduler.kv.pool
    engine.arrive("r0")
    engine.step()
    job_id, block = _mamba_source(engine)
    engine.step()
    engine.step()
    engine.complete(job_id, False)
    engine.step()
    assert block not in parts.connector_of(engine.scheduler).held_blocks()
    assert pool.ref_count(block) <= 1
    _sound(engine)


def test_an_unbound_connector_pins_nothing() -> None:
    engine = _engine()
    connector = parts.connector_of(engine.scheduler).clone()
    connector._pool = None  # as built standalone, before any scheduler binds it
    assert connector.held_blocks() == ()
