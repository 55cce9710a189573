"""``hybridkv.testbed.host_replay``: replays of hand-made host traffic under LRU, ARC and MIN.

One full-attention group of 4-token units, chunk 4, a store of 2 entries. Requests X, Y and Z
each claim one unit (5 tokens: 4 claimable); keys a, b, c are their units. The traffic stores
a, b, then c (a full store evicts), then asks X, X again, then Y. Hand-checked:

- LRU and ARC evict a (least recent) to admit c: only Y hits, 4 tokens.
- MIN evicts b (used after a; c is the incoming key): X hits twice, 8 tokens.
- MIN with bypass declines c (never used): every ask hits, 12 tokens, as without a limit.
"""

from __future__ import annotations

import pytest

from hybridkv.connector.geometry import ConnectorGeometry
from hybridkv.errors import HybridKVConfigError
from hybridkv.kinds import GroupKind
from hybridkv.planner import HybridOffloadPlanner
from hybridkv.store import StorePriority
from hybridkv.testbed.host_replay import (
    Ask,
    Event,
    Offer,
    Poll,
    Step,
    future_uses,
    loaded_keys,
    needed_keys,
    replay,
    unlimited,
)

FULL, SLIDING = GroupKind.FULL, GroupKind.SLIDING


def _geometry() -> ConnectorGeometry:
    return ConnectorGeometry.build(HybridOffloadPlanner(((FULL, 4),), 4, 4, 1 << 10), (FULL,))


def _ask(rid: str, key: bytes, loaded: int = 0) -> Ask:
    return Ask(rid, 0, 5, ((key,),), loaded)


def _stored(*keys: bytes) -> list[Event]:
    return [event for key in keys for event in (Offer((key,)), Step(), Poll())]


EVENTS: list[Event] = [
    *_stored(b"a", b"b", b"c"),
    _ask("X", b"a"),
    _ask("X2", b"a"),
    _ask("Y", b"b"),
]


@pytest.mark.parametrize(
    ("policy", "bypass", "ends", "evicted", "bypassed"),
    [
        ("lru", False, (0, 0, 4), 1, 0),
        ("arc", False, (0, 0, 4), 1, 0),
        ("min", False, (4, 4, 0), 1, 0),
        ("min", True, (4, 4, 4), 0, 1),
    ],
)
def test_hand_checked_replays(
    policy: str, bypass: bool, ends: tuple[int, ...], evicted: int, bypassed: int
) -> None:
    result = replay(EVENTS, _geometry(), 2, policy, delay=0, bypass=bypass)
    assert result.ends == ends
    assert result.claimed == sum(ends)
    assert result.key_reads == sum(ends) // 4
    assert (result.evicted, result.bypassed, result.refused, result.deferred) == (
        evicted,
        bypassed,
        0,
        0,
    )
    assert result.stored == 3 - bypassed
    assert result.policy == policy + (" bypass" if bypass else "")


def test_without_a_limit_every_ask_hits_and_min_uses_those_claims() -> None:
    geometry = _geometry()
    assert unlimited(EVENTS) == 4
    assert replay(EVENTS, geometry, unlimited(EVENTS), "lru", delay=0).ends == (4, 4, 4)
    future = future_uses(geometry, EVENTS, delay=0)
    future.advance(9)
    assert (future.next_use(b"a"), future.next_use(b"b"), future.next_use(b"c")) == (9, 11, 1 << 62)


def test_storing_keys_defer_asks_and_fill_the_store() -> None:
    # a is STORING when X asks (its store reports at the poll after the ask).
    events: list[Event] = [Offer((b"a",)), Step(), _ask("X", b"a"), Offer((b"b",)), Poll()]
    result = replay(events, _geometry(), 1, "lru", delay=1)
    assert (result.deferred, result.claimed, result.refused, result.stored) == (1, 0, 1, 1)
    # Reported one poll later, a is READY and loadable; the load pins it until it reports.
    later = [*events, Step(), Poll(), _ask("Y", b"a"), Offer((b"b",)), Step(), Poll(), Poll()]
    result = replay(later, _geometry(), 1, "lru", delay=1)
    assert (result.claimed, result.refused) == (4, 2)  # a pinned by Y's load: b refused again


def test_needed_keys_take_the_sliding_window_only() -> None:
    planner = HybridOffloadPlanner(((FULL, 4), (SLIDING, 4)), 4, 4, 1 << 10)
    geometry = ConnectorGeometry.build(planner, (FULL, SLIDING), (0, 7))
    keys = (tuple(b"f%d" % j for j in range(4)), tuple(b"s%d" % j for j in range(4)))
    ask = Ask("R", 0, 17, keys, 0)
    # Claim [0, 16): the full group needs units 0-3, the sliding one the 7 tokens before 16.
    assert needed_keys(geometry, ask, 16) == (*keys[0], b"s2", b"s3")
    assert needed_keys(geometry, ask, 0) == ()


def test_bad_arguments_name_their_field() -> None:
    for kwargs, field in (({"delay": -1}, "delay"), ({"delay": 0, "bypass": True}, "bypass")):
        with pytest.raises(HybridKVConfigError) as bad:
            replay(EVENTS, _geometry(), 2, "lru", **kwargs)  # type: ignore[arg-type]
        assert bad.value.field == field


def test_bypass_keeps_a_key_only_over_a_victim_used_later() -> None:
    # One entry. a is resident; (a, b) offers a present key and b, with no victim (a is
    # offered): b declined. d (used first) displaces a (used later); c (used after d) is
    # declined. Only W, which reads d, hits.
    events: list[Event] = [
        *_stored(b"a"),
        Offer((b"a", b"b")),
        Step(),
        Poll(),
        *_stored(b"d", b"c"),
        _ask("W", b"d"),
        _ask("X", b"a"),
        _ask("Z", b"c"),
        _ask("Y", b"b"),
    ]
    result = replay(events, _geometry(), 1, "min", delay=0, bypass=True)
    assert (result.ends, result.bypassed, result.evicted, result.stored) == ((4, 0, 0, 0), 2, 1, 2)
    plain = replay(events, _geometry(), 1, "min", delay=0)
    assert (plain.ends, plain.refused) == ((0, 0, 4, 0), 1)  # b refused, then c displaces d


def _sliding_geometry() -> ConnectorGeometry:
    planner = HybridOffloadPlanner(((FULL, 4), (SLIDING, 4)), 4, 4, 1 << 10)
    return ConnectorGeometry.build(planner, (FULL, SLIDING), (0, 7))


def test_loads_touch_keys_in_the_cores_order_by_end_then_group() -> None:
    # The core loads (and touches) a claim's items by the token their unit ends at, then by
    # group; the policy's recency follows that order. A store of 6 holds f0-f2 and s0-s2. R
    # claims [0, 12): f0, f1, s1, f2, s2 touched tail first, so LRU ranks s0 (untouched), s2,
    # f2, s1, f1, f0 from least recent. Three new keys evict s0, s2, f2, keeping s1, which Q
    # (resuming at 4) needs with f1. Touched in group order instead (f0-f2, s1, s2), s1 would
    # rank below f2 and be evicted, and Q would claim nothing.
    geometry = _sliding_geometry()
    full = tuple(b"f%d" % j for j in range(3))
    sliding = tuple(b"s%d" % j for j in range(3))
    assert loaded_keys(geometry, Ask("R", 0, 13, (full, sliding), 0), 12) == (
        b"f0",
        b"f1",
        b"s1",
        b"f2",
        b"s2",
    )
    events: list[Event] = [
        Offer((*full, *sliding)),
        Step(),
        Poll(),
        Ask("R", 0, 13, (full, sliding), 0),
        Step(),
        Poll(),
        Offer((b"x", b"y", b"z")),
        Step(),
        Poll(),
        Ask("Q", 4, 9, (full[:2], sliding[:2]), 0),
    ]
    assert replay(events, geometry, 6, "lru", delay=0).ends == (12, 4)


def test_delay_one_reports_at_the_first_poll_like_delay_zero() -> None:
    # The worker's rule (hybridkv.vllm.harness.delayed): delays 0 and 1 both report a job at the
    # first poll after its submission, its own step's; delay 2 one poll later.
    events: list[Event] = [Offer((b"a",)), Step(), Poll(), _ask("X", b"a"), Step(), Poll()]
    assert replay(events, _geometry(), 1, "lru", delay=0).ends == (4,)
    assert replay(events, _geometry(), 1, "lru", delay=1).ends == (4,)
    late = replay(events, _geometry(), 1, "lru", delay=2)
    assert (late.ends, late.deferred) == ((0,), 1)


def test_lru_and_arc_keep_the_offers_admission_class_min_ignores_it() -> None:
    # One entry holds a (NORMAL). b, offered LOW, may not displace it under LRU or ARC, so X
    # still claims a; MIN (no class) evicts a for b, which is never used, and X misses.
    events: list[Event] = [
        *_stored(b"a"),
        Offer((b"b",), StorePriority.LOW),
        Step(),
        Poll(),
        _ask("X", b"a"),
    ]
    for policy in ("lru", "arc"):
        result = replay(events, _geometry(), 1, policy, delay=0)
        assert (result.ends, result.refused) == ((4,), 1)
    assert replay(events, _geometry(), 1, "min", delay=0).ends == (0,)
