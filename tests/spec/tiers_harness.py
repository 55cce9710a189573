"""The search of tests/spec/test_tier_mutations.py over the two-tier model.

Not a test module (no ``test_`` prefix). :func:`caught` explores a
:class:`~spec.tiers.model.TierScenario` and returns the shortest counterexample naming one id,
as explorer_harness.caught does for the engine.
"""

from __future__ import annotations

from explorer_harness import Found, shortest

from spec.explorer import explore
from spec.tiers.model import TierModel, TierScenario, TierStart

EMPTY = TierScenario()
SHARED = TierScenario(start=TierStart.SHARED)

CONTROLS = {"empty": (EMPTY, 6), "shared": (SHARED, 5)}
"""Each scenario and the depth the correct model is explored to (>= every mutation's depth)."""


def caught(inv_id: str, scenario: TierScenario, depth: int, *, every_level: bool = False) -> Found:
    """Explore ``scenario`` to ``depth`` and return the counterexample naming ``inv_id``
    (asserted found). ``every_level``: go on past the first violating level."""
    return shortest(
        explore(TierModel(scenario), depth, stop_at_first=not every_level), inv_id, depth
    )
