"""Test-side knowledge of each sample layout, from plain logical indexing (not the library's
stride arithmetic): which logical pieces make up block ``b`` of a layer, in slot order."""

from __future__ import annotations

import torch

from hybridkv.cache_layouts import LayoutCase
from hybridkv.canonical import CanonicalCaches

RATIO = {"kernel_split_kv_first": 4, "kernel_split_block_first_hnd": 2, "kernel_split_mla": 2}


def block_parts(case: LayoutCase, layer: str, b: int) -> list[torch.Tensor]:
    """The logical pieces of block ``b`` of ``layer``, in the order a host slot holds them."""
    cache = case.kv_caches[layer]
    if isinstance(cache, tuple):
        return [cache[0][b], cache[1][b]]  # conv state, then ssm state
    r = RATIO.get(case.name, 1)
    if "kv_first" in case.name or layer.startswith("attn."):
        return [cache[0, b * r : (b + 1) * r], cache[1, b * r : (b + 1) * r]]
    return [cache[b * r : (b + 1) * r]]


def as_bytes(t: torch.Tensor) -> bytes:
    """A tensor's elements as bytes in logical order (NaN-safe comparison)."""
    return bytes(t.contiguous().view(-1).view(torch.uint8).tolist())


def group_block_bytes(case: LayoutCase, group: int, b: int) -> bytes:
    """Block ``b`` of ``group``: its layers' pieces in logical element order."""
    return b"".join(
        as_bytes(p) for layer in case.groups[group].layer_names for p in block_parts(case, layer, b)
    )


def storages(case: LayoutCase) -> list[torch.Tensor]:
    """Every distinct storage behind the case's caches, as flat uint8 tensors."""
    out: dict[int, torch.Tensor] = {}
    for cache in case.kv_caches.values():
        t = cache[0] if isinstance(cache, tuple) else cache
        s = t.untyped_storage()
        out[s.data_ptr()] = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
            s, 0, (s.nbytes(),), (1,)
        )
    return list(out.values())


def fill_random(case: LayoutCase, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for s in storages(case):
        s.copy_(torch.randint(0, 256, (s.numel(),), dtype=torch.uint8, generator=gen))


def read_block(cc: CanonicalCaches, group: int, b: int) -> bytes:
    """Block ``b`` of ``group`` read through the canonical refs, in slot order."""
    out = b""
    for ref in cc.group_refs[group]:
        row = cc.tensors[ref.tensor_index].view[b]
        for off, n in ref.runs:
            out += bytes(row[off : off + n].view(torch.uint8).tolist())
    return out
