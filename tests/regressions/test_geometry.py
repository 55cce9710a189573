"""Geometry: offload units, claim units and hash units of real hybrid layouts.

Scenario: the field's geometry bugs are about which token spans an offload tier can store and
restore for a layout vLLM derives. Each test derives the real layout of a preset
(``spec.layout`` on the checkpoint's config.json, the kernel facts of an H100), plans it with
``spec.planner`` (and the optimized ``hybridkv.planner``, which must agree), and checks what the
field got wrong. The broken variant is a planner snapshot with the bug's geometry; the PL-*
predicate that catches it is named. Every number is worked out in the comment beside it.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

import hybridkv.kinds
import hybridkv.planner
from spec.errors import ConfigError
from spec.invariants import check_all
from spec.kinds import GroupKind
from spec.layout import Layout, LayoutSettings, derive_layout, model_from_config
from spec.planner import HybridOffloadPlanner
from spec.presets import preset_config

MAX_LEN = 32768


def _layout(preset: str, mode: str = "align", max_len: int = MAX_LEN) -> Layout:
    model = model_from_config(preset_config(preset))
    return derive_layout(model, LayoutSettings(max_len, cache_mode=mode, platform="cuda-sm90"))


def _groups(lay: Layout) -> tuple[tuple[GroupKind, int], ...]:
    """One ``(kind, block)`` per distinct group kind, full attention first."""
    found = {(g.kind, g.block_size) for g in lay.groups}
    return tuple(sorted(found, key=lambda kb: (kb[0] is not GroupKind.FULL, kb[0].value)))


def _both(groups: tuple[tuple[GroupKind, int], ...], h: int, c: int, m: int) -> Any:
    """The reference planner, after checking the optimized one agrees on every field."""
    ref = HybridOffloadPlanner(groups, h, c, m)
    fast = hybridkv.planner.HybridOffloadPlanner(
        [(hybridkv.kinds.GroupKind(k.value), b) for k, b in groups], h, c, m
    )
    assert fast.snapshot() == ref.snapshot()
    assert check_all("planner", ref.snapshot()) == {}
    return ref


# --------------------------------------------------------------------------------------------
# #38230: the stock offload path needed the LCM of all group block sizes


def test_pl8_no_common_offload_block_of_every_group() -> None:
    """Scenario (#38230): Qwen3.5-27B. With prefix caching off (mamba mode ``none``) vLLM
    raises the attention block to 784 and gives mamba one block of max_model_len (32768). One
    offload block covering every group's blocks would be lcm(784, 32768) = 2^15 * 7^2 =
    1605632 tokens, 49x the longest request: nothing is ever stored. The planner refuses the
    geometry at start-up naming the fix; in align mode (block 832 for both kinds) it offloads
    each group in its own unit."""
    none = _layout("qwen3.5-27b", "none")
    assert _groups(none) == ((GroupKind.FULL, 784), (GroupKind.MAMBA, 32768))
    assert math.lcm(784, 32768) == 1605632
    with pytest.raises(ConfigError) as info:
        HybridOffloadPlanner(_groups(none), 16, 16, MAX_LEN)
    assert info.value.field == "max_model_len"
    assert "enable prefix caching" in str(info.value)

    align = _layout("qwen3.5-27b")
    assert _groups(align) == ((GroupKind.FULL, 832), (GroupKind.MAMBA, 832))
    # h 16, chunk 208 = 832 / 4: attention units of 208 (splittable), mamba its block (832);
    # claim unit lcm(208, 208, 832) = 832, the shortest prompt that can hit 833.
    p = _both(_groups(align), 16, 208, MAX_LEN)
    assert (p.units, p.splittable, p.claim_unit) == ((208, 832), (True, False), 832)

    # The stock geometry as a planner snapshot: one unit of lcm(784, 32768) tokens for every
    # group (the chunk), fields recounted consistently, except that no prompt can reach it.
    stock = {
        "groups": (("full", 784), ("mamba", 32768)),
        "hash_block_size": 16,
        "chunk_size": 1605632,
        "max_model_len": MAX_LEN,
        "units": (784, 32768),  # 1605632 does not divide 784: full keeps its block
        "hash_factors": (49, 2048),
        "splittable": (False, False),
        "first_storable_chunks": (0, 0),
        "claim_unit": 1605632,
        "shortest_hit_prompt": 1605633,
    }
    assert set(check_all("planner", stock)) == {"PL-8"}


# --------------------------------------------------------------------------------------------
# #54413: groups whose block is smaller than the hash unit are rejected


def test_pl1_hash_unit_divides_every_group_block() -> None:
    """Scenario (#54413): gpt-oss-20b, 12 sliding-window and 12 full-attention layers in 16-token
    blocks. A hash unit larger than a group's block (say 32, a chunk-sized hash) cannot key that
    group's blocks and the group was rejected. vLLM's contract makes the hash unit the gcd of
    the group blocks (16 here); the planner then keeps any group block smaller than the chunk
    as its own unit instead of refusing it."""
    lay = _layout("gpt-oss-20b", max_len=131072)
    assert _groups(lay) == ((GroupKind.FULL, 16), (GroupKind.SLIDING, 16))
    assert lay.hash_block_size == math.gcd(16, 16) == 16
    # Chunk 256: 256 does not divide 16, so both groups keep 16-token units; claim 256.
    p = _both(_groups(lay), 16, 256, 131072)
    assert (p.units, p.claim_unit, p.shortest_hit_prompt) == ((16, 16), 256, 257)

    with pytest.raises(ConfigError) as info:
        HybridOffloadPlanner(_groups(lay), 32, 256, 131072)
    assert info.value.field == "hash_block_size"
    assert "e.g. 16" in str(info.value)  # the fix: the gcd of the blocks
    broken = dict(p.snapshot(), hash_block_size=32, hash_factors=(0, 0))
    assert "PL-1" in check_all("planner", broken)


# --------------------------------------------------------------------------------------------
# #40696: no prefix caching below 528/784 tokens (attention raised to the mamba page size)


def test_pl2_no_hit_shorter_than_one_mamba_block() -> None:
    """Scenario (#40696): on Qwen3-Next-80B (align mode, H100) vLLM raises the attention block to
    576 so an attention page covers a GDN state page; the state exists every 576 tokens only.
    Splitting attention into small chunks does not help a mamba layout: a claim needs the state
    at its end, so the shortest prompt that hits is 577, whatever the chunk. Claiming the
    state at a chunk end inside the block (a 64-token mamba unit) restores a state that was
    never taken: PL-2. A layout without mamba (gpt-oss) hits from one chunk plus one token."""
    lay = _layout("qwen3-next-80b-a3b")
    assert _groups(lay) == ((GroupKind.FULL, 576), (GroupKind.MAMBA, 576))
    # Chunk 64 divides 576: attention units of 64; mamba 576; claim lcm(64, 64, 576) = 576.
    p = _both(_groups(lay), 16, 64, MAX_LEN)
    assert (p.units, p.claim_unit, p.shortest_hit_prompt) == ((64, 576), 576, 577)
    assert p.claimable_prefix_tokens(576) == 0  # the last token is always computed
    assert p.claimable_prefix_tokens(577) == 576

    fine = dict(p.snapshot(), units=(64, 64), hash_factors=(4, 4), claim_unit=64)
    fine["shortest_hit_prompt"] = 65
    fine["splittable"] = (True, True)
    assert "PL-2" in check_all("planner", fine)

    oss = _both(_groups(_layout("gpt-oss-20b", max_len=131072)), 16, 16, 131072)
    assert oss.shortest_hit_prompt == 17


# --------------------------------------------------------------------------------------------
# LMCache's hybrid mode: chunk a multiple of the unified block N


def test_pl7_chunk_need_not_be_a_multiple_of_the_unified_block() -> None:
    """Scenario (LMCache hybrid mode): with N = 832 (Qwen3.5-27B, align mode) LMCache demands a
    chunk that is a multiple of N and a step budget in [N, 2N). The planner takes any chunk
    that is a multiple of the hash unit: with chunk 16, attention is stored every 16 tokens and
    claims end at lcm(16, 16, 832) = 832, where the state is (the step budget is the mamba
    split's business: tests/regressions/test_wrong_output.py). Claiming at the chunk instead
    of the claim unit would claim positions with no state: PL-7."""
    lay = _layout("qwen3.5-27b")
    p = _both(_groups(lay), 16, 16, MAX_LEN)
    assert (p.units, p.hash_factors, p.claim_unit) == ((16, 832), (1, 52), 832)
    # Mamba's first storable chunk is the one ending at 832: 832 / 16 - 1 = 51.
    assert p.first_storable_chunks == (0, 51)

    at_chunk = dict(p.snapshot(), claim_unit=16, shortest_hit_prompt=17)
    assert set(check_all("planner", at_chunk)) == {"PL-7"}
