"""Narrated scenarios, replayed on vLLM 0.33's Scheduler and on the spec (vLLM-exact) in lock step.

Each scenario is a short list of arrivals, claims, load completions, failures and aborts, written
in claim units (``u``: the layout's scheduler block) so it runs on every layout. The lock-step
run compares every observation; each test then pins the behaviour the scenario is about, so a
scenario that stops exercising it fails. This is also the pattern for replaying a
``tests/regressions`` scenario against the real scheduler
(``docs/explanation/vllm-differential.md``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vLLM 0.33 (run `nox -s vllm`)")

from diffharness.layouts import RANDOM_TRACE_LAYOUTS, RECIPES, Layout
from diffharness.lockstep import RunResult, run_lockstep
from diffharness.observe import Hook, Phase, StepObservation
from diffharness.spec_side import SpecSide
from diffharness.trace import (
    AbortPhase,
    ClaimMode,
    ClaimScript,
    EngineSettings,
    FailurePolicy,
    LoadScript,
    RequestScript,
    Trace,
)
from diffharness.vllm_side import VllmSide

pytestmark = pytest.mark.vllm

LAYOUTS = pytest.mark.parametrize(
    "layout", RANDOM_TRACE_LAYOUTS, ids=[layout.name.lower() for layout in RANDOM_TRACE_LAYOUTS]
)


def _tokens(base: int, n: int) -> tuple[int, ...]:
    return tuple(range(base, base + n))


def _settings(layout: Layout, **changes: object) -> EngineSettings:
    recipe = RECIPES[layout]
    fields: dict[str, object] = {
        "num_blocks": recipe.min_num_blocks + 8,
        "max_num_batched_tokens": 4 * recipe.unit,
        "max_num_seqs": 4,
    }
    fields.update(changes)
    return EngineSettings(**fields)  # type: ignore[arg-type]


def _run(trace: Trace) -> RunResult:
    result = run_lockstep(trace, SpecSide(trace), VllmSide(trace))
    assert result.crash is None, result.crash
    return result


def _obs(result: RunResult, step: int, phase: Phase) -> StepObservation:
    return next(o for o in result.history if (o.step, o.phase) == (step, phase))


def _request(obs: StepObservation, rid: str) -> tuple[str, int]:
    r = next(r for r in obs.requests if r.request_id == rid)
    return r.status, r.num_computed_tokens


@LAYOUTS
def test_async_load_of_the_whole_prompt_resumes_at_the_last_token(layout: Layout) -> None:
    """A 2u prompt; the connector claims all of it asynchronously; the load reports in step 2's
    output; at step 3 the request resumes with every token but the last computed (which it
    computes again to sample), then decodes."""
    u = RECIPES[layout].unit
    trace = Trace(
        layout,
        _settings(layout),
        (
            RequestScript(
                "a",
                1,
                _tokens(100, 2 * u),
                2,
                claims=(ClaimScript(ClaimMode.ASYNC, 2),),
                loads=(LoadScript(1),),
            ),
        ),
    )
    result = _run(trace)
    assert _request(_obs(result, 1, Phase.SCHEDULE), "a") == ("waiting_for_remote_kvs", 2 * u)
    assert _request(_obs(result, 2, Phase.UPDATE), "a") == ("waiting_for_remote_kvs", 2 * u)
    assert _obs(result, 3, Phase.SCHEDULE).scheduled == (("a", 1),)
    assert _request(_obs(result, 3, Phase.SCHEDULE), "a") == ("running", 2 * u)
    assert result.history[-1].requests[0].status == "finished_length"


@LAYOUTS
@pytest.mark.parametrize("policy", list(FailurePolicy), ids=lambda p: p.value)
def test_failed_load_recomputes_or_errors(layout: Layout, policy: FailurePolicy) -> None:
    """A 3u claim whose load fails at its report: under ``recompute`` the request starts over
    from 0 and asks the connector again (this time nothing), under ``fail`` it ends
    FINISHED_ERROR and its blocks are freed in the same update."""
    u = RECIPES[layout].unit
    trace = Trace(
        layout,
        _settings(layout, failure_policy=policy),
        (
            RequestScript(
                "a",
                1,
                _tokens(100, 3 * u + 5),
                1,
                claims=(ClaimScript(ClaimMode.ASYNC, 3),),
                loads=(LoadScript(1, fails=True),),
            ),
        ),
    )
    result = _run(trace)
    (recovery,) = _obs(result, 2, Phase.UPDATE).recoveries
    assert recovery.computed_before == 3 * u
    if policy is FailurePolicy.RECOMPUTE:
        assert (recovery.outcome, recovery.recomputed) == ("recompute", 3 * u)
        asks = [
            c.args
            for o in result.history
            for c in o.hooks
            if c.hook is Hook.GET_NUM_NEW_MATCHED_TOKENS
        ]
        assert asks == [(0,), (0,)]
        assert result.history[-1].requests[0].status == "finished_length"
    else:
        assert recovery.outcome == "error"
        assert _request(_obs(result, 2, Phase.UPDATE), "a")[0] == "finished_error"
        assert _obs(result, 2, Phase.UPDATE).tables == ()


@LAYOUTS
@pytest.mark.parametrize("phase", list(AbortPhase), ids=lambda p: p.value)
def test_abort_during_a_load_frees_at_its_report(layout: Layout, phase: AbortPhase) -> None:
    """Aborted while its load is in flight, the request keeps its blocks until the load
    reports (two steps later), then they are freed; the connector never holds them."""
    u = RECIPES[layout].unit
    trace = Trace(
        layout,
        _settings(layout),
        (
            RequestScript(
                "a",
                1,
                _tokens(100, 2 * u + 1),
                1,
                claims=(ClaimScript(ClaimMode.ASYNC, 2),),
                loads=(LoadScript(3),),
                store_hold=1,
                abort_step=2,
                abort_phase=phase,
            ),
        ),
    )
    result = _run(trace)
    assert _request(_obs(result, 2, Phase.UPDATE), "a")[0] == "finished_aborted"
    assert _obs(result, 3, Phase.UPDATE).tables != ()
    assert _obs(result, 4, Phase.UPDATE).tables == ()
    finishes = [
        c for o in result.history for c in o.hooks if c.hook is Hook.REQUEST_FINISHED_ALL_GROUPS
    ]
    assert [c.answer for c in finishes] == [(False,)]


@LAYOUTS
def test_shared_prefix_hits_locally_but_not_across_salts(layout: Layout) -> None:
    """b shares a's 2u prefix and hits it locally (the connector is asked from 2u); c has the
    same prompt under another cache salt and hits nothing."""
    u = RECIPES[layout].unit
    prefix = _tokens(100, 2 * u)
    trace = Trace(
        layout,
        _settings(layout),
        (
            RequestScript("a", 1, (*prefix, *_tokens(7000, u)), 1),
            RequestScript("b", 4, (*prefix, *_tokens(8000, u)), 1),
            RequestScript("c", 4, (*prefix, *_tokens(8000, u)), 1, cache_salt="other"),
        ),
    )
    result = _run(trace)
    asks = {
        c.request_id: c.args[0]
        for o in result.history
        for c in o.hooks
        if c.hook is Hook.GET_NUM_NEW_MATCHED_TOKENS
    }
    assert asks == {"a": 0, "b": 2 * u, "c": 0}


@LAYOUTS
def test_block_pressure_preempts_the_last_running_request(layout: Layout) -> None:
    """Three half-``max_model_len`` prompts on the smallest pool vLLM accepts, admitted by their
    first chunk (``scheduler_reserve_full_isl`` off): a prefills, b is admitted beside a's first
    decode, and when the two outgrow the pool the last running request is preempted; it
    resumes later and everything finishes."""
    recipe = RECIPES[layout]
    length = recipe.max_model_len // 2
    trace = Trace(
        layout,
        _settings(
            layout,
            num_blocks=recipe.min_num_blocks,
            max_num_batched_tokens=min(length, 4 * recipe.unit),
            max_num_seqs=3,
            reserve_full_sequence=False,
        ),
        tuple(
            RequestScript(rid, 1, _tokens(base, length), 4)
            for rid, base in (("a", 0), ("b", 50_000), ("c", 90_000))
        ),
        max_steps=200,
    )
    result = _run(trace)
    assert result.counts["preemptions"] >= 1
    assert {r.status for r in result.history[-1].requests} == {"finished_length"}


@LAYOUTS
def test_whole_sequence_reservation_admits_one_at_a_time(layout: Layout) -> None:
    """The same three prompts with ``scheduler_reserve_full_isl`` on (vLLM's default): a
    request is admitted only if its whole sequence fits the free blocks. With attention groups
    alone nothing is preempted; on the mamba layout the gate counts one state block per mamba
    group (the align-mode count is capped at one new block, ``single_type_kv_cache_manager.py
    :1779-1790``) while a chunked prefill holds two (the last state and the new one), so the
    requests still outgrow the pool and one is preempted."""
    recipe = RECIPES[layout]
    length = recipe.max_model_len // 2
    trace = Trace(
        layout,
        _settings(
            layout,
            num_blocks=recipe.min_num_blocks,
            max_num_batched_tokens=min(length, 4 * recipe.unit),
            max_num_seqs=3,
            reserve_full_sequence=True,
        ),
        tuple(
            RequestScript(rid, 1, _tokens(base, length), 4)
            for rid, base in (("a", 0), ("b", 50_000), ("c", 90_000))
        ),
        max_steps=200,
    )
    result = _run(trace)
    if layout is Layout.MAMBA_FULL:
        assert result.counts["preemptions"] >= 1
    else:
        assert result.counts["preemptions"] == 0
    assert {r.status for r in result.history[-1].requests} == {"finished_length"}
