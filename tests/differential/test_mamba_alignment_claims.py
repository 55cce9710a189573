"""A connector claim with a mamba group ends on the alignment, even past the mamba block.

The connector's side of the mamba rule that ``tests/spec/test_coordinator.py`` checks on the
GPU cache: a claim may end only where every group can resume, a multiple of the alignment
(``lcm`` of the planner's claim unit and the scheduler block). With full attention blocks of 4
and mamba blocks of 2, the scheduler block is 4, larger than the mamba block: the host holds a
mamba state after 6 tokens, yet the claim stops at 4, the last aligned end whose state is
there. Both connectors (the spec's reference and the optimized core) must answer so; the
answers are derived by hand.
"""

from __future__ import annotations

import pytest

from hybridkv.simulator import engine_adapter
from spec.connector import ReferenceConnector
from spec.connector_api import Claim, ClaimKind, RequestId, RequestView
from spec.kinds import GroupKind
from spec.managers.group_spec import GroupSpec
from spec.planner import HybridOffloadPlanner
from spec.store import HostStore

HASH = CHUNK = 2
TOKENS = tuple(range(1, 11))  # 10 tokens: at most 8 are claimable (the last is computed)


def connectors(groups: tuple[GroupSpec, ...]) -> list[object]:
    planner = HybridOffloadPlanner(tuple((g.kind, g.block_size) for g in groups), HASH, CHUNK, 64)
    kinds = tuple(g.kind for g in groups)
    reference = ReferenceConnector(planner, HostStore(32, "lru"), kinds, HASH, CHUNK)
    core = engine_adapter.build_core(
        groups, hash_block_size=HASH, chunk_size=CHUNK, max_model_len=64, store_capacity=32
    )
    return [reference, core]


def claim_after_seeding(connector: object, full_tokens: int, mamba_tokens: int) -> Claim:
    seeder = RequestView(RequestId("x"), TOKENS, len(TOKENS))
    connector.seed(seeder, full_tokens, (0,))  # type: ignore[attr-defined]
    connector.seed(seeder, mamba_tokens, (1,))  # type: ignore[attr-defined]
    asker = RequestView(RequestId("y"), TOKENS, len(TOKENS))
    return connector.get_num_new_matched_tokens(asker, 0)  # type: ignore[attr-defined, no-any-return]


@pytest.mark.parametrize("side", ["reference", "optimized"])
def test_a_mamba_state_past_the_last_aligned_end_is_not_claimed(side: str) -> None:
    groups = (GroupSpec(GroupKind.FULL, 4), GroupSpec(GroupKind.MAMBA, 2))
    connector = connectors(groups)[side == "optimized"]
    # Full attention up to 8 tokens; mamba states after 2, 4 and 6 (not 8). Candidates, largest
    # first: 8 needs the state after 8 (absent); 4 has all it needs. 6 is not a candidate.
    assert claim_after_seeding(connector, 8, 6) == Claim(ClaimKind.ASYNC, 4)


@pytest.mark.parametrize("side", ["reference", "optimized"])
def test_at_an_alignment_equal_to_the_mamba_block_the_same_host_gives_6(side: str) -> None:
    # The guard: full attention blocks of 2 make the alignment 2, and the state after 6 counts.
    groups = (GroupSpec(GroupKind.FULL, 2), GroupSpec(GroupKind.MAMBA, 2))
    connector = connectors(groups)[side == "optimized"]
    assert claim_after_seeding(connector, 8, 6) == Claim(ClaimKind.ASYNC, 6)
