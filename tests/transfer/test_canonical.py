"""Canonical KV caches: every recognised layout, byte-exact on CPU tensors.

Expected bytes come from plain logical indexing of the original tensors (``t[0, b]``,
``conv[b]``...), never from the canonicaliser's stride arithmetic: each (block, layer, part)
is filled with its own constant, so the bytes of a block are known by hand up to nothing.
"""

from __future__ import annotations

import pytest
import torch
from layout_oracle import block_parts, read_block, storages

from hybridkv.cache_layouts import LayoutCase, all_layout_cases, mamba_states
from hybridkv.canonical import (
    CacheGroupSpec,
    CanonicalCaches,
    LayoutKind,
    build_canonical_caches,
)
from hybridkv.errors import HybridKVConfigError
from hybridkv.kinds import GroupKind

NUM_BLOCKS = 5
CASES = all_layout_cases(NUM_BLOCKS)


def fill_background(case: LayoutCase) -> None:
    for cache in case.kv_caches.values():
        t = cache[0] if isinstance(cache, tuple) else cache
        t.untyped_storage().fill_(0x5A)


def value(b: int, layer_idx: int, part: int) -> int:
    return 1 + 16 * b + 4 * layer_idx + part


def fill_patterns(case: LayoutCase, group: int) -> None:
    for li, layer in enumerate(case.groups[group].layer_names):
        for b in range(case.num_blocks):
            for p, part in enumerate(block_parts(case, layer, b)):
                part.fill_(value(b, li, p))


def expected_bytes(case: LayoutCase, group: int, b: int) -> bytes:
    out = b""
    for li, layer in enumerate(case.groups[group].layer_names):
        for p, part in enumerate(block_parts(case, layer, b)):
            full = torch.full((part.numel(),), value(b, li, p), dtype=part.dtype)
            out += bytes(full.view(torch.uint8).tolist())
    return out


def write_block(cc: CanonicalCaches, group: int, b: int, data: bytes) -> None:
    pos = 0
    src = torch.tensor(list(data), dtype=torch.uint8).view(torch.int8)
    for ref in cc.group_refs[group]:
        row = cc.tensors[ref.tensor_index].view[b]
        for off, n in ref.runs:
            row[off : off + n].copy_(src[pos : pos + n])
            pos += n
    assert pos == len(data)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_extract_is_byte_exact(case: LayoutCase) -> None:
    cc = build_canonical_caches(case.kv_caches, case.groups, case.num_blocks)
    for g, spec in enumerate(case.groups):
        fill_background(case)
        fill_patterns(case, g)
        assert cc.group_bytes(g) == len(spec.layer_names) * spec.real_page_size_bytes
        for b in range(case.num_blocks):
            assert read_block(cc, g, b) == expected_bytes(case, g, b), (g, b)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_write_changes_only_that_block(case: LayoutCase) -> None:
    cc = build_canonical_caches(case.kv_caches, case.groups, case.num_blocks)
    g, b = len(case.groups) - 1, 2
    fill_background(case)
    fill_patterns(case, g)
    before = [s.clone() for s in storages(case)]
    write_block(cc, g, b, expected_bytes(case, g, 4))  # block 4's content into block 2
    for li, layer in enumerate(case.groups[g].layer_names):
        for p, part in enumerate(block_parts(case, layer, b)):
            assert bool((part == value(4, li, p)).all()), (layer, p)
        for other in (0, 1, 3, 4):
            for p, part in enumerate(block_parts(case, layer, other)):
                assert bool((part == value(other, li, p)).all()), (layer, other, p)
    # Padding and every other byte of storage outside block 2's pages stay as they were.
    # Every storage is NUM_BLOCKS rows of `page` bytes (times 2 planes for (2, B, ...) caches);
    # a changed byte must lie in row b and inside its real bytes, never in padding.
    real = case.groups[g].real_page_size_bytes
    for old, new in zip(before, storages(case), strict=True):
        changed = (old != new).nonzero().flatten().tolist()
        assert changed, "the write reached every layer"
        page = old.numel() // (NUM_BLOCKS * (2 if "kv_first" in case.name else 1))
        assert all((pos // page) % NUM_BLOCKS == b for pos in changed)
        assert all(pos % page < real for pos in changed)


def test_recognised_kinds_and_sharing() -> None:
    kinds = {}
    for case in CASES:
        cc = build_canonical_caches(case.kv_caches, case.groups, case.num_blocks)
        kinds[case.name] = {(lay.layout, lay.kernel_blocks_per_block) for lay in cc.layers}
        if case.name == "hybrid_overlay":
            # two buffers, each holding one attention and one mamba layer: two tensors only
            assert len(cc.tensors) == 2
            assert all(t.block_stride_bytes > t.page_size_bytes for t in cc.tensors)
        if case.name == "kv_first_nhd":
            assert len(cc.tensors) == 4  # K and V planes of two layers
    assert kinds["kv_first_hnd"] == {(LayoutKind.SPLIT_KV_KV_FIRST, 1)}
    assert kinds["block_first_nhd"] == {(LayoutKind.SPLIT_KV_BLOCK_FIRST, 1)}
    assert kinds["packed_hnd"] == {(LayoutKind.PACKED_KV, 1)}
    assert kinds["mla_latent"] == {(LayoutKind.MLA_LATENT, 1)}
    assert kinds["kernel_split_kv_first"] == {(LayoutKind.SPLIT_KV_KV_FIRST, 4)}
    assert kinds["mamba_padded"] == {(LayoutKind.MAMBA_STATE, 1)}


def test_mamba_state_page_is_padded_stride_with_real_bytes() -> None:
    case = next(c for c in CASES if c.name == "mamba_padded")
    cc = build_canonical_caches(case.kv_caches, case.groups, case.num_blocks)
    spec = case.groups[0]
    # conv (3, 96) bf16 = 576 bytes + ssm (4, 8, 16) fp32 = 2048 bytes, padded by 448
    assert spec.real_page_size_bytes == 576 + 2048
    for t in cc.tensors:
        assert t.block_stride_bytes == 576 + 2048 + 448
        assert t.page_size_bytes == 576 + 2048
    assert [r.runs for r in cc.group_refs[0]] == [((0, 2624),), ((0, 2624),)]


# ---- refusals: each a named error, nothing built -------------------------------------------


def _attn_group(layers: tuple[str, ...], real: int, bs: int = 16) -> CacheGroupSpec:
    return CacheGroupSpec(GroupKind.FULL, bs, real, real, layers)


def test_token_first_layout_is_refused_naming_layer_and_shape() -> None:
    t = torch.zeros(16, 7, 2, 8, dtype=torch.float16)  # (tokens, blocks, H, D): no such layout
    with pytest.raises(HybridKVConfigError) as err:
        build_canonical_caches(
            {"model.layers.3.attn": t}, [_attn_group(("model.layers.3.attn",), 512)], 7
        )
    assert err.value.field == "kv_caches"
    assert "model.layers.3.attn" in str(err.value)
    assert "(16, 7, 2, 8)" in str(err.value)


def test_outer_dimension_other_than_kv_is_refused() -> None:
    base = torch.zeros(7, 16, 2, 8, dtype=torch.float16)  # (B, N, H, D)
    t = base.permute(1, 0, 2, 3).permute(1, 0, 2, 3)  # a no-op: accepted
    build_canonical_caches({"a": t}, [_attn_group(("a",), 512)], 7)
    inter = torch.zeros(3, 7, 2, 8, dtype=torch.float16).transpose(0, 1)  # (B, 3, ...) heads outer
    with pytest.raises(HybridKVConfigError, match="unrecognised KV cache layout"):
        build_canonical_caches({"a": inter}, [_attn_group(("a",), 96)], 7)


def test_wrong_real_page_is_refused() -> None:
    t = torch.zeros(2, 7, 16, 2, 8, dtype=torch.float16)
    with pytest.raises(HybridKVConfigError, match="real_page_size_bytes is 4096"):
        build_canonical_caches({"a": t}, [_attn_group(("a",), 4096)], 7)


def test_missing_layer_is_refused() -> None:
    with pytest.raises(HybridKVConfigError, match="no cache has it"):
        build_canonical_caches({}, [_attn_group(("a",), 1024)], 7)


def test_ambiguous_block_dimension_is_refused() -> None:
    t = torch.zeros(2, 2, 16, 2, 8, dtype=torch.float16)
    with pytest.raises(HybridKVConfigError, match="ambiguous"):
        build_canonical_caches({"a": t}, [_attn_group(("a",), 1024)], 2)


def test_tuple_in_attention_group_and_tensor_in_mamba_group_are_refused() -> None:
    raw = torch.zeros(7 * 64, dtype=torch.int8)
    states = mamba_states(raw, 7, 64, ((2, 4), torch.float16), ((2, 2), torch.float32))
    with pytest.raises(HybridKVConfigError, match="mamba group"):
        build_canonical_caches({"m": states}, [_attn_group(("m",), 32)], 7)
    mamba = CacheGroupSpec(GroupKind.MAMBA, 16, 64, 32, ("m",))
    with pytest.raises(HybridKVConfigError, match="tuple of state tensors"):
        build_canonical_caches({"m": torch.zeros(7, 32, dtype=torch.int8)}, [mamba], 7)
    assert build_canonical_caches({"m": states}, [mamba], 7).group_bytes(0) == 16 + 16


def test_vllm_033s_byte_view_of_a_mamba_layer_is_its_state_page() -> None:
    # vLLM 0.33's allocate_kv_cache views every layer as [B, H, N, C], a mamba layer as
    # (B, 1, 1, state bytes) over a padded page; the runner registers that view.
    raw = torch.arange(7 * 64, dtype=torch.int64).to(torch.int8)
    view = torch.as_strided(raw, (7, 1, 1, 32), (64, 32, 32, 1))
    mamba = CacheGroupSpec(GroupKind.MAMBA, 16, 64, 32, ("m",))
    caches = build_canonical_caches({"m": view}, [mamba], 7)
    assert caches.group_bytes(0) == 32
    assert [layer.layout for layer in caches.layers] == [LayoutKind.MAMBA_STATE]
    ref = caches.group_refs[0][0]
    row = caches.tensors[ref.tensor_index].view[3]
    got = torch.cat([row[r.offset : r.offset + r.length] for r in ref.runs])
    assert torch.equal(got, raw[3 * 64 : 3 * 64 + 32])


def test_kernel_ratio_must_divide_block_size() -> None:
    t = torch.zeros(2, 7 * 3, 5, 2, 8, dtype=torch.float16)  # 3 kernel blocks of 5 tokens
    with pytest.raises(HybridKVConfigError, match="do not divide block_size=16"):
        build_canonical_caches({"a": t}, [_attn_group(("a",), 2 * 3 * 160 * 2)], 7)


@pytest.mark.parametrize("bad", [0, -3, True, 2.0])
def test_bad_num_blocks(bad: object) -> None:
    with pytest.raises(HybridKVConfigError) as err:
        build_canonical_caches({}, [], bad)  # type: ignore[arg-type]
    assert err.value.field == "num_blocks"


def test_real_page_above_padded_page_is_refused() -> None:
    spec = CacheGroupSpec(GroupKind.FULL, 16, 100, 200, ("a",))
    with pytest.raises(HybridKVConfigError) as err:
        build_canonical_caches({}, [spec], 4)
    assert err.value.field == "groups[0].real_page_size_bytes"
