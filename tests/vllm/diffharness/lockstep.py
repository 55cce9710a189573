"""Run two sides through one trace in lock step and compare them after every call.

A step is: the trace's arrivals and between-step aborts (both sides, trace order);
``schedule()`` on both, compared; the fabricated worker's report (each side's own, compared);
the trace's during-step aborts; ``update_from_output()`` on both, compared. The run ends at the
step cap, or once every request has arrived, finished and been freed on both sides with no
report still due.

A call that raises on one side and not on the other is a disagreement. When both raise at the
same call the run stops there and the result says so (:class:`Crash`): the tests accept that
only for the catalogued vLLM findings, where the spec's exception names the invariant vLLM
breaks.

Replaying a narrated scenario: build a :class:`~diffharness.trace.Trace` by hand and call
:func:`run_lockstep` with a :class:`~diffharness.spec_side.SpecSide` and a
:class:`~diffharness.vllm_side.VllmSide` (``docs/explanation/vllm-differential.md``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from diffharness.observe import Phase, StepObservation, differences
from diffharness.trace import AbortPhase, KVReport, RequestScript, ScriptPlayer, Trace

__all__ = ["Crash", "Disagreement", "RunResult", "Side", "run_lockstep"]

T = TypeVar("T")


class Side(Protocol):
    """What :func:`run_lockstep` drives: a scheduler, its scripted connector and worker."""

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
    """Both sides raised at the same call."""

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


def _both(
    step: int, call: str, left: Callable[[], T], right: Callable[[], T], trace: Trace
) -> tuple[T, T] | Crash:
    outcomes: list[T | BaseException] = []
    for fn in (left, right):
        try:
            outcomes.append(fn())
        except Exception as exc:  # compared below: both must raise, or neither
            outcomes.append(exc)
    a, b = outcomes
    a_raised, b_raised = isinstance(a, BaseException), isinstance(b, BaseException)
    if a_raised and b_raised:
        return Crash(step, call, a, b)  # type: ignore[arg-type]
    if a_raised or b_raised:
        raised = a if a_raised else b
        raise Disagreement(
            f"step {step} {call}: only {'left' if a_raised else 'right'} raised "
            f"{type(raised).__name__}: {raised}\n{trace.narrate()}"
        ) from raised  # type: ignore[misc]
    return a, b  # type: ignore[return-value]


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
    result.observations += 1
    result.history.append(a)
    _count(result.counts, a)


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
    observation on which they differ."""
    result = RunResult(trace)
    last_event = max(
        [r.arrival_step for r in trace.requests]
        + [r.abort_step for r in trace.requests if r.abort_step is not None]
        + [0]
    )
    for step in range(1, trace.max_steps + 1):
        result.steps = step
        left.player.step = right.player.step = step
        for script in trace.arrivals(step):
            left.add(script)
            right.add(script)
        for rid in trace.aborts(step, AbortPhase.BEFORE_SCHEDULE):
            crash = _both(
                step,
                f"abort {rid}",
                lambda r=rid: left.abort(r),
                lambda r=rid: right.abort(r),
                trace,
            )
            if isinstance(crash, Crash):
                result.crash = crash
                return result
        got = _both(step, "schedule", left.schedule, right.schedule, trace)
        if isinstance(got, Crash):
            result.crash = got
            return result
        _compare(trace, result, *got)
        reports = (left.player.report(), right.player.report())
        if reports[0] != reports[1]:
            raise Disagreement(f"step {step}: worker reports differ {reports}\n{trace.narrate()}")
        result.counts["finished_recving"] += len(reports[0].finished_recving)
        result.counts["failed_recving"] += len(reports[0].failed_recving)
        result.counts["finished_sending"] += len(reports[0].finished_sending)
        for rid in trace.aborts(step, AbortPhase.DURING_STEP):
            crash = _both(
                step,
                f"abort {rid}",
                lambda r=rid: left.abort(r),
                lambda r=rid: right.abort(r),
                trace,
            )
            if isinstance(crash, Crash):
                result.crash = crash
                return result
        got = _both(
            step,
            "update_from_output",
            lambda rep=reports[0]: left.update(rep),
            lambda rep=reports[1]: right.update(rep),
            trace,
        )
        if isinstance(got, Crash):
            result.crash = got
            return result
        _compare(trace, result, *got)
        if got[0].phase is not Phase.UPDATE:
            raise AssertionError("update() must observe the update phase")
        if step >= last_event and left.quiescent() and right.quiescent():
            break
    for obs in result.history[-1:]:
        for r in obs.requests:
            result.counts[f"final:{r.status}"] += 1
    return result
