"""Issue 29 in the spec: async loads that fill the block pool (spec.scheduler.pool_model),
the admission rule (spec.connector.admission) and the liveness invariants SC-10..SC-12.

The claim rule before the admission rule (an async claim for every request) wedges exactly
where the arithmetic says it must; the admission rule wedges nowhere on the same grid, each
search exhaustive. tests/spec/test_explorer_mutations.py holds the shortest traces.
"""

from __future__ import annotations

import itertools

import pool_harness
import pytest

from spec.connector.admission import (
    Admission,
    AsyncClaim,
    GroupHold,
    HeldLoad,
    admit,
    blocks_to_run,
)
from spec.explorer import explore
from spec.invariants import ALL_INVARIANTS
from spec.kinds import GroupKind
from spec.scheduler.pool_model import ClaimRule, PoolModel, PoolScenario

GRID = [
    PoolScenario(requests=n, prefix_blocks=p, tail_blocks=t, fits=f, rule=rule, reserve_tails=r)
    for n, p, t, f, r in itertools.product(
        (2, 3, 4, 5), (1, 2, 3, 4), (1, 2, 3), (1, 2, 3), (False, True)
    )
    for rule in ClaimRule
]
DEPTH = 40  # past every run's end: each search below is exhaustive


def _found(scenario: PoolScenario) -> set[str]:
    result = explore(PoolModel(scenario), DEPTH, stop_at_first=False)
    assert result.exhaustive, scenario
    return {v.invariant_id for v in result.violations}


def _wedges(s: PoolScenario) -> bool:
    """Before the rule, with no reservation for tails, the first step admits as many loads as
    the pool holds prefixes (at most every request); they wedge when what is left is less
    than a tail. A reservation that counts the tails never admits that many."""
    if s.reserve_tails:
        return False
    loads = min(s.requests, s.capacity // s.prefix_blocks)
    return s.capacity - loads * s.prefix_blocks < s.tail_blocks


@pytest.mark.parametrize("scenario", [s for s in GRID if s.rule is ClaimRule.ADMISSION], ids=str)
def test_the_admission_rule_never_wedges(scenario: PoolScenario) -> None:
    assert _found(scenario) == set()


def test_the_claim_rule_before_admission_wedges_where_the_pool_says() -> None:
    """Every grid point of the old rule: SC-10, SC-11 and SC-12 found exactly where
    :func:`_wedges` predicts, on pools of one, two and three whole requests alike."""
    wedged = []
    for s in (s for s in GRID if s.rule is ClaimRule.EVERY):
        expected = {"SC-10", "SC-11", "SC-12"} if _wedges(s) else set()
        assert _found(s) == expected, s
        if expected:
            wedged.append(s.fits)
    assert sorted(set(wedged)) == [1, 2, 3]


def test_issue_29_in_small_wedges_before_the_rule_and_not_after() -> None:
    """The pool of three whole requests, four requests: the old rule's search finds SC-10
    (pool_harness.ISSUE_29); the rule's own, and vLLM's reservation if it counted the tails,
    do not."""
    assert "SC-10" in _found(pool_harness.ISSUE_29)
    assert _found(PoolScenario(requests=4, fits=3, rule=ClaimRule.ADMISSION)) == set()
    assert (
        _found(PoolScenario(requests=4, fits=3, rule=ClaimRule.EVERY, reserve_tails=True)) == set()
    )


def test_the_wedge_is_also_the_explorers_stuck_state() -> None:
    """SC-10 is the model's stuck id; the pool snapshot names the same ids the registry does."""
    assert PoolModel.stuck_invariant_id == "SC-10"
    assert {ALL_INVARIANTS[i].subject for i in ("SC-10", "SC-11", "SC-12")} == {"pool", "progress"}


# ----------------------------------------------------------------- the rule itself

PREFIX = tuple(f"h{i}".encode() for i in range(8))
OTHER = tuple(f"o{i}".encode() for i in range(8))


def test_a_request_waits_for_an_in_flight_load_of_its_prefix() -> None:
    claim = AsyncClaim("b", 0, 8, 5, PREFIX)
    loading = HeldLoad("a", True, 0, 4, 5, PREFIX)
    assert admit(claim, [loading], 100, 1) is Admission.DEFER_SHARED
    # Landed, it no longer shares (vLLM's GPU hit serves it); another prefix never shares.
    landed = HeldLoad("a", False, 0, 4, 5, PREFIX)
    assert admit(claim, [landed], 100, 1) is Admission.ADMIT
    assert admit(claim, [HeldLoad("a", True, 0, 4, 5, OTHER)], 100, 1) is Admission.ADMIT
    # Ranges that do not overlap share nothing.
    assert admit(AsyncClaim("b", 4, 8, 5, PREFIX), [loading], 100, 1) is Admission.ADMIT


def test_a_claim_waits_while_the_held_loads_leave_no_room_to_run() -> None:
    held = [HeldLoad("a", False, 0, 4, 6, OTHER), HeldLoad("c", True, 0, 4, 6, OTHER)]
    assert admit(AsyncClaim("b", 0, 4, 6, PREFIX), held, 18, 1) is Admission.ADMIT
    assert admit(AsyncClaim("b", 0, 4, 7, PREFIX), held, 18, 1) is Admission.DEFER_ROOM
    # Alone, a claim is never deferred for room (vLLM's start-up check fits one request);
    # its own earlier record is not another request.
    own = HeldLoad("b", True, 0, 4, 18, PREFIX)
    assert admit(AsyncClaim("b", 0, 4, 18, PREFIX), [own], 18, 1) is Admission.ADMIT
    assert Admission.DEFER_ROOM.defers
    assert not Admission.ADMIT.defers


def test_blocks_to_run_per_group_kind() -> None:
    full = GroupHold(GroupKind.FULL, 16)
    sliding = GroupHold(GroupKind.SLIDING, 16, reach=31)
    mamba = GroupHold(GroupKind.MAMBA, 16, states=2)
    # 100 tokens, 96 computed, chunks of 64: full 7 blocks; the window 31 + 4 -> 3 + 1; 2 states.
    assert blocks_to_run((full,), 100, 96, 64) == 7
    assert blocks_to_run((sliding,), 100, 96, 64) == 4
    assert blocks_to_run((mamba,), 100, 96, 64) == 2
    # Never more than the sequence's own blocks.
    assert blocks_to_run((sliding, mamba), 10, 0, 64) == 2
