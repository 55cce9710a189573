"""Differential test: spec.scheduler (vLLM-exact mode) against vLLM 0.33's real Scheduler.

Random traces (:mod:`diffharness.strategies`) over the four layouts run on both sides in lock
step (:mod:`diffharness.lockstep`); after every ``schedule()`` and every
``update_from_output()`` the two must agree on the scheduled tokens per request, every
request's status, computed and output counts, the three queues, every request's block table
per group (pattern and exact ids), the free block count, the order and arguments of every
connector hook call, the claims accepted and the tokens recomputed after a failed load. A run
may end in a crash only if both sides crash at the same call and the crash is a catalogued vLLM
finding (:mod:`diffharness.findings`).

Examples per layout: the profile's ``max_examples`` (at least 50), so the ``ci`` profile runs
200 traces per layout (800 in all) and ``nightly`` 2,000 per layout (8,000);
:func:`test_trace_counts_reach_the_profile` checks the counts after the random tests of a
session. A trace takes about 10 ms on each side.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vLLM 0.33 (run `nox -s vllm`)")

from diffharness.findings import classify
from diffharness.layouts import RANDOM_TRACE_LAYOUTS, Layout
from diffharness.lockstep import run_lockstep
from diffharness.spec_side import SpecSide
from diffharness.strategies import traces
from diffharness.tally import TALLY, record
from diffharness.vllm_side import VllmSide

pytestmark = pytest.mark.vllm

EXAMPLES_PER_LAYOUT = max(50, settings.default.max_examples)


@pytest.mark.parametrize(
    "layout", RANDOM_TRACE_LAYOUTS, ids=[layout.name.lower() for layout in RANDOM_TRACE_LAYOUTS]
)
@settings(max_examples=EXAMPLES_PER_LAYOUT)
@given(data=st.data())
def test_random_traces_agree_step_by_step(layout: Layout, data: st.DataObject) -> None:
    trace = data.draw(traces(layout), label="trace")
    result = run_lockstep(trace, SpecSide(trace), VllmSide(trace))
    if result.crash is not None:
        finding = classify(result.crash)
        assert finding is not None, (
            f"both sides raised at step {result.crash.step} {result.crash.call}: "
            f"spec {result.crash.left!r}, vllm {result.crash.right!r}\n{trace.narrate()}"
        )
    else:
        assert result.observations >= 2  # a schedule and an update agreed, at the least
    record(result)


def test_trace_counts_reach_the_profile() -> None:
    """The random test above ran its examples on every layout (when it ran in this session)."""
    ran = {layout: TALLY[layout]["traces"] for layout in RANDOM_TRACE_LAYOUTS}
    if not any(ran.values()):
        pytest.skip("the random traces did not run in this session")
    assert all(n >= EXAMPLES_PER_LAYOUT for n in ran.values() if n), ran
    if all(ran.values()):
        assert sum(ran.values()) >= 200, ran
