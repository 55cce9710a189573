"""Issue 29's run in vLLM's real model runner: loads that fill the block pool never wedge.

The run, as the issue tried it on vLLM's CPU build (``_models.POOL_FILLING``): a Gemma-3-like
random-weight model, 12 layers (10 sliding-window layers of window 512, then 2 full-attention
layers), hidden size 512, 2 KV heads of dim 128, float32; block size 32, a pool of 440 blocks
(about three 2,000-token requests), 4 requests at a time, 1,024 tokens a step,
``max_model_len`` 4,096, prefix caching on; 8 chats x 4 turns over one 2,000-token system
prompt, 100-token user turns, 16-token greedy answers; ``HybridKVConnector`` with
docs/howto/serve.md's JSON and a 1 GiB host tier.

Before the load admission rule (``hybridkv/vllm/admission.py``) this run wedged in its first
turn: three requests each loaded the system prompt's 1,984 tokens into their own blocks, 13 of
440 blocks stayed free, and none could get the blocks its last 116 tokens needed. The engine
is stepped by the test (``_watchdog``): a stall fails the test with the scheduler's state
instead of hanging the session.

Checks: every answer equals the no-connector run's (float32), vLLM took tokens from the host
tier, the connector's counters agree with vLLM's, and the async loads' time from admission to
completion (``_watchdog``) stays under ``LOAD_P99_S`` at the 99th percentile while the engine
loop spins (issue 29 item 4), and no load spans more than ``LOAD_MAX_STEPS`` engine steps; the
report gives it in seconds and in engine steps.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import _baselines
import _counters
import _llm
import _recipe
import _verdict
import pytest
from _watchdog import STALL_S, Stepper
from _workload import replay

pytestmark = pytest.mark.e2e

NAME = "gemma3_pool"
HOST_BYTES = 1 << 30
LOAD_P99_S = STALL_S / 2
"""Seconds: a load lands well before the watchdog would call the stall a wedge. Not tighter,
because a load's time here is mostly the steps that run beside it: vLLM admits it in one step
and takes it two steps later, and each of those steps computes up to 1,024 tokens of the other
requests, seconds on the shared 2-core machine (p50 8 s, p99 20 s at a load average of 40;
p50 0.19 s, p99 2.6 s at 1-2; docs/benchmarks). The steps each load spanned are reported
beside its time: a load spanning a thousand steps is a copy waiting for the GIL while the
engine loop spins."""
LOAD_MAX_STEPS = 300
"""Engine steps any one load may span: the copy thread's share of the GIL while the loop spins.
Before the worker's idle wait (``IDLE_STEP_WAIT_S``, issue 29 item 4) the copy got the GIL only
when the switch interval forced it and the slowest load spanned 1,661, 1,218 and 841 steps at
load averages 1-2, 3-4 and 7-12; with it, 15, 19 and 55 (load averages 3-5, 12-18 and 6-7;
docs/benchmarks). A bound 5 times the largest measured with the wait and 2.8 times under the
smallest without. On a machine as busy as 30-40 a load spans few steps either way (65 at most
before the wait), each a long forward: there the bound holds but cannot tell."""


def _config() -> dict[str, Any]:
    """docs/howto/serve.md's JSON with the issue's 1 GiB host tier."""
    config = _recipe.kv_transfer_config()
    extra = {**config["kv_connector_extra_config"], "host_memory_bytes": HOST_BYTES}
    return {**config, "kv_connector_extra_config": extra}


def _percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile (``share`` in (0, 1]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def test_loads_that_fill_the_pool_finish(model_root: Path, e2e_report: list[str]) -> None:
    model = _baselines.model(NAME, model_root)
    base = _baselines.baseline(NAME, model_root)
    with _llm.engine(model, _config()) as llm:
        stepper = Stepper(llm, _llm.sampling_params(model))
        transcript = replay(model.shape.workload, base.transcript, stepper.generate)
        run = _llm.Run(transcript, _llm.counters(llm))

    held = _verdict.answers_hold(NAME, model_root, run)
    counters = run.counters
    assert counters[_counters.EXTERNAL_HITS] > 0, "vLLM took no token from the host tier"
    problem = _counters.disagreement(counters)
    assert problem is None, problem
    loads = stepper.load_seconds
    assert loads, "no async load was timed"
    p50, p99 = _percentile(loads, 0.5), _percentile(loads, 0.99)
    steps = [float(n) for n in stepper.load_steps]
    e2e_report.append(
        f"pool 440   {NAME} {held}; loaded {counters[_counters.EXTERNAL_HITS]:.0f} tokens "
        f"({len(loads)} async loads, {counters[_counters.PREEMPTIONS]:.0f} preemptions) in "
        f"{stepper.steps} steps; load time p50 {p50:.2f} s, p99 {p99:.2f} s, max "
        f"{max(loads):.2f} s; steps a load spanned p50 {_percentile(steps, 0.5):.0f}, max "
        f"{max(steps):.0f}"
    )
    assert p99 <= LOAD_P99_S, f"p99 load latency {p99:.3f} s > {LOAD_P99_S} s: copies starved"
    assert max(steps) <= LOAD_MAX_STEPS, (
        f"a load spanned {max(steps):.0f} engine steps > {LOAD_MAX_STEPS}: the copy thread "
        "waited for the GIL while the engine loop spun"
    )
