"""The invariant registry: every invariant is a named predicate over a plain snapshot.

A predicate receives a snapshot (plain dicts, tuples, ints and strings, never an object of the
optimized library) and returns the list of violation messages; an empty list means it holds.
Returning messages rather than a bool lets a counterexample say *what* broke.

Ids are stable (``PL-1``, ``BP-3``...). The docstring's first line of each predicate is
``"<ID>: <statement>"``; the registry reads both from it so code, docs and catalog agree.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from spec.errors import InvariantViolation

__all__ = [
    "ALL_INVARIANTS",
    "Invariant",
    "Predicate",
    "check",
    "check_all",
    "invariant",
    "invariants_for",
]

Snapshot = Mapping[str, Any]
Predicate = Callable[[Snapshot], list[str]]

_ID = re.compile(r"^(?P<id>[A-Z]+-\d+): (?P<statement>\S.*)$")


@dataclass(frozen=True, slots=True)
class Invariant:
    """One named invariant.

    Attributes:
        id: stable id, e.g. ``"PL-1"``; the prefix names the subject family.
        statement: the one-line statement the docs cite.
        subject: the snapshot kind it reads (``"planner"``, ``"block_pool"``...).
        predicate: snapshot -> violation messages (empty when it holds).
    """

    id: str
    statement: str
    subject: str
    predicate: Predicate

    def violations(self, snapshot: Snapshot) -> list[str]:
        """Messages for every way ``snapshot`` breaks this invariant (empty when it holds).

        Pure: the predicate is a function of the plain snapshot and never mutates it.
        """
        return self.predicate(snapshot)


ALL_INVARIANTS: dict[str, Invariant] = {}


def invariant(subject: str) -> Callable[[Predicate], Predicate]:
    """Register a predicate whose docstring starts with ``"<ID>: <statement>"``.

    Pre: the id is new. Post: ``ALL_INVARIANTS[id]`` holds it. A duplicate id or a malformed
    first docstring line raises ``ValueError`` at import time, so a typo cannot hide a check.
    """

    def register(predicate: Predicate) -> Predicate:
        doc = (predicate.__doc__ or "").strip().splitlines()
        match = _ID.match(doc[0]) if doc else None
        if match is None:
            raise ValueError(
                f"invariant {predicate.__qualname__}: docstring must start with '<ID>: <statement>'"
            )
        inv_id = match.group("id")
        if inv_id in ALL_INVARIANTS:
            raise ValueError(f"invariant id {inv_id} registered twice")
        ALL_INVARIANTS[inv_id] = Invariant(inv_id, match.group("statement"), subject, predicate)
        return predicate

    return register


def invariants_for(subject: str) -> list[Invariant]:
    """The registered invariants that read snapshots of ``subject``, in id order.

    Frame: nothing changes but a private memo. Post: a fresh list (empty for an unknown
    subject) that the caller may mutate.
    """
    # Memoized on the registry's size: registering an invariant later refreshes the answer.
    cached = _BY_SUBJECT.get(subject)
    if cached is not None and cached[0] == len(ALL_INVARIANTS):
        return list(cached[1])
    found = [inv for inv in ALL_INVARIANTS.values() if inv.subject == subject]
    ordered = tuple(sorted(found, key=lambda inv: _sort_key(inv.id)))
    _BY_SUBJECT[subject] = (len(ALL_INVARIANTS), ordered)
    return list(ordered)


_BY_SUBJECT: dict[str, tuple[int, tuple[Invariant, ...]]] = {}


def check(invariant_id: str, snapshot: Snapshot) -> None:
    """Raise :class:`InvariantViolation` if the invariant ``invariant_id`` fails on ``snapshot``.

    Pure. Pre: ``invariant_id`` is registered (``KeyError`` otherwise). Post: returns when it
    holds; else raises carrying the id and the messages joined by ``"; "``.
    """
    messages = ALL_INVARIANTS[invariant_id].violations(snapshot)
    if messages:
        raise InvariantViolation(invariant_id, "; ".join(messages))


def check_all(subject: str, snapshot: Snapshot) -> dict[str, list[str]]:
    """Every failing invariant of ``subject`` on ``snapshot``: id -> messages (empty: all hold).

    Frame: nothing changes but the memo of :func:`invariants_for`. Post: ids in id order; an
    unknown subject has no invariant, so the answer is empty.
    """
    failing: dict[str, list[str]] = {}
    for inv in invariants_for(subject):
        messages = inv.violations(snapshot)
        if messages:
            failing[inv.id] = messages
    return failing


def _sort_key(inv_id: str) -> tuple[str, int]:
    family, _, number = inv_id.partition("-")
    return family, int(number)
