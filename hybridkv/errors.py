"""Errors raised by hybridkv.

Bad configuration or arguments raise :class:`HybridKVConfigError` eagerly, with a message that
names the field, the value and the fix. Expected refusals (no space, not ready) are return
values, not exceptions.
"""

from __future__ import annotations

__all__ = ["HybridKVConfigError", "HybridKVError"]


class HybridKVError(Exception):
    """Base class of every error hybridkv raises on purpose."""


class HybridKVConfigError(HybridKVError, ValueError):
    """A configuration or argument hybridkv cannot accept.

    It mirrors :class:`spec.errors.ConfigError` field for field, so differential tests can
    compare the two sides on ``field``.

    Attributes:
        field: the offending input, as the user spells it (``"chunk_size"``, ``"--tp"``).
        value: the value that was given.
        problem: what is wrong with it.
        fix: what to do instead.
    """

    def __init__(self, field: str, value: object, problem: str, fix: str) -> None:
        self.field = field
        self.value = value
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}={value!r}: {problem}; {fix}")
