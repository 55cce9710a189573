"""``HybridKVConnector``'s metrics and KV cache events through vLLM 0.33's own pipeline.

The in-process engine keeps every ``SchedulerStats.kv_connector_stats`` payload vLLM's
scheduler produced (the worker's ``get_kv_connector_stats`` in the step's
``KVConnectorOutput``, then the scheduler connector's aggregated into it,
``scheduler.py:2588-2603``). Those payloads are fed to vLLM's own consumers: the stats logger
(``KVConnectorLogging``, which rebuilds them with ``build_kv_connector_stats``) and the
Prometheus side (``KVConnectorProm``, which builds ``build_prom_metrics``). Every total is then
checked against what the test saw happen: the jobs in each step's metadata, the results the
worker reported, the external tokens vLLM handed ``update_state_after_alloc``, the frees the
connector delayed, the events vLLM drained, and the host store's own counts.

The run is sized so every counter moves (load and store faults injected, copies reported late,
a host tier small enough to refuse stores, and full-attention chunks evicted now and then so
the groups' host prefixes disagree), except ``deadlines_fired``, which only a load deadline
moves (0 here: no deadline is configured).
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from diffharness.layouts import RECIPES, Layout  # noqa: E402
from prometheus_client import (  # noqa: E402
    CollectorRegistry,
    Gauge,
    Histogram,
)
from prometheus_client import Counter as PromCounter  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorLogging,
    KVConnectorProm,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402

from hybridkv.connector import TransferKind  # noqa: E402
from hybridkv.connector.counts import COUNTED  # noqa: E402
from hybridkv.kinds import GroupKind  # noqa: E402
from hybridkv.vllm.connector import HybridKVConnector  # noqa: E402
from hybridkv.vllm.harness.chat import ChatTrace, run_trace  # noqa: E402
from hybridkv.vllm.harness.cpu_worker import FaultPlan, HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.engine_config import EngineSettings  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402
from hybridkv.vllm.layout import read_layout  # noqa: E402
from hybridkv.vllm.metrics import (  # noqa: E402
    COUNTERS,
    SCHEDULER_COUNTERS,
    WORKER_COUNTERS,
    HybridKVStats,
    counters_non_negative,
    scheduler_counter_values,
)

LABELS = ["model_name", "engine"]
PER_ENGINE: dict[int, list[object]] = {0: ["hybrid", "0"]}


def _transfer(chunk: int, host_bytes: int) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"host_memory_bytes": host_bytes, "chunk_size": chunk},
    )


class _Observed:
    """What the test sees happen, beside the counters (wrappers on the two connector roles)."""

    def __init__(self, engine: InProcessEngine, evict_seed: int | None) -> None:
        self.engine = engine
        self.calls: Counter[str] = Counter()
        self.jobs: dict[int, Any] = {}
        self.results: dict[int, bool] = {}
        self.events: list[Any] = []
        self.evicted = 0
        self._rng = random.Random(evict_seed) if evict_seed is not None else None
        scheduler_side, worker = engine.scheduler.connector, engine.worker
        self._wrap(scheduler_side, "get_num_new_matched_tokens", self._asked)
        self._wrap(scheduler_side, "request_finished_all_groups", self._finished)
        self._wrap(scheduler_side, "take_events", self._took)
        self._wrap(worker, "bind_connector_metadata", self._bound)
        self._wrap(worker, "build_connector_worker_meta", self._reported)
        real_step = engine.step

        def step() -> list[Any]:
            self._evict_some()
            return real_step()

        engine.step = step  # type: ignore[method-assign]

    @staticmethod
    def _wrap(obj: Any, name: str, after: Any) -> None:
        real = getattr(obj, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            after(out, *args)
            return out

        setattr(obj, name, wrapped)

    def _asked(self, answer: Any, *_: Any) -> None:
        self.calls["lookups"] += 1
        self.calls["lookups_deferred"] += answer[0] is None

    def _finished(self, answer: Any, *_: Any) -> None:
        self.calls["delayed_frees"] += bool(answer[0])

    def _took(self, events: Any) -> None:
        """The connector returns a list: reading it here leaves it whole for vLLM."""
        assert isinstance(events, list | tuple)
        self.events.extend(events)

    def _bound(self, _: Any, metadata: Any) -> None:
        if metadata is not None:
            for job in (*metadata.meta.load_jobs, *metadata.meta.store_jobs):
                self.jobs[job.job_id] = job

    def _reported(self, worker_meta: Any) -> None:
        for result in worker_meta.reports if worker_meta is not None else ():
            assert result.job_id not in self.results
            self.results[result.job_id] = result.success

    def _evict_some(self) -> None:
        """Now and then evict a full-attention chunk a successful store wrote (what a policy
        under pressure from one group does), so later lookups find the groups' prefixes
        differing."""
        if self._rng is None or self._rng.random() > 0.6:
            return
        core = self.engine.scheduler.connector.core
        full = [g for g, kind in enumerate(core.geometry.kinds) if kind is GroupKind.FULL]
        keys = sorted(
            item.key
            for job_id, ok in self.results.items()
            if ok and self.jobs[job_id].kind is TransferKind.STORE
            for item in self.jobs[job_id].items
            if item.group_idx in full
        )
        if keys:
            self.evicted += len(core.store.evict([self._rng.choice(keys)]))

    def expected(self, group_bytes: tuple[int, ...]) -> dict[str, int]:
        """The counters as the observed events imply them (seconds aside)."""
        found: Counter[str] = Counter()
        for job_id, job in self.jobs.items():
            side = "load" if job.kind is TransferKind.LOAD else "store"
            found[f"{side}_jobs"] += 1
            ok = self.results[job_id]  # every bound job reported by the end
            if not ok:
                found[f"{side}_jobs_failed"] += 1
                found["transfer_failures"] += 1
                continue
            found[f"{side}s_done"] += 1
            found[f"{side}_blocks"] += len(job.items)
            found[f"{side}_bytes"] += sum(group_bytes[item.group_idx] for item in job.items)
        found.update(self.calls)
        return dict(found)


class _HostSlots(HybridKVOnCPU):
    """The adapter with a host tier of ``slots`` slots of the layout vLLM planned."""

    def __init__(self, slots: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.slots = slots

    def configure(self, vllm_config: Any, kv_cache_config: Any) -> None:
        slot = read_layout(vllm_config, kv_cache_config).slot_bytes
        vllm_config.kv_transfer_config.kv_connector_extra_config["host_memory_bytes"] = (
            self.slots * slot
        )


class _RegistryCounter(PromCounter):
    """vLLM's counter class, registered in the test's own registry (no global collisions)."""

    registry = CollectorRegistry()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, registry=type(self).registry, **kwargs)


class _TestProm(KVConnectorProm):
    _gauge_cls = Gauge
    _counter_cls = _RegistryCounter
    _histogram_cls = Histogram


# (settings, trace, chunk, host slots, fault seed, eviction seed or None): sliding+full is sized
# so every counter but the deadline's and the restart guard's moves (26 slots: at 24 or fewer the
# admission rule refuses the decode units' LOW stores, which take free slots only, so no finished
# request waits for a store and delayed_frees stays 0), under either engine loop at these seeds:
# a run moves delayed_frees, load_jobs_failed and lookups_deferred only now and then, the two
# loops' timings differ, and at some seeds a failed load's restart needs the guard (seeds 13 and
# 2 since the load admission rule, hybridkv.vllm.admission, moved the timings). mamba+full's
# three conversations are too short for that under evictions (each eviction of a full-attention
# chunk voids every longer mamba claim), so it runs without them and checks the same identities.
SIZED = {
    Layout.SLIDING_FULL: (
        EngineSettings(
            num_gpu_blocks=30,
            max_model_len=512,
            block_size=32,
            max_num_seqs=3,
            max_num_batched_tokens=128,
            kv_events=True,
        ),
        ChatTrace(convs=4, turns=3, system_len=128),
        32,
        26,
        13,
        2,
    ),
    Layout.MAMBA_FULL: (
        EngineSettings(
            num_gpu_blocks=16,
            max_model_len=2560,
            max_num_seqs=2,
            max_num_batched_tokens=1280,
            kv_events=True,
        ),
        ChatTrace(convs=3, turns=3, system_len=700, user_min=150, user_max=300),
        640,
        40,
        3,
        None,
    ),
}


@pytest.mark.parametrize("layout", list(SIZED), ids=lambda lay: lay.value)
def test_metrics_agree_with_observed_events(layout: Layout) -> None:
    settings_, trace, chunk, slots, fault_seed, evict_seed = SIZED[layout]
    evict = evict_seed is not None
    recipe = RECIPES[layout]
    transfer = _transfer(chunk, 1)  # replaced by _HostSlots.configure
    faults = FaultPlan(fault_seed, load_rate=0.3, store_rate=0.3)
    adapter = _HostSlots(slots, faults=faults, delay=3)
    engine = InProcessEngine(recipe.config_json(), settings_, transfer, adapter)
    observed = _Observed(engine, evict_seed=evict_seed)
    report = run_trace(engine, trace)
    assert report.wrong_reads == 0
    assert report.leaked_blocks == 0
    connector = engine.scheduler.connector
    layout_groups = connector.layout.groups
    group_bytes = tuple(len(g.layer_names) * g.real_page_size_bytes for g in layout_groups)

    # Every payload vLLM produced is a non-negative increment (counters_non_negative).
    assert engine.connector_stats
    for payload in engine.connector_stats:
        assert counters_non_negative(payload), payload
        assert set(payload) <= set(COUNTERS), payload

    # vLLM's stats logger: rebuilt by class, summed over the interval.
    logging_ = KVConnectorLogging(engine.vllm_config.kv_transfer_config)
    for payload in engine.connector_stats:
        logging_.observe(payload)
    accumulated = logging_.transfer_stats_accumulator
    assert isinstance(accumulated, HybridKVStats)
    totals = accumulated.reduce()
    print(f"\n{layout.value}: {totals} evicted={observed.evicted}")

    # Every counter moved, except the deadline's (none configured; the name is there) and the
    # restart guard's, which this pool never needs (tests/vllm/test_bench_salvage.py drives it;
    # here they must equal the guard's own counts).
    assert list(totals) == list(COUNTERS)
    moved = {name for name, value in totals.items() if value > 0}
    guard = connector._reclaim
    assert (totals["restarts_deferred"], totals["restarts_whole"]) == (guard.deferred, guard.whole)
    if evict:
        quiet = {"deadlines_fired", "jobs_abandoned", "restarts_deferred", "restarts_whole"}
        assert moved == set(COUNTERS) - quiet, set(COUNTERS) - moved
    else:
        assert {"hit_tokens", "loads_done", "stores_done"} <= moved, moved
    assert totals["deadlines_fired"] == totals["jobs_abandoned"] == 0

    # ... and agrees with what happened.
    expected = observed.expected(group_bytes)
    for name, value in expected.items():
        assert totals[name] == value, (name, totals[name], value)
    assert totals["hit_tokens"] == report.external_loaded  # num_external_tokens vLLM handed
    assert totals["claims"] <= totals["lookups"] - totals["lookups_deferred"]
    assert totals["hit_tokens"] <= totals["claimed_tokens"]
    assert totals["group_prefix_disagreements"] <= totals["lookups"]
    store = connector.core.store.stats()
    core = connector.core.stats()
    assert totals["stores_refused"] == core.stores_refused

    # Events: one BlockStored per key the host stored, one removal per key it dropped.
    stored = [e for e in observed.events if isinstance(e, BlockStored)]
    removed = [h for e in observed.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert len(stored) == store.stored > 0
    assert len(removed) == store.removed + store.evicted
    assert bool(removed) == evict  # mamba+full's host never fills, nothing fails there
    assert all(e.medium == "CPU" for e in (*stored, *observed.events))
    assert all(len(e.block_hashes) == 1 for e in stored)
    units = connector.core.geometry.units
    assert all(e.block_size == units[e.group_idx] for e in stored)

    # Prometheus, built with vLLM's own classes: each counter holds the total.
    _RegistryCounter.registry = CollectorRegistry()  # one registry per run
    prom = _TestProm(engine.vllm_config, LABELS, PER_ENGINE)
    for payload in engine.connector_stats:
        prom.observe(payload, 0)
    registry = _RegistryCounter.registry
    for name, total in totals.items():
        sample = registry.get_sample_value(
            f"vllm:hybridkv_{name}_total", {"model_name": "hybrid", "engine": "0"}
        )
        assert sample == pytest.approx(total), name


def test_failure_free_hit_tokens_are_vllms_external_hits() -> None:
    """Without failures the host's hit tokens are exactly vLLM's external prefix-cache hits,
    and the bytes the meter counts are the bytes the transfer worker moved (measured on the
    canonical tensors)."""
    settings_ = EngineSettings(
        num_gpu_blocks=16, max_model_len=2560, max_num_seqs=2, max_num_batched_tokens=1280
    )
    trace = ChatTrace(convs=3, turns=3, system_len=700, user_min=150, user_max=300)
    recipe = RECIPES[Layout.MAMBA_FULL]
    engine = InProcessEngine(
        recipe.config_json(), settings_, _transfer(640, 64 << 20), HybridKVOnCPU(delay=0)
    )
    report = run_trace(engine, trace)
    totals = HybridKVStats()
    for payload in engine.connector_stats:
        totals.aggregate(HybridKVStats(dict(payload)))
    t = totals.reduce()
    assert t["hit_tokens"] == report.external_hits == report.external_loaded > 0
    worker = engine.worker.worker.stats()
    assert t["load_bytes"] == worker.bytes_loaded > 0
    assert t["store_bytes"] == worker.bytes_stored > 0
    assert t["load_blocks"] == worker.blocks_loaded
    assert t["store_blocks"] == worker.blocks_stored
    assert t["transfer_failures"] == t["load_jobs_failed"] == t["store_jobs_failed"] == 0
    assert t["load_jobs"] == t["loads_done"]
    assert t["store_jobs"] == t["stores_done"]


def test_vllm_counts_every_host_tier_hit_under_the_host_source() -> None:
    """vLLM 0.33's scheduler splits external hits by tier (``get_external_cache_hit_sources``,
    read at admission) into ``SchedulerStats.connector_prefix_cache_stats.hits_by_source``,
    which its Prometheus logger exports as ``vllm:prompt_tokens_cached_by_source``. Every
    token the host tier supplied is counted as ``host``, none as ``external_unspecified``."""
    settings_ = EngineSettings(
        num_gpu_blocks=16, max_model_len=2560, max_num_seqs=2, max_num_batched_tokens=1280
    )
    trace = ChatTrace(convs=3, turns=3, system_len=700, user_min=150, user_max=300)
    engine = InProcessEngine(
        RECIPES[Layout.MAMBA_FULL].config_json(),
        settings_,
        _transfer(640, 64 << 20),
        HybridKVOnCPU(delay=1),
    )
    by_source: Counter[CacheHitSource] = Counter()
    real_make_stats = engine.scheduler.make_stats

    def make_stats(*args: Any, **kwargs: Any) -> Any:
        stats = real_make_stats(*args, **kwargs)
        if stats is not None and stats.connector_prefix_cache_stats is not None:
            by_source.update(stats.connector_prefix_cache_stats.hits_by_source)
        return stats

    engine.scheduler.make_stats = make_stats  # type: ignore[method-assign]
    report = run_trace(engine, trace)
    assert report.external_hits > 0
    assert dict(by_source) == {CacheHitSource.HOST: report.external_hits}


def _runner_output(stats: HybridKVStats | None) -> ModelRunnerOutput:
    return ModelRunnerOutput.with_kv_conn_output_only(KVConnectorOutput(kv_connector_stats=stats))


def test_ranks_then_scheduler_merge_by_sum() -> None:
    """vLLM's ``KVOutputAggregator`` sums the ranks' worker stats, the scheduler's are added
    after (``update_from_output``), and the front-end rebuilds the dict: sums, name by name."""
    rank0 = HybridKVStats({"load_bytes": 100, "load_blocks": 2, "load_seconds": 0.5})
    rank1 = HybridKVStats({"load_bytes": 100, "load_blocks": 2, "transfer_failures": 1})
    merged = KVOutputAggregator(2).aggregate([_runner_output(rank0), _runner_output(rank1)])
    assert merged is not None
    assert merged.kv_connector_output is not None
    workers = merged.kv_connector_output.kv_connector_stats
    scheduler = HybridKVStats({"lookups": 3, "hit_tokens": 64, "load_jobs": 1})
    both = workers.aggregate(scheduler)
    payload = both.to_dict()
    assert payload == {
        "load_bytes": 200,
        "load_blocks": 4,
        "load_seconds": 0.5,
        "transfer_failures": 1,
        "lookups": 3,
        "hit_tokens": 64,
        "load_jobs": 1,
    }
    rebuilt = HybridKVConnector.build_kv_connector_stats(payload)
    assert isinstance(rebuilt, HybridKVStats)
    assert rebuilt.data == payload
    assert rebuilt.data is not payload  # the logger's accumulator must not alias the payload
    assert list(rebuilt.reduce()) == [n for n in COUNTERS if n in payload]
    assert not rebuilt.is_empty()
    rebuilt.reset()
    assert rebuilt.is_empty()
    assert HybridKVStats({"lookups": 0}).is_empty()


def test_counter_schema_sides_and_the_non_negative_predicate() -> None:
    assert not set(SCHEDULER_COUNTERS) & set(WORKER_COUNTERS)
    assert "deadlines_fired" in SCHEDULER_COUNTERS
    assert counters_non_negative({"lookups": 0, "load_seconds": 0.25})
    assert not counters_non_negative({"lookups": -1})
    assert not counters_non_negative({"lookups": True})
    assert not counters_non_negative({"lookups": "3"})


# Where each scheduler counter reads the mark (metrics.scheduler_mark: the core's counts in
# ``COUNTED`` order, then overridden, deferred, whole, disagreements, deadlines fired and
# deadline answers), written out here apart from the module's table.
_MARK_SOURCES = {
    "lookups": ("lookups", "overridden", "deadline_answers"),
    "lookups_deferred": ("deferred", "guard_deferred", "admission_deferred"),
    # The admission rule's deferrals were counted by the core as claims: taken off ("-").
    "claims": ("claims", "-admission_deferred"),
    "claimed_tokens": ("claimed_tokens", "-admission_tokens"),
    "hit_tokens": ("loaded_tokens",),
    "load_jobs": ("load_jobs",),
    "load_jobs_failed": ("load_jobs_failed",),
    "store_jobs": ("store_jobs",),
    "store_jobs_failed": ("store_jobs_failed",),
    "stores_refused": ("stores_refused",),
    "delayed_frees": ("delayed_frees",),
    "deadlines_fired": ("deadlines_fired",),
    "restarts_deferred": ("guard_deferred",),
    "restarts_whole": ("whole",),
    "group_prefix_disagreements": ("disagreements",),
}
_MARK_NAMES = (
    *COUNTED,
    "overridden",
    "guard_deferred",
    "whole",
    "disagreements",
    "deadlines_fired",
    "deadline_answers",
    "admission_deferred",
    "admission_tokens",
)


def _signed(source: str) -> int:
    """The weight of a mark position in a counter: its power of two, negative for ``-``."""
    name = source.removeprefix("-")
    return (-1 if source.startswith("-") else 1) << _MARK_NAMES.index(name)


def test_each_scheduler_counter_sums_its_own_positions_of_the_mark() -> None:
    # One distinct power of two per position: each counter's value names the positions it sums.
    mark = tuple(1 << i for i in range(len(_MARK_NAMES)))
    values = dict(zip(SCHEDULER_COUNTERS, scheduler_counter_values(mark), strict=True))
    assert list(values) == list(_MARK_SOURCES)
    for name, sources in _MARK_SOURCES.items():
        assert values[name] == sum(_signed(s) for s in sources), name


def test_the_counters_of_a_marks_difference_are_the_difference_of_its_counters() -> None:
    # What get_kv_connector_stats relies on to build increments from the marks alone.
    rng = random.Random(18)
    for _ in range(200):
        low = tuple(rng.randrange(50) for _ in _MARK_NAMES)
        high = tuple(v + rng.randrange(3) for v in low)
        moved = scheduler_counter_values(tuple(h - v for h, v in zip(high, low, strict=True)))
        now, then = scheduler_counter_values(high), scheduler_counter_values(low)
        assert moved == tuple(a - b for a, b in zip(now, then, strict=True))
