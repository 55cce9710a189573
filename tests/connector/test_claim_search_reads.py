"""The claim search against the rule stated plainly, and the keys it reports reading.

``hybridkv.connector.claims.decide_claim`` jumps over candidates and decides each group's
needed range once per scan (no ``ConnectorGeometry.first_needed`` call per candidate); its
answer must be the module rule's, computed here candidate by candidate from
``ConnectorGeometry.first_needed`` and ``claim_limit``, on random layouts that include a
sliding window whose reach is 0 and a mamba group. The core's claim memo keeps an answer while
the statuses of the keys the search read (``read=``) are unchanged: so the answer must not
move when every other key's status does.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from hybridkv.connector import ConnectorGeometry
from hybridkv.connector.claims import ClaimDecision, decide_claim
from hybridkv.kinds import GroupKind
from hybridkv.planner import HybridOffloadPlanner
from hybridkv.store import LookupResult

HIT, PENDING, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS
LAYOUTS = (
    ((GroupKind.FULL, 4), (GroupKind.SLIDING, 4)),
    ((GroupKind.FULL, 4), (GroupKind.MAMBA, 8)),
    ((GroupKind.MAMBA, 4), (GroupKind.FULL, 4), (GroupKind.SLIDING, 4)),
)


def _key(g: int, j: int) -> bytes:
    return j.to_bytes(4, "big") + g.to_bytes(4, "big")


def _plain(
    geometry: ConnectorGeometry,
    num_tokens: int,
    start: int,
    status: Callable[[bytes], LookupResult],
    failed: set[bytes],
) -> ClaimDecision:
    """The rule of claims.py's docstring, one candidate at a time."""
    align = geometry.align
    for t in range(geometry.claim_limit(num_tokens), start, -align):
        if t % align:
            continue
        needed = [
            _key(g, j)
            for g, u in enumerate(geometry.units)
            for j in range(geometry.first_needed(g, start, t), t // u)
        ]
        verdicts = [MISS if key in failed else status(key) for key in needed]
        if MISS in verdicts:
            continue  # not hopeful
        return ClaimDecision(start, True) if PENDING in verdicts else ClaimDecision(t, False)
    return ClaimDecision(start, False)


def test_the_search_answers_the_plain_rule_and_only_its_read_keys_matter() -> None:
    rng = random.Random(18)
    checked = deferred = claimed = 0
    for trial in range(600):
        groups = LAYOUTS[trial % len(LAYOUTS)]
        planner = HybridOffloadPlanner(groups, 4, 8, 256)
        kinds = tuple(kind for kind, _ in groups)
        # Reaches 0 (a one-token window), within a unit, and past several units.
        windows = tuple(rng.choice((0, 3, 9, 20)) if k is GroupKind.SLIDING else 0 for k in kinds)
        geometry = ConnectorGeometry.build(planner, kinds, windows)
        num_tokens = rng.randrange(1, 120)
        start = rng.randrange(0, num_tokens + 8) // geometry.scheduler_block
        start *= geometry.scheduler_block
        weights = rng.choice(((8, 1, 1), (3, 1, 2), (1, 0, 0)))
        statuses = {
            _key(g, j): rng.choices((HIT, PENDING, MISS), weights)[0]
            for g in range(len(groups))
            for j in range(40)
        }
        failed = {key for key in statuses if rng.random() < 0.03}
        read: list[bytes] = []
        got = decide_claim(
            geometry,
            _key,
            num_tokens,
            start,
            status=statuses.__getitem__,
            failed=failed,
            read=read,
        )
        assert got == _plain(geometry, num_tokens, start, statuses.__getitem__, failed)
        # Every key the search did not read gets another status: same answer, same reads.
        seen = set(read)
        moved = {
            key: value if key in seen else rng.choice((HIT, PENDING, MISS))
            for key, value in statuses.items()
        }
        again: list[bytes] = []
        assert (
            decide_claim(
                geometry,
                _key,
                num_tokens,
                start,
                status=moved.__getitem__,
                failed=failed,
                read=again,
            )
            == got
        )
        assert again == read
        checked += 1
        deferred += got.defer
        claimed += got.end > start
    assert checked == 600
    assert deferred > 30  # both outcomes well exercised
    assert claimed > 30
