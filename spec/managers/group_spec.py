"""What one KV cache group is: its kind, block size and the few parameters its manager reads.

The fields mirror vLLM 0.33's specs (``v1/kv_cache_interface.py``): ``SlidingWindowSpec``'s
``sliding_window`` and ``extra_retained_tokens`` (900-965) and ``MambaSpec``'s
``num_speculative_blocks`` (1093-1166). Mamba is modelled in ``align`` mode only (the mode prefix
caching uses); prefill checkpoint blocks, EAGLE and decode context parallelism are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from spec.errors import ConfigError
from spec.kinds import GroupKind

__all__ = ["GroupSpec", "cdiv"]


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b``.

    Pure. Pre: ``a >= 0``, ``b > 0`` (not checked: callers pass counts and block sizes)."""
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV cache group.

    Attributes:
        kind: FULL, SLIDING or MAMBA.
        block_size: tokens per block of this group (> 0).
        sliding_window: the window in tokens (SLIDING only, > 0).
        extra_retained_tokens: tokens kept below the window (SLIDING only, >= 0).
        num_speculative_blocks: scratch blocks for speculative decoding (MAMBA only, >= 0).
    """

    kind: GroupKind
    block_size: int
    sliding_window: int = 0
    extra_retained_tokens: int = 0
    num_speculative_blocks: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GroupKind):
            raise ConfigError("kind", self.kind, "not a GroupKind", "pass GroupKind.FULL/...")
        _positive("block_size", self.block_size)
        _non_negative("extra_retained_tokens", self.extra_retained_tokens)
        _non_negative("num_speculative_blocks", self.num_speculative_blocks)
        if self.kind is GroupKind.SLIDING:
            _positive("sliding_window", self.sliding_window)
        elif self.sliding_window or self.extra_retained_tokens:
            raise ConfigError(
                "sliding_window", self.sliding_window, "only a SLIDING group has a window", _FIX
            )
        if self.kind is not GroupKind.MAMBA and self.num_speculative_blocks:
            raise ConfigError(
                "num_speculative_blocks",
                self.num_speculative_blocks,
                "only a MAMBA group keeps speculative scratch blocks",
                _FIX,
            )


_FIX = "leave the field at its default for this kind"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(field: str, value: int) -> None:
    if not _is_int(value) or value <= 0:
        raise ConfigError(field, value, "must be an int > 0", "pass a positive int")


def _non_negative(field: str, value: int) -> None:
    if not _is_int(value) or value < 0:
        raise ConfigError(field, value, "must be an int >= 0", "pass a non-negative int")
