"""Run sides through one trace step by step; compare two of them after every call.

A step is: the trace's arrivals and between-step aborts (every side, trace order);
``schedule()``; the fabricated worker's report (each side's own, from its own connector's
calls); the trace's during-step aborts; ``update_from_output()``. The run ends at the step cap,
or once every request has arrived, finished and been freed on every side with no report still
due.

:func:`run_lockstep` drives two sides and compares them after every ``schedule()`` and every
``update_from_output()``. A call that raises on one side and not on the other is a
disagreement; when both raise at the same call the run stops there and the result says so
(:class:`Crash`): the tests accept that only for the catalogued vLLM findings, where the spec's
exception names the invariant vLLM breaks. :func:`run_alone` drives one side and keeps every
observation, for the divergence tests, which compare a chosen observation of two runs.

Replaying a narrated scenario: build a :class:`~diffharness.trace.Trace` by hand and call
:func:`run_lockstep` with a :class:`~diffharness.spec_side.SpecSide` and a
:class:`~diffharness.vllm_side.VllmSide` (``docs/explanation/vllm-differential.md``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from diffharness.observe import Phase, StepObservation, differences
from diffharness.trace import AbortPhase, KVReport, RequestScript, ScriptPlayer, Trace

__all__ = ["Crash", "Disagreement", "RunResult", "Side", "SoloRun", "run_alone", "run_lockstep"]


class Side(Protocol):
    """What the runs drive: a scheduler, its scripted connector and worker."""

    name: str
    player: ScriptPlayer

    def add(self, script: RequestScript) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def schedule(self) -> StepObservation: ...
    def update(self, report: KVReport) -> StepObservation: ...
    def quiescent(self) -> bool: ...


class Disagreement(AssertionError):
    """The two sides observed differently; the message has the trace and the differing fields."""


@dataclass(frozen=True, slots=True)
class Crash:
    """Both sides raised at the same call (``left``: the first side's exception)."""

    step: int
    call: str
    left: BaseException
    right: BaseException


@dataclass
class RunResult:
    """What a lock-step run saw (every observation agreed up to ``crash``, if any)."""

    trace: Trace
    steps: int = 0
    observations: int = 0
    crash: Crash | None = None
    counts: Counter[str] = field(default_factory=Counter)
    history: list[StepObservation] = field(default_factory=list)


@dataclass
class SoloRun:
    """One side's run: every observation, and the exception that ended it, if any."""

    trace: Trace
    observations: list[StepObservation] = field(default_factory=list)
    error: BaseException | None = None
    error_at: tuple[int, str] | None = None

    def at(self, step: int, phase: Phase) -> StepObservation:
        """The observation after ``phase`` of ``step``."""
        for obs in self.observations:
            if obs.step == step and obs.phase is phase:
                return obs
        raise KeyError(f"no observation for step {step} {phase.value} (run ended: {self.error})")


Outcome = StepObservation | BaseException | None
Check = Callable[[int, str, list[Outcome], list[KVReport]], bool]


def _call(fn: Callable[[], Outcome]) -> Outcome:
    try:
        return fn()
    except Exception as exc:  # the caller's check decides what a raise means
        return exc


def _last_event(trace: Trace) -> int:
    return max(
        [r.arrival_step for r in trace.requests]
        + [r.abort_step for r in trace.requests if r.abort_step is not None]
        + [0]
    )


def _drive(trace: Trace, sides: Sequence[Side], check: Check) -> int:
    """Run the sides step by step; ``check`` sees every call's outcomes and returns False to
    stop. Returns the last step run."""
    step = 0
    for step in range(1, trace.max_steps + 1):
        for side in sides:
            side.player.step = step
        for script in trace.arrivals(step):
            for side in sides:
                side.add(script)
        for rid in trace.aborts(step, AbortPhase.BEFORE_SCHEDULE):
            got = [_call(lambda s=side, r=rid: s.abort(r)) for side in sides]
            if not check(step, f"abort {rid}", got, []):
                return step
        got = [_call(side.schedule) for side in sides]
        reports = [side.player.report() for side in sides]
        if not check(step, "schedule", got, reports):
            return step
        for rid in trace.aborts(step, AbortPhase.DURING_STEP):
            got = [_call(lambda s=side, r=rid: s.abort(r)) for side in sides]
            if not check(step, f"abort {rid}", got, []):
                return step
        got = [
            _call(lambda s=side, rep=rep: s.update(rep))
            for side, rep in zip(sides, reports, strict=True)
        ]
        if not check(step, "update_from_output", got, []):
            return step
        if step >= _last_event(trace) and all(side.quiescent() for side in sides):
            break
    return step


def _count(counts: Counter[str], obs: StepObservation) -> None:
    counts["scheduled_tokens"] += sum(n for _, n in obs.scheduled)
    counts["preemptions"] += len(obs.preempted)
    counts["claims_accepted"] += sum(1 for c in obs.claims if c.accepted)
    counts["recoveries"] += len(obs.recoveries)
    counts["tokens_recomputed"] += sum(r.recomputed for r in obs.recoveries)
    counts["hook_calls"] += len(obs.hooks)
    for call in obs.hooks:
        counts[f"hook:{call.hook.value}"] += 1


def run_lockstep(trace: Trace, left: Side, right: Side) -> RunResult:
    """Drive ``left`` and ``right`` through ``trace``; raise :class:`Disagreement` at the first
    call on which they differ."""
    result = RunResult(trace)

    def check(step: int, call: str, got: list[Outcome], reports: list[KVReport]) -> bool:
        a, b = got
        a_raised, b_raised = isinstance(a, BaseException), isinstance(b, BaseException)
        if a_raised and b_raised:
            result.crash = Crash(step, call, a, b)  # type: ignore[arg-type]
            return False
        if a_raised or b_raised:
            raised = a if a_raised else b
            who = left.name if a_raised else right.name
            raise Disagreement(
                f"step {step} {call}: only {who} raised {type(raised).__name__}: {raised}\n"
                f"{trace.narrate()}"
            ) from raised  # type: ignore[misc]
        if isinstance(a, StepObservation) and isinstance(b, StepObservation):
            _compare(trace, result, a, b)
        if reports and reports[0] != reports[1]:
            raise Disagreement(f"step {step}: worker reports differ {reports}\n{trace.narrate()}")
        if reports:
            result.counts["finished_recving"] += len(reports[0].finished_recving)
            result.counts["failed_recving"] += len(reports[0].failed_recving)
            result.counts["finished_sending"] += len(reports[0].finished_sending)
        return True

    result.steps = _drive(trace, (left, right), check)
    for obs in result.history[-1:]:
        for r in obs.requests:
            result.counts[f"final:{r.status}"] += 1
    return result


def run_alone(trace: Trace, side: Side) -> SoloRun:
    """Drive one side through ``trace``, keeping every observation; stop at its first raise."""
    run = SoloRun(trace)

    def check(step: int, call: str, got: list[Outcome], reports: list[KVReport]) -> bool:
        del reports
        (outcome,) = got
        if isinstance(outcome, BaseException):
            run.error, run.error_at = outcome, (step, call)
            return False
        if isinstance(outcome, StepObservation):
            run.observations.append(outcome)
        return True

    _drive(trace, (side,), check)
    return run


def _compare(trace: Trace, result: RunResult, a: StepObservation, b: StepObservation) -> None:
    found = differences(a, b)
    if found:
        recent = "\n".join(
            f"  step {o.step} {o.phase.value}: scheduled {o.scheduled} statuses "
            f"{[(r.request_id, r.status, r.num_computed_tokens) for r in o.requests]}"
            for o in result.history[-6:]
        )
        raise Disagreement(
            f"step {a.step} after {a.phase.value}: {len(found)} difference(s)\n"
            + "\n".join(found)
            + f"\ntrace:\n{trace.narrate()}\nagreed so far:\n{recent}"
        )
    if a.phase not in (Phase.SCHEDULE, Phase.UPDATE):
        raise AssertionError(f"unknown phase {a.phase}")
    result.observations += 1
    result.history.append(a)
    _count(result.counts, a)
