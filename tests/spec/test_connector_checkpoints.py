"""The reference connector's mamba prefill-checkpoint rule (spec.connector.checkpoints), by hand.

One mamba group of 4-token blocks and one full-attention group of 4, hash block 2. A step
computes ``[0, 13)``; the running state after 13 tokens lands in slot 3 (not a unit end, never
stored). Where the checkpoint goes, derived from vLLM 0.33's formulas:

- no export (``alignment=None``): nothing of the mamba group is stored;
- grid 4, no EAGLE: ``floor((13 - 1) / 4) * 4 = 12`` in slot ``ceil(13 / 4) - 2 = 2``, whose own
  end is 12: stored at 12 from slot 2;
- grid 4, EAGLE's drop: ``floor(13 / 4) * 4 - 4 = 8``, still in slot 2: stored at 8 from slot 2
  (keyed by its slot, the host would hold the state after 8 under the key of 12);
- grid 2, no EAGLE: ``floor(12 / 2) * 2 = 12``: stored at 12; with EAGLE ``12 - 2 = 10``, mid-block:
  not stored;
- lookahead 3, grid 4: ``floor((13 - 3) / 4) * 4 = 8``: stored at 8.
"""

from __future__ import annotations

import pytest

from spec.connector.checkpoints import NONE, CheckpointRule, StateAt, states_written
from spec.connector.geometry import Geometry
from spec.connector.stores import store_units
from spec.errors import ConfigError
from spec.kinds import GroupKind
from spec.planner import HybridOffloadPlanner

PLANNER = HybridOffloadPlanner(((GroupKind.MAMBA, 4), (GroupKind.FULL, 4)), 2, 4, 64)
TABLE = ((0, 0, 102, 103), (200, 201, 202, 203))


def _mamba_stores(rule: CheckpointRule) -> list[tuple[int, int]]:
    geometry = Geometry.build(PLANNER, (GroupKind.MAMBA, GroupKind.FULL), (), (rule, NONE))
    return [
        (ref.end, block) for ref, block in store_units(geometry, TABLE, 0, 13) if ref.group_idx == 0
    ]


@pytest.mark.parametrize(
    ("rule", "stored"),
    [
        (NONE, []),
        (CheckpointRule(1, 2, 4, False, 0), [(12, 102)]),
        (CheckpointRule(1, 2, 4, True, 0), [(8, 102)]),
        (CheckpointRule(1, 2, 2, False, 0), [(12, 102)]),
        (CheckpointRule(1, 2, 2, True, 0), []),
        (CheckpointRule(1, 2, 4, False, 3), [(8, 102)]),
    ],
)
def test_a_checkpoint_is_stored_under_the_position_it_holds(
    rule: CheckpointRule, stored: list[tuple[int, int]]
) -> None:
    assert _mamba_stores(rule) == stored


def test_the_step_must_span_the_checkpoint_slot() -> None:
    """EAGLE, grid 4: the checkpoint of a step ending at 13 is 8. [8, 13) starts there, so it
    exports none (vLLM wants ``start + hash_block <= 8``); [4, 13) starts a block earlier, its
    initial state in slot 0, and exports 8 into slot 2."""
    rule = CheckpointRule(1, 2, 4, True, 0)
    assert states_written(rule, 8, 13, 4) == (StateAt(3, 13),)
    assert states_written(rule, 4, 13, 4) == (StateAt(3, 13), StateAt(2, 8))


def test_a_step_ending_on_a_unit_stores_its_running_state_only() -> None:
    geometry = Geometry.build(PLANNER, (GroupKind.MAMBA, GroupKind.FULL), (), (NONE, NONE))
    table = ((100, 101, 102, 103), (200, 201, 202, 203))  # every slot real
    stored = [
        (ref.end, block) for ref, block in store_units(geometry, table, 2, 12) if ref.group_idx == 0
    ]
    assert stored == [(12, 102)]  # slots 0 and 1 hold states of earlier steps, not 4 or 8


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ((0, 2, 4, False, 0), "alignment"),
        ((None, 0, 4, False, 0), "hash_block_size"),
        ((None, 2, True, False, 0), "cache_hit_alignment"),
        ((None, 2, 4, 1, 0), "drop_eagle_block"),
        ((None, 2, 4, False, -1), "hash_lookahead"),
    ],
)
def test_a_bad_rule_is_refused_naming_its_field(fields: tuple, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        CheckpointRule(*fields)
    assert caught.value.field == field


def test_geometry_refuses_a_rule_count_that_is_not_one_per_group() -> None:
    with pytest.raises(ConfigError) as caught:
        Geometry.build(PLANNER, (GroupKind.MAMBA, GroupKind.FULL), (), (NONE,))
    assert caught.value.field == "checkpoints"
