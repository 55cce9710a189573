"""Lock-step differential harness: vLLM 0.33's real Scheduler against ``spec.scheduler``.

- :mod:`diffharness.trace`: a trace (arrivals, claims, load timing, failures, store holds,
  aborts) as frozen values, and the script players both connectors answer from.
- :mod:`diffharness.layouts`: the four hybrid layouts, built from the project's presets.
- :mod:`diffharness.observe`: what is compared after every step, as frozen values.
- :mod:`diffharness.spec_side`: the spec scheduler driven by a trace (imports no vLLM).
- :mod:`diffharness.vllm_side`: vLLM's Scheduler, built as its engine core builds it, driven by
  the same trace through a scripted ``SupportsHMA`` connector (imports vLLM).
- :mod:`diffharness.lockstep`: runs two sides step by step and compares every observation.
- :mod:`diffharness.strategies`: hypothesis strategies for random traces.
- :mod:`diffharness.replay`: a ``tests/regressions`` scenario's finished script as a trace.

Only ``vllm_side`` imports vLLM; everything else runs without it (``tests/vllm/test_guard``).

Importing any submodule runs this file first, so the environment vLLM reads when it is first
imported (CPU platform, no hub, quiet logs) is set before ``vllm_side`` imports it; values
already set are kept.
"""

from __future__ import annotations

from _inprocess import set_cpu_env

set_cpu_env()
