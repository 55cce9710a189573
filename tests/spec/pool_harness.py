"""The pool model's search for tests/spec/test_explorer_mutations.py and test_pool_liveness.py.

Not a test module (no ``test_`` prefix). :func:`caught` explores
:class:`spec.scheduler.pool_model.PoolModel` on one scenario and returns the shortest
counterexample naming one id, as :func:`explorer_harness.caught` does for the engine model.
"""

from __future__ import annotations

from explorer_harness import Found

from spec.explorer import explore
from spec.scheduler.pool_model import ClaimRule, PoolModel, PoolScenario

__all__ = ["ISSUE_29", "caught"]

ISSUE_29 = PoolScenario(requests=4, prefix_blocks=3, tail_blocks=1, fits=3, rule=ClaimRule.EVERY)
"""Issue 29 in small: four requests share a prefix; the pool holds three whole requests; each
claims the prefix as its own async load (the claim rule before the admission rule)."""


def caught(inv_id: str, scenario: PoolScenario, depth: int) -> Found:
    """Explore ``scenario`` to ``depth`` past every violating level and return the shortest
    counterexample naming ``inv_id`` (asserted found)."""
    result = explore(PoolModel(scenario), depth, stop_at_first=False)
    ids = tuple(sorted({v.invariant_id for v in result.violations}))
    hits = [v for v in result.violations if v.invariant_id == inv_id]
    assert hits, f"{result.states} states to depth {depth}: found {ids or 'nothing'}"
    shortest = min(hits, key=lambda v: len(v.trace))
    trace = " | ".join(str(action) for action in shortest.trace) or "(initial state)"
    return Found(trace, shortest.messages, ids, result.states)
