"""The kinds of KV cache group a hybrid model has, named as vLLM 0.33 names their specs."""

from __future__ import annotations

from enum import Enum

__all__ = ["GroupKind", "MambaCacheMode"]


class GroupKind(Enum):
    """How a KV cache group keeps its history.

    - ``FULL``: full attention, one KV entry per token of the prefix (``FullAttentionSpec``).
    - ``SLIDING``: sliding-window attention, only the last ``window`` tokens matter
      (``SlidingWindowSpec``).
    - ``MAMBA``: mamba / gated-delta-net linear attention, one fixed-size recurrent state that is
      meaningful only at the exact token position where it was taken (``MambaSpec``).
    """

    FULL = "full"
    SLIDING = "sliding"
    MAMBA = "mamba"


class MambaCacheMode(Enum):
    """vLLM 0.33's ``mamba_cache_mode`` (``config/cache.py:176``); there is no ``all`` mode.

    - ``ALIGN``: prefix caching on; the state is kept at every block boundary of the mamba block
      size and at the end of each scheduler step.
    - ``NONE``: prefix caching off; one running state, ``mamba_block_size = max_model_len``.
    """

    ALIGN = "align"
    NONE = "none"
