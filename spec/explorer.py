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

A search can also be bounded by a budget: a number of distinct states (``max_states``) and the
process's resident memory (``max_rss_bytes``, sampled every :data:`MEMORY_CHECK_EVERY` new
states). A breadth-first search keeps every state it has seen, so memory grows with the states
and a deep bound on a large model would otherwise grow until the machine runs out. Past the
budget no state is added; the states already admitted are still checked, so every state the
result counts was checked, and the result says which budget cut it (:class:`Cut`).
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, Protocol, TypeVar

__all__ = [
    "Cut",
    "ExploreResult",
    "Model",
    "Progress",
    "Snapshot",
    "Violation",
    "explore",
    "rss_bytes",
]

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


class Cut(Enum):
    """Which budget stopped a search before its depth bound (``NONE``: no budget did)."""

    NONE = "none"
    MAX_STATES = "max_states"
    MAX_MEMORY = "max_memory"


@dataclass(frozen=True, slots=True)
class ExploreResult(Generic[A]):
    """The outcome of one search.

    ``exhaustive`` is true when no state was left unexpanded for lack of depth or budget: every
    reachable state was visited. ``cut`` names the budget that stopped the search (when
    ``Cut.NONE``, every state within ``max_depth`` actions was checked: bounded-exhaustive).
    ``coverage`` counts each label over every explored transition. ``rss_bytes`` is the
    largest resident memory of the process sampled during the search (``None`` where the
    platform reports none). ``checked_depth``: every state reachable within that many actions
    was checked; it equals ``depth_reached`` unless a budget cut the last level short.
    """

    states: int
    transitions: int
    depth_reached: int
    exhaustive: bool
    seconds: float
    violations: tuple[Violation[A], ...]
    coverage: Mapping[str, int] = field(default_factory=dict)
    cut: Cut = Cut.NONE
    rss_bytes: int | None = None
    checked_depth: int = 0

    @property
    def budget_cut(self) -> bool:
        """True when a budget (states or memory) stopped the search before its depth bound."""
        return self.cut is not Cut.NONE

    @property
    def states_per_second(self) -> float:
        """Distinct states checked per wall-clock second."""
        return self.states / self.seconds if self.seconds > 0 else float(self.states)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """How far a running search has got: what a progress callback is shown."""

    states: int
    depth: int
    seconds: float
    rss_bytes: int | None

    @property
    def states_per_second(self) -> float:
        """Distinct states seen per wall-clock second so far."""
        return self.states / self.seconds if self.seconds > 0 else float(self.states)


Progress = Callable[[Snapshot], None]
"""Called with a :class:`Snapshot` after each depth level is expanded, and every
``PROGRESS_EVERY`` states expanded within a level (``depth`` is then the level's own), so a
caller can show a long level advancing."""

PROGRESS_EVERY = 256
MEMORY_CHECK_EVERY = 256
"""New states between two samples of the resident memory (a read of /proc: microseconds, where
expanding 256 states of the engine model takes a fraction of a second)."""


def rss_bytes() -> int | None:
    """The resident memory of this process now, in bytes; ``None`` where the platform has none.

    Linux: /proc/self/statm (the current size). Elsewhere: the peak from ``getrusage``, which a
    breadth-first search, whose memory only grows, reaches at its end anyway. Never refuses:
    a platform without either source gives ``None``; nothing changes.
    """
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource  # absent on Windows
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in kilobytes on Linux and the BSDs, in bytes on macOS.
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


class _Budget:
    """The state and memory budgets of one search, asked before each new state is recorded."""

    def __init__(self, max_states: int | None, max_rss_bytes: int | None) -> None:
        for name, limit in (("max_states", max_states), ("max_rss_bytes", max_rss_bytes)):
            if limit is not None and limit < 1:
                raise ValueError(f"{name}={limit}: must be >= 1 (or None for no limit)")
        self.max_states = max_states
        self.max_rss_bytes = max_rss_bytes
        self.cut = Cut.NONE
        self.rss = rss_bytes()
        self._next_sample = 0  # the first new state samples memory

    def admits(self, states: int) -> bool:
        """May a new state join the ``states`` already recorded? Sets :attr:`cut` when not."""
        if self.cut is not Cut.NONE:
            return False
        if self.max_states is not None and states >= self.max_states:
            self.cut = Cut.MAX_STATES
            return False
        if states >= self._next_sample:
            self._next_sample = states + MEMORY_CHECK_EVERY
            now = self.sample()
            if self.max_rss_bytes is not None and now is not None and now >= self.max_rss_bytes:
                self.cut = Cut.MAX_MEMORY
                return False
        return True

    def spent(self) -> bool:
        """True once a budget refused a state (no further state is admitted)."""
        return self.cut is not Cut.NONE

    def sample(self) -> int | None:
        """Measure the resident memory now; :attr:`rss` keeps the largest sample."""
        now = rss_bytes()
        if now is not None:
            self.rss = now if self.rss is None else max(self.rss, now)
        return now


def explore(
    model: Model[S, A],
    max_depth: int,
    *,
    max_states: int | None = None,
    max_rss_bytes: int | None = None,
    stop_at_first: bool = True,
    progress: Progress | None = None,
) -> ExploreResult[A]:
    """Breadth-first search of ``model`` to ``max_depth`` actions.

    Pre: ``max_depth >= 0``; ``max_states`` and ``max_rss_bytes`` (when given) > 0.
    Post: every state reachable within ``max_depth`` actions was checked, or, when a budget
    cut the search (``result.cut``), every state recorded before it was; each reported
    violation carries a shortest trace. With ``stop_at_first`` the search ends at the first
    violating depth level, reporting every violation found at that level.
    """
    if max_depth < 0:
        raise ValueError(f"max_depth={max_depth}: must be >= 0")
    start = time.perf_counter()
    budget = _Budget(max_states, max_rss_bytes)
    parents: dict[Hashable, tuple[Hashable, A] | None] = {}
    frontier: deque[tuple[S, Hashable]] = deque()
    for state in model.initial_states():
        key = model.key(state)
        if key not in parents:
            parents[key] = None
            frontier.append((state, key))

    def report(depth: int) -> None:
        if progress is not None:
            seconds = time.perf_counter() - start
            progress(Snapshot(len(parents), depth, seconds, budget.sample()))

    violations: list[Violation[A]] = []
    coverage: Counter[str] = Counter()
    transitions = 0
    depth = 0
    checked_depth = 0
    truncated = False
    while frontier:
        level_violations = _check_level(model, frontier, parents)
        violations.extend(level_violations)
        if violations and stop_at_first:
            truncated = True
            break
        if budget.spent():
            # The states admitted before the cut are checked (above); expanding them again
            # would only step into states the budget refuses.
            truncated = True
            break
        if depth == max_depth:
            truncated = any(_has_action(model, s) for s, _ in frontier)
            break
        next_frontier: deque[tuple[S, Hashable]] = deque()
        for expanded, (state, key) in enumerate(frontier, 1):
            if expanded % PROGRESS_EVERY == 0:
                report(depth)
            transitions += _expand(model, state, key, parents, next_frontier, coverage, budget)
            if budget.spent():
                break
        frontier = next_frontier
        if not budget.spent():
            checked_depth = depth + 1 if frontier else depth
        if frontier:
            depth += 1
        report(depth)
    budget.sample()
    return ExploreResult(
        states=len(parents),
        transitions=transitions,
        depth_reached=depth,
        # A cut that admitted nothing of the next level leaves no frontier to stop on.
        exhaustive=not truncated and not budget.spent(),
        seconds=time.perf_counter() - start,
        violations=tuple(violations),
        coverage=dict(coverage),
        cut=budget.cut,
        rss_bytes=budget.rss,
        checked_depth=checked_depth,
    )


def _expand(  # noqa: PLR0917 - one state's expansion reads the whole search
    model: Model[S, A],
    state: S,
    key: Hashable,
    parents: dict[Hashable, tuple[Hashable, A] | None],
    next_frontier: deque[tuple[S, Hashable]],
    coverage: Counter[str],
    budget: _Budget,
) -> int:
    """Step ``state`` by every enabled action, recording the new states the budget admits.

    Returns the transitions taken.
    """
    transitions = 0
    for action in model.enabled(state):
        transitions += 1
        # Stepping first lets a model label a transition by what it caused.
        successor = model.step(state, action)
        coverage.update(model.labels(state, action))
        succ_key = model.key(successor)
        if succ_key in parents or not budget.admits(len(parents)):
            continue
        parents[succ_key] = (key, action)
        next_frontier.append((successor, succ_key))
    return transitions


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
