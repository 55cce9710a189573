"""The search of tests/spec/test_disk_mutations.py over the disk tier's model.

Not a test module (no ``test_`` prefix). :func:`caught` explores a
:class:`~spec.disk.model.DiskScenario` and returns the shortest counterexample naming one id,
as explorer_harness.caught does for the engine.
"""

from __future__ import annotations

from explorer_harness import Found, shortest

from spec.disk.directory import Crash, FsyncPolicy
from spec.disk.model import DiskModel, DiskScenario
from spec.explorer import explore

SHARED = DiskScenario()
"""Three keys of one 4-byte file each, room for two; another engine and damage act; kill -9."""

POWER = DiskScenario(fsync=FsyncPolicy.NEVER, crashes=(Crash.KILL, Crash.POWER), peer=False)
"""No fsync before the rename, power may fail; no other engine."""

CONTROLS = {"shared": (SHARED, 5), "power": (POWER, 8), "arc": (DiskScenario(policy="arc"), 5)}
"""Each scenario and the depth the correct model is explored to (>= every mutation's depth)."""


def caught(inv_id: str, scenario: DiskScenario, depth: int, *, every_level: bool = False) -> Found:
    """Explore ``scenario`` to ``depth`` and return the counterexample naming ``inv_id``
    (asserted found). ``every_level``: go on past the first violating level."""
    return shortest(
        explore(DiskModel(scenario), depth, stop_at_first=not every_level), inv_id, depth
    )
