"""The explorer on toy models whose reachable state spaces are known by hand."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import pytest

from spec.explorer import explore


@dataclass
class Counters:
    """Two counters a and b, each may be incremented up to ``limit``; the bug: a == b == bad."""

    limit: int
    bad: int | None = None
    stuck_invariant_id: str = "SC-3"
    wedge_at: tuple[int, int] | None = None

    def initial_states(self) -> Iterable[tuple[int, int]]:
        return [(0, 0)]

    def enabled(self, state: tuple[int, int]) -> Iterable[str]:
        if state == self.wedge_at:
            return []
        a, b = state
        return [name for name, v in (("a", a), ("b", b)) if v < self.limit]

    def step(self, state: tuple[int, int], action: str) -> tuple[int, int]:
        a, b = state
        return (a + 1, b) if action == "a" else (a, b + 1)

    def key(self, state: tuple[int, int]) -> tuple[int, int]:
        return state

    def violations(self, state: tuple[int, int]) -> Mapping[str, list[str]]:
        if self.bad is not None and state == (self.bad, self.bad):
            return {"XX-1": [f"reached {state}"]}
        return {}

    def is_final(self, state: tuple[int, int]) -> bool:
        return state == (self.limit, self.limit)

    def labels(self, state: tuple[int, int], action: str) -> Iterable[str]:
        return [f"inc:{action}"]


def test_exhaustive_search_visits_every_state_once() -> None:
    # Grid (a, b) with 0 <= a, b <= 3: 16 states; 2 * 3 * 4 = 24 transitions; depth 6.
    result = explore(Counters(limit=3), max_depth=10)
    assert result.states == 16
    assert result.transitions == 24
    assert result.depth_reached == 6
    assert result.exhaustive
    assert result.violations == ()
    assert result.coverage == {"inc:a": 12, "inc:b": 12}


def test_depth_bound_makes_the_search_non_exhaustive() -> None:
    # Within 2 steps: (0,0), (1,0), (0,1), (2,0), (1,1), (0,2) = 6 states, more remain.
    result = explore(Counters(limit=3), max_depth=2)
    assert result.states == 6
    assert not result.exhaustive


def test_violation_comes_with_a_shortest_trace() -> None:
    result = explore(Counters(limit=3, bad=2), max_depth=10)
    assert [v.invariant_id for v in result.violations] == ["XX-1"]
    trace = result.violations[0].trace
    assert len(trace) == 4  # (2, 2) is 4 increments from (0, 0), never fewer
    assert sorted(trace) == ["a", "a", "b", "b"]
    assert not result.exhaustive


def test_a_non_final_state_without_actions_is_a_wedge() -> None:
    result = explore(Counters(limit=2, wedge_at=(1, 0)), max_depth=10)
    assert [v.invariant_id for v in result.violations] == ["SC-3"]
    assert result.violations[0].trace == ("a",)


def test_max_states_truncates() -> None:
    result = explore(Counters(limit=3), max_depth=10, max_states=5)
    assert result.states == 5
    assert not result.exhaustive


def test_negative_depth_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_depth"):
        explore(Counters(limit=1), max_depth=-1)
