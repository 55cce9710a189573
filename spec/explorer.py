"""A bounded exhaustive explorer: breadth-first search over every interleaving of a model.

The explorer knows nothing about KV caches. A :class:`Model` gives initial states, the actions
enabled in a state, the successor of a state under an action, a deduplication key, the
invariant violations of a state and coverage labels. The explorer visits every state reachable
within ``max_depth`` actions exactly once (states with equal keys are merged), checks every
invariant in every state and reports each violation with the SHORTEST trace that reaches it:
breadth-first order guarantees that the first time a state is seen, it is seen at its minimal
depth, and the parent links then spell out a shortest path.

A state that is not final and enables no action is a wedge; it is reported under the model's
``stuck_invariant_id`` (liveness in its bounded form).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

__all__ = ["ExploreResult", "Model", "Progress", "Violation", "explore"]

S = TypeVar("S")
A = TypeVar("A")


class Model(Protocol[S, A]):
    """What the explorer needs from a model. ``step`` must not mutate its input state."""

    stuck_invariant_id: str

    def initial_states(self) -> Iterable[S]:
        """The states the search starts from (depth 0).

        Frame: nothing observable changes; the explorer calls it once and checks each state.
        """
        ...

    def enabled(self, state: S) -> Iterable[A]:
        """Every action that may happen next in ``state`` (empty when nothing can).

        Pure: the explorer asks more than once per state (the wedge check, the expansion) and
        needs the same actions each time. A state that is not final and enables nothing is
        reported under ``stuck_invariant_id``.
        """
        ...

    def step(self, state: S, action: A) -> S:
        """The successor of ``state`` under ``action``; ``state`` itself is left unchanged.

        Pre: ``action`` is one of ``enabled(state)``. Post: the successor, sharing nothing
        mutable with ``state``. Frame: ``state`` is unchanged (the explorer steps it under
        every enabled action); a model may keep a private memo (:meth:`labels` may read it).
        """
        ...

    def key(self, state: S) -> Hashable:
        """A hashable value equal for states the search may merge.

        Pure. Post: equal keys promise equal futures (the same actions enabled, successors of
        equal keys, the same violations and finality): the explorer keeps the first state of a
        key and drops the others.
        """
        ...

    def violations(self, state: S) -> Mapping[str, list[str]]:
        """Invariant id -> messages, for every invariant ``state`` breaks (empty when sound).

        Pure.
        """
        ...

    def is_final(self, state: S) -> bool:
        """True when the state has finished its work (no further action is required).

        Pure.
        """
        ...

    def labels(self, state: S, action: A) -> Iterable[str]:
        """Coverage labels of taking ``action`` in ``state`` (called right after ``step``).

        Pre: ``action`` is enabled in ``state``. Frame: ``state`` is unchanged; nothing
        observable changes. Post: the labels, counted into ``ExploreResult.coverage``.
        """
        ...


@dataclass(frozen=True, slots=True)
class Violation(Generic[A]):
    """One broken invariant and the shortest trace of actions that reaches it."""

    invariant_id: str
    messages: tuple[str, ...]
    trace: tuple[A, ...]


@dataclass(frozen=True, slots=True)
class ExploreResult(Generic[A]):
    """The outcome of one search.

    ``exhaustive`` is true when no state was left unexpanded for lack of depth or budget: every
    reachable state was visited. ``budget_cut`` is true when ``max_states`` stopped the search
    (so, when false, every state within ``max_depth`` actions was checked: bounded-exhaustive).
    ``coverage`` counts each label over every explored transition.
    """

    states: int
    transitions: int
    depth_reached: int
    exhaustive: bool
    seconds: float
    violations: tuple[Violation[A], ...]
    coverage: Mapping[str, int] = field(default_factory=dict)
    budget_cut: bool = False

    @property
    def states_per_second(self) -> float:
        """Distinct states checked per wall-clock second."""
        return self.states / self.seconds if self.seconds > 0 else float(self.states)


Progress = Callable[[int, int], None]
"""Called as ``progress(states_seen, depth)`` after each depth level is expanded, and every
``PROGRESS_EVERY`` states expanded within a level (``depth`` is then the level's own), so a
caller can show a long level advancing."""

PROGRESS_EVERY = 256


def explore(
    model: Model[S, A],
    max_depth: int,
    *,
    max_states: int | None = None,
    stop_at_first: bool = True,
    progress: Progress | None = None,
) -> ExploreResult[A]:
    """Breadth-first search of ``model`` to ``max_depth`` actions.

    Pre: ``max_depth >= 0``; ``max_states`` (when given) > 0.
    Post: every state reachable within ``max_depth`` actions (or the first ``max_states`` of
    them) was checked; each reported violation carries a shortest trace. With
    ``stop_at_first`` the search ends at the first violating depth level, reporting every
    violation found at that level.
    """
    if max_depth < 0:
        raise ValueError(f"max_depth={max_depth}: must be >= 0")
    start = time.perf_counter()
    parents: dict[Hashable, tuple[Hashable, A] | None] = {}
    frontier: deque[tuple[S, Hashable]] = deque()
    for state in model.initial_states():
        key = model.key(state)
        if key not in parents:
            parents[key] = None
            frontier.append((state, key))
    violations: list[Violation[A]] = []
    coverage: Counter[str] = Counter()
    transitions = 0
    depth = 0
    truncated = False
    budget_cut = False
    while frontier:
        level_violations = _check_level(model, frontier, parents)
        violations.extend(level_violations)
        if violations and stop_at_first:
            truncated = True
            break
        if depth == max_depth:
            truncated = any(_has_action(model, s) for s, _ in frontier)
            break
        next_frontier: deque[tuple[S, Hashable]] = deque()
        for expanded, (state, key) in enumerate(frontier, 1):
            if progress is not None and expanded % PROGRESS_EVERY == 0:
                progress(len(parents), depth)
            moved, cut = _expand(model, state, key, parents, next_frontier, coverage, max_states)
            transitions += moved
            if cut:
                truncated = budget_cut = True
        frontier = next_frontier
        if frontier:
            depth += 1
        if progress is not None:
            progress(len(parents), depth)
    return ExploreResult(
        states=len(parents),
        transitions=transitions,
        depth_reached=depth,
        exhaustive=not truncated,
        seconds=time.perf_counter() - start,
        violations=tuple(violations),
        coverage=dict(coverage),
        budget_cut=budget_cut,
    )


def _expand(  # noqa: PLR0917 - one state's expansion reads the whole search
    model: Model[S, A],
    state: S,
    key: Hashable,
    parents: dict[Hashable, tuple[Hashable, A] | None],
    next_frontier: deque[tuple[S, Hashable]],
    coverage: Counter[str],
    max_states: int | None,
) -> tuple[int, bool]:
    """Step ``state`` by every enabled action, recording new states; ``(transitions, cut)``."""
    transitions = 0
    cut = False
    for action in model.enabled(state):
        transitions += 1
        # Stepping first lets a model label a transition by what it caused.
        successor = model.step(state, action)
        coverage.update(model.labels(state, action))
        succ_key = model.key(successor)
        if succ_key in parents:
            continue
        if max_states is not None and len(parents) >= max_states:
            cut = True
            continue
        parents[succ_key] = (key, action)
        next_frontier.append((successor, succ_key))
    return transitions, cut


def _has_action(model: Model[S, A], state: S) -> bool:
    return any(True for _ in model.enabled(state))


def _check_level(
    model: Model[S, A],
    frontier: Iterable[tuple[S, Hashable]],
    parents: Mapping[Hashable, tuple[Hashable, A] | None],
) -> list[Violation[A]]:
    found: list[Violation[A]] = []
    for state, key in frontier:
        broken = dict(model.violations(state))
        if not model.is_final(state) and not _has_action(model, state):
            broken.setdefault(model.stuck_invariant_id, []).append(
                "a state that is not final enables no action (wedge)"
            )
        for inv_id in sorted(broken):
            found.append(Violation(inv_id, tuple(broken[inv_id]), _trace(parents, key)))
    return found


def _trace(parents: Mapping[Hashable, tuple[Hashable, A] | None], key: Hashable) -> tuple[A, ...]:
    actions: list[A] = []
    link = parents[key]
    while link is not None:
        parent_key, action = link
        actions.append(action)
        link = parents[parent_key]
    return tuple(reversed(actions))
