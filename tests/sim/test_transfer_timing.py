"""The copy-time model, the timed transfer engine, the client-abort plan and the event counts
of ``hybridkv simulate``, unit by unit: arithmetic, when a job is reported, when its bytes
move, refusals, what counts as a preemption or abort during a load."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from hybridkv.cache_layouts import all_layout_cases
from hybridkv.canonical import CanonicalCaches, build_canonical_caches
from hybridkv.cli.main import main
from hybridkv.errors import HybridKVConfigError
from hybridkv.hostmem import HostMemory, PinMode
from hybridkv.simulator.transfers import TransferEvents
from hybridkv.testbed.aborts import ABORT_WINDOW_STEPS, AbortPlan
from hybridkv.testbed.copy_time import CopyTimeModel
from hybridkv.testbed.timed_engine import TimedTransferEngine
from hybridkv.transfer import CpuTransferEngine, Direction, FinishedJob, JobId, TransferPair
from spec.connector_api import (
    ConnectorMeta,
    JobResult,
    KVConnectorOutput,
    RequestId,
    TransferItem,
    TransferJob,
    TransferKind,
)
from spec.connector_api import JobId as SpecJobId

# ----------------------------------------------------------------- the model


def test_job_time_is_latency_plus_modelled_bytes_over_bandwidth() -> None:
    model = CopyTimeModel(gbps=2.0, latency_us=30.0, step_ms=1.0, byte_scale=4.0)
    # 1000 copied bytes stand for 4000 modelled bytes: 2000 ns at 2 GB/s, plus 30 us.
    assert model.job_ns(1000) == 30_000 + 2_000
    assert model.step_ns == 1_000_000
    assert (model.step_start_ns(3), model.step_end_ns(3)) == (2_000_000, 3_000_000)
    # 1 MB copied = 4 MB modelled = 2 ms + 30 us: three steps with its start step.
    assert model.steps_for(10**6) == 3
    assert model.steps_for(0) == 1


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("--transfer-gbps", {"gbps": 0.0}),
        ("--transfer-gbps", {"gbps": math.nan}),
        ("--transfer-latency-us", {"latency_us": -1.0}),
        ("--step-ms", {"step_ms": math.inf}),
        ("byte_scale", {"byte_scale": 0.0}),
    ],
)
def test_model_refuses_values_out_of_range(field: str, kwargs: dict[str, float]) -> None:
    with pytest.raises(HybridKVConfigError) as err:
        CopyTimeModel(**kwargs)
    assert err.value.field == field


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--transfer-gbps", "0"], "--transfer-gbps"),
        (["--transfer-gbps", "nan"], "--transfer-gbps"),
        (["--transfer-latency-us", "-5"], "--transfer-latency-us"),
        (["--step-ms", "0"], "--step-ms"),
        (["--aborts", "1.5"], "--aborts"),
    ],
)
def test_simulate_refuses_bad_timing_flags_in_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], flag: str
) -> None:
    assert main(["simulate", "--requests", "2", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hybridkv simulate: error:")
    assert flag in err
    assert "pass" in err  # the fix
    assert len(err.splitlines()) == 1


# ----------------------------------------------------------------- the engine


def _caches() -> tuple[CanonicalCaches, HostMemory]:
    case = next(c for c in all_layout_cases(4) if c.name == "block_first_nhd")
    cc = build_canonical_caches(case.kv_caches, case.groups, case.num_blocks)
    slot = cc.group_bytes(0)
    return cc, HostMemory(4 * slot, slot, PinMode.OFF)


def _runs(cc: CanonicalCaches, block: int) -> list[torch.Tensor]:
    """Every byte run of ``block`` in group 0 (views into the caches)."""
    out: list[torch.Tensor] = []
    for ref in cc.group_refs[0]:
        row = cc.tensors[ref.tensor_index].view[block]
        out.extend(row[off : off + n] for off, n in ref.runs)
    return out


def _block(cc: CanonicalCaches, block: int) -> torch.Tensor:
    return torch.cat(_runs(cc, block))


def _fill(cc: CanonicalCaches, block: int, value: int) -> None:
    for run in _runs(cc, block):
        run.fill_(value)


@pytest.fixture
def timed() -> Iterator[tuple[TimedTransferEngine, CanonicalCaches, HostMemory]]:
    cc, host = _caches()
    nbytes = cc.group_bytes(0)
    # One block's copy takes 2.5 steps of 1 ms: reported in its third step.
    model = CopyTimeModel(gbps=1.0, latency_us=0.0, step_ms=1.0, byte_scale=2.5e6 / nbytes)
    engine = TimedTransferEngine(CpuTransferEngine(cc, host), model, cc, host)
    yield engine, cc, host
    engine.close()
    host.close()


def test_a_load_is_reported_and_lands_only_when_the_model_says(
    timed: tuple[TimedTransferEngine, CanonicalCaches, HostMemory],
) -> None:
    engine, cc, host = timed
    _fill(cc, 1, 7)
    engine.start_step()
    store = engine.submit(Direction.STORE, [TransferPair(0, 1, 2)])
    for step in (1, 2):
        engine.end_forward()
        engine.advance()
        assert engine.poll() == [], f"reported in step {step}, before its copy ends"
        assert not bool((host.slot(2) == 7).all()), "the store's bytes moved before its end"
        engine.start_step()
    engine.end_forward()
    engine.advance()
    assert engine.poll() == [FinishedJob(store, True)]
    assert bool((host.slot(2)[: cc.group_bytes(0)] == 7).all())
    # Load slot 2 into block 3 from step 4: due in step 6; block 3 keeps its bytes until then.
    _fill(cc, 3, 0)
    engine.start_step()
    load = engine.submit(Direction.LOAD, [TransferPair(0, 3, 2)])
    assert [p.job_id for p in engine.pending()] == [load]
    for _ in range(2):
        engine.end_forward()
        engine.advance()
        assert engine.poll() == []
        assert bool((_block(cc, 3) == 0).all())
        engine.start_step()
    engine.end_forward()
    engine.advance()
    assert engine.poll() == [FinishedJob(load, True)]
    assert bool((_block(cc, 3) == 7).all())
    assert engine.bytes_moved(Direction.LOAD) == engine.bytes_moved(Direction.STORE) > 0


def test_a_store_reads_its_source_when_its_copy_ends(
    timed: tuple[TimedTransferEngine, CanonicalCaches, HostMemory],
) -> None:
    """The strict reading: a source rewritten before the store ends is what the host gets,
    so a scheduler that rewrites a pinned source (TR-2) leaves wrong content behind."""
    engine, cc, host = timed
    _fill(cc, 1, 5)
    engine.start_step()
    engine.end_forward()
    engine.submit(Direction.STORE, [TransferPair(0, 1, 0)])
    _fill(cc, 1, 9)
    engine.wait([p.job_id for p in engine.pending()])
    assert bool((host.slot(0)[: cc.group_bytes(0)] == 9).all())


def test_jobs_of_one_direction_queue_on_its_link(
    timed: tuple[TimedTransferEngine, CanonicalCaches, HostMemory],
) -> None:
    engine, _, _ = timed
    engine.start_step()
    first = engine.submit(Direction.LOAD, [TransferPair(0, 1, 0)])
    second = engine.submit(Direction.LOAD, [TransferPair(0, 2, 1)])
    store = engine.submit(Direction.STORE, [TransferPair(0, 3, 2)])
    due = {p.job_id: p.due_ns for p in engine.pending()}
    step = engine.model.step_ns
    assert due[first] == due[store] == 2.5 * step  # the other direction does not wait
    assert due[second] == 5 * step  # the second load waits for the first


def test_a_refused_job_takes_no_link_time(
    timed: tuple[TimedTransferEngine, CanonicalCaches, HostMemory],
) -> None:
    engine, cc, _ = timed
    engine.start_step()
    with pytest.raises(HybridKVConfigError):
        engine.submit(Direction.LOAD, [TransferPair(0, cc.num_blocks, 0)])
    assert engine.pending() == ()
    job = engine.submit(Direction.LOAD, [TransferPair(0, 1, 0)])
    assert engine.pending()[0].due_ns == 2.5 * engine.model.step_ns
    with pytest.raises(HybridKVConfigError):
        engine.wait([JobId(job + 1)])


def test_wait_completes_a_job_at_once_and_close_runs_what_is_pending(
    timed: tuple[TimedTransferEngine, CanonicalCaches, HostMemory],
) -> None:
    engine, _, _ = timed
    engine.start_step()
    sync = engine.submit(Direction.LOAD, [TransferPair(0, 1, 0)])
    engine.wait([sync])
    assert engine.poll() == [FinishedJob(sync, True)]
    late = engine.submit(Direction.STORE, [TransferPair(0, 2, 1)])
    engine.close()
    assert engine.poll() == [FinishedJob(late, True)]
    with pytest.raises(HybridKVConfigError):
        engine.submit(Direction.LOAD, [TransferPair(0, 1, 0)])


# ----------------------------------------------------------------- aborts


def test_abort_plan_is_a_pure_function_of_seed_and_request() -> None:
    plan = AbortPlan(0.5, seed=3)
    first = [plan.patience(i) for i in range(200)]
    assert first == [AbortPlan(0.5, seed=3).patience(i) for i in range(200)]
    impatient = [p for p in first if p is not None]
    assert 60 < len(impatient) < 140
    assert set(impatient) <= set(range(1, ABORT_WINDOW_STEPS + 1))
    assert len(set(impatient)) > 1
    assert all(AbortPlan(0.0).patience(i) is None for i in range(50))
    assert all(AbortPlan(1.0).patience(i) is not None for i in range(50))


@pytest.mark.parametrize("rate", [-0.1, 1.01, math.nan, True])
def test_abort_plan_refuses_a_rate_that_is_not_a_probability(rate: float) -> None:
    with pytest.raises(HybridKVConfigError) as err:
        AbortPlan(rate)
    assert err.value.field == "--aborts"


# ----------------------------------------------------------------- the event counts


def _job(job_id: int, kind: str, rid: str) -> TransferJob:
    item = TransferItem(0, job_id, b"k%d" % job_id, 16)
    return TransferJob(SpecJobId(job_id), TransferKind(kind), RequestId(rid), (item,))


def _done(*job_ids: int) -> KVConnectorOutput:
    return KVConnectorOutput(completed_jobs=tuple(JobResult(SpecJobId(j), True) for j in job_ids))


def test_transfer_events_count_what_they_saw_in_flight() -> None:
    events = TransferEvents()
    a, b = RequestId("a"), RequestId("b")
    # Step 1: a's load and b's store start; the store is reported in step 1 (its one source
    # block found rewritten), the load is not.
    events.scheduled(1, (), (), ConnectorMeta((_job(1, "load", "a"),), (_job(2, "store", "b"),)))
    events.reported(1, _done(2), lambda job: len(job.items))
    assert events.loading(a)
    assert not events.loading(b)
    assert events.in_flight()
    # Step 2: b is preempted while a's load copies; a's load passes its deadline.
    events.scheduled(2, (b,), (a,), ConnectorMeta())
    events.aborted(b)  # b has no load of its own
    # Step 3: a is preempted, its abandoned load still copying; then the client cancels a.
    events.scheduled(3, (a,), (), ConnectorMeta())
    events.aborted(a)
    events.reported(4, _done(1))
    assert not events.in_flight()
    assert events.counts.as_dict() == {
        "load_jobs_spanning_steps": 1,
        "longest_load_steps": 4,
        "store_jobs_spanning_steps": 0,
        "deadlines_fired": 1,
        "abandoned_loads_reported": 1,
        "preemptions_during_loads": 2,
        "preemptions_of_loading_requests": 1,
        "aborts": 2,
        "aborts_during_load": 1,
        "store_blocks_verified": 1,
        "wrong_content_stores": 1,
    }
    # A preemption with nothing loading counts nowhere.
    events.scheduled(5, (b,), (), ConnectorMeta())
    assert events.counts.preemptions_during_loads == 2
