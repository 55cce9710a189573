"""The harness's own values: bad traces are refused with the field named, and the script player
answers, loads, holds and reports as the trace says (no vLLM needed, run with the vLLM tests)."""

from __future__ import annotations

import pytest
from diffharness.layouts import RECIPES, Layout
from diffharness.observe import (
    Hook,
    HookCall,
    Phase,
    RequestObs,
    StepObservation,
    differences,
    pattern,
)
from diffharness.trace import (
    AbortPhase,
    ClaimMode,
    ClaimScript,
    EngineSettings,
    KVReport,
    LoadScript,
    RequestScript,
    ScriptPlayer,
    Trace,
    TraceError,
    prompt_repr,
)

pytestmark = pytest.mark.vllm

SETTINGS = EngineSettings(20, 64, 2)


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: ClaimScript(ClaimMode.SYNC), "num_units"),
        (lambda: ClaimScript(ClaimMode.NONE, 2), "num_units"),
        (lambda: ClaimScript("async", 1), "mode"),  # type: ignore[arg-type]
        (lambda: LoadScript(-1), "delay"),
        (lambda: LoadScript(1, valid_units=1), "valid_units"),
        (lambda: RequestScript("", 1, (1,), 1), "request_id"),
        (lambda: RequestScript("a", 0, (1,), 1), "arrival_step"),
        (lambda: RequestScript("a", 1, [1], 1), "prompt"),  # type: ignore[arg-type]
        (lambda: RequestScript("a", 1, (), 1), "prompt"),
        (lambda: RequestScript("a", 1, (1,), 0), "max_tokens"),
        (lambda: RequestScript("a", 3, (1,), 1, abort_step=2), "abort_step"),
        (lambda: RequestScript("a", 1, (1,), 1, claims=[ClaimScript(ClaimMode.NONE)]), "claims"),  # type: ignore[arg-type]
        (lambda: EngineSettings(1, 64, 2), "num_blocks"),
        (lambda: EngineSettings(20, 64, 2, retention_interval=64), "retention_interval"),
        (lambda: EngineSettings(20, 64, True), "max_num_seqs"),  # type: ignore[arg-type]
        (lambda: Trace("full", SETTINGS, ()), "layout"),  # type: ignore[arg-type]
        (
            lambda: Trace(Layout.FULL_ONLY, SETTINGS, (RequestScript("a", 1, (1,), 1),) * 2),
            "requests",
        ),
        (
            lambda: Trace(Layout.FULL_ONLY, SETTINGS, (RequestScript("a", 1, (1,) * 510, 4),)),
            "requests",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_field(build: object, field: str) -> None:
    with pytest.raises(TraceError, match=f"^{field}="):
        build()  # type: ignore[operator]


def test_claims_stay_inside_vllms_contract() -> None:
    unit = 32
    # An async claim may end at the last token; a sync one stops a unit short of it.
    assert ClaimScript(ClaimMode.ASYNC, 5).resolve(0, 64, unit) == (ClaimMode.ASYNC, 64)
    assert ClaimScript(ClaimMode.SYNC, 5).resolve(0, 64, unit) == (ClaimMode.SYNC, 32)
    assert ClaimScript(ClaimMode.SYNC, 1).resolve(32, 64, unit) == (ClaimMode.NONE, 0)
    assert ClaimScript(ClaimMode.ASYNC, 1).resolve(32, 70, unit) == (ClaimMode.ASYNC, 32)
    # The divergence knobs: past a unit, past the sync cap.
    assert ClaimScript(ClaimMode.ASYNC, 1, offset_tokens=1).resolve(0, 70, unit)[1] == 33
    assert ClaimScript(ClaimMode.SYNC, 2, capped=False).resolve(0, 64, unit)[1] == 64
    assert ClaimScript(ClaimMode.DEFER).resolve(0, 64, unit) == (ClaimMode.DEFER, 0)


def test_player_answers_loads_holds_and_reports_from_the_trace() -> None:
    trace = Trace(
        Layout.FULL_ONLY,
        SETTINGS,
        (
            RequestScript(
                "a",
                1,
                tuple(range(100)),
                1,
                claims=(ClaimScript(ClaimMode.ASYNC, 2),),
                loads=(LoadScript(2, block_level=True, valid_units=1),),
                store_hold=1,
            ),
        ),
    )
    player = ScriptPlayer(trace, 32)
    player.step = 1
    assert player.answer("a", 0, 100) == (ClaimMode.ASYNC, 64)
    player.allocated("a", 64, ((7, 8),), (32,))
    assert player.report() == KVReport()
    assert not player.finished("a")  # its load is outstanding: no hold
    player.step = 3
    report = player.report()
    assert report.finished_recving == report.failed_recving == frozenset({"a"})
    assert report.invalid_blocks == (("a", frozenset({8})),)  # the first unit arrived intact
    assert report.invalid_block_ids == frozenset({8})
    player.saw_output(report.finished_recving)
    assert player.finished("a")  # now it holds, reported a step later
    assert player.pending()
    player.step = 4
    assert player.report().finished_sending == frozenset({"a"})
    assert not player.pending()
    assert player.answer("a", 0, 100) == (ClaimMode.NONE, 0)  # the script ran out
    with pytest.raises(TraceError, match=r"^request_id="):
        player.answer("zz", 0, 10)


def test_trace_steps_and_narration() -> None:
    trace = Trace(
        Layout.MAMBA_FULL,
        SETTINGS,
        (
            RequestScript("a", 2, (1, 2, 3), 1, abort_step=4, abort_phase=AbortPhase.DURING_STEP),
            RequestScript("b", 2, (1, 2), 1, cache_salt="s", abort_step=4),
        ),
    )
    assert [r.request_id for r in trace.arrivals(2)] == ["a", "b"]
    assert trace.aborts(4, AbortPhase.DURING_STEP) == ("a",)
    assert trace.aborts(4, AbortPhase.BEFORE_SCHEDULE) == ("b",)
    text = trace.narrate()
    assert "mamba+full" in text
    assert "salt 's'" in text
    assert "abort @4 during_step" in text
    assert RECIPES[Layout.MAMBA_FULL].unit == 640


@pytest.mark.parametrize(
    "prompt", [(5,), (1, 2), (4, 5, 6, 7), (1, 2, 3, 10, 11, 20), (*range(9, 700), 3)]
)
def test_prompt_repr_is_short_and_evaluates_back(prompt: tuple[int, ...]) -> None:
    text = prompt_repr(prompt)
    assert eval(text) == prompt
    assert len(text) < 60


def _obs(**changes: object) -> StepObservation:
    base: dict[str, object] = {
        "step": 1,
        "phase": Phase.SCHEDULE,
        "scheduled": (("a", 32),),
        "preempted": (),
        "finished_ids": (),
        "requests": (RequestObs("a", "running", 32, 0),),
        "running": ("a",),
        "waiting": (),
        "kv_holding": (),
        "tables": (("a", ((0, 3),)),),
        "num_free_blocks": 10,
        "hooks": (),
        "claims": (),
        "recoveries": (),
    }
    base.update(changes)
    return StepObservation(**base)  # type: ignore[arg-type]


def test_differences_name_every_differing_field_patterns_first() -> None:
    assert differences(_obs(), _obs()) == []
    found = differences(_obs(), _obs(tables=(("a", ((0, 4),)),), num_free_blocks=9))
    assert [f.split(":")[0] for f in found] == ["num_free_blocks", "tables"]
    found = differences(_obs(), _obs(tables=(("a", ((5, 4),)),)))
    assert [f.split(":")[0] for f in found] == ["table_patterns", "tables"]
    assert pattern(((0, 3, 0), (7,))) == ((0, 1, 0), (1,))


def test_finish_calls_of_failed_loads_compare_in_id_order() -> None:
    """vLLM finishes failed loads in set order (PYTHONHASHSEED); that one run is compared
    sorted, every other order as it is."""

    def finish(rid: str) -> HookCall:
        return HookCall(Hook.REQUEST_FINISHED_ALL_GROUPS, rid, answer=(False,))

    errored = (RequestObs("a", "finished_error", 0, 0), RequestObs("b", "finished_error", 0, 0))
    one = _obs(phase=Phase.UPDATE, requests=errored, hooks=(finish("b"), finish("a")))
    two = _obs(phase=Phase.UPDATE, requests=errored, hooks=(finish("a"), finish("b")))
    assert differences(one, two) == []
    done = (RequestObs("a", "finished_length", 0, 1), RequestObs("b", "finished_length", 0, 1))
    one = _obs(phase=Phase.UPDATE, requests=done, hooks=(finish("b"), finish("a")))
    two = _obs(phase=Phase.UPDATE, requests=done, hooks=(finish("a"), finish("b")))
    assert [f.split(":")[0] for f in differences(one, two)] == ["hook_shapes", "ordered_hooks"]


def test_min_blocks_matches_the_recipes() -> None:
    """The formula gives the smallest pool recorded per layout (the largest budget's: the random
    traces' budgets, or 4 claim units for the layouts no random trace runs on)."""
    from diffharness.strategies import BUDGETS

    for layout, recipe in RECIPES.items():
        budgets = BUDGETS.get(layout, (4 * recipe.unit,))
        assert max(recipe.min_blocks(b) for b in budgets) == recipe.min_num_blocks
