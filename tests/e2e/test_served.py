"""HybridKVConnector served by vLLM's OpenAI server, driven over HTTP by the ``openai`` client.

Per architecture, the server runs the command of docs/howto/serve.md (``_recipe``; the CPU
entrypoint and the tiny model's path and sizing are the only changes, ``_server``) with its
engine in a separate process. The chats go in as concurrent completion requests, one batch
per turn: the prompts of the same model's no-connector run (``_baselines``), whose answers
are the baseline. Checks:

- every request's greedy answer (the server's ``token_ids``) equals the baseline's (float32),
  or stays within the in-process reference's bound with the server's logprobs (bfloat16,
  ``_drift``; ``_verdict``);
- ``/metrics``: vLLM's ``vllm:external_prefix_cache_hits_total`` is positive, the
  connector's load jobs succeeded, and ``vllm:hybridkv_hit_tokens_total`` agrees with vLLM's
  counter (``_counters.disagreement``).

The negative control is served too, on the GDN + full model (the layout where a wrong state
load has hurt users most, docs/explanation): the page's command with the zeroing control's
JSON must land far outside that bound over HTTP as it does in process.
"""

from __future__ import annotations

from pathlib import Path

import _baselines
import _counters
import _recipe
import _server
import _verdict
import pytest
from _models import ARCHITECTURES

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_served_answers_match_baseline_with_loads(
    name: str, model_root: Path, tmp_path: Path, e2e_report: list[str]
) -> None:
    run = _server.served_run(name, model_root, _recipe.serve_flags(), tmp_path / "server.log")
    counters = run.counters
    held = _verdict.answers_hold(name, model_root, run)
    assert counters[_counters.EXTERNAL_HITS] > 0, f"{name}: vLLM took no token from the host"
    assert counters[_counters.LOADS_DONE] > 0, f"{name}: no load job succeeded"
    problem = _counters.disagreement(counters)
    assert problem is None, f"{name}: {problem}"
    e2e_report.append(
        f"served     {name:8} {held}; loaded {counters[_counters.EXTERNAL_HITS]:.0f} tokens "
        f"({counters[_counters.LOADS_DONE]:.0f} load jobs, "
        f"{counters[_counters.PREEMPTIONS]:.0f} preemptions)"
    )


def test_served_control_with_corrupted_loads_fails(
    model_root: Path, tmp_path: Path, e2e_report: list[str]
) -> None:
    name = "qwen3_5"
    # Zeros: random bytes read as bfloat16 give NaN logprobs, which the server cannot put in
    # JSON (it answers 400).
    zeros = _baselines.model(name, model_root).shape.dtype == "bfloat16"
    flags = _recipe.serve_flags(_recipe.control_config(zeros))
    control = _server.served_run(name, model_root, flags, tmp_path / "server.log")
    assert control.counters[_counters.LOADS_DONE] > 0, "the served control loaded nothing"
    e2e_report.append(f"served     {name:8} {_verdict.control_fails(name, model_root, control)}")
