"""Errors of the reference models.

Bad input is a :class:`ConfigError` that names the field, the value and the fix, in one line
with the value cut to a readable length. A broken invariant is an :class:`InvariantViolation`
that carries the invariant id. An expected refusal (no space, not ready) is never an
exception: it is a return value.
"""

from __future__ import annotations

import reprlib

__all__ = ["ConfigError", "InvariantViolation"]

_VALUE_LIMIT = 120  # characters of an echoed value
_TEXT_LIMIT = 400  # characters of a field, a problem or a fix


def _shortener() -> reprlib.Repr:
    r = reprlib.Repr()
    r.maxlevel = 3
    r.maxstring = 100
    r.maxother = 100
    r.maxlong = 40
    r.maxdict = 4
    for kind in ("maxlist", "maxtuple", "maxset", "maxfrozenset"):
        setattr(r, kind, 6)
    return r


_REPR = _shortener()


def _short_repr(value: object) -> str:
    """The repr of ``value`` on one line and at most 120 characters, whatever its size."""
    try:
        text = _REPR.repr(value)
    except ValueError:  # str() of an int refuses past sys.get_int_max_str_digits()
        text = f"<int of {value.bit_length()} bits>" if isinstance(value, int) else "<?>"
    return _one_line(text, _VALUE_LIMIT)


def _one_line(text: object, limit: int = _TEXT_LIMIT) -> str:
    joined = " ".join(str(text).splitlines())
    if len(joined) <= limit:
        return joined
    return joined[: limit - 20] + f"... ({len(joined)} chars)"


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
        message = f"{_one_line(field)}={_short_repr(value)}: {_one_line(problem)}; {_one_line(fix)}"
        super().__init__(message)


class InvariantViolation(AssertionError):
    """A state broke a named invariant; ``invariant_id`` names it (e.g. ``"BP-1"``)."""

    def __init__(self, invariant_id: str, detail: str) -> None:
        self.invariant_id = invariant_id
        self.detail = detail
        super().__init__(f"{invariant_id}: {detail}")
