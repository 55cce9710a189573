"""The default chunk (hybridkv.default_chunk) and the one ``hybridkv plan`` recommends.

The default is the finest claim any whole-block chunk gives: checked against every multiple of
the hash block up to a bound, not only the candidates. ``hybridkv plan`` recommends the same
chunk on every preset, so what the plan prints is what the connector runs with.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.default_chunk import chunk_candidates, default_chunk_size, whole_block_planner
from hybridkv.kinds import GroupKind
from hybridkv.simulator.chunking import chunk_options, recommend
from spec.config_json import model_from_config
from spec.layout import LayoutSettings, derive_layout
from spec.presets import PRESETS, preset_config


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[list[tuple[GroupKind, int]], int, int]:
    h = draw(st.sampled_from([8, 16, 32]))
    kinds = draw(st.lists(st.sampled_from(list(GroupKind)), min_size=1, max_size=4))
    groups = [(k, h * draw(st.integers(1, 6))) for k in kinds]
    max_len = draw(st.integers(1, 4 * math.lcm(*(b for _, b in groups)) + 2))
    return groups, h, max_len


@given(_layouts())
def test_the_default_is_the_finest_whole_block_claim(
    layout: tuple[list[tuple[GroupKind, int]], int, int],
) -> None:
    groups, h, max_len = layout
    blocks = [b for _, b in groups]
    chunk = default_chunk_size(groups, h, max_len)
    # Every multiple of h up to lcm(blocks) (a whole-block chunk past it has a larger claim).
    whole = {
        c: p
        for c in range(h, math.lcm(*blocks) + 1, h)
        if (p := whole_block_planner(groups, h, c, max_len)) is not None
    }
    if chunk is None:
        assert not whole
        assert math.lcm(*blocks) + 1 > max_len
        return
    planner = whole_block_planner(groups, h, chunk, max_len)
    assert planner is not None
    assert planner.claim_unit == math.lcm(*blocks) == min(p.claim_unit for p in whole.values())
    finest = [c for c, p in whole.items() if p.claim_unit == planner.claim_unit]
    assert chunk == min(c for c in chunk_candidates(groups, h) if c in finest)


def test_the_smallest_whole_chunk_is_not_always_the_finest_claim() -> None:
    # Blocks 16 and 48: a 32-token chunk splits neither, but claims lcm(32, 16, 48) = 96;
    # 48 claims 48. The rule picks the claim, not the size.
    groups = [(GroupKind.SLIDING, 16), (GroupKind.FULL, 48)]
    assert whole_block_planner(groups, 16, 32, 4096) is not None
    assert default_chunk_size(groups, 16, 4096) == 48


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_plan_recommends_the_connector_default_on_every_preset(name: str) -> None:
    model = model_from_config(preset_config(name))
    settings = LayoutSettings(max_model_len=8192)
    layout = derive_layout(model, settings)
    groups = [(GroupKind(g.kind.value), g.block_size) for g in layout.groups]
    best = recommend(chunk_options(layout, settings.max_model_len))
    default = default_chunk_size(groups, layout.hash_block_size, settings.max_model_len)
    assert (best.chunk_size if best else None) == default
    if best is not None:
        assert best.whole_blocks
        assert best.claim_unit == math.lcm(*(b for _, b in groups))
