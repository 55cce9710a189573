"""HybridKVConnector inside vLLM's real model runner, through ``LLM`` in this process.

Per architecture (full attention, sliding window + full, GDN + full), the chats of
``_workload`` run three times on the same tiny checkpoint: without a connector (the
baseline), with the connector configured by the JSON of docs/howto/serve.md, and with the
negative control (``_corrupting_connector``: the same connector whose loads read random
bytes); the last two answer the baseline's prompts. A bfloat16 model runs a fourth time, the
reference: no connector, prefix caching off (``_drift``). Checks (``_verdict``):

- float32: every request's greedy answer equals the baseline's; bfloat16: the answers' drift
  and the number that differ stay within the reference's bound;
- vLLM's own counter of connector-supplied tokens (``vllm:external_prefix_cache_hits``) is
  positive, and the connector's load jobs succeeded: KV really came back from the host tier;
- the connector's ``hit_tokens`` agrees with vLLM's counter (``_counters.disagreement``);
- the control, which loads as much, changes at least one answer (float32), or drifts at least
  ``_drift.CONTROL_FACTOR`` times the bound (bfloat16): passing answers are not an accident
  of recomputation.
"""

from __future__ import annotations

from pathlib import Path

import _baselines
import _counters
import _llm
import _recipe
import _verdict
import pytest
from _models import ARCHITECTURES

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_answers_match_baseline_with_loads(
    name: str, model_root: Path, e2e_report: list[str]
) -> None:
    model = _baselines.model(name, model_root)
    base = _baselines.baseline(name, model_root)
    assert base.counters.get(_counters.EXTERNAL_HITS, 0) == 0, "the baseline has no connector"

    run = _llm.run(model, _recipe.kv_transfer_config(), base.transcript)
    held = _verdict.answers_hold(name, model_root, run)
    assert run.counters[_counters.EXTERNAL_HITS] > 0, f"{name}: vLLM took no token from the host"
    assert run.counters[_counters.LOADS_DONE] > 0, f"{name}: no load job succeeded"
    problem = _counters.disagreement(run.counters)
    assert problem is None, f"{name}: {problem}"

    zeros = model.shape.dtype == "bfloat16"  # random bytes would read as NaNs (_drift)
    control = _llm.run(model, _recipe.control_config(zeros), base.transcript)
    assert control.counters[_counters.LOADS_DONE] > 0, f"{name}: the control loaded nothing"
    failed = _verdict.control_fails(name, model_root, control)

    e2e_report.append(
        f"in process {name:8} {held}; loaded {run.counters[_counters.EXTERNAL_HITS]:.0f} "
        f"tokens ({run.counters[_counters.LOADS_DONE]:.0f} load jobs, "
        f"{run.counters[_counters.PREEMPTIONS]:.0f} preemptions); {failed}"
    )
