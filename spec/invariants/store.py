"""ST-*: invariants of the host store (snapshot subject ``"store"``).

Each predicate reads the plain snapshot documented in :mod:`spec.store` (the optimized store
exports the same schema). Every hand-kept count of the snapshot has a predicate that recounts
it: ``used``/``storing``/``evictable`` (ST-2), pins (ST-5), lifecycle counters (ST-6),
event-ledger counters (ST-9), the policy's resident set (ST-7).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Any

from spec.invariants._registry import invariant
from spec.store import EntryState, EventKind

__all__: list[str] = []

_STORING = EntryState.STORING.value
_READY = EntryState.READY.value
_KINDS = tuple(kind.value for kind in EventKind)
_SUBJECT = "store"


def _entries(snap: Mapping[str, Any]) -> list[tuple[str, str, int]]:
    return list(snap["entries"])


def _count(entries: Iterable[tuple[str, str, int]], state: str) -> int:
    return sum(1 for _, entry_state, _ in entries if entry_state == state)


def _duplicates(keys: Iterable[str]) -> list[str]:
    return sorted(key for key, n in Counter(keys).items() if n > 1)


@invariant(_SUBJECT)
def st1_capacity(snap: Mapping[str, Any]) -> list[str]:
    """ST-1: capacity is an int >= 1 and the store holds at most capacity entries."""
    capacity = snap["capacity"]
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        return [f"capacity {capacity!r} is not an int >= 1"]
    held = len(_entries(snap))
    return [f"{held} entries exceed capacity {capacity}"] if held > capacity else []


@invariant(_SUBJECT)
def st2_slot_counts(snap: Mapping[str, Any]) -> list[str]:
    """ST-2: the hand-kept counts used, storing and evictable recount the entries."""
    entries = _entries(snap)
    expected = {
        "used": len(entries),
        "storing": _count(entries, _STORING),
        "evictable": sum(1 for _, state, pins in entries if state == _READY and pins == 0),
    }
    return [
        f"{name} is {snap[name]}, entries recount {value}"
        for name, value in expected.items()
        if snap[name] != value
    ]


@invariant(_SUBJECT)
def st3_well_formed(snap: Mapping[str, Any]) -> list[str]:
    """ST-3: distinct keys, a known state, int pins >= 0; the low keys are distinct entries."""
    entries = _entries(snap)
    messages = [f"key {key} listed twice" for key in _duplicates(k for k, _, _ in entries)]
    low = snap["low"]
    messages += [f"low key {key} listed twice" for key in _duplicates(low)]
    present = {key for key, _, _ in entries}
    messages += [f"low key {key} is no entry" for key in low if key not in present]
    for key, state, pins in entries:
        if state not in (_STORING, _READY):
            messages.append(f"key {key} has unknown state {state!r}")
        if isinstance(pins, bool) or not isinstance(pins, int) or pins < 0:
            messages.append(f"key {key} has pin count {pins!r}")
    return messages


@invariant(_SUBJECT)
def st4_pins_only_ready(snap: Mapping[str, Any]) -> list[str]:
    """ST-4: only READY entries are pinned; a STORING entry is neither loadable nor pinned."""
    return [
        f"STORING key {key} holds {pins} pins"
        for key, state, pins in _entries(snap)
        if state == _STORING and pins != 0
    ]


@invariant(_SUBJECT)
def st5_pins_balance(snap: Mapping[str, Any]) -> list[str]:
    """ST-5: pins held recount loads prepared minus completed: no pinned entry left the store."""
    counters = snap["counters"]
    in_flight = counters["loads_prepared"] - counters["loads_completed"]
    held = sum(pins for _, _, pins in _entries(snap))
    if held == in_flight:
        return []
    return [f"entries hold {held} pins but {in_flight} loads are in flight"]


@invariant(_SUBJECT)
def st6_lifecycle_balance(snap: Mapping[str, Any]) -> list[str]:
    """ST-6: reserved = stored + removed + STORING entries; stored = evicted + READY entries."""
    counters = snap["counters"]
    entries = _entries(snap)
    messages = [f"counter {name} is negative" for name, n in counters.items() if n < 0]
    storing, ready = _count(entries, _STORING), _count(entries, _READY)
    settled = counters["stored"] + counters["removed"] + storing
    if counters["reserved"] != settled:
        messages.append(f"reserved {counters['reserved']} != stored+removed+storing {settled}")
    if counters["stored"] != counters["evicted"] + ready:
        messages.append(
            f"stored {counters['stored']} != evicted+ready {counters['evicted']}+{ready}"
        )
    return messages


@invariant(_SUBJECT)
def st7_policy_tracks_entries(snap: Mapping[str, Any]) -> list[str]:
    """ST-7: the policy's resident keys are exactly the entry keys, each once."""
    resident = list(snap["policy"]["resident"])
    messages = [f"policy lists {key} twice" for key in _duplicates(resident)]
    keys = {key for key, _, _ in _entries(snap)}
    messages += [f"policy tracks absent key {key}" for key in sorted(set(resident) - keys)]
    messages += [f"policy ignores entry {key}" for key in sorted(keys - set(resident))]
    return messages


@invariant(_SUBJECT)
def st8_policy_history(snap: Mapping[str, Any]) -> list[str]:
    """ST-8: ghosts are distinct, never resident; ARC: B1, B2 <= capacity, 0 <= p <= capacity."""
    policy = snap["policy"]
    ghosts, resident = list(policy["ghosts"]), set(policy["resident"])
    messages = [f"ghost {key} listed twice" for key in _duplicates(ghosts)]
    messages += [f"ghost {key} is resident" for key in sorted(resident.intersection(ghosts))]
    if policy["name"] == "arc":
        messages += _arc_history(policy, snap["capacity"])
    return messages


def _arc_history(policy: Mapping[str, Any], capacity: int) -> list[str]:
    extra = policy["extra"]
    messages = []
    if tuple(policy["resident"]) != (*extra["t1"], *extra["t2"]):
        messages.append("resident is not T1 followed by T2")
    if tuple(policy["ghosts"]) != (*extra["b1"], *extra["b2"]):
        messages.append("ghosts are not B1 followed by B2")
    messages += [
        f"{name} holds {len(extra[name])} ghosts > capacity {capacity}"
        for name in ("b1", "b2")
        if len(extra[name]) > capacity
    ]
    target = Fraction(*extra["target"])
    if not 0 <= target <= capacity:
        messages.append(f"target p={target} outside [0, {capacity}]")
    return messages


@invariant(_SUBJECT)
def st9_event_ledger(snap: Mapping[str, Any]) -> list[str]:
    """ST-9: counters stored, evicted and removed equal their keys in taken plus pending events."""
    pending = Counter(dict.fromkeys(_KINDS, 0))
    messages = []
    for kind, keys in snap["events"]:
        if kind not in pending:
            messages.append(f"event of unknown kind {kind!r}")
            continue
        pending[kind] += len(keys)
    for kind in _KINDS:
        logged = snap["taken"][kind] + pending[kind]
        if snap["counters"][kind] != logged:
            messages.append(f"counter {kind} is {snap['counters'][kind]}, events hold {logged}")
    return messages


@invariant(_SUBJECT)
def st10_events_agree(snap: Mapping[str, Any]) -> list[str]:
    """ST-10: a key's last pending event agrees: stored -> READY; evicted/removed -> not READY."""
    last: dict[str, str] = {}
    for kind, keys in snap["events"]:
        last.update(dict.fromkeys(keys, kind))
    state = {key: entry_state for key, entry_state, _ in _entries(snap)}
    messages = []
    for key, kind in sorted(last.items()):
        now = state.get(key, "absent")
        if kind == EventKind.STORED.value and now != _READY:
            messages.append(f"key {key} last reported stored but is {now}")
        elif kind != EventKind.STORED.value and now == _READY:
            messages.append(f"key {key} last reported {kind} but is ready")
    return messages
