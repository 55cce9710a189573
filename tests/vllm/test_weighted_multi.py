"""``WeightedMultiConnector`` (:mod:`hybridkv.vllm.multi`) inside vLLM 0.33's real Scheduler
(:mod:`hybridkv.vllm.harness.inprocess`: both roles, CPU caches from vLLM's ``allocate_kv_cache``,
every KV slot the forward reads content-checked), with two children that both store every prompt:
``HybridKVConnector`` (named ``host``) and vLLM's native ``OffloadingConnector`` (named
``native``, its worker on CPU tensors through
:class:`~hybridkv.vllm.harness.native_cpu.NativeOffloadOnCPU`), on the sliding + full layout (two KV
cache groups, so HMA is on).

- The weights decide which child loads, observed in the bytes each child's worker moved: host
  weighted higher, only the host tier loads; native weighted higher, the native tier loads most
  (the host loads only what native has not stored yet); native at weight 0, only the host loads.
  0 wrong reads, 0 leaked blocks, no wedge, nothing in flight at the end.
- A child without ``SupportsHMA`` on this two-group model is refused at start-up, by name;
  on a one-group model it is taken.
- Preemptions: vLLM's ``preempted_req_ids`` reach both children's scheduler sides, and every
  step each worker child's ``handle_preemptions`` gets its own metadata, with content intact.
- Random traces (ci 25, nightly 250): random weights per child (0, 0.5, 1, 2), copy delays,
  load faults in the host child, pools from vLLM's minimum up (preemptions), aborts of loading
  requests: 0 wrong reads, 0 wedges, nothing left behind; across the batch both children load,
  and failed loads are recovered by recompute.
- The how-to's ``--kv-transfer-config`` builds through vLLM's factory; bad child entries and
  foreign stats payloads are refused by name.
- Stats: the payloads vLLM produced, keyed by child name, rebuild after pickling in a fresh
  process that never built a connector, with ``HybridKVConnector`` taken out of vLLM's factory
  registry (as a child loaded only by module path is), to the same reduced figures; the host's
  byte counter agrees with its worker's; vLLM's ``KVConnectorProm`` hands each child's payload
  to that child class's Prometheus metrics.
"""

from __future__ import annotations

import json
import pickle
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from diffharness.layouts import RECIPES, Layout  # noqa: E402
from hypothesis import settings  # noqa: E402
from prometheus_client import CollectorRegistry, Gauge, Histogram  # noqa: E402
from prometheus_client import Counter as PromCounter  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm  # noqa: E402

from hybridkv.errors import HybridKVConfigError  # noqa: E402
from hybridkv.vllm.connector import HybridKVConnector  # noqa: E402
from hybridkv.vllm.harness.chat import ChatTrace, run_trace  # noqa: E402
from hybridkv.vllm.harness.cpu_worker import FaultPlan, HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.engine_config import (  # noqa: E402
    EngineSettings,
    WedgedError,
    default_async_scheduling,
)
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402
from hybridkv.vllm.harness.multi_cpu import MultiOnCPU  # noqa: E402
from hybridkv.vllm.harness.native_cpu import NativeOffloadOnCPU  # noqa: E402
from hybridkv.vllm.harness.report import InProcessReport  # noqa: E402
from hybridkv.vllm.multi import WeightedMultiConnector, WeightedMultiStats  # noqa: E402

LAYOUT = Layout.SLIDING_FULL
SETTINGS = EngineSettings(
    num_gpu_blocks=30, max_model_len=512, block_size=32, max_num_seqs=3, max_num_batched_tokens=128
)
TRACE = ChatTrace(convs=4, turns=3, system_len=128)


def _host(weight: float) -> dict[str, Any]:
    return {
        "name": "host",
        "load_weight": weight,
        "kv_connector": "HybridKVConnector",
        "kv_connector_module_path": "hybridkv.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"host_memory_bytes": 64 << 20, "chunk_size": 32},
    }


def _native(weight: float) -> dict[str, Any]:
    return {
        "name": "native",
        "load_weight": weight,
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {},
    }


def _transfer(*children: dict[str, Any]) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="WeightedMultiConnector",
        kv_connector_module_path="hybridkv.vllm.multi",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"connectors": list(children)},
    )


def _engine(host_weight: float, native_weight: float, settings: EngineSettings = SETTINGS):
    adapter = MultiOnCPU({"host": HybridKVOnCPU(), "native": NativeOffloadOnCPU(256, delay=1)})
    transfer = _transfer(_host(host_weight), _native(native_weight))
    return InProcessEngine(RECIPES[LAYOUT].config_json(), settings, transfer, adapter)


def _clean(engine: InProcessEngine, report: InProcessReport) -> None:
    """Every request finished (no wedge), every read right, nothing leaked or in flight."""
    assert report.connector == "WeightedMultiConnector"
    assert report.finished == report.requests > 0
    assert report.slots_checked > 0
    assert report.wrong_reads == 0
    assert report.leaked_blocks == 0
    assert engine.adapter.pending() == 0
    host = engine.scheduler.connector.child("host").core
    assert (host.stats().jobs_in_flight, host.stats().held_blocks, host.stats().requests) == (
        0,
        0,
        0,
    )
    assert (host.store.stats().pinned, host.store.stats().storing) == (0, 0)


# ------------------------------------------------------------------ selection by weight


def _watch_allocations(engine: InProcessEngine) -> list[dict[str, int]]:
    """Per ``update_state_after_alloc`` of the multi-connector: what each child was handed."""
    multi = engine.scheduler.connector
    calls: list[dict[str, int]] = []
    outer = multi.update_state_after_alloc

    def allocated(request: Any, blocks: Any, num_external_tokens: int) -> None:
        calls.append({})
        outer(request, blocks, num_external_tokens)

    multi.update_state_after_alloc = allocated
    for spec in multi.specs:
        child = multi.child(spec.name)
        inner = child.update_state_after_alloc

        def handed(
            request: Any, blocks: Any, count: int, inner: Any = inner, name: str = spec.name
        ):
            calls[-1][name] = count
            inner(request, blocks, count)

        child.update_state_after_alloc = handed
    return calls


def test_the_weights_decide_which_child_loads() -> None:
    runs = {}
    for weights in ((2.0, 1.0), (1.0, 2.0), (1.0, 0.0)):
        engine = _engine(*weights)
        claims = _watch_allocations(engine)
        report = run_trace(engine, TRACE)
        print(f"\nweights host, native = {weights}: {report}")
        _clean(engine, report)
        assert report.external_loaded > 0
        assert report.external_hits == report.external_loaded
        # Every allocation reached both children, at most one with a positive count, and the
        # positive counts add up to what vLLM allocated for external tokens.
        assert claims
        assert all(len(counts) == 2 for counts in claims)
        assert all(sum(c > 0 for c in counts.values()) <= 1 for counts in claims)
        assert sum(sum(counts.values()) for counts in claims) == report.external_loaded
        runs[weights] = (engine, report)

    # host weighted higher, or native store-only: only the host tier loads, and the host
    # connector loaded every external token vLLM allocated.
    for weights in ((2.0, 1.0), (1.0, 0.0)):
        engine, report = runs[weights]
        multi = engine.scheduler.connector
        assert report.transfers["host.bytes_loaded"] > 0
        assert report.transfers["native.load"] == report.transfers["native.bytes_loaded"] == 0
        assert report.transfers["native.bytes_stored"] > 0  # it stores all the same
        assert multi.selections.chosen["native"] == 0 < multi.selections.chosen["host"]
        assert multi.child("host").core.stats().loaded_tokens == report.external_loaded

    # native weighted higher: the native tier does most of the loading.
    engine, report = runs[(1.0, 2.0)]
    multi = engine.scheduler.connector
    assert report.transfers["native.bytes_loaded"] > report.transfers["host.bytes_loaded"]
    assert multi.selections.chosen["native"] > multi.selections.chosen["host"]
    assert multi.child("host").core.stats().loaded_tokens < report.external_loaded
    # The native connector answers None while a request's transfers run: counted, never chosen.
    assert multi.selections.pending > 0
    assert multi.selections.answers == (
        sum(multi.selections.chosen.values()) + multi.selections.pending + multi.selections.no_hit
    )


# ------------------------------------------------------------------ HMA


def test_a_child_without_hma_is_refused_by_name() -> None:
    example = {
        "name": "disk",
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": "/nonexistent"},
    }
    with pytest.raises(HybridKVConfigError) as caught:
        InProcessEngine(
            RECIPES[LAYOUT].config_json(),
            SETTINGS,
            _transfer(_host(1.0), example),
            MultiOnCPU({"host": HybridKVOnCPU(), "disk": HybridKVOnCPU()}),
        )
    error = caught.value
    assert error.field == "kv_connector_extra_config.connectors[1] (disk)"
    assert error.value == "ExampleConnector"
    assert "SupportsHMA" in error.problem
    assert "2 KV cache groups" in error.problem
    assert "'disk'" in error.fix


def test_a_child_without_hma_is_taken_on_a_one_group_model(tmp_path: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from hybridkv.vllm.harness.engine_config import _process_setup, _vllm_config
    from hybridkv.vllm.harness.planning import plan_kv_caches

    _process_setup()
    example = {
        "name": "disk",
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    recipe = RECIPES[Layout.FULL_ONLY]
    one_group = EngineSettings(
        num_gpu_blocks=recipe.min_blocks(128),
        max_model_len=recipe.max_model_len,
        block_size=recipe.block_size,
        max_num_batched_tokens=128,
    )
    config = _vllm_config(recipe.config_json(), one_group, _transfer(_host(1.0), example))
    kv_cache_config, _, _ = plan_kv_caches(config, 1 << 30)
    assert len(kv_cache_config.kv_cache_groups) == 1
    multi = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    assert isinstance(multi, WeightedMultiConnector)
    assert type(multi.child("disk")).__name__ == "ExampleConnector"
    assert not WeightedMultiConnector.all_children_support_hma(config.kv_transfer_config)


# ------------------------------------------------------------------ preemption


def test_preemptions_reach_both_children() -> None:
    tight = EngineSettings(
        # vLLM's minimum: one step's budget per batch in flight (2 under async scheduling).
        num_gpu_blocks=RECIPES[LAYOUT].min_blocks(
            128 * (2 if default_async_scheduling() else 1), 320
        ),
        max_model_len=320,
        block_size=32,
        max_num_seqs=3,
        max_num_batched_tokens=128,
    )
    engine = _engine(1.0, 1.0, tight)
    multi = engine.scheduler.connector
    preempted: dict[str, set[str]] = {"host": set(), "native": set()}
    worker_meta: dict[str, list[str]] = {"host": [], "native": []}
    for name in ("host", "native"):
        scheduler_child = multi.child(name)
        build = scheduler_child.build_connector_meta

        def seen(output: Any, build: Any = build, name: str = name) -> Any:
            preempted[name].update(output.preempted_req_ids or ())
            return build(output)

        scheduler_child.build_connector_meta = seen
        worker_child = engine.worker.child(name)
        handle = worker_child.handle_preemptions

        def handled(meta: Any, handle: Any = handle, name: str = name) -> None:
            worker_meta[name].append(type(meta).__name__)
            handle(meta)

        worker_child.handle_preemptions = handled
    trace = ChatTrace(convs=4, turns=3, system_len=64, user_min=20, user_max=40, output_len=40)
    report = run_trace(engine, trace)
    print(f"\ntight pool: {report}")
    _clean(engine, report)
    assert report.preemptions > 0
    assert preempted["host"] == preempted["native"] != set()
    # Every scheduled step's metadata reached both workers (under async scheduling the loop's
    # last turn only applies an output: a turn is not a step).
    assert len(worker_meta["host"]) == len(worker_meta["native"]) == engine.tally.schedules
    assert set(worker_meta["host"]) == {"HybridKVMetadata"}
    assert set(worker_meta["native"]) == {"OffloadingConnectorMetadata"}


# ------------------------------------------------------------------ stats across processes

_REBUILD = """
import json, pickle, sys
from hybridkv.vllm.multi import WeightedMultiConnector
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
# Built by module path only, as a child named by kv_connector_module_path is: unregistered.
KVConnectorFactory._registry.pop("HybridKVConnector", None)
payloads = pickle.load(sys.stdin.buffer)
total = None
for payload in payloads:
    stats = WeightedMultiConnector.build_kv_connector_stats(payload)
    total = stats if total is None else total.aggregate(stats)
print(json.dumps({
    "registered": "HybridKVConnector" in KVConnectorFactory._registry,
    "types": {name: type(s).__name__ for name, s in total.data.items()},
    "reduced": total.reduce(),
}))
"""


class _PrivateRegistry:
    """Prometheus metric classes registered in one registry of this test's own (two builds of
    a connector's metrics in one process would collide in the global registry)."""

    registry = CollectorRegistry()


class _Counter(PromCounter):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, registry=_PrivateRegistry.registry, **kwargs)


class _Gauge(Gauge):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, registry=_PrivateRegistry.registry, **kwargs)


class _Histogram(Histogram):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, registry=_PrivateRegistry.registry, **kwargs)


class _PrivateProm(KVConnectorProm):
    _gauge_cls = _Gauge
    _counter_cls = _Counter
    _histogram_cls = _Histogram


def test_stats_are_keyed_by_child_name_and_rebuild_in_another_process() -> None:
    engine = _engine(2.0, 1.0)
    report = run_trace(engine, TRACE)
    _clean(engine, report)
    payloads = engine.connector_stats
    assert payloads
    names = {name for payload in payloads for name in payload}
    assert names == {"host", "native"}
    sent = pickle.dumps(payloads)  # what crosses to the other process, taken first
    here: WeightedMultiStats | None = None
    for payload in payloads:
        stats = WeightedMultiConnector.build_kv_connector_stats(payload)
        assert isinstance(stats, WeightedMultiStats)
        here = stats if here is None else here.aggregate(stats)
    assert here is not None
    assert pickle.loads(sent) == payloads  # rebuilding left the payloads as they were
    reduced = here.reduce()
    # Identity: the bytes the host child's stats report are the bytes its worker moved.
    assert reduced["host.load_bytes"] == report.transfers["host.bytes_loaded"] > 0
    assert reduced["host.store_bytes"] == report.transfers["host.bytes_stored"] > 0

    # Prometheus through vLLM's own KVConnectorProm: each child's payload reaches its class's
    # metrics (hybridkv's counters hold the host child's totals; the native ones exist).
    prom = _PrivateProm(engine.vllm_config, ["model_name", "engine"], {0: ["hybrid", "0"]})
    for payload in payloads:
        prom.observe(payload, 0)
    labels = {"model_name": "hybrid", "engine": "0"}
    registry = _PrivateRegistry.registry
    for counter in ("load_bytes", "store_bytes"):
        found = registry.get_sample_value(f"vllm:hybridkv_{counter}_total", labels)
        assert found == reduced[f"host.{counter}"], counter
    names = {metric.name for metric in registry.collect()}
    assert any(name.startswith("vllm:kv_offload") for name in names), names

    done = subprocess.run(
        [sys.executable, "-c", _REBUILD],
        input=sent,
        capture_output=True,
        timeout=300,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    there = json.loads(done.stdout.decode().strip().splitlines()[-1])
    # vLLM's MultiConnector rebuilds by registered class name; this one needs no registry.
    assert there["registered"] is False
    assert there["types"] == {"host": "HybridKVStats", "native": "OffloadingConnectorStats"}
    assert there["reduced"] == json.loads(json.dumps(reduced))


# ------------------------------------------------------------------ the how-to's config

SERVE_DOC = Path(__file__).parents[2] / "docs" / "howto" / "serve.md"


def _doc_json() -> dict[str, Any]:
    """The how-to's ``--kv-transfer-config`` for ``WeightedMultiConnector``, exactly as written."""
    found = [
        json.loads(match)
        for match in re.findall(r"--kv-transfer-config '(\{.*\})'", SERVE_DOC.read_text())
        if "WeightedMultiConnector" in match
    ]
    assert len(found) == 1, f"{SERVE_DOC}: {len(found)} WeightedMultiConnector configs"
    return found[0]


def test_the_docs_config_builds_through_vllms_factory() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from hybridkv.vllm.harness.engine_config import _process_setup, _vllm_config
    from hybridkv.vllm.harness.planning import plan_kv_caches

    _process_setup()  # vLLM's one-rank distributed state, as the engine sets it up
    doc = _doc_json()
    config = _vllm_config(RECIPES[LAYOUT].config_json(), SETTINGS, KVTransferConfig(**doc))
    assert not config.scheduler_config.disable_hybrid_kv_cache_manager  # HMA stays on
    kv_cache_config, _, _ = plan_kv_caches(config, 1 << 30)
    assert len(kv_cache_config.kv_cache_groups) == 2
    multi = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    assert isinstance(multi, WeightedMultiConnector)
    children = doc["kv_connector_extra_config"]["connectors"]
    assert [(s.name, s.load_weight) for s in multi.specs] == [
        (c["name"], c["load_weight"]) for c in children
    ]
    assert [type(multi.child(c["name"])).__name__ for c in children] == [
        c["kv_connector"] for c in children
    ]
    assert WeightedMultiConnector.all_children_support_hma(config.kv_transfer_config)
    assert not WeightedMultiConnector.requires_piecewise_for_cudagraph(
        doc["kv_connector_extra_config"]
    )
    # Neither child overrides vLLM's default (True); one child that cannot follow the remap
    # turns it off for the whole multi-connector.
    assert WeightedMultiConnector.supports_sleep_mode(config.kv_transfer_config)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(HybridKVConnector, "supports_sleep_mode", classmethod(lambda cls, c: False))
        assert not WeightedMultiConnector.supports_sleep_mode(config.kv_transfer_config)
    with pytest.raises(KeyError, match="no child named 'disk'"):
        multi.child("disk")


# ------------------------------------------------------------------ bad configs and payloads


def _bad(children: list[dict[str, Any]]) -> HybridKVConfigError:
    with pytest.raises(HybridKVConfigError) as caught:
        WeightedMultiConnector._classes({"connectors": children}, None)
    return caught.value


def test_a_bad_child_entry_is_refused_by_name() -> None:
    unknown = _bad([_host(1.0), {**_native(1.0), "kv_connector": "NoSuchConnector"}])
    assert unknown.field == "kv_connector_extra_config.connectors[1].kv_connector (native)"
    assert unknown.value == "NoSuchConnector"
    invalid = _bad([{**_host(1.0), "kv_role": "kv_sideways"}])
    assert invalid.field == "kv_connector_extra_config.connectors[0] (host)"
    assert "KVTransferConfig" in invalid.problem
    unnamed = _bad([{k: v for k, v in _host(1.0).items() if k != "name"}])
    assert unnamed.field == "kv_connector_extra_config.connectors[0].name"


def test_stats_refuse_foreign_payloads_and_mixed_classes() -> None:
    with pytest.raises(HybridKVConfigError) as caught:
        WeightedMultiConnector.build_kv_connector_stats({"host": {"load_bytes": 1}})
    assert caught.value.field == "kv_connector_stats['host']"
    with pytest.raises(HybridKVConfigError) as caught:
        WeightedMultiConnector.build_kv_connector_stats(
            {"host": {"connector": "no.such.module:Connector", "stats": {}}}
        )
    assert caught.value.value == "no.such.module:Connector"
    host = "hybridkv.vllm.connector:HybridKVConnector"
    built = WeightedMultiConnector.build_kv_connector_stats(
        {"host": {"connector": host, "stats": {"load_bytes": 5}}}
    )
    assert isinstance(built, WeightedMultiStats)
    assert built.reduce() == {"host.load_bytes": 5}
    with pytest.raises(ValueError, match="child 'host'"):
        built.put("host", "elsewhere:Other", built.data["host"])
    with pytest.raises(TypeError):
        built.aggregate(built.data["host"])
    built.reset()
    assert built.is_empty()
    assert WeightedMultiConnector.build_kv_connector_stats(None) == WeightedMultiStats()


# ------------------------------------------------------------------ random traces

# Seeded traces (the Hypothesis profile's max_examples / 8: ci 25, nightly 250), each with its
# own weights, copy delays, host-tier load faults, a pool from vLLM's minimum up, and aborts.
RANDOM_TRACES = max(8, settings.default.max_examples // 8)
WEIGHTS = (0.0, 0.5, 1.0, 2.0)


def _random_engine(rng: random.Random, seed: int) -> InProcessEngine:
    recipe = RECIPES[LAYOUT]
    budget = 128
    # vLLM's minimum counts one step's budget per batch in flight (2 under async scheduling).
    batches = 2 if default_async_scheduling() else 1
    settings_ = EngineSettings(
        num_gpu_blocks=recipe.min_blocks(budget * batches) + rng.choice((0, 1, 3, 8)),
        max_model_len=recipe.max_model_len,
        block_size=recipe.block_size,
        max_num_seqs=3,
        max_num_batched_tokens=budget,
        max_steps=600,
    )
    faults = FaultPlan(seed, load_rate=rng.choice((0.0, 0.3, 0.6)), store_rate=0.0)
    adapter = MultiOnCPU(
        {
            "host": HybridKVOnCPU(faults=faults, delay=rng.choice((0, 1, 2))),
            "native": NativeOffloadOnCPU(256, delay=rng.choice((0, 1, 2))),
        }
    )
    transfer = _transfer(_host(rng.choice(WEIGHTS)), _native(rng.choice(WEIGHTS)))
    return InProcessEngine(recipe.config_json(), settings_, transfer, adapter)


def _random_prompts(rng: random.Random) -> list[tuple[int, str, list[int], int]]:
    """(arrival step, id, prompt, max tokens): 4-7 prefixes of two shared bases plus own tokens."""
    bases = [[rng.randint(3, 999) for _ in range(400)] for _ in range(2)]
    found = []
    for i in range(rng.randint(4, 7)):
        prompt = rng.choice(bases)[: rng.randint(16, 392)]
        prompt += [rng.randint(3, 999) for _ in range(rng.choice((0, 0, 3, 16)))]
        found.append((rng.randint(0, 10), f"r{i}", prompt, rng.randint(1, 40)))
    return sorted(found, key=lambda a: (a[0], a[1]))


def _play(seed: int) -> tuple[InProcessEngine, InProcessReport, set[str], int, int]:
    rng = random.Random(seed)
    engine = _random_engine(rng, seed)
    failed: set[str] = set()
    worker = engine.worker
    results = worker.get_transfer_results

    def watched(finished: Any) -> Any:
        out = results(finished)
        failed.update(out.failed_recving)
        return out

    worker.get_transfer_results = watched
    multi = engine.scheduler.connector
    finish = multi.request_finished_all_groups

    def finished(request: Any, block_ids: Any) -> Any:
        delay, params = finish(request, block_ids)
        delayed[0] += bool(delay)
        return delay, params

    delayed = [0]
    multi.request_finished_all_groups = finished
    arrivals = _random_prompts(rng)
    aborted: set[str] = set()
    step = 0
    while arrivals or engine.busy():
        while arrivals and arrivals[0][0] <= step:
            _, rid, prompt, max_tokens = arrivals.pop(0)
            engine.add(rid, prompt, max_tokens)
        step += 1
        if not engine.busy():
            continue
        if engine.tally.steps >= engine.settings.max_steps:
            raise WedgedError(f"seed {seed}: max_steps={engine.settings.max_steps}")
        for rid, request in engine.requests.items():
            loading = engine.status(rid) == "WAITING_FOR_REMOTE_KVS"
            draw = rng.random() < (0.2 if loading else 0.01)
            if not request.is_finished() and draw and engine.abort(rid):
                aborted.add(rid)
        engine.step()
    report = engine.report(sum(r.is_finished() for r in engine.requests.values()))
    recovered = sum(
        engine.status(rid) == "FINISHED_LENGTH_CAPPED" for rid in failed if rid not in aborted
    )
    return engine, report, failed, recovered, delayed[0]


def test_random_traces_with_weights_faults_and_aborts() -> None:
    total: Counter[str] = Counter()
    for seed in range(RANDOM_TRACES):
        engine, report, failed, recovered, delayed = _play(seed)
        _clean(engine, report)  # every request finished, 0 wrong reads, nothing left behind
        engine.close()
        multi = engine.scheduler.connector
        chosen = multi.selections.chosen
        # vLLM's free waits exactly when a child asked for it: only the host child ever does
        # (the native one fences its stores instead), so the two counts are equal.
        assert delayed == multi.child("host").core.stats().delayed_frees, seed
        total.update(
            traces=1,
            slots_checked=report.slots_checked,
            wrong_reads=report.wrong_reads,
            external_loaded=report.external_loaded,
            preemptions=report.preemptions,
            host_chosen=chosen["host"],
            native_chosen=chosen["native"],
            host_bytes_loaded=report.transfers["host.bytes_loaded"],
            native_bytes_loaded=report.transfers["native.bytes_loaded"],
            load_faults=report.transfers.get("host.load_faults", 0),
            failed_loads=len(failed),
            recovered=recovered,
            delayed_frees=delayed,
        )
    print(f"\nweighted multi, {RANDOM_TRACES} random traces: {dict(total)}")
    assert total["wrong_reads"] == 0
    for name in (
        "slots_checked",
        "external_loaded",
        "preemptions",
        "host_chosen",
        "native_chosen",
        "host_bytes_loaded",
        "native_bytes_loaded",
        "load_faults",
        "failed_loads",
        "recovered",
        "delayed_frees",
    ):
        assert total[name] > 0, (name, dict(total))
