""":func:`hybridkv.connector.claims.decide_claim` against the rule of its module docstring,
computed plainly, on random stores: same end, same DEFER, and each unit looked up O(1) times.

The plain rule walks every aligned candidate ``t`` down from the claimable limit and asks every
needed key of every group (:meth:`ConnectorGeometry.first_needed`); the largest *hopeful*
candidate (no needed key absent or failed) is claimed when all its keys are READY, deferred when
one is STORING. The fast search jumps below an absent key and remembers the units it found
hopeful per group; these tests check its jumps and its memory on layouts whose units, blocks and
windows differ, including claim alignments larger than the claim unit and one of a single token.
They run in well under a second, the fast check ``tools/mutants.py`` gives the module beside the
differential machine (tests/differential/test_connector_agreement.py, which compares the whole
core with the spec's).
"""

from __future__ import annotations

import functools
import random
from collections import Counter
from collections.abc import Callable

import pytest

from hybridkv.connector import ConnectorGeometry
from hybridkv.connector.claims import ClaimDecision, decide_claim, some_group_passes
from hybridkv.kinds import GroupKind
from hybridkv.planner import HybridOffloadPlanner
from hybridkv.store import LookupResult

FULL, SLIDING, MAMBA = GroupKind.FULL, GroupKind.SLIDING, GroupKind.MAMBA
HIT, PENDING, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS

# name -> (groups (kind, block), hash block, chunk, sliding reaches or ())
LAYOUTS = {
    "full4+mamba8": (((FULL, 4), (MAMBA, 8)), 4, 8, ()),
    "full4+sliding4": (((FULL, 4), (SLIDING, 4)), 4, 4, (0, 9)),
    "mamba+sliding+full": (((MAMBA, 4), (SLIDING, 4), (FULL, 4)), 4, 8, (0, 13, 0)),
    # Two sliding groups: the first one scanned (the wider window) is asked again at lower
    # candidates whenever the second finds a hole, so its memory of hopeful units is used.
    "sliding13+sliding9+full": (((SLIDING, 4), (SLIDING, 4), (FULL, 4)), 4, 4, (13, 9, 0)),
    "two-full-aligned-12": (((FULL, 4), (FULL, 6)), 2, 12, ()),
    # Chunks smaller than the blocks: claim unit 4 or 8, but claims end on the scheduler's
    # block (16 or 8), so the claimable limit is rounded down to the alignment.
    "full16+mamba8-chunk4": (((FULL, 16), (MAMBA, 8)), 4, 4, ()),
    "full8+sliding8-chunk4": (((FULL, 8), (SLIDING, 8)), 4, 4, (0, 11)),
    # Blocks and chunks of one token: every token is a candidate end (align 1), so the
    # lowest candidate past an answer is the token right after it, not a block away.
    "full1+mamba1-align1": (((FULL, 1), (MAMBA, 1)), 1, 1, ()),
}
MAX_LEN = 96


def _geometry(name: str, eagle: bool = False) -> ConnectorGeometry:
    """``eagle``: every group is one vLLM drops EAGLE's block from (vLLM's fallback when no
    group is marked); the attention groups then need a proof unit past a claim."""
    groups, hbs, chunk, reaches = LAYOUTS[name]
    planner = HybridOffloadPlanner(groups, hbs, chunk, MAX_LEN)
    eagle_groups = tuple(range(len(groups))) if eagle else ()
    return ConnectorGeometry.build(planner, tuple(k for k, _ in groups), reaches, (), eagle_groups)


def _proof(geometry: ConnectorGeometry, g: int) -> int:
    """Units past a claim end group ``g`` needs stored: one for an EAGLE attention group."""
    return int(bool(geometry.proofs[g]) and geometry.kinds[g] is not MAMBA)


def _key(g: int, j: int) -> bytes:
    return f"{g}:{j}".encode()


def _plain(
    geometry: ConnectorGeometry,
    num_tokens: int,
    start: int,
    *,
    status: Callable[[bytes], LookupResult],
    failed: set[bytes],
    groups: tuple[int, ...],
) -> ClaimDecision:
    align = geometry.align
    limit = geometry.planner.claimable_prefix_tokens(num_tokens)
    for g, u in enumerate(geometry.units):
        if _proof(geometry, g):  # the proof unit is one of the request's full units
            limit = min(limit, (num_tokens // u - 1) * u)
    limit = max(0, limit) // align * align
    for t in range(limit, start, -align):
        if t % align:
            continue
        verdicts = [
            MISS if _key(g, j) in failed else status(_key(g, j))
            for g in groups
            for j in range(
                geometry.first_needed(g, start, t), t // geometry.units[g] + _proof(geometry, g)
            )
        ]
        if MISS in verdicts:
            continue  # not hopeful
        if all(v is HIT for v in verdicts):
            return ClaimDecision(t, False)
        return ClaimDecision(start, True)  # the largest hopeful candidate has a STORING key
    return ClaimDecision(start, False)


def _status_in(store: dict[bytes, LookupResult], key: bytes) -> LookupResult:
    return store.get(key, MISS)


def _random_store(rng: random.Random, geometry: ConnectorGeometry) -> dict[bytes, LookupResult]:
    dense = rng.random()  # some stores nearly full, some nearly empty
    pending = rng.random() * 0.3
    store = {}
    for g, u in enumerate(geometry.units):
        for j in range(MAX_LEN // u):
            if rng.random() < dense:
                store[_key(g, j)] = PENDING if rng.random() < pending else HIT
    return store


@pytest.mark.parametrize("eagle", [False, True], ids=["plain", "eagle"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_search_answers_the_plain_rule_on_random_stores(name: str, eagle: bool) -> None:
    geometry = _geometry(name, eagle)
    rng = random.Random(name)
    pass_read = random.Random(f"{name}/read")  # its own stream: the stores stay as they were
    answers: Counter[str] = Counter()
    for _ in range(400):
        store = _random_store(rng, geometry)
        failed = {k for k in store if rng.random() < 0.04}
        num_tokens = rng.randrange(0, MAX_LEN + 1)
        start = rng.randrange(0, max(1, num_tokens)) // geometry.scheduler_block
        start *= geometry.scheduler_block
        asked: Counter[bytes] = Counter()
        in_order: list[bytes] = []

        def status(
            key: bytes,
            store: dict[bytes, LookupResult] = store,
            asked: Counter[bytes] = asked,
            in_order: list[bytes] = in_order,
        ) -> LookupResult:
            asked[key] += 1
            in_order.append(key)
            return store.get(key, MISS)

        groups = geometry.scan_order
        if rng.random() < 0.3:  # a per-group look (the metric): other groups taken as READY
            groups = (rng.randrange(len(geometry.kinds)),)
        # ``read`` (the core's claim memo) gets every key whose status was read, in order; a
        # list already holding keys is appended to, not replaced.
        read = [b"before"] if pass_read.random() < 0.5 else None
        got = decide_claim(
            geometry,
            _key,
            num_tokens,
            start,
            status=status,
            failed=failed,
            groups=None if len(groups) > 1 else groups,
            read=read,
        )
        if read is not None:
            assert read == [b"before", *in_order]
        expected = _plain(
            geometry,
            num_tokens,
            start,
            status=functools.partial(_status_in, store),
            failed=failed,
            groups=groups,
        )
        assert got == expected
        assert type(got.end) is int
        # Each unit is asked at most once per call (module docstring: O(1) look-ups per unit).
        assert max(asked.values(), default=0) <= 1
        answers["defer" if got.defer else "claim" if got.end > start else "none"] += 1
    # The proof unit makes claims rarer on random stores: each answer still seen often.
    assert min(answers[a] for a in ("defer", "claim", "none")) >= (10 if eagle else 20), answers


def test_a_claim_ends_at_the_largest_ready_candidate_past_a_hole() -> None:
    # full4+mamba8, align 8: the full units 0..5 READY, 6 absent, 7..11 READY; mamba states
    # READY at every 8 tokens. Candidates above 24 need full unit 6: the claim is 24.
    geometry = _geometry("full4+mamba8")
    store = {_key(0, j): HIT for j in range(12) if j != 6} | {_key(1, j): HIT for j in range(6)}
    decision = decide_claim(
        geometry, _key, 49, 0, status=lambda k: store.get(k, MISS), failed=frozenset()
    )
    assert decision == ClaimDecision(24, False)
    # From 16 on, only units from 4 up are needed by the full group: the same hole bounds it.
    decision = decide_claim(
        geometry, _key, 49, 16, status=lambda k: store.get(k, MISS), failed=frozenset()
    )
    assert decision == ClaimDecision(24, False)
    # A failed key is a hole too; a STORING one in the largest hopeful candidate defers.
    failed = {_key(0, 3)}
    assert decide_claim(
        geometry, _key, 49, 0, status=lambda k: store.get(k, MISS), failed=failed
    ) == ClaimDecision(8, False)
    store[_key(1, 2)] = PENDING
    assert decide_claim(
        geometry, _key, 49, 0, status=lambda k: store.get(k, MISS), failed=frozenset()
    ) == ClaimDecision(0, True)


def test_nothing_is_asked_when_no_candidate_lies_past_the_start() -> None:
    geometry = _geometry("full4+mamba8")
    asked: list[bytes] = []

    def status(key: bytes) -> LookupResult:
        asked.append(key)
        return HIT

    # 9 tokens: the claimable prefix is 8 (the last token is always computed); from 8, none.
    assert decide_claim(geometry, _key, 9, 8, status=status, failed=()) == ClaimDecision(8, False)
    assert decide_claim(geometry, _key, 8, 0, status=status, failed=()) == ClaimDecision(0, False)
    assert asked == []
    assert decide_claim(geometry, _key, 9, 0, status=status, failed=()) == ClaimDecision(8, False)
    assert sorted(asked) == [_key(0, 0), _key(0, 1), _key(1, 0)]


def test_a_full_group_the_host_lacks_from_its_first_unit_ends_the_search_at_once() -> None:
    # Module docstring: a full-attention group is read from the bottom, so a prefix the host
    # lacks ends the search after one lookup, not one per candidate (48 candidates here; a
    # scan from the top would ask each candidate's last unit).
    geometry = _geometry("two-full-aligned-12")
    asked: list[bytes] = []

    def status(key: bytes) -> LookupResult:
        asked.append(key)
        return MISS

    assert decide_claim(geometry, _key, 97, 0, status=status, failed=()) == ClaimDecision(0, False)
    assert asked == [_key(geometry.scan_order[0], 0)]
    # Every unit READY but the first of the second full group: the first group is read whole
    # once (24 units of 4 tokens), the second group once, at its first unit.
    asked.clear()
    store = {_key(0, j): HIT for j in range(24)} | {_key(1, j): HIT for j in range(1, 16)}

    def stored(key: bytes) -> LookupResult:
        asked.append(key)
        return store.get(key, MISS)

    decision = decide_claim(geometry, _key, 97, 0, status=stored, failed=())
    assert decision == ClaimDecision(0, False)
    assert sorted(asked) == sorted([*(_key(0, j) for j in range(24)), _key(1, 0)])


def test_a_second_sliding_group_s_hole_sends_the_first_one_below_its_memory() -> None:
    # sliding13+sliding9+full, units of 4 tokens, claims every 4: at 96 the full group reads
    # its prefix, the first sliding group finds units 20..23 hopeful and the second finds unit
    # 23 absent. At 92 the first group needs units 19..22: it knows 20..22 and reads 19 only
    # (absent), so the claim falls to 76, where every needed unit is READY.
    geometry = _geometry("sliding13+sliding9+full")
    assert geometry.scan_order == (2, 0, 1)
    store = {_key(g, j): HIT for g in range(3) for j in range(24)}
    del store[_key(0, 19)], store[_key(1, 23)]
    asked: Counter[bytes] = Counter()

    def status(key: bytes) -> LookupResult:
        asked[key] += 1
        return store.get(key, MISS)

    assert decide_claim(geometry, _key, 97, 0, status=status, failed=()) == ClaimDecision(76, False)
    assert max(asked.values()) == 1
    # Only unit 21 of the second group absent: at 84 the first group needs 17..20 and knows
    # 20 from the look at 96; it reads 17..19 only, each unit once.
    store[_key(0, 19)] = store[_key(1, 23)] = HIT
    del store[_key(1, 21)]
    asked.clear()
    assert decide_claim(geometry, _key, 97, 0, status=status, failed=()) == ClaimDecision(84, False)
    assert max(asked.values()) == 1
    assert {j for g, j in (k.decode().split(":") for k in asked) if g == "0"} == {
        str(j) for j in range(17, 24)
    }


def test_a_window_forgotten_after_a_hole_is_read_again_down_to_its_first_unit() -> None:
    # sliding13+sliding9+full, units of 4, claims every 4, 25 tokens (limit 24). At 24 the
    # first sliding group finds units 2..5 hopeful and the second finds unit 5 absent. At 20
    # the first group knows 2..4 and reads unit 1: absent, below what it knew, so it forgets
    # its memory (nothing it knew lies below 1). At 4 it needs unit 0, which it never read:
    # absent, so no candidate is hopeful. A memory that still claimed unit 0 would claim 4.
    geometry = _geometry("sliding13+sliding9+full")
    store = {_key(2, j): HIT for j in range(6)}
    store |= {_key(0, j): HIT for j in range(2, 6)} | {_key(1, j): HIT for j in range(5)}
    asked: list[bytes] = []

    def status(key: bytes) -> LookupResult:
        asked.append(key)
        return store.get(key, MISS)

    decision = decide_claim(geometry, _key, 25, 0, status=status, failed=())
    assert decision == ClaimDecision(0, False)
    assert asked[-1] == _key(0, 0)  # the search ends on the first sliding group's unit 0
    expected = _plain(
        geometry,
        25,
        0,
        status=functools.partial(_status_in, store),
        failed=set(),
        groups=geometry.scan_order,
    )
    assert decision == expected
    # With unit 0 READY the same reads claim 4: the answer turns on that one unit.
    store[_key(0, 0)] = HIT
    assert decide_claim(geometry, _key, 25, 0, status=status, failed=()) == ClaimDecision(4, False)


@pytest.mark.parametrize("eagle", [False, True], ids=["plain", "eagle"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_one_group_passes_the_rule_s_answer_exactly_when_the_groups_own_ends_differ(
    name: str, eagle: bool
) -> None:
    # The per-group prefix metric: after the rule answered (not DEFER), its groups' own ends
    # (the rule on one group, STORING counted as absent) differ exactly when one group alone
    # passes the answer. The ends are computed here by the plain rule, group by group.
    geometry = _geometry(name, eagle)
    rng = random.Random(f"{name}/passes")
    outcomes: Counter[tuple[bool, bool]] = Counter()
    for _ in range(600):
        store = _random_store(rng, geometry)
        failed = {k for k in store if rng.random() < 0.04}
        num_tokens = rng.randrange(0, MAX_LEN + 1)
        start = rng.randrange(0, max(1, num_tokens)) // geometry.scheduler_block
        start *= geometry.scheduler_block
        status = functools.partial(_status_in, store)
        answer = decide_claim(geometry, _key, num_tokens, start, status=status, failed=failed)
        if answer.defer:
            continue
        ready = {key: HIT for key, value in store.items() if value is HIT}
        ends = {
            _plain(
                geometry,
                num_tokens,
                start,
                status=functools.partial(_status_in, ready),
                failed=failed,
                groups=(g,),
            ).end
            for g in range(len(geometry.kinds))
        }
        asked: list[bytes] = []

        def reading(
            key: bytes, asked: list[bytes] = asked, store: dict[bytes, LookupResult] = store
        ) -> LookupResult:
            asked.append(key)
            return store.get(key, MISS)

        passes = some_group_passes(
            geometry, _key, num_tokens, start, answer.end, status=reading, failed=failed
        )
        assert passes == (len(ends) > 1)
        # Only past the answer: a full-attention group's units below it are the claim's.
        for key in asked:
            g, j = map(int, key.decode().split(":"))
            if geometry.kinds[g] is FULL:
                assert j >= answer.end // geometry.units[g]
        assert len(asked) == len(set(asked))  # no key read twice
        outcomes[passes, answer.end > start] += 1
    assert len(outcomes) == 4, outcomes
    assert min(outcomes.values()) >= (3 if eagle else 5), outcomes
