"""The pool model's search for tests/spec/test_explorer_mutations.py and test_pool_liveness.py.

Not a test module (no ``test_`` prefix). :func:`caught` explores
:class:`spec.scheduler.pool_model.PoolModel` on one scenario and returns the shortest
counterexample naming one id, as :func:`explorer_harness.caught` does for the engine model.
"""

from __future__ import annotations

from explorer_harness import Found, shortest

from spec.explorer import explore
from spec.scheduler.pool_model import ClaimRule, PoolModel, PoolScenario

__all__ = ["ISSUE_29", "caught"]

ISSUE_29 = PoolScenario(requests=4, prefix_blocks=3, tail_blocks=1, fits=3, rule=ClaimRule.EVERY)
"""Issue 29 in small: four requests share a prefix; the pool holds three whole requests; each
claims the prefix as its own async load (the claim rule before the admission rule)."""


def caught(inv_id: str, scenario: PoolScenario, depth: int) -> Found:
    """Explore ``scenario`` to ``depth`` past every violating level and return the shortest
    counterexample naming ``inv_id`` (asserted found)."""
    return shortest(explore(PoolModel(scenario), depth, stop_at_first=False), inv_id, depth)
