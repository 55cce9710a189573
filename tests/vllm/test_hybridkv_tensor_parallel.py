"""``HybridKVConnector`` under tensor parallel 2, simulated in one process
(:mod:`hybridkv.vllm.harness.inprocess`, ``tensor_parallel_size=2``).

What is real: vLLM 0.33's ``Scheduler`` on a ``VllmConfig`` with ``tensor_parallel_size=2``
(``world_size`` 2, so the scheduler-side connector sizes the host tier for two ranks and waits
for two reports per job); vLLM's planning over two workers' layer specs, each rank's model
constructed as that rank of two (its KV and mamba heads halved); each rank's own CPU caches from
``allocate_kv_cache``, worker-role connector, host memory and copy engine; vLLM's own
``KVOutputAggregator`` combining the two ranks' outputs each step. What is simulated: both ranks
run in this process one after the other (no second process, no collective), and the forward is
the content-tag stand-in, on every rank with rank-salted tags.

- A multi-turn chat hits the host tier on both layouts, every read on both ranks content-checked.
- Load faults injected on rank 1 only (before submission and inside the copy), reports delayed
  differently per rank (ranks finish jobs in different steps): every injected fault fails the
  load for both ranks (the core sees exactly the faults as failed load jobs), vLLM gets the
  requests in ``failed_recving`` and recomputes, nothing reads wrong on either rank, nothing
  leaks or stays pending.
- Random traces (seeded; ``max_examples / 20`` per layout at the Hypothesis profile, at least 4:
  ``ci`` 10 per layout, ``nightly`` 100) on three layouts: load and store faults on one
  rank drawn per trace, each rank its own report delay, tight pools (preemptions) and aborts of
  loading requests: 0 wrong reads on either rank, 0 wedges, 0 leaks, and the core's failed jobs
  are exactly the faults that fired on the faulty rank.
- The fold itself against vLLM's ``KVOutputAggregator``: a job one rank finished and the other
  failed a step later is released once, failed, in the step vLLM emits the request as finished
  and failed.
- Replicated KV (``EngineSettings.replicated_kv``: vLLM's ``kv_tp_replicas`` = 2, as it plans
  an all-MLA model, and the same content on both ranks): the host tier is not divided over the
  ranks, rank 0 alone copies stores into one shared host region, both ranks load from it with
  correct content; the random traces run replicated too. The sharding and the replica rank's
  engine on their own.
- Pipeline and context parallel are refused at construction, naming the setting.
"""

from __future__ import annotations

import copy
import random
from collections import Counter
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _random_traces import SHAPES as TRACE_SHAPES  # noqa: E402
from _random_traces import smallest_pool, step_budget  # noqa: E402
from diffharness.layouts import RECIPES, Layout  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import AttentionSpec  # noqa: E402
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput  # noqa: E402

from hybridkv.connector import JobResult  # noqa: E402
from hybridkv.errors import HybridKVConfigError  # noqa: E402
from hybridkv.vllm.connector import HybridKVConnector, HybridKVWorkerMeta  # noqa: E402
from hybridkv.vllm.harness.chat import ChatTrace, run_trace  # noqa: E402
from hybridkv.vllm.harness.cpu_worker import FaultPlan, HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.engine_config import EngineSettings, WedgedError  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402
from hybridkv.vllm.metrics import HybridKVStats  # noqa: E402
from hybridkv.vllm.ranks import (  # noqa: E402
    JobQuorum,
    RankReport,
    ReplicaEngine,
    host_sharding,
)

TP = 2
HOST_BYTES = 64 << 20

# The chat pools of test_hybridkv_inprocess.py, smaller traces; chunk = one block.
CHAT = {
    Layout.MAMBA_FULL: (
        EngineSettings(
            num_gpu_blocks=16,
            max_model_len=2560,
            max_num_seqs=2,
            max_num_batched_tokens=1280,
            tensor_parallel_size=TP,
        ),
        ChatTrace(convs=3, turns=3, system_len=700, user_min=150, user_max=300),
        640,
    ),
    Layout.SLIDING_FULL: (
        EngineSettings(
            num_gpu_blocks=30,
            max_model_len=512,
            block_size=32,
            max_num_seqs=3,
            max_num_batched_tokens=128,
            tensor_parallel_size=TP,
        ),
        ChatTrace(convs=3, turns=3, system_len=128),
        32,
    ),
}


def _transfer(chunk_size: int, host_bytes: int = HOST_BYTES) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"host_memory_bytes": host_bytes, "chunk_size": chunk_size},
    )


def _check_sharded(engine: InProcessEngine, layout: Layout) -> None:
    """Two ranks, each with its own caches holding its shard of the KV heads; the scheduler
    sized the host tier for two ranks of one rank's slot."""
    config_json = RECIPES[layout].config_json()
    scheduler = engine.scheduler.connector
    assert len(engine.ranks) == TP
    assert scheduler.world_size == TP
    assert scheduler.num_chunks == HOST_BYTES // (TP * scheduler.layout.slot_bytes)
    for rank in engine.ranks:
        assert rank.worker.layout.slot_bytes == scheduler.layout.slot_bytes
        heads = {
            g.kv_cache_spec.num_kv_heads
            for g in rank.kv_cache_config.kv_cache_groups
            if isinstance(g.kv_cache_spec, AttentionSpec)
        }
        assert heads == {config_json["num_key_value_heads"] // TP}
    first, second = (rank.kv_caches for rank in engine.ranks)
    assert all(first[name].data_ptr() != second[name].data_ptr() for name in first)
    # Rank-salted tags: one rank's content never verifies on the other.
    for (_, tags0, _), (_, tags1, _) in zip(*(r.layers for r in engine.ranks), strict=True):
        assert tags0.name == tags1.name
        assert (tags0.expected([12345], range(1)) != tags1.expected([12345], range(1))).all()


def _quiescent(engine: InProcessEngine) -> None:
    scheduler = engine.scheduler.connector
    stats = scheduler.core.stats()
    store = scheduler.core.store.stats()
    assert engine.pending() == 0
    assert scheduler._quorum.pending() == 0
    assert (stats.jobs_in_flight, stats.held_blocks, stats.requests) == (0, 0, 0), stats
    assert (store.pinned, store.storing) == (0, 0), store
    assert engine.leaked_blocks() == 0


@pytest.mark.parametrize("layout", list(CHAT), ids=lambda lay: lay.value)
def test_tp2_chat_hits_the_host_tier_with_correct_content_on_every_rank(layout: Layout) -> None:
    settings, trace, chunk = CHAT[layout]
    adapters = [HybridKVOnCPU(delay=1), HybridKVOnCPU(delay=2)]
    engine = InProcessEngine(RECIPES[layout].config_json(), settings, _transfer(chunk), adapters)
    _check_sharded(engine, layout)
    report = run_trace(engine, trace)
    print(f"\n{layout.value} TP={TP}: {report}")
    assert report.finished == report.requests > 0
    assert report.slots_checked > 0
    assert report.wrong_reads == 0
    assert report.external_loaded > 0
    assert report.external_hits == report.external_loaded
    assert report.failed_loads == 0
    assert report.preemptions == 0  # the identity below holds without recompute
    total = report.prefill_computed + report.gpu_prefix_hits + report.external_hits
    assert total == report.prompt_tokens
    per_rank = [a.stats() for a in adapters]
    # Both ranks moved the same jobs, each its own shard: equal bytes, none zero.
    assert per_rank[0]["bytes_loaded"] == per_rank[1]["bytes_loaded"] > 0
    assert per_rank[0]["bytes_stored"] == per_rank[1]["bytes_stored"] > 0
    assert report.transfers["bytes_loaded"] == TP * per_rank[0]["bytes_loaded"]
    _quiescent(engine)


def test_a_load_fault_on_one_rank_fails_the_load_for_both_and_vllm_recomputes() -> None:
    layout = Layout.SLIDING_FULL
    settings, trace, chunk = CHAT[layout]
    faulty = HybridKVOnCPU(faults=FaultPlan(seed=7, load_rate=0.5, mid_copy=0.5), delay=2)
    clean = HybridKVOnCPU(delay=1)
    engine = InProcessEngine(
        RECIPES[layout].config_json(), settings, _transfer(chunk), [clean, faulty]
    )
    report = run_trace(engine, trace)
    print(f"\n{layout.value} TP={TP} faults on rank 1: {report}")
    core = engine.scheduler.connector.core.stats()
    injected = faulty.stats()["load_faults"]
    assert injected > 0
    assert clean.stats().get("load_faults", 0) == 0
    assert clean.stats()["jobs_failed"] == 0  # the clean rank's copies of those jobs succeeded
    # Every fault fired on rank 1 fails its job for both ranks, and nothing else fails.
    assert core.load_jobs_failed == injected
    assert core.load_jobs > core.load_jobs_failed
    assert report.failed_loads > 0  # vLLM got them in failed_recving and recomputed
    # Failed loads count as computed (recomputed), never as external hits.
    assert report.preemptions == 0
    assert report.external_hits < report.external_loaded
    total = report.prefill_computed + report.gpu_prefix_hits + report.external_hits
    assert total == report.prompt_tokens
    assert report.finished == report.requests
    assert report.slots_checked > 0
    assert report.wrong_reads == 0
    _quiescent(engine)


# ------------------------------------------------------------------ replicated KV (MLA)


def test_vllm_marks_an_all_mla_model_replicated_on_every_rank() -> None:
    # What replicated_kv simulates: vLLM's planner gives MLA layers (max_tp_shards=1)
    # kv_tp_replicas = the TP size, and any non-MLA layer (a mamba group) brings it back to 1.
    import torch
    from vllm.v1.core.kv_cache_planning import kv_cache_groups_tp_replicas
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec, MLAAttentionSpec

    mla = MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, max_tp_shards=1
    )
    assert kv_cache_groups_tp_replicas([KVCacheGroupSpec(["l0"], mla)], TP) == TP
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))
    both = [KVCacheGroupSpec(["l0"], mla), KVCacheGroupSpec(["l1"], mamba)]
    assert kv_cache_groups_tp_replicas(both, TP) == 1


def test_a_replica_ranks_engine_stores_nothing_and_loads_everything() -> None:
    # A rank whose group's writer stores the shared slots runs its store jobs empty (still
    # reported, successful), and its loads in full.
    import torch

    from hybridkv.cache_layouts import all_layout_cases
    from hybridkv.canonical import build_canonical_caches
    from hybridkv.hostmem import HostMemory, PinMode
    from hybridkv.transfer import CpuTransferEngine, Direction, FinishedJob, TransferPair

    case = all_layout_cases(4)[0]
    cc = build_canonical_caches(case.kv_caches, case.groups, case.num_blocks)
    slot = cc.group_bytes(0)
    host = HostMemory(4 * slot, slot, PinMode.OFF)
    host.tensor.fill_(5)
    with ReplicaEngine(CpuTransferEngine(cc, host)) as engine:
        store = engine.submit(Direction.STORE, [TransferPair(0, 1, 2), TransferPair(0, 3, 1)])
        engine.wait([store])
        assert engine.poll() == [FinishedJob(store, True)]
        assert host.tensor.eq(5).all()  # no byte stored
        load = engine.submit(Direction.LOAD, [TransferPair(0, 0, 2)])
        engine.wait([load])
        assert engine.poll() == [FinishedJob(load, True)]
    for ref in cc.group_refs[0]:  # every byte of block 0 came from the slot
        row = cc.tensors[ref.tensor_index].view[0].view(torch.uint8)
        for offset, length in ref.runs:
            assert row[offset : offset + length].eq(5).all()


@pytest.mark.parametrize(
    ("replicas", "world", "copies"), [(1, 2, 2), (2, 2, 1), (2, 4, 2), (4, 4, 1)]
)
def test_host_sharding_writers_paths_and_copies(replicas: int, world: int, copies: int) -> None:
    class _Parallel:
        world_size = world
        distributed_executor_backend = "mp"
        nnodes_within_dp = 1

    class _KV:
        kv_tp_replicas = replicas

    sharding = host_sharding(_Parallel(), _KV())
    assert sharding.copies == copies
    writers = [r for r in range(world) if sharding.writes(r)]
    assert writers == list(range(0, world, replicas))
    paths = [sharding.shared_path("e1", r) for r in range(world)]
    if replicas == 1:
        assert paths == [None] * world
    else:  # one file per group of replicas, named by engine
        assert len(set(paths)) == copies
        assert all(p is not None and "e1" in p for p in paths)
        assert paths[0] == paths[replicas - 1]


@pytest.mark.parametrize(("backend", "nodes"), [("ray", 1), ("mp", 2), (None, 1)])
def test_replicas_on_more_than_one_machine_keep_a_copy_each(backend: Any, nodes: int) -> None:
    # A /dev/shm file is one machine's: ranks elsewhere (or of another executor) would map a
    # file nobody writes, so they store their own copies instead.
    class _Parallel:
        world_size = 2
        distributed_executor_backend = backend
        nnodes_within_dp = nodes

    class _KV:
        kv_tp_replicas = 2

    sharding = host_sharding(_Parallel(), _KV())
    assert (sharding.replicas, sharding.copies) == (1, 2)
    assert sharding.writes(0)
    assert sharding.writes(1)
    assert sharding.shared_path("e1", 1) is None


@pytest.mark.parametrize("bad", [3, 0, True, "2"])
def test_a_replica_count_that_does_not_divide_the_ranks_is_refused(bad: object) -> None:
    class _Parallel:
        world_size = 4

    class _KV:
        kv_tp_replicas = bad

    with pytest.raises(HybridKVConfigError) as caught:
        host_sharding(_Parallel(), _KV())
    assert caught.value.field == "kv_cache_config.kv_tp_replicas"


@pytest.mark.parametrize("layout", list(CHAT), ids=lambda lay: lay.value)
def test_replicated_kv_one_rank_writes_a_shared_host_copy_the_size_of_the_whole_tier(
    layout: Layout,
) -> None:
    settings, trace, chunk = CHAT[layout]
    replicated = EngineSettings(**{**_fields(settings), "replicated_kv": True})
    # Every store rank 1 copies would fail inside its copy (run 1 of each store raises): rank 1
    # must copy no store at all, and load the bytes rank 0 stored into the shared slots.
    reader = HybridKVOnCPU(faults=FaultPlan(seed=3, store_rate=1.0, mid_copy=1.0), delay=2)
    writer = HybridKVOnCPU(delay=1)
    engine = InProcessEngine(
        RECIPES[layout].config_json(), replicated, _transfer(chunk), [writer, reader]
    )
    scheduler = engine.scheduler.connector
    # The host tier is not divided over the ranks: one copy serves both.
    assert scheduler.num_chunks == HOST_BYTES // scheduler.layout.slot_bytes
    assert scheduler.sharding.copies == 1
    assert [r.worker.sharding.writes(r.worker.rank) for r in engine.ranks] == [True, False]
    report = run_trace(engine, trace)
    print(f"\n{layout.value} TP={TP} replicated: {report}")
    assert report.finished == report.requests > 0
    assert report.slots_checked > 0
    assert report.wrong_reads == 0  # rank 1 read what rank 0 wrote: one shared region
    assert report.external_loaded > 0
    assert report.external_hits == report.external_loaded
    assert report.failed_loads == 0
    core = scheduler.core.stats()
    assert core.store_jobs > 0
    assert core.store_jobs_failed == 0
    assert reader.stats().get("store_faults", 0) == 0  # no store copy ran on rank 1
    loaded = [a.stats()["bytes_loaded"] for a in (writer, reader)]
    assert loaded[0] == loaded[1] > 0  # both ranks load into their own caches
    stats = HybridKVStats()
    for payload in engine.connector_stats:
        stats.aggregate(HybridKVStats(dict(payload)))
    totals = stats.reduce()
    # Worker metrics count the bytes copied: the stores once (rank 0), the loads per rank.
    assert totals["store_bytes"] == writer.stats()["bytes_stored"] > 0
    assert totals["load_bytes"] == 2 * loaded[0]
    _quiescent(engine)
    engine.close()  # unlinks the shared file


# ------------------------------------------------------------------ random traces

# The random traces' shapes (_random_traces.SHAPES: budget, chunk, longest prompt,
# max_num_seqs), with their pools and step budgets under the engine loop in use (smallest_pool,
# step_budget: under async scheduling a sliding window schedules half the budget a step, so vLLM
# accepts pools as tight as under sync).
SHAPES = {
    layout: TRACE_SHAPES[layout]
    for layout in (Layout.MAMBA_FULL, Layout.SLIDING_FULL, Layout.THREE_GROUPS)
}
TRACES_PER_LAYOUT = max(4, hypothesis_settings.default.max_examples // 20)


def _random_engine(
    layout: Layout, rng: random.Random, seed: int, replicated: bool = False
) -> tuple[InProcessEngine, int]:
    """A TP=2 engine on a tight pool, faults on one rank (returned), delays per rank;
    ``replicated``: the ranks hold replicated KV (one writer, one shared host copy)."""
    shape = SHAPES[layout]
    chunk = shape.chunk
    recipe = RECIPES[layout]
    settings = EngineSettings(
        num_gpu_blocks=smallest_pool(shape) + rng.choice((0, 1, 3, 8)),
        max_model_len=recipe.max_model_len,
        block_size=recipe.block_size,
        max_num_seqs=shape.max_seqs,
        max_num_batched_tokens=step_budget(shape),
        max_steps=600,
        tensor_parallel_size=TP,
        replicated_kv=replicated,
    )
    faulty = rng.randrange(TP)
    plan = FaultPlan(seed, load_rate=rng.choice((0.3, 0.6)), store_rate=rng.choice((0.0, 0.3)))
    adapters = [
        HybridKVOnCPU(faults=plan if r == faulty else None, delay=rng.choice((0, 1, 2, 3)))
        for r in range(TP)
    ]
    host = rng.choice((HOST_BYTES, TP * 6 * recipe.max_model_len * 4096))
    engine = InProcessEngine(recipe.config_json(), settings, _transfer(chunk, host), adapters)
    return engine, faulty


def _random_arrivals(layout: Layout, rng: random.Random) -> list[tuple[int, str, list[int], int]]:
    """4-7 requests over two shared bases, arriving over the first steps (step, id, prompt,
    max_tokens)."""
    chunk, longest = SHAPES[layout].chunk, SHAPES[layout].max_prompt
    bases = [[rng.randint(3, 999) for _ in range(longest)] for _ in range(2)]
    arrivals = []
    for i in range(rng.randint(4, 7)):
        base = rng.choice(bases)
        length = rng.randint(chunk // 2, longest - 8)
        own = [rng.randint(3, 999) for _ in range(rng.choice((0, 0, 3, chunk // 2)))]
        prompt = (base[:length] + own)[:longest]
        arrivals.append((rng.randint(0, 10), f"r{i}", prompt, rng.randint(1, 3)))
    return sorted(arrivals, key=lambda a: (a[0], a[1]))


def _play(layout: Layout, seed: int, replicated: bool = False) -> Counter[str]:
    rng = random.Random(seed)
    engine, faulty = _random_engine(layout, rng, seed, replicated)
    try:
        arrivals = _random_arrivals(layout, rng)
        aborted_loading = 0
        step = 0
        while arrivals or engine.busy():
            while arrivals and arrivals[0][0] <= step:
                _, rid, prompt, max_tokens = arrivals.pop(0)
                engine.add(rid, prompt, max_tokens)
            step += 1
            if not engine.busy():
                continue
            if engine.tally.steps >= engine.settings.max_steps:
                requests = engine.requests.items()
                live = {r: engine.status(r) for r, q in requests if not q.is_finished()}
                raise WedgedError(f"{layout.value} seed {seed}: {live}")
            for rid, request in engine.requests.items():
                if request.is_finished():
                    continue
                loading = engine.status(rid) == "WAITING_FOR_REMOTE_KVS"
                if rng.random() < (0.25 if loading else 0.01) and engine.abort(rid):
                    aborted_loading += loading
            engine.step()
        report = engine.report(sum(r.is_finished() for r in engine.requests.values()))
        assert report.finished == report.requests, f"seed {seed}: unfinished requests"
        assert report.wrong_reads == 0, f"seed {seed}: {report}"
        _quiescent(engine)
        injected = [rank.adapter.stats() for rank in engine.ranks]
        clean = [f for r, f in enumerate(injected) if r != faulty]
        assert all(f.get("load_faults", 0) == f.get("store_faults", 0) == 0 for f in clean)
        core = engine.scheduler.connector.core.stats()
        # A job fails for all ranks exactly when it failed on the faulty one.
        assert core.load_jobs_failed == injected[faulty].get("load_faults", 0), seed
        assert core.store_jobs_failed == injected[faulty].get("store_faults", 0), seed
        return Counter(
            traces=1,
            slots_checked=report.slots_checked,
            wrong_reads=report.wrong_reads,
            host_loaded=report.external_loaded,
            load_faults=injected[faulty].get("load_faults", 0),
            store_faults=injected[faulty].get("store_faults", 0),
            failed_loads=report.failed_loads,
            preemptions=report.preemptions,
            aborted_loading=aborted_loading,
        )
    finally:
        engine.close()  # a replicated run's shared host file goes with it


@pytest.mark.parametrize("replicated", [False, True], ids=["sharded", "replicated"])
@pytest.mark.parametrize("layout", list(SHAPES), ids=lambda lay: lay.value)
def test_tp2_random_traces_with_faults_on_one_rank_preemptions_and_aborts(
    layout: Layout, replicated: bool
) -> None:
    # Replicated: a store fault inside the copy can fire only on the writer (rank 0): the
    # reader's store jobs copy nothing; the identities below hold either way.
    total: Counter[str] = Counter()
    for seed in range(TRACES_PER_LAYOUT):
        total.update(_play(layout, seed, replicated))
    print(f"\n{layout.value} TP={TP} replicated={replicated}: {dict(total)}")
    assert total["wrong_reads"] == 0
    for name in ("slots_checked", "host_loaded", "load_faults", "failed_loads"):
        assert total[name] > 0, (name, dict(total))


def _rank_output(jobs: tuple[JobResult, ...], finished: set[str], failed: set[str]) -> Any:
    output = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
    meta = HybridKVWorkerMeta(tuple(RankReport(j.job_id, 1, j.success) for j in jobs))
    output.kv_connector_output = KVConnectorOutput(
        finished_recving=finished,
        failed_recving=failed,
        kv_connector_worker_meta=meta if jobs else None,
    )
    return output


def test_vllms_aggregator_and_the_quorum_release_a_job_once_failed_if_one_rank_failed() -> None:
    aggregator = KVOutputAggregator(TP)
    quorum = JobQuorum(TP)
    # Step 1: rank 0 finished job 7 (request r) well, rank 1 is still copying; job 8 (request s)
    # finished well on both.
    step1 = aggregator.aggregate(
        [
            _rank_output((JobResult(7, True), JobResult(8, True)), {"r", "s"}, set()),
            _rank_output((JobResult(8, True),), {"s"}, set()),
        ]
    ).kv_connector_output
    assert step1.finished_recving == {"s"}
    assert not step1.failed_recving
    assert quorum.fold(step1.kv_connector_worker_meta.reports) == (JobResult(8, True),)
    assert quorum.pending() == 1
    # Step 2: rank 1's copy of job 7 failed.
    step2 = aggregator.aggregate(
        [_rank_output((), set(), set()), _rank_output((JobResult(7, False),), {"r"}, {"r"})]
    ).kv_connector_output
    assert step2.finished_recving == {"r"}
    assert step2.failed_recving == {"r"}
    assert quorum.fold(step2.kv_connector_worker_meta.reports) == (JobResult(7, False),)
    assert quorum.pending() == 0
    assert quorum.fold((RankReport(9, 1, True),)) == ()
    with pytest.raises(HybridKVConfigError):  # 3 reports of 2 workers: one reported it twice
        quorum.fold((RankReport(9, 2, True),))


@pytest.fixture(scope="module")
def one_rank() -> Any:
    settings, _, chunk = CHAT[Layout.SLIDING_FULL]
    one = EngineSettings(**{**_fields(settings), "tensor_parallel_size": 1})
    engine = InProcessEngine(
        RECIPES[Layout.SLIDING_FULL].config_json(), one, _transfer(chunk), HybridKVOnCPU()
    )
    yield engine
    engine.worker.shutdown()


@pytest.mark.parametrize(
    "name",
    ["pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"],
)
def test_pipeline_and_context_parallel_are_refused_naming_the_setting(
    name: str, one_rank: InProcessEngine
) -> None:
    config = copy.copy(one_rank.vllm_config)
    config.parallel_config = copy.copy(config.parallel_config)
    setattr(config.parallel_config, name, 2)
    with pytest.raises(HybridKVConfigError) as caught:
        HybridKVConnector(config, KVConnectorRole.SCHEDULER, one_rank.kv_cache_config)
    assert caught.value.field == f"parallel_config.{name}"
    assert "\n" not in str(caught.value)


def _fields(settings: EngineSettings) -> dict[str, Any]:
    return {name: getattr(settings, name) for name in EngineSettings.__slots__}
