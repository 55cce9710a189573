"""KV cache group kinds, with the same values as vLLM's spec classes and the formal model."""

from __future__ import annotations

from enum import Enum

__all__ = ["GroupKind"]


class GroupKind(Enum):
    """``FULL`` full attention, ``SLIDING`` sliding window, ``MAMBA`` mamba/GDN recurrent state."""

    FULL = "full"
    SLIDING = "sliding"
    MAMBA = "mamba"
