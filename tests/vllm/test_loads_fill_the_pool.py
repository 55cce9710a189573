"""Issue 29: async loads that fill vLLM 0.33's block pool so that none can run.

The run: a Gemma-3-like model (10 sliding-window layers of window 512, then 2 full-attention
layers; block 32), 8 conversations sharing one 2,000-token system prompt, 100-token user turns,
16 output tokens, 4 requests at a time, on a pool that holds about three 2,000-token requests,
``HybridKVConnector`` with docs/howto/serve.md's extra config (its host tier sized down).
Copies report three polls late, as a busy engine loop makes them.

Before :mod:`hybridkv.vllm.admission` the engine wedged in the first turn under both engine
loops: three requests each loaded the system prompt's 1,984 tokens into their own blocks, 13 of
440 blocks stayed free, each needed 24 to run its last 116 tokens, and nothing ran. vLLM's
reservation for in-flight loads counts 0 blocks for a sliding group whose skipped prefix is
padded with null blocks (the module docstring has the lines). Without a connector, and with
vLLM's native connector (which defers a request whose chunks another request is loading), the
run finishes.

The progress watchdog is the harness's ``max_steps``: a wedge fails with
:class:`~hybridkv.vllm.harness.engine_config.WedgedError` instead of hanging.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.vllm.harness.chat import ChatTrace, run_trace  # noqa: E402
from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.engine_config import (  # noqa: E402
    EngineSettings,
    WedgedError,
    default_async_scheduling,
)
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402
from hybridkv.vllm.harness.native_cpu import NativeOffloadOnCPU  # noqa: E402
from hybridkv.vllm.harness.report import InProcessReport  # noqa: E402
from spec.presets import tiny_config  # noqa: E402

WINDOW_LAYERS, FULL_LAYERS = 10, 2
BLOCK, MAX_MODEL_LEN, WINDOW = 32, 2560, 512
# Half of the issue's 1,024 a step: vLLM sizes a window's smallest pool for every batch in
# flight, so under async scheduling this keeps the issue's tokens in flight and its pool.
BUDGET = 512
WEDGING_POOL = 440  # about three requests: 142 blocks each once loaded, 166 to finish
DELAY = 3  # polls before a copy reports
MAX_STEPS = 600  # the run takes about 100 steps; a wedge spins until this

TRACE = ChatTrace(
    convs=8, turns=2, system_len=2000, user_min=100, user_max=100, output_len=16, stagger=0
)


def _config() -> dict[str, Any]:
    cfg = tiny_config("gemma-3-1b", WINDOW_LAYERS + FULL_LAYERS)
    cfg["layer_types"] = ["sliding_attention"] * WINDOW_LAYERS + ["full_attention"] * FULL_LAYERS
    assert cfg["sliding_window"] == WINDOW
    return cfg


def _settings(pool: int) -> EngineSettings:
    return EngineSettings(
        num_gpu_blocks=pool,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK,
        max_num_seqs=4,
        max_num_batched_tokens=BUDGET,
        max_steps=MAX_STEPS,
    )


def smallest_pool() -> int:
    """The smallest pool vLLM's start-up check accepts under the engine loop in use: the null
    block, a full group's ``max_model_len``, and per sliding group its admission cap over the
    tokens in flight (one budget per batch; 2 batches under async scheduling)."""
    in_flight = BUDGET * (2 if default_async_scheduling() else 1)
    window = -(-min(WINDOW - 1 + in_flight, MAX_MODEL_LEN) // BLOCK) + 1
    # vLLM groups the layers in twos: 5 sliding groups and 1 full group.
    return 1 + -(-MAX_MODEL_LEN // BLOCK) + (WINDOW_LAYERS // FULL_LAYERS) * window


def _hybridkv() -> KVTransferConfig:
    """docs/howto/serve.md's JSON, the host tier 512 MiB (every prefix of the run fits)."""
    return KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"host_memory_bytes": 512 << 20, "eviction_policy": "lru"},
    )


def _native() -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config={}
    )


def _engine(kind: str, pool: int) -> InProcessEngine:
    if kind == "none":
        return InProcessEngine(_config(), _settings(pool))
    if kind == "native":
        adapter = NativeOffloadOnCPU(4000, delay=DELAY)
        return InProcessEngine(_config(), _settings(pool), _native(), adapter)
    return InProcessEngine(_config(), _settings(pool), _hybridkv(), HybridKVOnCPU(delay=DELAY))


def _finished(report: InProcessReport) -> None:
    assert report.finished == report.requests == TRACE.convs * TRACE.turns
    assert report.wrong_reads == 0
    assert report.leaked_blocks == 0
    assert report.slots_checked > 0


def test_the_issue_run_finishes_with_hybridkv() -> None:
    """The wedging pool: every request finishes, content-checked, with host loads; the rule
    deferred requests whose prefix another request was loading."""
    engine = _engine("hybridkv", WEDGING_POOL)
    report = run_trace(engine, TRACE)
    print(f"\nhybridkv at {WEDGING_POOL} blocks: {report}")
    _finished(report)
    assert report.external_loaded > 0
    admission = engine.scheduler.connector._admission
    assert admission.shared > 0
    assert len(admission) == 0  # every request it recorded ran or finished


def test_without_the_admission_rule_vllm_wedges() -> None:
    """The control: the same run with the rule switched off wedges (the state the issue
    describes). If this starts passing, vLLM or the core changed and the rule may be moot."""
    engine = _engine("hybridkv", WEDGING_POOL)
    engine.scheduler.connector._admission.enabled = False
    with pytest.raises(WedgedError, match=f"max_steps={MAX_STEPS}"):
        run_trace(engine, TRACE)
    scheduler = engine.scheduler
    assert not scheduler.running
    loaded = [r for r in scheduler.kv_holding_waiting if r.num_computed_tokens == 1984]
    assert len(loaded) >= 3  # three copies of one prefix hold the pool
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() < 24


@pytest.mark.parametrize("kind", ["none", "native"])
def test_the_issue_run_finishes_without_a_connector_and_with_native(kind: str) -> None:
    report = run_trace(_engine(kind, WEDGING_POOL), TRACE)
    print(f"\n{kind} at {WEDGING_POOL} blocks: {report}")
    _finished(report)


def test_vllm_refuses_the_pool_below_the_smallest() -> None:
    """The sweep below starts where vLLM starts: one block fewer is refused at start-up."""
    with pytest.raises(ValueError, match="max seq len"):
        _engine("none", smallest_pool() - 1)


def test_pool_size_sweep_hybridkv_finishes_and_computes_no_more_than_native() -> None:
    """From the smallest pool upward: where the run finishes without a connector, hybridkv
    finishes too, and computes no more prefill than native."""
    pools = sorted({smallest_pool(), 360, 400, WEDGING_POOL, 480, 560})
    rows = []
    for pool in pools:
        reports = {kind: run_trace(_engine(kind, pool), TRACE) for kind in ("none", "native")}
        reports["hybridkv"] = run_trace(_engine("hybridkv", pool), TRACE)
        for report in reports.values():
            _finished(report)
        rows.append((pool, *(reports[k].prefill_computed for k in ("none", "native", "hybridkv"))))
        assert reports["hybridkv"].prefill_computed <= reports["native"].prefill_computed, pool
    print("\npool  none native hybridkv (prefill computed)")
    for pool, none, native, hybridkv in rows:
        print(f"{pool:4d} {none:6d} {native:6d} {hybridkv:8d}")
