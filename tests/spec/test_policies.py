"""Unit tests of the eviction policies, driven through the policy protocol.

Every expected list and target below is worked out by hand from the rules in the policy
module docstrings (vLLM 0.33's LRU and ARC), step by step in the comments.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from spec.errors import ConfigError
from spec.policies import POLICY_NAMES, ARCPolicy, LRUPolicy, make_policy

A, B, C, D, E, X, Y = (name.encode() for name in "abcdexy")


def _all(_key: bytes) -> bool:
    return True


def test_make_policy_knows_lru_and_arc_and_names_the_field_otherwise() -> None:
    assert POLICY_NAMES == ("lru", "arc")
    assert isinstance(make_policy("lru", 3), LRUPolicy)
    assert isinstance(make_policy("arc", 3), ARCPolicy)
    with pytest.raises(ConfigError) as err:
        make_policy("fifo", 3)
    assert err.value.field == "cache_policy"


# --- LRU ---


def test_lru_orders_by_last_insert_or_access() -> None:
    lru = LRUPolicy(4)
    for key in (A, B, C):
        lru.on_insert(key)
    lru.on_access(A, ready=True)  # a becomes most recent: b, c, a
    assert lru.resident() == (B, C, A)
    lru.on_access(B, ready=False)  # STORING or not, LRU refreshes: c, a, b
    assert lru.resident() == (C, A, B)


def test_lru_victims_are_least_recent_evictable_and_choosing_changes_nothing() -> None:
    lru = LRUPolicy(4)
    for key in (A, B, C, D):
        lru.on_insert(key)
    assert lru.victims(2, _all, ()) == (A, B)
    assert lru.victims(2, lambda key: key != A, ()) == (B, C)  # a pinned: skipped
    assert lru.victims(3, lambda key: key in (A, D), ()) == (A, D)  # only two evictable
    assert lru.victims(0, _all, ()) == ()
    assert lru.resident() == (A, B, C, D)  # victims is pure


def test_lru_evict_and_remove_forget_the_key() -> None:
    lru = LRUPolicy(3)
    for key in (A, B, C):
        lru.on_insert(key)
    lru.on_evict((A,))
    lru.on_remove(C)
    lru.on_miss(A)  # no history: nothing happens
    assert lru.resident() == (B,)
    assert lru.ghosts() == ()


def test_lru_copy_is_independent() -> None:
    lru = LRUPolicy(3)
    lru.on_insert(A)
    twin = lru.copy()
    twin.on_insert(B)
    assert lru.resident() == (A,)
    assert twin.resident() == (A, B)


# --- ARC ---


def _arc_with_ghosts() -> ARCPolicy:
    """capacity 5; B1 = [a, b], B2 = [c, d, e], T1 = T2 = [], p = 0."""
    arc = ARCPolicy(5)
    for key in (A, B, C, D, E):
        arc.on_insert(key)  # T1 = [a, b, c, d, e]
    for key in (C, D, E):
        arc.on_access(key, ready=True)  # T1 = [a, b], T2 = [c, d, e]
    arc.on_evict((A, B))
    arc.on_evict((C, D, E))
    return arc


def test_arc_eviction_sends_t1_to_b1_and_t2_to_b2() -> None:
    arc = _arc_with_ghosts()
    extra = arc.extra()
    assert extra["b1"] == (A.hex(), B.hex())
    assert extra["b2"] == (C.hex(), D.hex(), E.hex())
    assert arc.resident() == ()
    assert arc.ghosts() == (A, B, C, D, E)


def test_arc_ghost_hits_adapt_p_by_the_ghost_size_ratio() -> None:
    arc = _arc_with_ghosts()
    # B1 hit: p += max(1, |B2|/|B1|) = max(1, 3/2) = 3/2.
    arc.on_miss(A)
    assert arc.target == Fraction(3, 2)
    assert arc.extra()["target"] == (3, 2)
    assert arc.extra()["b1"] == (B.hex(), A.hex())  # the ghost moved to B1's recent end
    # B2 hit: p -= max(1, |B1|/|B2|) = max(1, 2/3) = 1 -> 1/2.
    arc.on_miss(C)
    assert arc.target == Fraction(1, 2)
    # A second B2 hit would go to -1/2: p is clamped at 0.
    arc.on_miss(D)
    assert arc.target == 0
    # A plain miss (never seen) changes nothing.
    arc.on_miss(X)
    assert arc.target == 0


def test_arc_p_is_clamped_at_capacity() -> None:
    arc = ARCPolicy(2)
    for key in (A, B):
        arc.on_insert(key)
    arc.on_access(B, ready=True)  # T1 = [a], T2 = [b]
    arc.on_evict((A, B))  # B1 = [a], B2 = [b]
    arc.on_miss(A)  # p = 0 + max(1, 1/1) = 1
    arc.on_miss(A)  # 2
    arc.on_miss(A)  # 3, clamped to capacity 2
    assert arc.target == 2


def test_arc_picks_t1_when_t1_size_reaches_floor_of_p() -> None:
    arc = _arc_with_ghosts()
    arc.on_miss(A)  # p = 3/2
    arc.on_insert(X)  # T1 = [x]
    arc.on_insert(Y)
    arc.on_access(Y, ready=True)  # T1 = [x], T2 = [y]
    # |T1| = 1 >= floor(3/2) = 1: vLLM evicts from T1 (the paper's |T1| > p would take y).
    assert arc.victims(1, _all, ()) == (X,)
    # Then |T1| = 0 < 1, so the second victim comes from T2.
    assert arc.victims(2, _all, ()) == (X, Y)
    # x unevictable: T1 has none left, fall back to T2.
    assert arc.victims(1, lambda key: key != X, ()) == (Y,)


def test_arc_victims_use_p_adapted_to_the_incoming_keys_without_changing_it() -> None:
    arc = _arc_with_ghosts()
    arc.on_miss(A)  # p = 3/2, B1 = [b, a], B2 = [c, d, e]
    arc.on_insert(X)
    arc.on_insert(Y)
    arc.on_access(Y, ready=True)  # T1 = [x], T2 = [y]
    # Offering b (B1 hit) first: p' = 3/2 + max(1, 3/2) = 3, |T1| = 1 < 3 -> T2's y.
    assert arc.victims(1, _all, (B,)) == (Y,)
    # Offering c (B2 hit) first: p' = 3/2 - max(1, 2/3) = 1/2, floor 0 -> T1's x.
    assert arc.victims(1, _all, (C,)) == (X,)
    assert arc.target == Fraction(3, 2)  # victims is pure
    assert arc.extra()["b1"] == (B.hex(), A.hex())


def test_arc_access_promotes_ready_keys_only() -> None:
    arc = ARCPolicy(4)
    for key in (A, B, C):
        arc.on_insert(key)  # T1 = [a, b, c]
    arc.on_access(A, ready=False)  # STORING: stays in T1, most recent: [b, c, a]
    arc.on_access(B, ready=True)  # T1 = [c, a], T2 = [b]
    arc.on_access(C, ready=True)  # T1 = [a], T2 = [b, c]
    arc.on_access(B, ready=True)  # T2 refresh: [c, b]
    extra = arc.extra()
    assert extra["t1"] == (A.hex(),)
    assert extra["t2"] == (C.hex(), B.hex())
    assert arc.resident() == (A, C, B)


def test_arc_insert_clears_ghosts_and_remove_leaves_none() -> None:
    arc = _arc_with_ghosts()
    arc.on_insert(A)  # a back from B1
    arc.on_insert(C)  # c back from B2
    assert arc.ghosts() == (B, D, E)
    arc.on_remove(A)  # a failed store: gone without a ghost
    assert arc.resident() == (C,)
    assert arc.ghosts() == (B, D, E)


def test_arc_trims_each_ghost_list_to_capacity() -> None:
    arc = ARCPolicy(2)
    for key in (A, B, C):
        arc.on_insert(key)
    arc.on_evict((A, B, C))  # B1 = [a, b, c] -> cut to the 2 most recent
    assert arc.ghosts() == (B, C)


def test_arc_copy_is_independent() -> None:
    arc = _arc_with_ghosts()
    twin = arc.copy()
    twin.on_miss(A)
    twin.on_insert(X)
    assert arc.target == 0
    assert arc.resident() == ()
    assert twin.resident() == (X,)
    assert twin.target == Fraction(3, 2)
