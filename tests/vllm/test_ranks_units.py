""":mod:`hybridkv.vllm.ranks` on its own: the reports' merge, the quorum, the refusals of
pipeline and context parallel and of a bad replica count, the host sharding, the replica rank's
engine. Each value and each refusal is pinned whole (field, value, problem, fix, message).

``tests/vllm/test_hybridkv_tensor_parallel.py`` runs these inside vLLM's scheduler on two ranks;
this file checks each function's contract directly. It was written for the mutants mutmut left
alive in ``tools/mutants.py``'s run over the module (docs/explanation/mutations.md, "Whole
modules under mutmut"). The module imports no vLLM, but its package (``hybridkv.vllm``) does,
hence the skip.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from hybridkv.connector import JobId as ConnectorJobId
from hybridkv.connector import JobResult
from hybridkv.errors import HybridKVConfigError
from hybridkv.transfer import Direction, FinishedJob, JobId, TransferEngine, TransferPair
from hybridkv.vllm.ranks import (
    HostSharding,
    JobQuorum,
    RankReport,
    ReplicaEngine,
    host_sharding,
    merge_reports,
    refuse_unsupported_parallelism,
)

pytestmark = pytest.mark.vllm


def test_merge_adds_workers_ands_success_and_sorts_by_job() -> None:
    rank0 = [RankReport(9, 1, True), RankReport(3, 1, True), RankReport(5, 1, False)]
    rank1 = [RankReport(3, 1, False), RankReport(9, 1, True)]
    rank2 = [RankReport(3, 2, True), RankReport(5, 1, True)]
    assert merge_reports(rank0, rank1, rank2) == (
        RankReport(3, 4, False),
        RankReport(5, 2, False),
        RankReport(9, 2, True),
    )
    assert merge_reports() == ()
    assert merge_reports([RankReport(1, 1, True)]) == (RankReport(1, 1, True),)


def test_a_quorum_releases_each_job_once_every_worker_reported_it_failed_if_one_failed() -> None:
    quorum = JobQuorum(3)
    assert quorum.world_size == 3
    assert quorum.fold([RankReport(8, 1, True), RankReport(4, 2, False)]) == ()
    assert quorum.pending() == 2
    assert quorum.fold([RankReport(8, 1, True), RankReport(4, 1, True)]) == (
        JobResult(ConnectorJobId(4), False),
    )
    assert quorum.pending() == 1
    # Out of order in one fold: released ascending.
    released = quorum.fold([RankReport(8, 1, True), RankReport(2, 3, True)])
    assert released == (JobResult(ConnectorJobId(2), True), JobResult(ConnectorJobId(8), True))
    assert quorum.pending() == 0
    assert JobQuorum(1).fold([RankReport(6, 1, False)]) == (JobResult(ConnectorJobId(6), False),)


def test_one_worker_releases_reports_ascending_and_refuses_a_double_report_whole() -> None:
    quorum = JobQuorum(1)
    assert quorum.fold([RankReport(9, 1, True), RankReport(3, 1, False)]) == (
        JobResult(ConnectorJobId(3), False),
        JobResult(ConnectorJobId(9), True),
    )
    with pytest.raises(HybridKVConfigError, match="kv_connector_worker_meta"):
        quorum.fold([RankReport(4, 2, True)])
    assert quorum.pending() == 0
    assert quorum.fold(()) == ()


def test_one_worker_holds_a_report_of_no_worker_and_ands_it_with_the_next() -> None:
    # A report naming no worker is held (0 of 1); the job's next report completes it, and a
    # failure held first still fails it.
    quorum = JobQuorum(1)
    assert quorum.fold([RankReport(5, 0, False)]) == ()
    assert quorum.pending() == 1
    assert quorum.fold([RankReport(5, 1, True), RankReport(6, 1, True)]) == (
        JobResult(ConnectorJobId(5), False),
        JobResult(ConnectorJobId(6), True),
    )
    assert quorum.pending() == 0


def test_a_job_reported_by_more_workers_than_exist_is_refused_whole() -> None:
    quorum = JobQuorum(2)
    assert quorum.fold([RankReport(7, 1, True)]) == ()
    with pytest.raises(HybridKVConfigError) as caught:
        quorum.fold([RankReport(7, 2, True)])
    refused = caught.value
    assert (refused.field, refused.value, refused.problem, refused.fix) == (
        "kv_connector_worker_meta",
        7,
        "job reported by 3 workers of 2",
        "each worker reports a job once",
    )
    assert str(refused) == (
        "kv_connector_worker_meta=7: job reported by 3 workers of 2; each worker reports a job once"
    )


@pytest.mark.parametrize("world", [0, -1])
def test_a_quorum_of_no_worker_is_refused(world: int) -> None:
    with pytest.raises(ValueError, match=rf"^world_size={world}: at least one worker$"):
        JobQuorum(world)


@pytest.mark.parametrize(
    ("name", "what"),
    [
        ("pipeline_parallel_size", "pipeline parallel"),
        ("prefill_context_parallel_size", "prefill context parallel"),
        ("decode_context_parallel_size", "decode context parallel"),
    ],
)
@pytest.mark.parametrize("value", [2, 0])
def test_pipeline_and_context_parallel_are_refused_whole(name: str, what: str, value: int) -> None:
    config = SimpleNamespace(
        pipeline_parallel_size=1, prefill_context_parallel_size=1, decode_context_parallel_size=1
    )
    setattr(config, name, value)
    with pytest.raises(HybridKVConfigError) as caught:
        refuse_unsupported_parallelism(config)
    refused = caught.value
    problem = f"{what} is not supported by hybridkv.vllm (tensor parallel is)"
    fix = f"set --{name.replace('_', '-')} 1"
    field = f"parallel_config.{name}"
    assert (refused.field, refused.value, refused.problem, refused.fix) == (
        field,
        value,
        problem,
        fix,
    )
    assert str(refused) == f"{field}={value}: {problem}; {fix}"


def test_one_rank_per_stage_and_context_is_accepted_and_missing_settings_count_as_one() -> None:
    refuse_unsupported_parallelism(
        SimpleNamespace(
            pipeline_parallel_size=1,
            prefill_context_parallel_size=1,
            decode_context_parallel_size=1,
        )
    )
    refuse_unsupported_parallelism(SimpleNamespace())  # an older vLLM without the settings


def test_sharding_maps_ranks_to_shards_writers_and_files() -> None:
    sharding = HostSharding(world_size=6, replicas=3)
    assert sharding.copies == 2
    assert [sharding.shard(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [sharding.writes(r) for r in range(6)] == [True, False, False, True, False, False]
    assert sharding.shared_path("e7", 0) == "/dev/shm/hybridkv-e7-shard0.kv"
    assert sharding.shared_path("e7", 4) == "/dev/shm/hybridkv-e7-shard1.kv"
    private = HostSharding(world_size=4, replicas=1)
    assert private.copies == 4
    assert [private.shard(r) for r in range(4)] == [0, 1, 2, 3]
    assert all(private.writes(r) for r in range(4))
    assert private.shared_path("e7", 2) is None


def _parallel(world: int, backend: object = "mp", nodes: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        world_size=world, distributed_executor_backend=backend, nnodes_within_dp=nodes
    )


@pytest.mark.parametrize(
    ("parallel", "replicas", "expected"),
    [
        (_parallel(4), 2, HostSharding(4, 2)),
        (_parallel(4), 4, HostSharding(4, 4)),
        (_parallel(4), 1, HostSharding(4, 1)),
        (_parallel(4, "ray"), 2, HostSharding(4, 1)),
        (_parallel(4, "mp", 2), 2, HostSharding(4, 1)),
        (SimpleNamespace(world_size=4), 2, HostSharding(4, 1)),  # no backend named: one copy each
        (SimpleNamespace(world_size=4, distributed_executor_backend="mp"), 2, HostSharding(4, 2)),
    ],
)
def test_replicas_share_a_copy_only_on_one_machine_under_mp(
    parallel: SimpleNamespace, replicas: int, expected: HostSharding
) -> None:
    assert host_sharding(parallel, SimpleNamespace(kv_tp_replicas=replicas)) == expected


def test_a_kv_cache_config_without_replicas_is_unreplicated() -> None:
    assert host_sharding(_parallel(2), SimpleNamespace()) == HostSharding(2, 1)


@pytest.mark.parametrize("bad", [3, 0, -2, True, "2", 2.0])
def test_a_replica_count_that_does_not_divide_the_ranks_is_refused_whole(bad: object) -> None:
    with pytest.raises(HybridKVConfigError) as caught:
        host_sharding(_parallel(4), SimpleNamespace(kv_tp_replicas=bad))
    refused = caught.value
    problem = "does not divide the 4 tensor-parallel ranks into groups of identical KV"
    fix = "report it: vLLM plans kv_tp_replicas as a divisor of tensor_parallel_size"
    field = "kv_cache_config.kv_tp_replicas"
    assert (refused.field, refused.value, refused.problem, refused.fix) == (
        field,
        bad,
        problem,
        fix,
    )
    assert str(refused) == f"{field}={bad!r}: {problem}; {fix}"


class _Recorder(TransferEngine):
    """Records what reaches it; every job finishes at once, successfully."""

    def __init__(self) -> None:
        self.submitted: list[tuple[Direction, list[TransferPair]]] = []

    def submit(self, direction: Direction, pairs: Sequence[TransferPair]) -> JobId:
        self.submitted.append((direction, list(pairs)))
        return JobId(len(self.submitted))

    def poll(self) -> list[FinishedJob]:
        return [FinishedJob(JobId(j + 1), True) for j in range(len(self.submitted))]

    def wait(self, job_ids: Iterable[JobId]) -> None:
        pass

    def abandon(self, job_ids: Iterable[JobId]) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_replica_engine_submits_stores_empty_and_loads_whole() -> None:
    inner = _Recorder()
    engine = ReplicaEngine(inner)
    pairs = [TransferPair(0, 1, 2), TransferPair(1, 3, 0)]
    assert engine.submit(Direction.STORE, pairs) == 1
    assert engine.submit(Direction.LOAD, pairs) == 2
    assert inner.submitted == [(Direction.STORE, []), (Direction.LOAD, pairs)]
