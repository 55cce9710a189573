"""Errors raised by hybridkv.

Bad configuration or arguments raise :class:`HybridKVConfigError` eagerly, with a message that
names the field, the value and the fix. Expected refusals (no space, not ready) are return
values, not exceptions.
"""

from __future__ import annotations

import reprlib
from typing import TypeGuard

__all__ = ["HybridKVConfigError", "HybridKVError", "int_at_least", "readable"]

# A message is one line a person reads: a value echoed whole (a 50 MB string from a bad
# trace) would bury the fix, so values and free text are cut to these lengths.
_VALUE_CHARS = 120
_TEXT_CHARS = 400


def _value_repr() -> reprlib.Repr:
    short = reprlib.Repr()
    short.maxstring = short.maxother = 100
    short.maxlong = 40
    short.maxlist = short.maxtuple = short.maxset = short.maxfrozenset = 6
    short.maxdict = 4
    short.maxlevel = 3
    return short


_SHORT = _value_repr()


def readable(value: object) -> str:
    """``value``'s repr on one line, cut to a readable length (nested and huge values too)."""
    try:
        text = _SHORT.repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        bits = value.bit_length() if isinstance(value, int) else 0
        text = f"<int of {bits} bits>" if bits else f"<{type(value).__name__}>"
    return _line(text, _VALUE_CHARS)


def _line(text: str, limit: int = _TEXT_CHARS) -> str:
    flat = " ".join(str(text).splitlines())
    return flat if len(flat) <= limit else f"{flat[: limit - 20]}... ({len(flat)} chars)"


class HybridKVError(Exception):
    """Base class of every error hybridkv raises on purpose."""


class HybridKVConfigError(HybridKVError, ValueError):
    """A configuration or argument hybridkv cannot accept.

    Its attributes carry the contract's error fields (``field``, ``value``, ``problem``,
    ``fix``), the same the reference model's ``ConfigError`` carries, so differential tests can
    compare the two sides on ``field``. The message is one line with the value cut to a
    readable length (:func:`readable`); the attributes keep what was given.

    Attributes:
        field: the offending input, as the user spells it (``"chunk_size"``, ``"--tp"``).
        value: the value that was given.
        problem: what is wrong with it.
        fix: what to do instead.
    """

    def __init__(self, field: str, value: object, problem: str, fix: str) -> None:
        super().__init__(_config_message(field, value, problem, fix))
        self.field = field
        self.value = value
        self.problem = problem
        self.fix = fix


def _config_message(field: str, value: object, problem: str, fix: str) -> str:
    """``field=value: problem; fix`` on one line, each part cut to a readable length."""
    return f"{_line(field)}={readable(value)}: {_line(problem)}; {_line(fix)}"


def int_at_least(value: object, least: int) -> TypeGuard[int]:
    """Whether ``value`` is an int of at least ``least``; a bool is not an int here.

    The test behind every count, size and index hybridkv checks before it raises
    :class:`HybridKVConfigError` (``True`` passed as a block size is a mistake, not a 1).
    """
    return isinstance(value, int) and not isinstance(value, bool) and value >= least
