"""Errors of the reference models.

Bad input is a :class:`ConfigError` that names the field, the value and the fix. A broken
invariant is an :class:`InvariantViolation` that carries the invariant id. An expected refusal
(no space, not ready) is never an exception: it is a return value.
"""

from __future__ import annotations

__all__ = ["ConfigError", "InvariantViolation"]


class ConfigError(ValueError):
    """A configuration or argument the model cannot accept.

    Attributes:
        field: the name of the offending input, as the user spells it.
        value: the value that was given.
        fix: what to do instead.
    """

    def __init__(self, field: str, value: object, problem: str, fix: str) -> None:
        self.field = field
        self.value = value
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}={value!r}: {problem}; {fix}")


class InvariantViolation(AssertionError):
    """A state broke a named invariant; ``invariant_id`` names it (e.g. ``"BP-1"``)."""

    def __init__(self, invariant_id: str, detail: str) -> None:
        self.invariant_id = invariant_id
        self.detail = detail
        super().__init__(f"{invariant_id}: {detail}")
