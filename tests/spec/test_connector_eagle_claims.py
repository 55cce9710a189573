"""The claim rule under EAGLE's block drop, on hand-computed stores.

Geometry: FULL block 2 + MAMBA block 2, hash block 2, chunk 2, so every offload unit is 2 tokens
and a claim may end on any even token. With group 0 an EAGLE group, a claim ending at ``t`` also
needs the full-attention unit ``[t, t + 2)`` READY (its proof, read and never loaded) and that
unit must be one of the request's full units; the mamba group never carries a proof.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from connector_harness import FULL, MAMBA, Harness, key, view

from spec.connector import ReferenceConnector, ReferenceWorker
from spec.connector.claims import ClaimDecision, claim_candidates, claim_keys, decide_claim
from spec.connector.geometry import Geometry
from spec.connector_api import Claim, ClaimKind
from spec.errors import ConfigError
from spec.hashing import request_block_hashes
from spec.planner import HybridOffloadPlanner
from spec.store import HostStore, LookupResult

PLANNER = HybridOffloadPlanner(((FULL, 2), (MAMBA, 2)), 2, 2, 64)
PLAIN = Geometry.build(PLANNER, (FULL, MAMBA))
EAGLE = Geometry.build(PLANNER, (FULL, MAMBA), eagle_groups=(0, 1))
A10 = tuple(range(1, 11))
HIT, PENDING, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS


def _status(present: dict[bytes, LookupResult]) -> Callable[[bytes], LookupResult]:
    return lambda k: present.get(k, MISS)


def _a_stored(*, full_up_to: int, states: tuple[int, ...]) -> dict[bytes, LookupResult]:
    """A10's full-attention units ending at 2..``full_up_to`` and its states at ``states``."""
    present = {key(A10, end, 0): HIT for end in range(2, full_up_to + 1, 2)}
    present.update({key(A10, end, 1): HIT for end in states})
    return present


def _decide(
    geometry: Geometry, present: dict[bytes, LookupResult], failed: tuple[bytes, ...] = ()
) -> ClaimDecision:
    hashes = request_block_hashes(A10, 2)
    return decide_claim(geometry, hashes, 10, 0, status=_status(present), failed=failed)


def test_a_mamba_group_named_eagle_carries_no_proof() -> None:
    assert EAGLE.eagle == (True, False)
    assert EAGLE.proof_groups == (0,)
    assert EAGLE.proof_unit(1, 4) is None
    assert PLAIN.proof_unit(0, 4) is None
    ref = EAGLE.proof_unit(0, 4)
    assert ref is not None
    assert (ref.index, ref.end) == (2, 6)  # the unit [4, 6)


def test_the_proof_is_the_unit_after_the_claim_and_only_read() -> None:
    hashes = request_block_hashes(A10, 2)
    assert claim_keys(PLAIN, hashes, 0, 4) == (key(A10, 2, 0), key(A10, 4, 0), key(A10, 4, 1))
    assert claim_keys(EAGLE, hashes, 0, 4) == (*claim_keys(PLAIN, hashes, 0, 4), key(A10, 6, 0))


def test_the_proof_unit_must_be_one_of_the_request_s_full_units() -> None:
    # 10 tokens: the claimable prefix is 8 and [8, 10) is a full unit; 9 tokens: it is not.
    assert list(claim_candidates(EAGLE, 0, 10)) == [8, 6, 4, 2]
    assert list(claim_candidates(PLAIN, 0, 9)) == [8, 6, 4, 2]
    assert list(claim_candidates(EAGLE, 0, 9)) == [6, 4, 2]
    assert list(claim_candidates(EAGLE, 0, 3)) == []


def test_a_claim_ends_one_unit_below_the_last_stored_unit() -> None:
    # Units up to 8 and every state: the plain rule claims 8; at 8 the proof [8, 10) is absent.
    present = _a_stored(full_up_to=8, states=(2, 4, 6, 8))
    assert _decide(PLAIN, present) == ClaimDecision(8, False)
    assert _decide(EAGLE, present) == ClaimDecision(6, False)
    present[key(A10, 10, 0)] = HIT
    assert _decide(EAGLE, present) == ClaimDecision(8, False)


def test_a_storing_proof_defers_and_a_failed_one_counts_as_absent() -> None:
    present = _a_stored(full_up_to=8, states=(2, 4, 6, 8))
    present[key(A10, 10, 0)] = PENDING
    assert _decide(EAGLE, present) == ClaimDecision(0, True)
    present[key(A10, 10, 0)] = HIT
    assert _decide(EAGLE, present, failed=(key(A10, 10, 0),)) == ClaimDecision(6, False)


def test_bad_eagle_groups_are_refused_by_field() -> None:
    for bad in ((2,), (-1,), (True,), ("0",)):
        with pytest.raises(ConfigError) as caught:
            Geometry.build(PLANNER, (FULL, MAMBA), eagle_groups=bad)  # type: ignore[arg-type]
        assert caught.value.field == "eagle_groups"


def test_a_request_diverging_at_a_unit_boundary_loads_one_unit_less() -> None:
    # vLLM's own cache, for B = A's first 8 tokens and a new tail, serves 6 tokens under EAGLE:
    # the block [6, 8) is a hit only with the block after it, and B's [8, 10) is not A's.
    for eagle_groups, expected in (((), 8), ((0,), 6)):
        connector = ReferenceConnector(
            PLANNER, HostStore(32), (FULL, MAMBA), 2, 2, eagle_groups=eagle_groups
        )
        h = Harness(connector, ReferenceWorker())
        full_table = (1, 2, 3, 4, 5)
        mamba_table = (11, 12, 13, 14, 15)
        for done in range(0, 10, 2):  # one unit a step: a state at every unit end
            h.store_all(((view("A", A10), (full_table, mamba_table), done, 2),))
        b = view("B", (*A10[:8], 99, 98))
        assert connector.get_num_new_matched_tokens(b, 0) == Claim(ClaimKind.ASYNC, expected)
        tables = ((21, 22, 23, 24, 25), (31, 32, 33, 34, 35))
        connector.update_state_after_alloc(b, tables, expected)
        h.step()
        loaded = [(i.group_idx, i.end_token) for job in h.meta.load_jobs for i in job.items]
        # The claim loads [0, expected) and the state there, never its proof unit.
        assert max(end for _, end in loaded) == expected
        assert (1, expected) in loaded
