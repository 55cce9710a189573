"""Both sides refresh an announced claim at the same asks, in the same order.

Each answer of a claim refreshes the keys its load would read, head most recent
(``hybridkv.connector.ConnectorCore._refresh_claim``,
``spec.connector.ReferenceConnector.get_num_new_matched_tokens``). The random traces of
``test_connector_agreement`` rarely ask one claim again after other stores, so this scripted
trace does so at several capacities and reservation counts, then asks another claim of the
same request, and compares both sides' whole snapshots (the host's policy order included)
after every call.
"""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.simulator import engine_adapter
from spec.connector import ReferenceConnector
from spec.connector_api import ClaimKind, RequestId, RequestView
from spec.kinds import GroupKind
from spec.managers.group_spec import GroupSpec
from spec.planner import HybridOffloadPlanner
from spec.store import HostStore as SpecStore

GROUPS = (GroupSpec(GroupKind.FULL, 2), GroupSpec(GroupKind.MAMBA, 2))
MAX_MODEL_LEN = 64
WAITING = RequestView(RequestId("A"), (1, 2, 3, 4, 5, 6, 7), 7)  # 6 seeded: 6 keys, claim 6


def _sides(capacity: int, policy: str) -> tuple[Any, Any]:
    planner = HybridOffloadPlanner(
        tuple((g.kind, g.block_size) for g in GROUPS), 2, 2, MAX_MODEL_LEN
    )
    reference = ReferenceConnector(
        planner, SpecStore(capacity, policy), tuple(g.kind for g in GROUPS), 2, 2
    )
    core = engine_adapter.build_core(
        GROUPS,
        hash_block_size=2,
        chunk_size=2,
        max_model_len=MAX_MODEL_LEN,
        store_capacity=capacity,
        policy=policy,
    )
    return reference, core


def _other(round_no: int, keys: int) -> RequestView:
    """A prompt of ``keys`` full-attention units nobody else shares (seeded full group only)."""
    first = 100 * (round_no + 1)
    tokens = tuple(range(first, first + 2 * keys + 1))
    return RequestView(RequestId(f"other-{round_no}"), tokens, len(tokens))


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("capacity", [8, 12, 16])
def test_both_sides_refresh_a_claim_asked_again_alike(policy: str, capacity: int) -> None:
    for reserved in range(capacity - 6 + 1):
        sides = _sides(capacity, policy)
        for side in sides:
            assert side.seed(WAITING, 6, ()) == 6
        # Asked from 0 twice, then from 2 (as after a GPU hit of one block): another claim,
        # walked whatever was reserved, then asked again the same.
        for round_no, start in enumerate((0, 0, 2, 2)):
            claims = [side.get_num_new_matched_tokens(WAITING, start) for side in sides]
            assert claims[0] == claims[1]
            assert claims[0].kind is ClaimKind.ASYNC
            assert claims[0].num_tokens == 6 - start
            assert sides[0].snapshot() == sides[1].snapshot(), (reserved, round_no)
            if reserved:
                # New keys, the most recent: whether the next ask walks the claim again shows
                # in the order, and the count crosses a quarter of the capacity at some round.
                other = _other(round_no, reserved)
                seeded = [side.seed(other, 2 * reserved, (0,)) for side in sides]
                assert seeded[0] == seeded[1] == reserved
                assert sides[0].snapshot() == sides[1].snapshot(), (reserved, round_no)
