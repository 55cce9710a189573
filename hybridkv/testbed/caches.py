"""Per-layer KV caches for a simulated model, allocated the way vLLM 0.33 allocates them.

vLLM gives a hybrid model one buffer per *layer slot*: slot ``i`` holds layer ``i`` of every
KV cache group, overlaid, since a block id belongs to one group at a time. Every group's page
is the same size (attention blocks were raised, mamba pages padded). Inside a slot:

- an attention layer is a ``(2, num_blocks, block_size, row)`` tensor with vLLM's hybrid stride
  trick: the block dimension is outermost in memory (stride = the page), K and V are two halves
  of each page;
- a mamba layer is a tuple of state tensors ``(num_blocks, *shape)`` (conv, then ssm...) packed
  at the start of each page, the rest of the page padding.

So the simulated caches exercise the same canonicalisation (:mod:`hybridkv.canonical`) and
transfer paths as a real model. ``layers_per_group`` scales the model down: every group gets
that many layers (vLLM's groups have equal layer counts), and bytes moved scale with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hybridkv.canonical import CacheGroupSpec
from hybridkv.errors import HybridKVConfigError
from hybridkv.kinds import GroupKind

__all__ = ["SimCaches", "SimGroup", "build_sim_caches"]

_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


@dataclass(frozen=True, slots=True)
class SimGroup:
    """One KV cache group of the simulated model.

    Attributes:
        kind: full attention, sliding window or mamba.
        block_size: tokens per block.
        page_size_bytes: bytes per block per layer, padded (equal for every group).
        real_page_size_bytes: bytes that carry KV or state (attention: K and V of every token).
        attention_dtype: element type of attention KV (ignored for mamba).
        state_shapes, state_dtypes: a mamba group's state tensors per block (empty otherwise).
        sliding_window: the window of a sliding group (``None`` otherwise).
    """

    kind: GroupKind
    block_size: int
    page_size_bytes: int
    real_page_size_bytes: int
    attention_dtype: str = "bfloat16"
    state_shapes: tuple[tuple[int, ...], ...] = ()
    state_dtypes: tuple[str, ...] = ()
    sliding_window: int | None = None


@dataclass(frozen=True, slots=True, eq=False)
class SimCaches:
    """The simulated caches.

    Attributes:
        groups: the canonicaliser's view of each group (layer names included).
        kv_caches: layer name -> its cache (a tensor, or a tuple of state tensors).
        planes: per group, per layer, the tensors content is written through: attention
            ``(K, V)`` each ``(num_blocks, block_size, row)``; mamba the state tensors.
        num_blocks: blocks per layer, the null block included.
        buffers: the raw per-slot buffers (kept alive here).
    """

    groups: tuple[CacheGroupSpec, ...]
    kv_caches: Mapping[str, torch.Tensor | tuple[torch.Tensor, ...]]
    planes: tuple[tuple[tuple[torch.Tensor, ...], ...], ...]
    num_blocks: int
    buffers: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of GPU (or CPU) memory the caches take."""
        return sum(b.numel() for b in self.buffers)


def _dtype(field: str, name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise HybridKVConfigError(
            field, name, "is not a known dtype", f"use one of {sorted(_DTYPES)}"
        )
    return _DTYPES[name]


def build_sim_caches(
    groups: Sequence[SimGroup],
    num_blocks: int,
    layers_per_group: int = 1,
    device: str | torch.device = "cpu",
) -> SimCaches:
    """Allocate zeroed caches for ``groups`` (module docstring).

    Pre: at least one group, all with the same ``page_size_bytes``; an attention group's real
    page splits into K and V rows of whole elements per token; a mamba group's states fit its
    real page. Refusal: :class:`HybridKVConfigError` naming the field, nothing allocated.
    """
    for field, value in (("num_blocks", num_blocks), ("layers_per_group", layers_per_group)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise HybridKVConfigError(field, value, "must be an int >= 1", f"pass {field} >= 1")
    if not groups:
        raise HybridKVConfigError("groups", (), "need at least one group", "describe the model")
    page = groups[0].page_size_bytes
    for g, group in enumerate(groups):
        _check_group(g, group, page)
    dev = torch.device(device)
    buffers = tuple(
        torch.zeros(num_blocks * page, dtype=torch.int8, device=dev)
        for _ in range(layers_per_group)
    )
    kv_caches: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = {}
    specs: list[CacheGroupSpec] = []
    planes: list[tuple[tuple[torch.Tensor, ...], ...]] = []
    for g, group in enumerate(groups):
        names: list[str] = []
        per_layer: list[tuple[torch.Tensor, ...]] = []
        for slot, raw in enumerate(buffers):
            name = f"layers.{slot}.group{g}"
            cache, layer_planes = _layer(raw, group, num_blocks)
            kv_caches[name] = cache
            names.append(name)
            per_layer.append(layer_planes)
        specs.append(
            CacheGroupSpec(
                group.kind,
                group.block_size,
                group.page_size_bytes,
                group.real_page_size_bytes,
                tuple(names),
            )
        )
        planes.append(tuple(per_layer))
    return SimCaches(tuple(specs), kv_caches, tuple(planes), num_blocks, buffers)


def _check_group(g: int, group: SimGroup, page: int) -> None:
    where = f"groups[{g}]"
    if group.page_size_bytes != page:
        raise HybridKVConfigError(
            f"{where}.page_size_bytes",
            group.page_size_bytes,
            f"differs from group 0's {page}: vLLM unifies every group's page",
            "derive the layout with spec.layout (pages are padded to one size)",
        )
    if not 0 < group.real_page_size_bytes <= page or group.block_size < 1:
        raise HybridKVConfigError(
            f"{where}.real_page_size_bytes",
            group.real_page_size_bytes,
            f"not in (0, page_size_bytes={page}] or block_size < 1",
            "derive the layout with spec.layout, which pads every page to one size",
        )
    if group.kind is GroupKind.MAMBA:
        if not group.state_shapes or len(group.state_shapes) != len(group.state_dtypes):
            raise HybridKVConfigError(
                f"{where}.state_shapes",
                group.state_shapes,
                "need one dtype per shape",
                "give state_dtypes one dtype name for each state shape",
            )
        used = sum(
            _numel(s) * torch.empty(0, dtype=_dtype(f"{where}.state_dtypes", d)).element_size()
            for s, d in zip(group.state_shapes, group.state_dtypes, strict=True)
        )
        if used > group.real_page_size_bytes:
            raise HybridKVConfigError(
                f"{where}.state_shapes",
                group.state_shapes,
                f"exceed the real page ({used} > {group.real_page_size_bytes} bytes)",
                "derive the layout with spec.layout, whose mamba page holds every state",
            )
        return
    es = torch.empty(0, dtype=_dtype(f"{where}.attention_dtype", group.attention_dtype))
    per_token = 2 * group.block_size * es.element_size()
    if group.real_page_size_bytes % per_token:
        raise HybridKVConfigError(
            f"{where}.real_page_size_bytes",
            group.real_page_size_bytes,
            f"is not K and V rows of whole {group.attention_dtype} elements for "
            f"{group.block_size} tokens",
            "derive the layout with spec.layout",
        )


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _layer(
    raw: torch.Tensor, group: SimGroup, num_blocks: int
) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    page = group.page_size_bytes
    if group.kind is GroupKind.MAMBA:
        states = _states(raw, group, num_blocks)
        return states, states
    dtype = _dtype("attention_dtype", group.attention_dtype)
    es = torch.empty(0, dtype=dtype).element_size()
    row = group.real_page_size_bytes // (2 * group.block_size * es)
    half = group.block_size * row
    # vLLM's hybrid stride trick: a (2, B, bs, row) shape whose block dim strides by the page.
    cache = torch.as_strided(
        raw.view(dtype), (2, num_blocks, group.block_size, row), (half, page // es, row, 1)
    )
    return cache, (cache[0], cache[1])


def _states(raw: torch.Tensor, group: SimGroup, num_blocks: int) -> tuple[torch.Tensor, ...]:
    """The state tensors packed at the start of each page (vLLM's mamba layout)."""
    page = group.page_size_bytes
    out: list[torch.Tensor] = []
    offset = 0
    for shape, name in zip(group.state_shapes, group.state_dtypes, strict=True):
        dtype = _dtype("state_dtypes", name)
        es = torch.empty(0, dtype=dtype).element_size()
        if page % es or offset % es:
            raise HybridKVConfigError(
                "state_dtypes", name, "misaligned inside the page", "order states by alignment"
            )
        inner = [1]
        for n in reversed(shape[1:]):
            inner.insert(0, inner[0] * n)
        strides = (page // es, *inner)
        out.append(torch.as_strided(raw.view(dtype), (num_blocks, *shape), strides, offset // es))
        offset += es * _numel(shape)
    return tuple(out)
