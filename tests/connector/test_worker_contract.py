""":class:`hybridkv.connector.worker.TransferWorker`'s contract on its own: what it hands the
engine, what it counts, and each refusal whole (field, value, problem, fix, message).

A recording engine and a dict of host entries stand in for the copy engine and the host store
(the worker's two collaborators, :class:`~hybridkv.transfer.TransferEngine` and
:class:`~hybridkv.connector.worker.HostSlots`), so every pair, wait and abandon the worker issues
is visible; the caches are real canonical caches (Qwen3-Next-like: full attention and mamba
overlaid, two group sizes). tests/connector/test_transfer_worker.py runs the worker with real
copies. This file was written for the mutants mutmut left alive in ``tools/mutants.py``'s run
over the module (docs/explanation/mutations.md, "Whole modules under mutmut").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import pytest
import torch

from hybridkv.cache_layouts import hybrid_overlay_case
from hybridkv.canonical import CanonicalCaches, build_canonical_caches
from hybridkv.connector import (
    ConnectorMeta,
    JobId,
    JobResult,
    RequestId,
    TransferItem,
    TransferJob,
    TransferKind,
)
from hybridkv.connector.worker import TransferWorker, WorkerStats
from hybridkv.errors import HybridKVConfigError
from hybridkv.hostmem import HostMemory, PinMode
from hybridkv.store import LookupResult
from hybridkv.transfer import Direction, FinishedJob, TransferEngine, TransferPair
from hybridkv.transfer import JobId as EngineJobId

LOAD, STORE = TransferKind.LOAD, TransferKind.STORE
HIT, PENDING = LookupResult.HIT, LookupResult.HIT_PENDING
NUM_BLOCKS = 8
FIX = "bind only jobs the connector core built for this worker's caches and store"


class Slots:
    """Host entries: key -> (state, slot)."""

    def __init__(self, entries: dict[bytes, tuple[LookupResult, int]], capacity: int = 3) -> None:
        self.entries = entries
        self._capacity = capacity

    @property
    def capacity(self) -> int:
        return self._capacity

    def status(self, key: bytes) -> LookupResult:
        return self.entries[key][0] if key in self.entries else LookupResult.MISS

    def slots(self, keys: Sequence[bytes]) -> tuple[int, ...]:
        return tuple(self.entries[k][1] for k in keys)


class Recorder(TransferEngine):
    """Records every call; a job finishes when the test says so (``finish``)."""

    def __init__(self, *, refuse: bool = False) -> None:
        self.submitted: list[tuple[Direction, list[TransferPair]]] = []
        self.waited: list[list[EngineJobId]] = []
        self.abandoned: list[list[EngineJobId]] = []
        self.done: list[FinishedJob] = []
        self.refuse = refuse

    def submit(self, direction: Direction, pairs: Sequence[TransferPair]) -> EngineJobId:
        if self.refuse:
            raise RuntimeError("engine full")
        self.submitted.append((direction, list(pairs)))
        return EngineJobId(100 + len(self.submitted))

    def finish(self, engine_job: int, success: bool = True) -> None:
        self.done.append(FinishedJob(EngineJobId(engine_job), success))

    def poll(self) -> list[FinishedJob]:
        done, self.done = self.done, []
        return done

    def wait(self, job_ids: Iterable[EngineJobId]) -> None:
        self.waited.append(sorted(job_ids))

    def abandon(self, job_ids: Iterable[EngineJobId]) -> None:
        self.abandoned.append(sorted(job_ids))

    def close(self) -> None:
        pass


def _caches() -> tuple[CanonicalCaches, HostMemory]:
    case = hybrid_overlay_case(NUM_BLOCKS, torch.device("cpu"))
    caches = build_canonical_caches(case.kv_caches, case.groups, case.num_blocks)
    slot = max(caches.group_bytes(g) for g in range(2))
    return caches, HostMemory(3 * slot, slot, PinMode.OFF)


CACHES, HOST = _caches()
FULL_BYTES, MAMBA_BYTES = CACHES.group_bytes(0), CACHES.group_bytes(1)
ENTRIES = {b"ready-a": (HIT, 2), b"ready-b": (HIT, 0), b"storing": (PENDING, 1)}


def _worker(
    engine: TransferEngine,
    entries: dict[bytes, tuple[LookupResult, int]] | None = None,
    *,
    fault_hook: Callable[[TransferJob], bool] | None = None,
) -> TransferWorker:
    slots = Slots(dict(ENTRIES if entries is None else entries))
    return TransferWorker(engine, slots, CACHES, HOST, fault_hook=fault_hook)


def _job(job_id: int, kind: TransferKind, *items: TransferItem, sync: bool = False) -> TransferJob:
    return TransferJob(JobId(job_id), kind, RequestId("req-7"), items, sync)


def _item(group: int, block: int, key: bytes) -> TransferItem:
    return TransferItem(group, block, key, 16)


def test_jobs_become_engine_pairs_on_the_stores_slots_and_are_counted() -> None:
    engine = Recorder()
    entries = {**ENTRIES, b"storing-2": (PENDING, 2)}
    worker = _worker(engine, entries)
    load = _job(1, LOAD, _item(0, 3, b"ready-a"), _item(1, 5, b"ready-b"))
    store = _job(2, STORE, _item(0, NUM_BLOCKS - 1, b"storing"))
    second = _job(3, STORE, _item(1, 2, b"storing-2"))  # every store of the step is queued
    worker.bind_connector_metadata(ConnectorMeta((load,), (store, second)))
    assert engine.submitted == [(Direction.LOAD, [TransferPair(0, 3, 2), TransferPair(1, 5, 0)])]
    assert engine.waited == []  # an async load is not waited for
    worker.wait_for_save()
    assert engine.submitted[1:] == [
        (Direction.STORE, [TransferPair(0, NUM_BLOCKS - 1, 1)]),
        (Direction.STORE, [TransferPair(1, 2, 2)]),
    ]
    assert worker.in_flight() == (1, 2, 3)
    worker.bind_connector_metadata(ConnectorMeta((_job(4, LOAD, _item(0, 4, b"ready-b")),)))
    assert worker.stats() == WorkerStats(
        jobs_submitted=4,
        jobs_failed=0,
        faults_injected=0,
        blocks_loaded=3,
        blocks_stored=2,
        bytes_loaded=2 * FULL_BYTES + MAMBA_BYTES,
        bytes_stored=FULL_BYTES + MAMBA_BYTES,
        jobs_abandoned=0,
    )
    engine.finish(102, success=False)
    engine.finish(101)
    engine.finish(103, success=False)
    out = worker.get_transfer_results()
    assert out.completed_jobs == (
        JobResult(JobId(1), True),
        JobResult(JobId(2), False),
        JobResult(JobId(3), False),
    )
    assert worker.stats().jobs_failed == 2  # each engine failure is counted
    assert worker.in_flight() == (4,)


def test_a_sync_load_is_waited_for_at_bind_and_an_async_one_is_not() -> None:
    engine = Recorder()
    worker = _worker(engine)
    sync = _job(1, LOAD, _item(0, 3, b"ready-a"), sync=True)
    worker.bind_connector_metadata(ConnectorMeta((sync, _job(2, LOAD, _item(0, 4, b"ready-b")))))
    assert engine.waited == [[101]]


def test_results_wait_for_every_job_but_the_held_ones_and_drain_waits_for_the_named() -> None:
    engine = Recorder()
    worker = _worker(engine)
    worker.bind_connector_metadata(
        ConnectorMeta(
            (_job(1, LOAD, _item(0, 3, b"ready-a")), _job(2, LOAD, _item(0, 4, b"ready-b")))
        )
    )
    engine.finish(101)
    engine.finish(102)
    out = worker.get_transfer_results(wait=True, hold={JobId(1)})
    assert engine.waited == [[102]]
    assert out.completed_jobs == (JobResult(JobId(2), True),)
    assert worker.get_transfer_results().completed_jobs == (JobResult(JobId(1), True),)
    worker.bind_connector_metadata(ConnectorMeta((_job(3, LOAD, _item(0, 5, b"ready-a")),)))
    worker.bind_connector_metadata(ConnectorMeta((_job(4, LOAD, _item(0, 6, b"ready-b")),)))
    worker.drain([JobId(4)])
    worker.drain()
    assert engine.waited[1:] == [[104], [103, 104]]


def test_an_injected_fault_and_an_engine_refusal_fail_the_job_unsubmitted() -> None:
    faulty = Recorder()
    worker = _worker(faulty, fault_hook=lambda job: job.job_id != 2)
    worker.bind_connector_metadata(
        ConnectorMeta(
            (
                _job(1, LOAD, _item(0, 3, b"ready-a")),
                _job(2, LOAD, _item(0, 4, b"ready-b")),
                _job(3, LOAD, _item(0, 5, b"ready-a")),
            )
        )
    )
    assert [pairs for _, pairs in faulty.submitted] == [[TransferPair(0, 4, 0)]]
    out = worker.get_transfer_results()
    assert out.completed_jobs == (JobResult(JobId(1), False), JobResult(JobId(3), False))
    assert out.failed_recving == frozenset()  # its other load still runs: no verdict yet
    faulty.finish(101)
    assert worker.get_transfer_results().failed_recving == {"req-7"}
    assert worker.stats()[:4] == (1, 2, 2, 1)  # submitted, failed, faults, blocks loaded
    refusing = Recorder(refuse=True)
    worker = _worker(refusing)
    worker.bind_connector_metadata(ConnectorMeta((_job(1, LOAD, _item(0, 3, b"ready-a")),)))
    worker.bind_connector_metadata(ConnectorMeta((_job(2, LOAD, _item(0, 3, b"ready-a")),)))
    assert worker.get_transfer_results().completed_jobs == (
        JobResult(JobId(1), False),
        JobResult(JobId(2), False),
    )
    assert worker.stats() == WorkerStats(0, 2, 0, 0, 0, 0, 0, 0)


def test_an_abandoned_load_stops_its_copy_and_reports_failed_once() -> None:
    engine = Recorder()
    worker = _worker(engine)
    worker.bind_connector_metadata(
        ConnectorMeta(
            (
                _job(1, LOAD, _item(0, 3, b"ready-a")),
                _job(2, LOAD, _item(0, 4, b"ready-b")),
                _job(3, LOAD, _item(0, 5, b"ready-b")),
            )
        )
    )
    assert worker.abandon([JobId(2), JobId(9)]) == (2,)
    assert engine.abandoned == [[102]]
    engine.finish(101)
    engine.finish(102)  # its copy landed, yet it reports failed
    out = worker.get_transfer_results()
    assert out.completed_jobs == (JobResult(JobId(1), True), JobResult(JobId(2), False))
    assert worker.stats().jobs_abandoned == 1
    assert worker.stats().jobs_failed == 0  # the engine reported success
    assert worker.abandon([JobId(2)]) == ()  # reported: nothing left to stop
    assert worker.abandon([JobId(3)]) == (3,)
    assert engine.abandoned == [[102], [103]]
    assert worker.stats().jobs_abandoned == 2
    # An id reported once may be bound again (the tracker refuses only ids in flight): the
    # new job is not the abandoned one and reports its own result.
    worker.bind_connector_metadata(ConnectorMeta((_job(2, LOAD, _item(0, 6, b"ready-a")),)))
    engine.finish(104)
    assert worker.get_transfer_results().completed_jobs == (JobResult(JobId(2), True),)


def test_a_store_view_answering_too_few_slots_is_refused_before_binding() -> None:
    class Short(Slots):
        def slots(self, keys: Sequence[bytes]) -> tuple[int, ...]:
            return super().slots(keys)[:-1]

    engine = Recorder()
    worker = TransferWorker(engine, Short(dict(ENTRIES)), CACHES, HOST)
    load = _job(1, LOAD, _item(0, 3, b"ready-a"), _item(1, 5, b"ready-b"))
    with pytest.raises(ValueError, match="zip"):
        worker.bind_connector_metadata(ConnectorMeta((load,)))
    assert engine.submitted == []
    assert worker.in_flight() == ()


def _refusal(call: object, *args: object) -> HybridKVConfigError:
    with pytest.raises(HybridKVConfigError) as caught:
        call(*args)  # type: ignore[operator]
    return caught.value


def test_abandoning_a_store_is_refused_whole() -> None:
    worker = _worker(Recorder())
    worker.bind_connector_metadata(ConnectorMeta((), (_job(4, STORE, _item(0, 3, b"storing")),)))
    refused = _refusal(worker.abandon, [JobId(4)])
    problem = "is a store job (store job 4 of req-7)"
    assert (refused.field, refused.value, refused.problem, refused.fix) == (
        "job_id",
        4,
        problem,
        "abandon load jobs only",
    )
    assert str(refused) == f"job_id=4: {problem}; abandon load jobs only"


BAD = {
    "group past the groups": (
        _job(5, LOAD, _item(2, 3, b"ready-a")),
        ("group_idx", 2, "is not one of the 2 groups (load job 5 of req-7)", FIX),
    ),
    "negative group": (
        _job(5, LOAD, _item(-1, 3, b"ready-a")),
        ("group_idx", -1, "is not one of the 2 groups (load job 5 of req-7)", FIX),
    ),
    "group True": (
        _job(5, LOAD, _item(True, 3, b"ready-a")),
        ("group_idx", True, "is not one of the 2 groups (load job 5 of req-7)", FIX),
    ),
    "null block": (
        _job(5, LOAD, _item(0, 0, b"ready-a")),
        ("block_id", 0, "is the null block (load job 5 of req-7)", FIX),
    ),
    "block past the cache": (
        _job(5, STORE, _item(0, NUM_BLOCKS, b"storing")),
        ("block_id", NUM_BLOCKS, "is outside the GPU cache (store job 5 of req-7)", FIX),
    ),
    "negative block": (
        _job(5, LOAD, _item(0, -1, b"ready-a")),
        ("block_id", -1, "is outside the GPU cache (load job 5 of req-7)", FIX),
    ),
    "block True": (
        _job(5, LOAD, _item(0, True, b"ready-a")),
        ("block_id", True, "is outside the GPU cache (load job 5 of req-7)", FIX),
    ),
    "a block loaded twice": (
        _job(5, LOAD, _item(0, 3, b"ready-a"), _item(1, 3, b"ready-b")),
        (
            "block_id",
            3,
            "is loaded twice in one job (units smaller than a block) (load job 5 of req-7)",
            "use a chunk_size that is a multiple of every attention block",
        ),
    ),
    "a key not in the host": (
        _job(5, LOAD, _item(0, 3, b"gone")),
        ("key", b"gone".hex(), "has no host entry (load job 5 of req-7)", FIX),
    ),
    "a store of a READY key": (
        _job(5, STORE, _item(0, 3, b"ready-a")),
        ("key", b"ready-a".hex(), "is READY (store job 5 of req-7)", FIX),
    ),
    "a load of a STORING key": (
        _job(5, LOAD, _item(0, 3, b"storing")),
        ("key", b"storing".hex(), "is still being stored (load job 5 of req-7)", FIX),
    ),
    "one key twice": (
        _job(5, LOAD, _item(0, 3, b"ready-a"), _item(0, 4, b"ready-a")),
        ("key", "repeated", "names one key twice (load job 5 of req-7)", FIX),
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_job_is_refused_whole_and_nothing_is_submitted(name: str) -> None:
    bad, (field, value, problem, fix) = BAD[name]
    engine = Recorder()
    worker = _worker(engine)
    good = _job(1, LOAD, _item(0, 6, b"ready-b"))  # before the bad one: nothing partial
    meta = ConnectorMeta((good, bad)) if bad.kind is LOAD else ConnectorMeta((good,), (bad,))
    refused = _refusal(worker.bind_connector_metadata, meta)
    assert (refused.field, refused.value, refused.problem, refused.fix) == (
        field,
        value,
        problem,
        fix,
    )
    assert str(refused) == f"{field}={value!r}: {problem}; {fix}"
    assert engine.submitted == []
    assert worker.in_flight() == ()


def test_a_store_may_name_one_block_for_two_groups_and_the_last_block_is_real() -> None:
    engine = Recorder()
    entries = {b"s0": (PENDING, 0), b"s1": (PENDING, 1)}
    worker = _worker(engine, entries)
    store = _job(1, STORE, _item(0, NUM_BLOCKS - 1, b"s0"), _item(1, NUM_BLOCKS - 1, b"s1"))
    worker.bind_connector_metadata(ConnectorMeta((), (store,)))
    worker.wait_for_save()
    pairs = [TransferPair(0, NUM_BLOCKS - 1, 0), TransferPair(1, NUM_BLOCKS - 1, 1)]
    assert engine.submitted == [(Direction.STORE, pairs)]


@pytest.mark.parametrize("capacity", [3, 4])
def test_a_store_with_more_entries_than_host_slots_is_refused_whole(capacity: int) -> None:
    slots = Slots({}, capacity)
    if capacity <= HOST.num_slots:
        TransferWorker(Recorder(), slots, CACHES, HOST)
        return
    refused = _refusal(TransferWorker, Recorder(), slots, CACHES, HOST)
    problem = "exceeds the 3 slots of host memory"
    fix = "give the store at most 3 chunks, or more host memory"
    assert (refused.field, refused.value, refused.problem, refused.fix) == (
        "num_chunks",
        4,
        problem,
        fix,
    )
    assert str(refused) == f"num_chunks=4: {problem}; {fix}"
