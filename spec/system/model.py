"""The explorer adapter: the :class:`spec.explorer.Model` protocol over :class:`Engine`.

Actions are small values that print as readable trace steps (``arrive r1``, ``step``,
``load 3 of r1 fails``...). A state's violations are every registered invariant the engine's
parts are subject to: ``system`` (TR-*, DATA-*) on the engine snapshot, plus every other family
registered for a snapshot the scheduler or the connector exports (``scheduler``,
``connector``...; see :func:`spec.system.parts.subject_snapshots`).

Coverage labels (``labels``) name what a transition did: ``event:<kind>`` for the action and for
what the step caused (``event:preempt``, ``event:load_timeout``, ``event:finish``...),
``status:<NAME>`` for every request status a transition enters, and ``recovery:<mode>`` when a
failed load is recovered. The labels come from the successor, which ``step`` remembers, so
labelling costs no second step.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

from spec.connector_api import JobId, RequestId, TransferKind
from spec.invariants import check_all
from spec.system import parts
from spec.system.engine import Engine

__all__ = ["Abort", "Action", "Arrive", "Complete", "EngineModel", "Step"]


@dataclass(frozen=True, slots=True)
class Arrive:
    """The scheduler receives a request."""

    request_id: RequestId

    def __str__(self) -> str:
        return f"arrive {self.request_id}"


@dataclass(frozen=True, slots=True)
class Step:
    """One scheduler step (schedule, forward, update)."""

    def __str__(self) -> str:
        return "step"


@dataclass(frozen=True, slots=True)
class Complete:
    """A transfer job reports: ``ok`` or failed."""

    job_id: JobId
    kind: TransferKind
    request_id: RequestId
    ok: bool

    def __str__(self) -> str:
        outcome = "completes" if self.ok else "fails"
        return f"{self.kind.value} job {self.job_id} of {self.request_id} {outcome}"


@dataclass(frozen=True, slots=True)
class Abort:
    """The client cancels a request."""

    request_id: RequestId

    def __str__(self) -> str:
        return f"abort {self.request_id}"


Action = Arrive | Step | Complete | Abort


class EngineModel:
    """Every interleaving of arrivals, steps, job outcomes and aborts from some initial engines.

    Requests arrive in scenario order (r1 after r0): the queue order is what matters, and the
    reverse order is the same scenario with the prompts swapped.
    """

    stuck_invariant_id = "SC-3"

    def __init__(self, engines: Iterable[Engine], *, aborts: bool = True) -> None:
        """Pre: engines built by :mod:`spec.system.scenarios` (or equivalent)."""
        self._initial = tuple(engines)
        self._aborts = aborts
        self._memo: tuple[Engine, Action, Engine] | None = None

    def initial_states(self) -> Iterable[Engine]:
        """The starting engines (one per recovery mode explored).

        Frame: nothing changes; the same engines every call (:meth:`step` never mutates one).
        """
        return self._initial

    def enabled(self, state: Engine) -> Iterable[Action]:
        """Arrive the next request; step while work remains; complete or fail any job; abort.

        Pure. Post: ``Arrive`` of the first request not arrived; ``Step`` while an arrived
        request is unfinished, a result is undelivered or the scheduler has work; ``Complete``
        ok and failed for every in-flight job, by id; with ``aborts``, ``Abort`` of every
        unfinished arrived request.
        """
        actions: list[Action] = []
        pending = [r.request_id for r in state.config.requests if r.request_id not in state.arrived]
        if pending:
            actions.append(Arrive(pending[0]))
        statuses = state.statuses()
        unfinished = [rid for rid, s in statuses.items() if not s.startswith("FINISHED")]
        if unfinished or state.pending or parts.has_work(state.scheduler):
            actions.append(Step())
        for job_id, started in sorted(state.in_flight.items()):
            job = started.job
            for ok in (True, False):
                actions.append(Complete(job_id, job.kind, job.request_id, ok))
        if self._aborts:
            actions.extend(Abort(rid) for rid in unfinished)
        return actions

    def step(self, state: Engine, action: Action) -> Engine:
        """The successor under ``action`` (``state`` is left unchanged).

        Pre: ``action`` is enabled in ``state`` (else the engine raises, on the copy). Post:
        the event applied to ``state.clone()``. Frame: ``state`` is unchanged; the memo now
        holds the transition for :meth:`labels`.
        """
        successor = state.clone()
        if isinstance(action, Arrive):
            successor.arrive(action.request_id)
        elif isinstance(action, Step):
            successor.step()
        elif isinstance(action, Complete):
            successor.complete(action.job_id, action.ok)
        else:
            successor.abort(action.request_id)
        self._memo = (state, action, successor)
        return successor

    def key(self, state: Engine) -> Hashable:
        """The engine's canonical key.

        Pure: :meth:`Engine.freeze`.
        """
        return state.freeze()

    def violations(self, state: Engine) -> Mapping[str, list[str]]:
        """Every broken invariant: the system family and the parts' own families.

        Pure: the ``system`` invariants on :meth:`Engine.snapshot`, each part's family on its
        snapshot (:func:`spec.system.parts.subject_snapshots`); id -> messages.
        """
        broken = dict(check_all("system", state.snapshot()))
        for subject, snapshot in parts.subject_snapshots(state.scheduler):
            broken.update(check_all(subject, snapshot))
        return broken

    def is_final(self, state: Engine) -> bool:
        """Every request arrived and finished, no job in flight, no result undelivered.

        Pure; also no load, parked load or held block left in the scheduler.
        """
        statuses = state.statuses()
        return (
            len(state.arrived) == len(state.config.requests)
            and all(s.startswith("FINISHED") for s in statuses.values())
            and not state.in_flight
            and not state.pending
            and not parts.has_work(state.scheduler)
        )

    def labels(self, state: Engine, action: Action) -> Iterable[str]:
        """Coverage labels of ``action`` in ``state`` (module docstring).

        Pre: ``action`` is enabled in ``state``. Frame: ``state`` is unchanged; the successor
        comes from the memo of the last :meth:`step`, or from a new step on a copy.
        """
        memo = self._memo
        if memo is not None and memo[0] is state and memo[1] == action:
            successor = memo[2]
        else:
            successor = self.step(state, action)
        return transition_labels(state, action, successor)


def transition_labels(state: Engine, action: Action, successor: Engine) -> list[str]:
    """What taking ``action`` from ``state`` to ``successor`` covered.

    Pure. Pre: ``successor`` is ``state`` after ``action``. Post: ``event:<action>`` first,
    ``event:abort_during_transfer`` for an abort of a request with a job in flight,
    ``status:<NAME>`` per request whose status changed, then a step's own labels
    (:func:`spec.system.parts.step_labels`).
    """
    labels = [f"event:{_event_name(action)}"]
    if isinstance(action, Abort) and state.jobs_of(action.request_id):
        labels.append("event:abort_during_transfer")
    before, after = state.statuses(), successor.statuses()
    for rid, status in after.items():
        if before.get(rid) != status:
            labels.append(f"status:{status}")
    if isinstance(action, Step):
        labels.extend(parts.step_labels(state, successor))
    return labels


def _event_name(action: Action) -> str:
    if isinstance(action, Complete):
        return f"{action.kind.value}_{'ok' if action.ok else 'fail'}"
    return type(action).__name__.lower()
