"""Builders of per-layer KV caches shaped and strided the way vLLM 0.33 allocates them.

Tests, benchmarks and ``hybridkv simulate`` need real tensors in every layout that
:mod:`hybridkv.canonical` recognises. Each builder returns a :class:`LayoutCase`: the group
specs, the per-layer caches and the block count, on any device. Caches are zero-filled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from hybridkv.canonical import CacheGroupSpec
from hybridkv.kinds import GroupKind

__all__ = ["LayoutCase", "all_layout_cases", "hybrid_overlay_case", "mamba_states"]

Cache = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass(frozen=True, slots=True, eq=False)
class LayoutCase:
    """One model's caches: ``name`` says which layout they exercise."""

    name: str
    groups: tuple[CacheGroupSpec, ...]
    kv_caches: Mapping[str, Cache]
    num_blocks: int


def _spec(kind: GroupKind, bs: int, page: int, real: int, layers: Sequence[str]) -> CacheGroupSpec:
    return CacheGroupSpec(kind, bs, page, real, tuple(layers))


def _attention(
    name: str,
    shape_of: Callable[[int, int], tuple[int, ...]],
    perm: tuple[int, ...],
    *,
    num_blocks: int,
    ratio: int,
    device: torch.device,
    dtype: torch.dtype = torch.float16,
    block_size: int = 16,
    layers: int = 2,
) -> LayoutCase:
    """Allocate ``shape_of(kernel_blocks, kernel_block_size)`` and view it through ``perm``."""
    kbs = block_size // ratio
    caches = {
        f"{name}.{i}": torch.zeros(
            shape_of(num_blocks * ratio, kbs), dtype=dtype, device=device
        ).permute(perm)
        for i in range(layers)
    }
    first = next(iter(caches.values()))
    real = first.numel() * first.element_size() // num_blocks
    group = _spec(GroupKind.FULL, block_size, real, real, list(caches))
    return LayoutCase(name, (group,), caches, num_blocks)


def mamba_states(
    raw: torch.Tensor,
    num_blocks: int,
    page: int,
    conv: tuple[tuple[int, ...], torch.dtype],
    ssm: tuple[tuple[int, ...], torch.dtype],
) -> tuple[torch.Tensor, torch.Tensor]:
    """View a raw int8 buffer of ``num_blocks * page`` bytes as (conv, ssm) state tensors.

    As vLLM does: per block, the conv state then the ssm state, then padding up to ``page``.
    """
    out: list[torch.Tensor] = []
    offset = 0
    for shape, dtype in (conv, ssm):
        es = torch.empty(0, dtype=dtype).element_size()
        typed = raw.view(dtype)
        inner = [1]
        for n in reversed(shape[1:]):
            inner.insert(0, inner[0] * n)
        strides = (page // es, *inner)
        out.append(torch.as_strided(typed, (num_blocks, *shape), strides, offset // es))
        offset += es * _prod(shape)
    return out[0], out[1]


def _prod(shape: Sequence[int]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _mamba_case(num_blocks: int, device: torch.device, layers: int = 2) -> LayoutCase:
    conv = ((3, 96), torch.bfloat16)  # (kernel - 1, conv dim)
    ssm = ((4, 8, 16), torch.float32)  # (heads, head dim, state)
    real = 2 * 3 * 96 + 4 * 4 * 8 * 16
    page = real + 448  # padded to a page shared with attention
    caches: dict[str, Cache] = {}
    for i in range(layers):
        raw = torch.zeros(num_blocks * page, dtype=torch.int8, device=device)
        caches[f"mamba.{i}"] = mamba_states(raw, num_blocks, page, conv, ssm)
    group = _spec(GroupKind.MAMBA, 32, page, real, list(caches))
    return LayoutCase("mamba_padded", (group,), caches, num_blocks)


def hybrid_overlay_case(num_blocks: int, device: torch.device) -> LayoutCase:
    """A Qwen3-Next-like overlay: each buffer holds one attention layer and one mamba layer.

    The attention layer uses vLLM's hybrid stride trick: shape ``(2, B, bs, H, D)`` with the
    block outermost, padded to the mamba page; the mamba layer's conv and ssm states live in
    the same padded pages. Groups own a block id one at a time, so the overlay is sound.
    """
    bs, heads, head = 16, 2, 32
    attn_real = 2 * bs * heads * head * 2
    conv = ((3, 64), torch.bfloat16)
    ssm = ((2, 8, 32), torch.float32)
    mamba_real = 2 * 3 * 64 + 4 * 2 * 8 * 32
    page = max(attn_real, mamba_real) + 256
    caches: dict[str, Cache] = {}
    for i in range(2):
        raw = torch.zeros(num_blocks * page, dtype=torch.int8, device=device)
        half = bs * heads * head
        caches[f"attn.{i}"] = torch.as_strided(
            raw.view(torch.float16),
            (2, num_blocks, bs, heads, head),
            (half, page // 2, heads * head, head, 1),
        )
        caches[f"gdn.{i}"] = mamba_states(raw, num_blocks, page, conv, ssm)
    groups = (
        _spec(GroupKind.FULL, bs, page, attn_real, ["attn.0", "attn.1"]),
        _spec(GroupKind.MAMBA, bs, page, mamba_real, ["gdn.0", "gdn.1"]),
    )
    return LayoutCase("hybrid_overlay", groups, caches, num_blocks)


def all_layout_cases(num_blocks: int = 5, device: str | torch.device = "cpu") -> list[LayoutCase]:
    """One case per recognised layout (and kernel-split variants), each on ``device``."""
    dev = torch.device(device)
    h, d = 2, 8

    def att(
        name: str,
        shape_of: Callable[[int, int], tuple[int, ...]],
        perm: tuple[int, ...],
        ratio: int = 1,
        dtype: torch.dtype = torch.float16,
    ) -> LayoutCase:
        return _attention(
            name, shape_of, perm, num_blocks=num_blocks, ratio=ratio, device=dev, dtype=dtype
        )

    nhd5, hnd5 = (0, 1, 2, 3, 4), (0, 1, 3, 2, 4)
    return [
        att("kv_first_nhd", lambda b, n: (2, b, n, h, d), nhd5),
        att("kv_first_hnd", lambda b, n: (2, b, h, n, d), hnd5),
        att("block_first_nhd", lambda b, n: (b, 2, n, h, d), nhd5),
        att("block_first_hnd", lambda b, n: (b, 2, h, n, d), hnd5),
        att("packed_nhd", lambda b, n: (b, n, h, 2 * d), (0, 1, 2, 3)),
        att("packed_hnd", lambda b, n: (b, h, n, 2 * d), (0, 2, 1, 3)),
        att("mla_latent", lambda b, n: (b, n, 72), (0, 1, 2), dtype=torch.bfloat16),
        att("kernel_split_kv_first", lambda b, n: (2, b, n, h, d), nhd5, ratio=4),
        att("kernel_split_block_first_hnd", lambda b, n: (b, 2, h, n, d), hnd5, ratio=2),
        att("kernel_split_mla", lambda b, n: (b, n, 72), (0, 1, 2), ratio=2),
        _mamba_case(num_blocks, dev),
        hybrid_overlay_case(num_blocks, dev),
    ]
