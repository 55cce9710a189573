"""Recurrent-state shapes of the mamba-like layers vLLM 0.33 caches, per tensor-parallel rank.

Each layer family keeps two tensors per request slot: a convolution state and a temporal (SSM)
state. The shapes follow ``MambaStateShapeCalculator`` (``layers/mamba/mamba_utils.py``) in the
default "SD" conv layout (``VLLM_SSM_CONV_STATE_LAYOUT`` unset: ``(state_len, dim)``), with no
speculative tokens. Dtypes follow ``MambaStateDtypeCalculator``: the conv state has the model
dtype, the temporal state ``ssm_dtype`` (which defaults to the conv dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["DTYPE_BYTES", "GdnDims", "Mamba1Dims", "Mamba2Dims", "MambaDims", "MambaVariant"]

#: Bytes per element of the dtypes the geometry model accepts.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

Shape = tuple[int, ...]


class MambaVariant(Enum):
    """The recurrent layer family (vLLM's ``MambaAttentionBackendEnum`` names in brackets)."""

    GDN = "gdn"  # gated delta net, Qwen3-Next / Qwen3.5 (GDN_ATTN)
    MAMBA2 = "mamba2"  # Nemotron-H, Granite-4.0-H (MAMBA2)
    MAMBA1 = "mamba1"  # Jamba (MAMBA1)


@dataclass(frozen=True, slots=True)
class GdnDims:
    """Gated-delta-net dims as config.json spells them (``linear_*``)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    variant = MambaVariant.GDN

    def split_sizes(self) -> tuple[int, ...]:
        """Sizes that tensor parallelism must divide.

        Pure: ``(conv_dim(), num_v_heads)``.
        """
        return (self.conv_dim(), self.num_v_heads)

    def conv_dim(self) -> int:
        """Channels of the convolution state, all ranks together.

        Pure: ``2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim`` (q, k and v).
        """
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    def shapes(self, tp: int) -> tuple[Shape, Shape]:
        """Pre: ``tp`` divides every split size. Post: (conv, temporal) shapes of one rank."""
        return (
            (self.conv_kernel - 1, self.conv_dim() // tp),
            (self.num_v_heads // tp, self.head_v_dim, self.head_k_dim),
        )


@dataclass(frozen=True, slots=True)
class Mamba2Dims:
    """Mamba-2 dims; ``intermediate_size`` is the model's inner width (heads x head dim)."""

    intermediate_size: int
    n_groups: int
    num_heads: int
    head_dim: int
    state_size: int
    conv_kernel: int

    variant = MambaVariant.MAMBA2

    def split_sizes(self) -> tuple[int, ...]:
        """Sizes that tensor parallelism must divide.

        Pure: ``(intermediate_size, num_heads)``.
        """
        return (self.intermediate_size, self.num_heads)

    def shapes(self, tp: int) -> tuple[Shape, Shape]:
        """Pre: ``tp`` divides every split size. Post: (conv, temporal) shapes of one rank."""
        # Groups that tp does not divide are replicated so each head shard keeps its group.
        groups = self.n_groups if self.n_groups % tp == 0 else tp
        conv_dim = self.intermediate_size + 2 * groups * self.state_size
        return (
            (self.conv_kernel - 1, conv_dim // tp),
            (self.num_heads // tp, self.head_dim, self.state_size),
        )


@dataclass(frozen=True, slots=True)
class Mamba1Dims:
    """Mamba-1 dims; ``intermediate_size`` is ``mamba_expand * hidden_size``."""

    intermediate_size: int
    state_size: int
    conv_kernel: int

    variant = MambaVariant.MAMBA1

    def split_sizes(self) -> tuple[int, ...]:
        """Sizes that tensor parallelism must divide.

        Pure: ``(intermediate_size,)``.
        """
        return (self.intermediate_size,)

    def shapes(self, tp: int) -> tuple[Shape, Shape]:
        """Pre: ``tp`` divides every split size. Post: (conv, temporal) shapes of one rank."""
        width = self.intermediate_size // tp
        return ((self.conv_kernel - 1, width), (width, self.state_size))


MambaDims = GdnDims | Mamba2Dims | Mamba1Dims
