"""Simulated caches and content addressing: vLLM-shaped caches, and wrong data always visible."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridkv.canonical import LayoutKind, build_canonical_caches
from hybridkv.errors import HybridKVConfigError
from hybridkv.kinds import GroupKind
from hybridkv.testbed.caches import SimGroup, build_sim_caches
from hybridkv.testbed.content import BlockTags, ContentCodec, PrefixHashes, words

BS = 4
ROW = 8  # bfloat16 elements per token per plane: 16 bytes, two words
REAL_ATTN = 2 * BS * ROW * 2  # 128 bytes: K and V rows of 4 tokens
STATES = ((2, 6), (2, 3, 4))  # conv (bfloat16) and ssm (float32) per block: 24 + 96 bytes
PAGE = 160


def _groups() -> list[SimGroup]:
    mamba = SimGroup(
        GroupKind.MAMBA, BS, PAGE, 120, state_shapes=STATES, state_dtypes=("bfloat16", "float32")
    )
    full = SimGroup(GroupKind.FULL, BS, PAGE, REAL_ATTN)
    return [mamba, full]


def _codec(layers: int = 2) -> ContentCodec:
    return ContentCodec(build_sim_caches(_groups(), 6, layers))


def test_caches_overlay_groups_per_layer_slot_as_vllm_does() -> None:
    caches = build_sim_caches(_groups(), 6, layers_per_group=3)
    assert caches.nbytes == 3 * 6 * PAGE  # one buffer per slot, shared by both groups
    canonical = build_canonical_caches(caches.kv_caches, caches.groups, 6)
    assert len(canonical.tensors) == 3
    assert canonical.group_bytes(0) == 3 * 120
    assert canonical.group_bytes(1) == 3 * REAL_ATTN
    kinds = {layer.group: layer.layout for layer in canonical.layers}
    assert kinds == {0: LayoutKind.MAMBA_STATE, 1: LayoutKind.SPLIT_KV_KV_FIRST}


def test_rows_written_are_rows_checked() -> None:
    codec = _codec()
    hashes = PrefixHashes([7, 8, 9, 10, 11, 12])
    codec.write_rows(1, [3, 5], hashes, 0, 6)
    assert codec.check_rows(1, [3, 5], hashes, 0, 6) == 0
    assert codec.check_rows(1, [3, 5], hashes, 2, 5) == 0


def test_a_different_prefix_shows_from_the_first_differing_token() -> None:
    codec = _codec()
    codec.write_rows(1, [3, 5], PrefixHashes([7, 8, 9, 10, 11, 12]), 0, 6)
    other = PrefixHashes([7, 8, 9, 10, 99, 12])  # differs at position 4, in the second block
    assert codec.check_rows(1, [3, 5], other, 0, 4) == 0
    # Block 5 is wrong in K and V, in both layers.
    assert codec.check_rows(1, [3, 5], other, 4, 6) == 4


def test_rows_of_another_block_or_unwritten_rows_are_wrong() -> None:
    codec = _codec(layers=1)
    hashes = PrefixHashes(range(8))
    codec.write_rows(1, [3, 5], hashes, 0, 8)
    assert codec.check_rows(1, [5, 3], hashes, 0, 8) == 4  # swapped blocks: both, K and V
    assert codec.check_rows(1, [3, 4], hashes, 4, 8) == 2  # block 4 never written


def test_k_and_v_planes_and_layers_hold_different_words() -> None:
    h = torch.tensor([123], dtype=torch.int64)
    seen = {int(words(h, g, layer, plane)) for g in (0, 1) for layer in (0, 1) for plane in (0, 1)}
    assert len(seen) == 8


def test_a_state_is_the_state_of_exactly_its_position() -> None:
    codec = _codec()
    hashes = PrefixHashes([1, 2, 3, 4, 5, 6, 7, 8])
    codec.write_state(0, 2, hashes, 4)
    assert codec.check_state(0, 2, hashes, 4)
    assert not codec.check_state(0, 2, hashes, 8)  # a state of another length
    assert not codec.check_state(0, 3, hashes, 4)  # another block
    assert not codec.check_state(0, 2, PrefixHashes([1, 2, 3, 9]), 4)  # another prefix


def test_padding_and_the_other_group_are_untouched() -> None:
    caches = build_sim_caches(_groups(), 6, 1)
    codec = ContentCodec(caches)
    codec.write_state(0, 2, PrefixHashes([1, 2, 3, 4]), 4)
    page = caches.buffers[0][2 * PAGE : 3 * PAGE]
    assert bool((page[120:] == 0).all())  # padding
    assert bool((page[:120] != 0).any())


def test_wrong_kind_and_bad_arguments_are_named() -> None:
    codec = _codec()
    hashes = PrefixHashes([1, 2, 3, 4])
    with pytest.raises(HybridKVConfigError, match="mamba group"):
        codec.write_rows(0, [1], hashes, 0, 4)
    with pytest.raises(HybridKVConfigError, match="not a mamba group"):
        codec.write_state(1, 1, hashes, 4)
    with pytest.raises(HybridKVConfigError) as info:
        codec.write_state(0, 0, hashes, 4)
    assert info.value.field == "position"
    with pytest.raises(HybridKVConfigError) as info:
        codec.write_rows(1, [1, 2], hashes, 0, 6)
    assert info.value.field == "end"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"page_size_bytes": PAGE + 8}, "groups[1].page_size_bytes"),
        ({"real_page_size_bytes": 100}, "groups[1].real_page_size_bytes"),
        ({"attention_dtype": "float64x"}, "groups[1].attention_dtype"),
    ],
)
def test_bad_layouts_are_refused(change: dict[str, object], field: str) -> None:
    groups = _groups()
    groups[1] = dataclasses.replace(groups[1], **change)  # type: ignore[arg-type]
    with pytest.raises(HybridKVConfigError) as info:
        build_sim_caches(groups, 4)
    assert info.value.field == field


def test_states_that_do_not_fit_are_refused() -> None:
    too_big = SimGroup(GroupKind.MAMBA, BS, PAGE, 120, ((40,),), ("float32",))
    with pytest.raises(HybridKVConfigError) as info:
        build_sim_caches([too_big], 4)
    assert info.value.field == "groups[0].state_shapes"


def test_block_tags_name_the_bytes_wherever_they_travel() -> None:
    caches = build_sim_caches(_groups(), 6, 2)
    canonical = build_canonical_caches(caches.kv_caches, caches.groups, 6)
    tags = BlockTags(canonical)
    tags.write(1, 3, ("prefix", (1, 2, 3)))
    assert tags.read(1, 3) == ("prefix", (1, 2, 3))
    assert tags.read(1, 4, "none") == "none"  # never written
    assert tags.read(0, 3, "none") == "none"  # another group's bytes are not its tag
    for view in caches.planes[1][1]:  # a torn copy: one layer's K rows overwritten
        view[3].zero_()
        break
    assert tags.read(1, 3, "torn") == "torn"
