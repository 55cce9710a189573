"""Canonical KV caches: every layer's cache as int8 ``(num_blocks, page)`` views of its bytes.

The transfer engine moves bytes, not tensors. This module turns vLLM 0.33's per-layer caches
(whatever their shape, dtype and stride order) into a small set of *canonical tensors*: int8
views of shape ``(num_blocks, page_size_bytes)`` whose row stride is the real distance between
two manager blocks, and per KV cache group the *references* that say which bytes of which
canonical tensor hold one block of that group. Layers that share storage (groups overlaid on
one allocation, as vLLM does for hybrid models) share one canonical tensor.

Recognised layouts (:class:`LayoutKind`), all by shape *and* strides, so that vLLM's
hybrid stride trick (a ``(2, B, ...)`` shape with block-outermost strides) is read correctly:

- split K/V, ``(2, B, ...)`` (K and V planes) and ``(B, 2, ...)``, NHD or HND token order;
- packed K|V ``(B, ..., 2 * head_size)`` and MLA latent rows ``(B, block_size, latent)``;
- a flat page ``(B, page_bytes)``;
- mamba/GDN state tuples (conv + ssm, different dtypes), padded pages included, and vLLM 0.33's
  own per-layer ``(B, 1, 1, state_bytes)`` view of a mamba layer (what its runner registers);
- kernel-block-split caches: ``shape[block_dim] = num_blocks * ratio``, a manager block being
  ``ratio`` consecutive kernel blocks (vLLM 0.33 leaves these opaque; we map them).

Anything else raises :class:`~hybridkv.errors.HybridKVConfigError` naming the layer and shape.
The token/head order inside a block does not matter here: a block's bytes move as runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import torch

from hybridkv.errors import HybridKVConfigError
from hybridkv.kinds import GroupKind

__all__ = [
    "ByteRun",
    "CacheGroupSpec",
    "CanonicalCaches",
    "CanonicalTensor",
    "GroupRef",
    "LayerLayout",
    "LayoutKind",
    "build_canonical_caches",
]

# A block that splits into more runs than this is an interleaving we refuse to move piecemeal.
MAX_RUNS_PER_BLOCK = 64


class LayoutKind(Enum):
    """How one layer's cache is laid out, as recognised from its shape and strides."""

    SPLIT_KV_KV_FIRST = "split_kv_kv_first"  # (2, B, ...)
    SPLIT_KV_BLOCK_FIRST = "split_kv_block_first"  # (B, 2, ...)
    PACKED_KV = "packed_kv"  # (B, N, H, 2D) or (B, H, N, 2D)
    MLA_LATENT = "mla_latent"  # (B, N, latent)
    FLAT_PAGE = "flat_page"  # (B, page_bytes)
    MAMBA_STATE = "mamba_state"  # tuple of (B, *state_shape), or vLLM 0.33's (B, 1, 1, C) view


@dataclass(frozen=True, slots=True)
class CacheGroupSpec:
    """One KV cache group as the canonicaliser needs it (vLLM's ``KVCacheGroupSpec``).

    Attributes:
        kind: full attention, sliding window or mamba.
        block_size: tokens per manager block.
        page_size_bytes: bytes per block per layer, padded (vLLM's ``page_size_bytes``).
        real_page_size_bytes: the unpadded bytes per block per layer that carry state.
        layer_names: the group's layers, in vLLM's order.
    """

    kind: GroupKind
    block_size: int
    page_size_bytes: int
    real_page_size_bytes: int
    layer_names: tuple[str, ...]


class ByteRun(NamedTuple):
    """``length`` contiguous bytes at ``offset`` from the start of a canonical row."""

    offset: int
    length: int


@dataclass(frozen=True, slots=True, eq=False)
class CanonicalTensor:
    """One unique piece of cache storage, as int8 rows of one manager block each.

    ``view`` has shape ``(num_blocks, page_size_bytes)`` and strides ``(block_stride_bytes, 1)``;
    ``block_stride_bytes`` may exceed ``page_size_bytes`` (padded or interleaved layouts).
    ``flat`` is a 1-D int8 view from row 0's first byte to the last row's last byte, for copies
    that span several rows.
    """

    view: torch.Tensor
    flat: torch.Tensor
    block_stride_bytes: int
    page_size_bytes: int


@dataclass(frozen=True, slots=True)
class GroupRef:
    """The bytes of one block of a group inside one canonical tensor (one layer, one plane)."""

    tensor_index: int
    runs: tuple[ByteRun, ...]

    @property
    def page_size_bytes(self) -> int:
        """The unpadded bytes this reference moves per block."""
        return sum(r.length for r in self.runs)


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """What was recognised for one layer."""

    layer_name: str
    group: int
    layout: LayoutKind
    kernel_blocks_per_block: int


@dataclass(frozen=True, slots=True, eq=False)
class CanonicalCaches:
    """The unique canonical tensors and, per group, the references of one block.

    A host slot holding a block of group ``g`` stores the runs of ``group_refs[g]`` back to back,
    in order; ``group_bytes(g)`` is that size.
    """

    num_blocks: int
    tensors: tuple[CanonicalTensor, ...]
    group_refs: tuple[tuple[GroupRef, ...], ...]
    layers: tuple[LayerLayout, ...]

    def group_bytes(self, group: int) -> int:
        """Bytes one block of ``group`` occupies in a host slot (all its layers, unpadded)."""
        return sum(ref.page_size_bytes for ref in self.group_refs[group])

    @property
    def device(self) -> torch.device:
        """The device of the caches (all tensors share one)."""
        return self.tensors[0].view.device if self.tensors else torch.device("cpu")


class _Plane(NamedTuple):
    """A block-strided region of one layer: base address, manager stride and runs per block."""

    base: int
    stride: int
    runs: tuple[ByteRun, ...]
    storage: torch.Tensor  # a tensor over the plane's storage, to build views from


def build_canonical_caches(
    kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
    groups: Sequence[CacheGroupSpec],
    num_blocks: int,
) -> CanonicalCaches:
    """Build the canonical tensors and group references for a model's caches.

    Pre: every layer named by ``groups`` is a key of ``kv_caches``; all tensors are on one device.
    Post: for every group ``g`` and block ``b``, the runs of ``group_refs[g]`` over row ``b`` of
    their canonical tensors are exactly the bytes vLLM's layout assigns to block ``b`` of the
    group's layers, and they total ``len(layer_names) * real_page_size_bytes``.
    Frame: a refused call (HybridKVConfigError) creates nothing and touches no tensor.
    """
    _check_count("num_blocks", num_blocks)
    planes: list[_Plane] = []
    refs_of: list[list[int]] = []
    layers: list[LayerLayout] = []
    for g, spec in enumerate(groups):
        _check_group(g, spec)
        refs_of.append([])
        for name in spec.layer_names:
            if name not in kv_caches:
                raise HybridKVConfigError(
                    "kv_caches",
                    name,
                    f"group {g} names layer {name!r} but no cache has it",
                    "pass one cache per layer named in the group specs",
                )
            layout, ratio, layer_planes = _layer_planes(name, kv_caches[name], spec, num_blocks)
            layers.append(LayerLayout(name, g, layout, ratio))
            for plane in layer_planes:
                refs_of[g].append(len(planes))
                planes.append(plane)
    _check_one_device(planes)
    return _merge(planes, refs_of, num_blocks, tuple(layers))


def _check_count(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HybridKVConfigError(field, value, "must be a positive int", f"pass {field} >= 1")


def _check_group(g: int, spec: CacheGroupSpec) -> None:
    for field in ("block_size", "page_size_bytes", "real_page_size_bytes"):
        _check_count(f"groups[{g}].{field}", getattr(spec, field))
    if spec.real_page_size_bytes > spec.page_size_bytes:
        raise HybridKVConfigError(
            f"groups[{g}].real_page_size_bytes",
            spec.real_page_size_bytes,
            f"exceeds page_size_bytes={spec.page_size_bytes}",
            "the padded page is at least the real page; pass the unpadded size as real",
        )
    if not spec.layer_names:
        raise HybridKVConfigError(
            f"groups[{g}].layer_names", spec.layer_names, "is empty", "name the group's layers"
        )


def _layer_planes(
    name: str,
    cache: torch.Tensor | Sequence[torch.Tensor],
    spec: CacheGroupSpec,
    num_blocks: int,
) -> tuple[LayoutKind, int, list[_Plane]]:
    """Recognise one layer's layout and return its planes (refuses with the layer's name)."""
    if isinstance(cache, torch.Tensor):
        layout, ratio, planes = _tensor_planes(name, cache, spec, num_blocks)
    else:
        layout, ratio, planes = _state_planes(name, tuple(cache), spec, num_blocks)
    real = sum(sum(r.length for r in p.runs) for p in planes)
    if real != spec.real_page_size_bytes:
        raise HybridKVConfigError(
            "kv_caches",
            name,
            f"layer {name!r} ({_describe(cache)}) holds {real} bytes per block but its group's "
            f"real_page_size_bytes is {spec.real_page_size_bytes}",
            "pass the spec of the group this layer belongs to, and the cache vLLM allocated "
            "for it with the same num_blocks",
        )
    return layout, ratio, planes


def _tensor_planes(
    name: str, t: torch.Tensor, spec: CacheGroupSpec, num_blocks: int
) -> tuple[LayoutKind, int, list[_Plane]]:
    if spec.kind is GroupKind.MAMBA:
        return _state_view_planes(name, t, num_blocks)
    kv_first = t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] % num_blocks == 0
    block_first = t.dim() >= 2 and t.shape[0] % num_blocks == 0
    if kv_first and block_first:
        raise _unknown(name, t, f"with num_blocks={num_blocks} the block dimension is ambiguous")
    if kv_first:
        ratio = t.shape[1] // num_blocks
        layout = LayoutKind.SPLIT_KV_KV_FIRST
        planes = _planes_of(name, t, 1, ratio)
    elif block_first:
        ratio = t.shape[0] // num_blocks
        layout = _block_first_kind(name, t)
        planes = _planes_of(name, t, 0, ratio)
    else:
        raise _unknown(name, t, f"no dimension holds num_blocks={num_blocks} (times a ratio)")
    if spec.block_size % ratio:
        raise _unknown(
            name, t, f"{ratio} kernel blocks per block do not divide block_size={spec.block_size}"
        )
    return layout, ratio, planes


def _block_first_kind(name: str, t: torch.Tensor) -> LayoutKind:
    if t.dim() == 2:
        return LayoutKind.FLAT_PAGE
    if t.dim() == 3:
        return LayoutKind.MLA_LATENT
    if t.dim() == 4:
        return LayoutKind.PACKED_KV
    if t.dim() == 5 and t.shape[1] == 2:
        return LayoutKind.SPLIT_KV_BLOCK_FIRST
    raise _unknown(name, t, "a block-first cache of this rank is not a known layout")


def _state_planes(
    name: str, states: tuple[torch.Tensor, ...], spec: CacheGroupSpec, num_blocks: int
) -> tuple[LayoutKind, int, list[_Plane]]:
    if spec.kind is not GroupKind.MAMBA or not states:
        raise _unknown(name, states, "a tuple of tensors is a mamba state, in a mamba group")
    planes: list[_Plane] = []
    for s in states:
        if not isinstance(s, torch.Tensor) or s.dim() < 1 or s.shape[0] != num_blocks:
            raise _unknown(name, states, f"each state tensor is (num_blocks={num_blocks}, ...)")
        planes.extend(_planes_of(name, s, 0, 1))
    return LayoutKind.MAMBA_STATE, 1, planes


def _state_view_planes(
    name: str, t: torch.Tensor, num_blocks: int
) -> tuple[LayoutKind, int, list[_Plane]]:
    """A mamba layer registered as vLLM 0.33's per-layer byte view ``(B, 1, 1, state_bytes)``
    (``allocate_kv_cache`` views every layer as ``[B, H, N, C]``, mamba included): the state's
    bytes are one run per block, however the model later splits them into conv and ssm."""
    if t.dim() != 4 or t.shape[0] != num_blocks:
        raise _unknown(
            name,
            t,
            "a mamba layer's cache is a tuple of state tensors or vLLM 0.33's "
            f"(num_blocks={num_blocks}, H, N, C) byte view",
        )
    return LayoutKind.MAMBA_STATE, 1, _planes_of(name, t, 0, 1)


def _planes_of(name: str, t: torch.Tensor, block_dim: int, ratio: int) -> list[_Plane]:
    """Split ``t`` into block-strided planes and compute each plane's runs per manager block.

    A dimension other than the block dimension lies *outside* a block when its byte stride
    exceeds the block's; only a leading K/V dimension of size 2 may (the ``(2, B, ...)``
    layout), and it yields one plane per index.
    """
    es = t.element_size()
    kstride = t.stride(block_dim) * es
    dims = [(d, t.shape[d], t.stride(d) * es) for d in range(t.dim()) if d != block_dim]
    dims = [x for x in dims if x[1] > 1]
    outer = [x for x in dims if x[2] >= kstride]
    if outer and (len(outer) > 1 or outer[0][0] != 0 or outer[0][1] != 2 or block_dim != 1):
        raise _unknown(name, t, "only a leading K/V dimension of 2 may lie outside a block")
    inner = [(size, stride) for (_, size, stride) in dims if (_, size, stride) not in outer]
    kernel_runs = _runs(inner, es)
    if kernel_runs is None or len(kernel_runs) * ratio > MAX_RUNS_PER_BLOCK:
        raise _unknown(name, t, f"a block splits into more than {MAX_RUNS_PER_BLOCK} byte runs")
    if kernel_runs[-1].offset + kernel_runs[-1].length > kstride:
        raise _unknown(name, t, "a block's bytes interleave with its neighbours'")
    runs = _coalesce(
        [ByteRun(k * kstride + r.offset, r.length) for k in range(ratio) for r in kernel_runs]
    )
    planes_at = [0] if not outer else [0, outer[0][2]]
    return [_Plane(t.data_ptr() + off, kstride * ratio, runs, t) for off in planes_at]


def _runs(dims: list[tuple[int, int]], es: int) -> tuple[ByteRun, ...] | None:
    """Sorted byte runs covered by an index space of (size, byte stride) dims.

    Dims that continue the innermost run (stride == run length so far) merge into it; the
    rest are enumerated, giving None when that would exceed MAX_RUNS_PER_BLOCK offsets.
    """
    run = es
    rest: list[tuple[int, int]] = []
    for size, stride in sorted(dims, key=lambda x: x[1]):
        if not rest and stride == run:
            run *= size
        else:
            rest.append((size, stride))
    offsets = [0]
    for size, stride in rest:
        offsets = [o + i * stride for o in offsets for i in range(size)]
        if len(offsets) > MAX_RUNS_PER_BLOCK:
            return None
    return _coalesce(sorted(ByteRun(o, run) for o in offsets))


def _coalesce(runs: list[ByteRun]) -> tuple[ByteRun, ...]:
    """Merge sorted runs that touch or overlap into maximal runs."""
    out: list[ByteRun] = []
    for r in sorted(runs):
        if out and out[-1].offset + out[-1].length >= r.offset:
            last = out[-1]
            out[-1] = ByteRun(last.offset, max(last.length, r.offset + r.length - last.offset))
        else:
            out.append(r)
    return tuple(out)


def _merge(
    planes: list[_Plane], refs_of: list[list[int]], num_blocks: int, layers: tuple[LayerLayout, ...]
) -> CanonicalCaches:
    """Give planes that share storage one canonical tensor; turn planes into group refs.

    Two planes share a tensor when they have the same block stride and one row of the first
    holds the other's runs: the same ``data_ptr`` and strides (overlaid groups), or a state
    tensor living inside another's padded page (mamba conv + ssm in one buffer).
    """
    owners: list[list[int]] = []  # per canonical tensor: the plane indices, the first lowest
    home: list[tuple[int, int]] = []  # per plane: (tensor index, byte shift inside the row)
    for p in sorted(range(len(planes)), key=lambda i: (planes[i].stride, planes[i].base)):
        plane = planes[p]
        for idx, members in enumerate(owners):
            first = planes[members[0]]
            shift = plane.base - first.base
            end = shift + plane.runs[-1].offset + plane.runs[-1].length
            same = _storage_ptr(first) == _storage_ptr(plane)
            if same and first.stride == plane.stride and shift >= 0 and end <= first.stride:
                members.append(p)
                home.append((p, idx))
                break
        else:
            owners.append([p])
            home.append((p, len(owners) - 1))
    where = dict(home)
    tensors = tuple(_canonical(planes, m, num_blocks) for m in owners)
    group_refs = tuple(_join([_ref(planes, owners, where[p], p) for p in ps]) for ps in refs_of)
    return CanonicalCaches(num_blocks, tensors, group_refs, layers)


def _join(refs: list[GroupRef]) -> tuple[GroupRef, ...]:
    """Merge consecutive refs into one tensor (a mamba layer's conv + ssm) into fewer runs."""
    out: list[GroupRef] = []
    for ref in refs:
        if out and out[-1].tensor_index == ref.tensor_index:
            last = out[-1]
            if last.runs[-1].offset + last.runs[-1].length <= ref.runs[0].offset:
                out[-1] = GroupRef(last.tensor_index, _coalesce([*last.runs, *ref.runs]))
                continue
        out.append(ref)
    return tuple(out)


def _storage_ptr(plane: _Plane) -> int:
    return int(plane.storage.untyped_storage().data_ptr())


def _ref(planes: list[_Plane], owners: list[list[int]], idx: int, p: int) -> GroupRef:
    shift = planes[p].base - planes[owners[idx][0]].base
    return GroupRef(idx, tuple(ByteRun(shift + r.offset, r.length) for r in planes[p].runs))


def _canonical(planes: list[_Plane], members: list[int], num_blocks: int) -> CanonicalTensor:
    first = planes[members[0]]
    page = max(
        planes[m].base - first.base + planes[m].runs[-1].offset + planes[m].runs[-1].length
        for m in members
    )
    raw = _bytes_of(first.storage)
    start = first.base - raw.data_ptr()
    view = torch.as_strided(raw, (num_blocks, page), (first.stride, 1), start)
    flat = torch.as_strided(raw, ((num_blocks - 1) * first.stride + page,), (1,), start)
    return CanonicalTensor(view, flat, first.stride, page)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A 1-D int8 tensor over all of ``t``'s storage (views are built from it by offset)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.int8, device=t.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )


def _check_one_device(planes: list[_Plane]) -> None:
    devices = {p.storage.device for p in planes}
    if len(devices) > 1:
        raise HybridKVConfigError(
            "kv_caches",
            sorted(str(d) for d in devices),
            "caches live on several devices",
            "pass the caches of one worker (one device)",
        )


def _describe(cache: object) -> str:
    if isinstance(cache, torch.Tensor):
        return f"shape {tuple(cache.shape)}, strides {cache.stride()}, {cache.dtype}"
    if isinstance(cache, Sequence):
        return "(" + "; ".join(_describe(c) for c in cache) + ")"
    return type(cache).__name__


def _unknown(name: str, cache: object, problem: str) -> HybridKVConfigError:
    return HybridKVConfigError(
        "kv_caches",
        name,
        f"layer {name!r} has an unrecognised KV cache layout ({_describe(cache)}): {problem}",
        "use one of vLLM 0.33's layouts (split K/V (2, B, ...) or (B, 2, ...), packed K|V, "
        "MLA latent, mamba state tuple, or a kernel-block split of these) or register the "
        "layer as opaque",
    )
