"""KV-cache geometry of a hybrid model as vLLM 0.33 derives it: groups, block and page sizes.

The derivation follows vLLM's own order (each step names the vLLM routine it models):

1. ``MambaModelConfig.verify_and_update_config`` (``models/config.py``): prefix caching on means
   mamba cache mode ``align`` with ``mamba_block_size = block_size``; off means ``none`` with
   ``mamba_block_size = max_model_len``.
2. ``Platform.update_block_size_for_backend`` / ``_align_hybrid_block_size``
   (``platforms/interface.py``): the attention block is raised until one attention page covers
   the mamba page, ``attn_block = align * cdiv(mamba_page, align * attn_page_per_token)`` with
   ``align = max(kernel block, block_size)`` (times the GDN prefill checkpoint alignment in
   align mode), rounded up to the kernel block; the mamba page is padded to the attention page.
3. Each layer's spec (``Attention.get_kv_cache_spec``, ``MambaBase.get_kv_cache_spec``).
4. ``unify_kv_cache_spec_page_size`` and ``_get_kv_cache_groups_uniform_page_size``
   (``v1/core/kv_cache_planning.py``): equal pages, then groups with equal layer counts.
5. ``EngineCore._initialize_kv_caches`` (``v1/engine/core.py``): the final block size is the
   smallest prefix-cacheable group block; ``resolve_kv_cache_block_sizes`` and
   ``resolve_cache_hit_alignment_tokens`` (``v1/core/kv_cache_utils.py``) give the scheduler
   block size, the hash block size and the cache-hit alignment.

Not modelled (vLLM features this project does not use): speculative decoding, decode context
parallelism, quantized KV caches, MLA, ``prefix_match_unit``, an explicit
``--mamba-ssm-cache-dtype``, and a disabled hybrid KV-cache manager.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from spec.config_json import (
    SUPPORTED_ARCHITECTURES,
    KVLayer,
    ModelDescription,
    model_from_config,
)
from spec.errors import ConfigError
from spec.kinds import GroupKind, MambaCacheMode
from spec.mamba_state import DTYPE_BYTES, MambaVariant
from spec.platforms import DEFAULT_PLATFORM, PLATFORMS, Platform

__all__ = [
    "PLATFORMS",
    "SUPPORTED_ARCHITECTURES",
    "GroupSpec",
    "KVLayer",
    "Layout",
    "LayoutSettings",
    "ModelDescription",
    "Platform",
    "derive_layout",
    "model_from_config",
]

Shape = tuple[int, ...]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(name, value, "must be a positive integer", f"give {name} >= 1")
    return value


@dataclass(frozen=True, slots=True)
class LayoutSettings:
    """The serving settings geometry depends on, validated eagerly.

    Attributes:
        max_model_len: the longest request in tokens (``--max-model-len``).
        block_size: the user's ``--block-size``, or ``None`` for the platform default.
        cache_mode: ``ALIGN`` is vLLM with prefix caching (mamba cache mode ``align``);
            ``NONE`` is ``--no-enable-prefix-caching`` (mamba cache mode ``none``). A string
            ``"align"`` / ``"none"`` is accepted and stored as the enum.
        dtype: the KV / state dtype: ``"auto"`` (the checkpoint's) or a dtype name.
        tp: the tensor-parallel size.
        platform: a name in :data:`PLATFORMS`; the kernel facts it stands for decide alignment.
    Raises ConfigError naming the offending field; a refused construction builds nothing.
    """

    max_model_len: int
    block_size: int | None = None
    cache_mode: MambaCacheMode = MambaCacheMode.ALIGN
    dtype: str = "auto"
    tp: int = 1
    platform: str = DEFAULT_PLATFORM

    def __post_init__(self) -> None:
        _positive_int("max_model_len", self.max_model_len)
        _positive_int("tp", self.tp)
        if self.platform not in PLATFORMS:
            raise ConfigError(
                "platform", self.platform, "unknown platform", f"use one of {sorted(PLATFORMS)}"
            )
        mode: Any = self.cache_mode
        if not isinstance(mode, MambaCacheMode):
            try:
                mode = MambaCacheMode(mode)
            except ValueError:
                raise ConfigError(
                    "cache_mode", mode, "unknown cache mode", "use 'align' or 'none'"
                ) from None
            object.__setattr__(self, "cache_mode", mode)
        if self.dtype != "auto" and self.dtype not in DTYPE_BYTES:
            raise ConfigError(
                "dtype",
                self.dtype,
                "unsupported dtype",
                f"use 'auto' or one of {list(DTYPE_BYTES)}",
            )
        if self.block_size is not None:
            _positive_int("block_size", self.block_size)
            platform = PLATFORMS[self.platform]
            base = platform.kernel_block_base
            if self.block_size % base and not platform.odd_block_size_warns:
                raise ConfigError(
                    "block_size",
                    self.block_size,
                    f"the {self.platform} attention kernels need a multiple of {base}",
                    f"give a multiple of {base}, or leave it unset",
                )


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV cache group (vLLM's ``KVCacheGroupSpec``): layers sharing one block table.

    ``padding_bytes = page_size_bytes - real_page_size_bytes``. ``sliding_window`` is set only
    for ``SLIDING`` groups; ``mamba_*`` fields are non-empty only for ``MAMBA`` groups.
    """

    kind: GroupKind
    layer_indices: tuple[int, ...]
    block_size: int
    page_size_bytes: int
    real_page_size_bytes: int
    sliding_window: int | None = None
    extra_retained_tokens: int = 0
    mamba_variant: MambaVariant | None = None
    mamba_shapes: tuple[Shape, ...] = ()
    mamba_dtypes: tuple[str, ...] = ()
    prefix_cacheable: bool = True

    @property
    def num_layers(self) -> int:
        return len(self.layer_indices)

    @property
    def padding_bytes(self) -> int:
        return self.page_size_bytes - self.real_page_size_bytes


@dataclass(frozen=True, slots=True)
class Layout:
    """The geometry vLLM 0.33 derives (see the module docstring for each step).

    ``mamba_block_size`` is ``None`` for a model without mamba layers. ``warnings`` are what
    vLLM logs as a warning for these settings (it serves them all the same); ``notes`` explain.
    """

    groups: tuple[GroupSpec, ...]
    block_size: int
    mamba_block_size: int | None
    scheduler_block_size: int
    hash_block_size: int
    cache_hit_alignment_tokens: int
    platform: str
    cache_mode: MambaCacheMode
    dtype: str
    tp: int
    notes: tuple[str, ...] = field(default=())
    warnings: tuple[str, ...] = field(default=())


@dataclass(frozen=True, slots=True)
class _LayerSpec:
    """A layer's spec before grouping; equal values land in the same bucket."""

    kind: GroupKind
    block_size: int
    page_size_bytes: int
    real_page_size_bytes: int
    sliding_window: int | None


def _check_tp(model: ModelDescription, tp: int) -> None:
    kv = model.num_kv_heads
    kv_ok = (kv % tp == 0) if tp <= kv else (tp % kv == 0)
    splits = [model.num_attention_heads, *(model.mamba.split_sizes() if model.mamba else ())]
    if not kv_ok or any(s % tp for s in splits):
        raise ConfigError(
            "tp",
            tp,
            f"does not divide the model's heads (attention {model.num_attention_heads}, "
            f"kv {kv}, mamba splits {splits[1:]})",
            "choose a tensor-parallel size that divides them",
        )


def _ssm_dtype(model: ModelDescription, dtype: str, platform: Platform) -> str:
    if platform.fp32_ssm_state:
        return "float32"
    return dtype if model.ssm_dtype == "auto" else model.ssm_dtype


def _mamba_state(
    model: ModelDescription, dtype: str, tp: int, platform: Platform
) -> tuple[tuple[Shape, ...], tuple[str, ...], int]:
    """Post: (shapes, dtypes, bytes) of one layer's recurrent state on one rank."""
    assert model.mamba is not None  # callers check is_hybrid
    shapes = model.mamba.shapes(tp)
    dtypes = (dtype, _ssm_dtype(model, dtype, platform))
    size = sum(math.prod(s) * DTYPE_BYTES[d] for s, d in zip(shapes, dtypes, strict=True))
    return shapes, dtypes, size


def _hybrid_block_size(
    model: ModelDescription,
    *,
    settings: LayoutSettings,
    platform: Platform,
    base_block: int,
    attn_per_token: int,
    mamba_page: int,
) -> int:
    """``_align_hybrid_block_size``: the attention block whose page covers the mamba page."""
    align = max(platform.kernel_block_base, base_block)
    assert model.mamba is not None
    if settings.cache_mode is MambaCacheMode.ALIGN and model.mamba.variant is MambaVariant.GDN:
        align = math.lcm(align, platform.gdn_checkpoint_alignment)
    attn_block = align * -(-mamba_page // (align * attn_per_token))
    kernel = platform.kernel_block_base
    attn_block = kernel * -(-attn_block // kernel)
    return max(base_block, attn_block)


def _sliding_block(block: int, kernel: int) -> int:
    """``_largest_kernel_block_within``: a sliding-window layer's own block.

    The largest multiple of the kernel block within ``block`` (the page budget is ``block``
    tokens of the same per-token size), at least one kernel block: ``block`` itself whenever it
    is a multiple of the kernel block, e.g. 32 for a CPU ``--block-size 16`` or 48.
    """
    return max(kernel, block // kernel * kernel)


def _layer_specs(
    model: ModelDescription,
    block: int,
    mamba_block: int,
    attn_per_token: int,
    mamba_page: int,
    *,
    kernel: int,
) -> list[_LayerSpec]:
    specs = []
    for layer in model.layers:
        if layer.kind is GroupKind.MAMBA:
            padded = max(mamba_page, block * attn_per_token)
            specs.append(_LayerSpec(layer.kind, mamba_block, padded, mamba_page, None))
        else:
            size = _sliding_block(block, kernel) if layer.kind is GroupKind.SLIDING else block
            page = size * attn_per_token
            specs.append(_LayerSpec(layer.kind, size, page, page, layer.sliding_window))
    return specs


def _unify_pages(specs: list[_LayerSpec]) -> list[_LayerSpec]:
    """``unify_kv_cache_spec_page_size``: scale attention blocks or pad pages to the largest."""
    top = max(s.page_size_bytes for s in specs)
    out = []
    for s in specs:
        if s.page_size_bytes == top:
            out.append(s)
        elif s.kind is not GroupKind.MAMBA and top % s.page_size_bytes == 0:
            ratio = top // s.page_size_bytes
            out.append(
                _LayerSpec(
                    s.kind,
                    s.block_size * ratio,
                    top,
                    s.real_page_size_bytes * ratio,
                    s.sliding_window,
                )
            )
        else:
            out.append(
                _LayerSpec(s.kind, s.block_size, top, s.real_page_size_bytes, s.sliding_window)
            )
    return out


def _group_layers(
    layers: tuple[KVLayer, ...], specs: list[_LayerSpec]
) -> list[tuple[_LayerSpec, tuple[int, ...]]]:
    """``_get_kv_cache_groups_uniform_page_size``: equal layer counts per group.

    Buckets of equal specs in order of first appearance; the group size is the smallest bucket,
    or the largest when it is under 1.5 times the smallest; bucket ``b`` with ``g`` groups gives
    group ``i`` the layers ``b[i::g]``.
    """
    buckets: dict[_LayerSpec, list[int]] = {}
    for layer, spec in zip(layers, specs, strict=True):
        buckets.setdefault(spec, []).append(layer.index)
    smallest = min(len(b) for b in buckets.values())
    largest = max(len(b) for b in buckets.values())
    size = largest if largest < smallest * 1.5 else smallest
    groups: list[tuple[_LayerSpec, tuple[int, ...]]] = []
    for spec, indices in buckets.items():
        count = -(-len(indices) // size)
        groups.extend((spec, tuple(indices[i::count])) for i in range(count))
    return groups


def _block_sizes(groups: tuple[GroupSpec, ...], prefix_caching: bool) -> tuple[int, int, int, int]:
    """Post: (block_size, scheduler_block_size, hash_block_size, cache_hit_alignment_tokens)."""
    cacheable = [g.block_size for g in groups if g.prefix_cacheable]
    block = min(cacheable or [g.block_size for g in groups])
    if len(groups) == 1:
        return block, block, block, block
    sched = math.lcm(*(g.block_size for g in groups))
    if not prefix_caching:
        # No prefix caching and no connector: hashes keep the scheduler block size.
        return block, sched, sched, sched
    hashed = math.gcd(*(cacheable or [g.block_size for g in groups]))
    partial = any(g.kind is GroupKind.MAMBA and g.block_size > hashed for g in groups) and all(
        g.kind is not GroupKind.SLIDING or g.block_size == hashed
        for g in groups
        if g.prefix_cacheable
    )
    return block, sched, hashed, hashed if partial else sched


def _block_size_warnings(
    settings: LayoutSettings, platform: Platform, groups: tuple[GroupSpec, ...]
) -> tuple[str, ...]:
    """vLLM's warning for a user block size off the kernel block (``odd_block_size_warns``)."""
    user, kernel = settings.block_size, platform.kernel_block_base
    if user is None or user % kernel == 0:
        return ()
    blocks = sorted({g.block_size for g in groups})
    return (
        f"--block-size {user} is not a multiple of {kernel}: vLLM on {platform.name} keeps it "
        f"with a warning (its attention backend prefers multiples of {kernel}) and derives "
        f"group blocks of {blocks} tokens from it; give a multiple of {kernel} to avoid the "
        "warning",
    )


def derive_layout(model: ModelDescription, settings: LayoutSettings) -> Layout:
    """The KV-cache geometry vLLM 0.33 builds for ``model`` under ``settings``.

    Pre: ``settings`` is validated (its constructor did it).
    Post: the groups, block sizes and alignments of the module docstring's derivation.
    Raises ConfigError (field ``tp``) when the tensor-parallel size does not divide the
    model's heads; nothing else changes.
    """
    _check_tp(model, settings.tp)
    platform = PLATFORMS[settings.platform]
    dtype = model.dtype if settings.dtype == "auto" else settings.dtype
    prefix_caching = settings.cache_mode is MambaCacheMode.ALIGN
    base_block = settings.block_size or platform.default_block_size
    kv_heads = max(1, model.num_kv_heads // settings.tp)
    attn_per_token = 2 * kv_heads * model.head_dim * DTYPE_BYTES[dtype]
    notes: list[str] = []
    shapes: tuple[Shape, ...] = ()
    dtypes: tuple[str, ...] = ()
    mamba_page = 0
    mamba_block: int | None = None
    block = base_block
    if model.mamba is not None:
        shapes, dtypes, mamba_page = _mamba_state(model, dtype, settings.tp, platform)
        block = _hybrid_block_size(
            model,
            settings=settings,
            platform=platform,
            base_block=base_block,
            attn_per_token=attn_per_token,
            mamba_page=mamba_page,
        )
        mamba_block = block if prefix_caching else settings.max_model_len
        if not prefix_caching:
            notes.append(
                "cache mode none: prefix caching is off, one running mamba state per request "
                f"(mamba block size = max_model_len = {settings.max_model_len})"
            )
    specs = _unify_pages(
        _layer_specs(
            model,
            block,
            mamba_block or block,
            attn_per_token,
            mamba_page,
            kernel=platform.kernel_block_base,
        )
    )
    variant = model.mamba.variant if model.mamba is not None else None
    groups = tuple(
        GroupSpec(
            kind=spec.kind,
            layer_indices=indices,
            block_size=spec.block_size,
            page_size_bytes=spec.page_size_bytes,
            real_page_size_bytes=spec.real_page_size_bytes,
            sliding_window=spec.sliding_window,
            mamba_variant=variant if spec.kind is GroupKind.MAMBA else None,
            mamba_shapes=shapes if spec.kind is GroupKind.MAMBA else (),
            mamba_dtypes=dtypes if spec.kind is GroupKind.MAMBA else (),
        )
        for spec, indices in _group_layers(model.layers, specs)
    )
    final, sched, hashed, hit = _block_sizes(groups, prefix_caching)
    warnings = _block_size_warnings(settings, platform, groups)
    return Layout(
        groups=groups,
        block_size=final,
        mamba_block_size=mamba_block,
        scheduler_block_size=sched,
        hash_block_size=hashed,
        cache_hit_alignment_tokens=hit,
        platform=platform.name,
        cache_mode=settings.cache_mode,
        dtype=dtype,
        tp=settings.tp,
        notes=tuple(notes),
        warnings=warnings,
    )
