"""The explorer on toy models whose reachable state spaces are known by hand."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import pytest

from spec.explorer import Cut, Snapshot, explore, rss_bytes


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
    assert result.cut is Cut.MAX_STATES
    assert result.budget_cut


def test_a_cut_search_checks_what_it_admitted_and_expands_nothing_more() -> None:
    # BFS order: (0,0); (1,0), (0,1); then (1,0) gives (2,0), (1,1) = 5 states, and (0,1)'s
    # first successor (0,2) is refused. The bug (1,1) was admitted, so it is checked.
    result = explore(Counters(limit=3, bad=1), max_depth=10, max_states=5)
    assert [v.invariant_id for v in result.violations] == ["XX-1"]
    # Without the bug the search stops expanding at the cut: 2 + 2 + 2 transitions (the last
    # two are (0,1)'s, both refused), not the next level's 4 more into refused states.
    result = explore(Counters(limit=3), max_depth=10, max_states=5)
    assert result.transitions == 6
    assert (result.depth_reached, result.checked_depth) == (2, 1)


def test_memory_budget_cuts_the_search() -> None:
    # Any process holds more than one byte: the first new state finds the budget spent.
    result = explore(Counters(limit=30), max_depth=100, max_rss_bytes=1)
    assert result.cut is Cut.MAX_MEMORY
    assert result.states == 1
    assert not result.exhaustive
    assert result.rss_bytes is not None
    assert result.rss_bytes > 1


def test_an_uncut_search_reports_its_memory_and_full_depth() -> None:
    result = explore(Counters(limit=3), max_depth=10, max_states=16, max_rss_bytes=1 << 40)
    assert (result.states, result.cut, result.exhaustive) == (16, Cut.NONE, True)
    assert result.checked_depth == result.depth_reached == 6
    assert result.rss_bytes is not None


def test_progress_shows_states_depth_speed_and_memory() -> None:
    seen: list[Snapshot] = []
    explore(Counters(limit=3), max_depth=10, progress=seen.append)
    assert [s.depth for s in seen] == [1, 2, 3, 4, 5, 6, 6]  # once per level, then the end
    assert seen[-1].states == 16
    assert all(s.states_per_second > 0 and s.seconds >= 0 for s in seen)
    assert all(s.rss_bytes is not None and s.rss_bytes > 1 << 20 for s in seen)


def test_rss_is_this_process_resident_memory() -> None:
    before = rss_bytes()
    hold = bytearray(64 << 20)  # 64 MiB, written so that it is resident
    hold[::4096] = b"x" * len(hold[::4096])
    after = rss_bytes()
    assert before is not None
    assert after is not None
    assert after - before >= 60 << 20


@pytest.mark.parametrize("budget", [{"max_states": 0}, {"max_rss_bytes": 0}])
def test_an_empty_budget_is_rejected(budget: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=next(iter(budget))):
        explore(Counters(limit=1), max_depth=3, **budget)


def test_negative_depth_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_depth"):
        explore(Counters(limit=1), max_depth=-1)
