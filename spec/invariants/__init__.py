"""``ALL_INVARIANTS``: every invariant of the formal model, id -> :class:`Invariant`.

Each family lives in its own module (``planner`` holds ``PL-*``...); importing this package
imports them all, so the registry is complete whenever it is visible.
"""

from spec.invariants import block_pool as _block_pool
from spec.invariants import connector as _connector
from spec.invariants import disk as _disk
from spec.invariants import groups as _groups
from spec.invariants import liveness as _liveness
from spec.invariants import planner as _planner
from spec.invariants import scheduler as _scheduler
from spec.invariants import store as _store
from spec.invariants import system as _system
from spec.invariants import tiers as _tiers
from spec.invariants._registry import (
    ALL_INVARIANTS,
    Invariant,
    Predicate,
    check,
    check_all,
    invariant,
    invariants_for,
)

__all__ = [
    "ALL_INVARIANTS",
    "Invariant",
    "Predicate",
    "check",
    "check_all",
    "invariant",
    "invariants_for",
]

_FAMILIES = (
    _planner,
    _store,
    _block_pool,
    _groups,
    _scheduler,
    _liveness,
    _system,
    _connector,
    _tiers,
    _disk,
)
