"""The eviction policies' own contract, called directly: what a policy promises any caller.

The store (hybridkv.store.HostStore) never asks a policy for zero victims and copies only
through its own ``copy``; the differential and stateful tests reach the policies through the
store. These call :class:`~hybridkv.store.LRUPolicy` and :class:`~hybridkv.store.ARCPolicy`
as a custom store or a test would (both are exported): ``victims(0, ...)`` is empty, and
``copy`` is a policy of the same capacity and order that shares nothing with the original.
They were written for the mutants mutmut left alive in ``tools/mutants.py``'s runs over
lru.py and arc.py (docs/explanation/mutations.md, "Whole modules under mutmut").
"""

from __future__ import annotations

import pytest

from hybridkv.store import ARCPolicy, HostStore, LRUPolicy, PrepareStoreOutput

A, B, C, D, E, X, Y, Z = (name.encode() for name in "abcdexyz")
POLICIES = [LRUPolicy, ARCPolicy]


def anything(key: bytes) -> bool:
    return True


@pytest.mark.parametrize("policy_type", POLICIES)
def test_no_victim_is_asked_for_none(policy_type: type[LRUPolicy | ARCPolicy]) -> None:
    policy = policy_type(3)
    for key in (A, B, C):
        policy.on_insert(key)
    assert policy.victims(0, anything, ()) == ()
    assert policy.victims(-1, anything, (D,)) == ()
    assert policy.victims(1, anything, ()) == (A,)


def test_a_copied_lru_keeps_capacity_and_order_and_shares_nothing() -> None:
    policy = LRUPolicy(3)
    for key in (A, B, C):
        policy.on_insert(key)
    policy.on_access(A, ready=True)
    twin = policy.copy()
    assert type(twin) is LRUPolicy
    assert (twin.capacity, twin.resident(), twin.ghosts()) == (3, (B, C, A), ())
    assert twin.snapshot() == policy.snapshot()
    twin.on_evict([B])
    twin.on_insert(D)
    assert policy.resident() == (B, C, A)
    assert twin.resident() == (C, A, D)
    assert twin.victims(2, anything, ()) == (C, A)


def test_a_copied_lru_store_evicts_on_its_own() -> None:
    store = HostStore(2, "lru")
    out = store.prepare_store([A, B])
    assert isinstance(out, PrepareStoreOutput)
    store.complete_store(out.keys_to_store, success=True)
    # Keys reach the policy tail first: a is the most recent, b the next victim.
    twin = store.copy()
    twin.touch([B])
    assert twin.prepare_store([C]) == PrepareStoreOutput((C,), (A,))
    assert store.prepare_store([D]) == PrepareStoreOutput((D,), (B,))


def arc_with_history() -> ARCPolicy:
    """T1 = [c], T2 = [b], B1 = [a], target 1 after a ghost hit on a."""
    policy = ARCPolicy(2)
    for key in (A, B):
        policy.on_insert(key)
    policy.on_access(B, ready=True)  # b: T1 -> T2
    policy.on_evict([A])  # a: T1 -> B1
    policy.on_insert(C)
    policy.on_miss(A)  # a B1 ghost hit: target 0 -> 1
    return policy


def test_a_copied_arc_keeps_lists_and_target_and_shares_nothing() -> None:
    policy = arc_with_history()
    assert policy.extra() == {
        "t1": (C.hex(),),
        "t2": (B.hex(),),
        "b1": (A.hex(),),
        "b2": (),
        "target": (1, 1),
    }
    twin = policy.copy()
    assert type(twin) is ARCPolicy
    assert twin.capacity == 2
    assert twin.snapshot() == policy.snapshot()
    twin.on_evict([B, C])  # b -> B2, c -> B1
    twin.on_miss(B)  # a B2 ghost hit: target 1 -> 0
    twin.on_insert(D)
    assert twin.extra() == {
        "t1": (D.hex(),),
        "t2": (),
        "b1": (A.hex(), C.hex()),
        "b2": (B.hex(),),
        "target": (0, 1),
    }
    assert policy.extra()["t1"] == (C.hex(),)
    assert policy.extra()["target"] == (1, 1)
    assert policy.snapshot() == arc_with_history().snapshot()


def arc_with_ghosts(capacity: int, b1: tuple[bytes, ...], b2: tuple[bytes, ...]) -> ARCPolicy:
    """An ARC policy whose only state is the ghost lists ``b1`` and ``b2`` (least recent first)."""
    policy = ARCPolicy(capacity)
    for key in b2:
        policy.on_insert(key)
        policy.on_access(key, ready=True)  # T1 -> T2, so that its eviction leaves a B2 ghost
    policy.on_evict(b2)
    for key in b1:
        policy.on_insert(key)
    policy.on_evict(b1)
    assert policy.ghosts() == (*b1, *b2)
    return policy


def target(policy: ARCPolicy) -> tuple[int, int]:
    numerator, denominator = policy.extra()["target"]
    return numerator, denominator


def test_a_b1_ghost_hit_raises_the_target_by_the_ghost_ratio_up_to_capacity() -> None:
    # |B1| = 2 < |B2| = 3: a B1 hit adds 3/2; the target never passes the capacity (4).
    policy = arc_with_ghosts(4, (A, B), (C, D, E))
    policy.on_miss(A)
    assert target(policy) == (3, 2)
    assert policy.extra()["b1"] == (B.hex(), A.hex())  # the ghost moved to its MRU end
    policy.on_miss(B)
    assert target(policy) == (3, 1)
    policy.on_miss(A)
    assert target(policy) == (4, 1)


def test_a_b1_ghost_hit_adds_one_when_b2_is_not_longer() -> None:
    for b2 in ((C, D), (C,)):
        policy = arc_with_ghosts(4, (A, B), b2)
        policy.on_miss(A)
        assert target(policy) == (1, 1)


def test_a_b2_ghost_hit_lowers_the_target_by_the_ghost_ratio_down_to_zero() -> None:
    # |B1| = 3 > |B2| = 1: a B2 hit takes 3 off; the target never goes below 0.
    policy = arc_with_ghosts(4, (A, B, C), (D,))
    for key in (A, B, C, A):
        policy.on_miss(key)
    assert target(policy) == (4, 1)
    policy.on_miss(D)
    assert target(policy) == (1, 1)
    assert policy.extra()["b2"] == (D.hex(),)
    policy.on_miss(D)
    assert target(policy) == (0, 1)


def test_a_b2_ghost_hit_takes_one_off_when_b1_is_not_longer() -> None:
    for b1 in ((A, B), (A,)):
        policy = arc_with_ghosts(4, b1, (C, D))
        for key in b1:
            policy.on_miss(key)
        before = target(policy)[0]
        policy.on_miss(C)
        assert target(policy) == (before - 1, 1)


def test_a_miss_that_is_no_ghost_changes_nothing() -> None:
    policy = arc_with_ghosts(4, (A,), (B,))
    before = policy.snapshot()
    policy.on_miss(C)
    assert policy.snapshot() == before


def test_a_b2_ghost_hit_steps_by_a_fraction() -> None:
    # |B1| = 3, |B2| = 2: each B1 hit adds 1 (B2 is shorter), the B2 hit takes 3/2 off.
    policy = arc_with_ghosts(5, (A, B, C), (D, E))
    for key in (A, B, C):
        policy.on_miss(key)
    assert target(policy) == (3, 1)
    policy.on_miss(D)
    assert target(policy) == (3, 2)


def test_arc_victims_compare_t1_with_the_floor_of_a_fractional_target() -> None:
    # Target 3/2 (the test above), T1 = [x], T2 = [y]: |T1| = 1 is at least floor(3/2), so T1
    # gives the victim (ARC's rule, module docstring); compared with 3/2 itself, T2 would.
    policy = arc_with_ghosts(5, (A, B, C), (D, E))
    for key in (A, B, C, D):
        policy.on_miss(key)
    assert target(policy) == (3, 2)
    policy.on_insert(X)
    policy.on_insert(Y)
    policy.on_access(Y, ready=True)
    assert policy.resident() == (X, Y)
    assert policy.victims(1, anything, ()) == (X,)
    assert policy.victims(2, anything, ()) == (X, Y)


def arc_before_three_ghost_hits() -> ARCPolicy:
    """B1 = [x, y, z], T1 = [a, c], T2 = [b], target 0, capacity 3."""
    policy = ARCPolicy(3)
    for key in (X, Y, Z):
        policy.on_insert(key)
    policy.on_evict([X, Y, Z])
    for key in (A, B):
        policy.on_insert(key)
    policy.on_access(B, ready=True)
    policy.on_insert(C)
    assert policy.resident() == (A, C, B)
    return policy


def test_arc_victims_follow_the_target_the_incoming_ghosts_would_set() -> None:
    policy = arc_before_three_ghost_hits()
    before = policy.snapshot()
    # Target 0: T1 (2 keys) is at least floor(p), so T1's least recent goes first.
    assert policy.victims(1, anything, ()) == (A,)
    # Three B1 ghosts coming back would raise p to 3 > |T1|: T2 goes first, then T1.
    assert policy.victims(1, anything, (X, Y, Z)) == (B,)
    assert policy.victims(3, anything, (X, Y, Z)) == (B, A, C)
    # Two ghosts raise p to 2: T1 gives one key, then has 1 < 2 left, so T2 gives the next.
    assert policy.victims(2, anything, (X, Y)) == (A, B)
    # One ghost raises p to 1: T1 gives one key and still has 1 >= 1, so it gives the next.
    assert policy.victims(2, anything, (X,)) == (A, C)
    # More victims asked than keys resident: every key, and no more.
    assert policy.victims(4, anything, ()) == (A, C, B)
    # No evictable key in T2: T1 after all.
    assert policy.victims(1, lambda key: key != B, (X, Y, Z)) == (A,)
    assert policy.snapshot() == before  # victims is pure


def test_arc_victims_count_t1_down_as_they_take_from_it() -> None:
    # T1 = [a, c, d], T2 = [b]; two B1 ghosts raise p to 2: T1 gives a (3 -> 2 left, still
    # >= 2), then c (1 left, below 2), then T2 gives b.
    policy = arc_before_three_ghost_hits()
    policy.on_insert(D)
    assert policy.victims(3, anything, (X, Y)) == (A, C, B)
