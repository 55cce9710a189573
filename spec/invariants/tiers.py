"""TT-*: invariants of the two-tier store (host tier over a shared remote tier; issue 12).

Two subjects:

- ``"tiers"`` reads the two-tier snapshot of :mod:`spec.tiers.two_tier` (TT-1, TT-3, TT-4,
  TT-8); the library exports the same dict, so these run on both sides.
- ``"tiers_content"`` reads ``{"tiers": <that snapshot>, "content": <content oracle>}``
  (TT-2, TT-5, TT-6, TT-7): contents are not in the snapshot, so a caller that knows what each
  key should hold supplies them. The oracle is the dict of
  :meth:`spec.tiers.two_tier.TwoTierStore.content` plus two entries the caller adds:
  ``resolved`` (the promotions its last action resolved, each
  ``(chunk_key_hex, resolution, lookup_salt, (reserved_key_hex, ...), (loaded_tag, ...))``)
  and ``tenant_of`` (``{tag: salt}``: the salt each true content was written under).

Decisions where the contract leaves room:

- The contract names TT-1, TT-3, TT-4 and TT-8 snapshot predicates and TT-2, TT-6 content
  predicates; TT-5 (what a resolution left behind) and TT-7 (the payloads a queued or remote
  chunk carries) need what the snapshot lacks, so they read the oracle too.
- TT-1 on the snapshot cannot recompute a chunk key (the namespace is not in the schema): it
  checks that each listing names its members once and that a promotion's members are among
  those the map holds for its key. A half chunk whose header still names every member is the
  reader's CORRUPT verdict, and TT-2 if it were loaded.
- TT-3's "exactly one operation" for GPU store jobs, which the schema does not list, is checked
  by the model (:meth:`spec.tiers.model.TierModel.owners`) and reported under TT-3.
- TT-4's deadline is modelled as a resolution always being possible (a fetch may always time
  out, a write may always fail), and its liveness half (a state that is not final enables an
  action) is the explorer's wedge check, reported under TT-4 by the model.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from spec.invariants._registry import invariant
from spec.store import EntryState

__all__: list[str] = []

_SNAPSHOT = "tiers"
_CONTENT = "tiers_content"
_FAILURES = ("missing", "fault", "timeout", "corrupt")


def _duplicates(keys: Iterable[str]) -> list[str]:
    return sorted(key for key, n in Counter(keys).items() if n > 1)


def _named(listing: Iterable[tuple[str, tuple[str, ...]]]) -> dict[str, tuple[str, ...]]:
    return dict(listing)


@invariant(_SNAPSHOT)
def tt1_atomic_chunk(snap: Mapping[str, Any]) -> list[str]:
    """TT-1: the remote map holds each chunk whole: its members once, a promotion's among them."""
    messages = []
    for name in ("remote", "writes"):
        listing = list(snap[name])
        messages += [f"{name} lists chunk {k} twice" for k in _duplicates(k for k, _ in listing)]
        for key, members in listing:
            if not members or len(set(members)) != len(members):
                messages.append(f"{name} chunk {key} has members {members!r}")
    held = _named(snap["remote"])
    for key, reserved in snap["promotions"]:
        if key in held and not set(reserved) <= set(held[key]):
            missing = sorted(set(reserved) - set(held[key]))
            messages.append(f"remote chunk {key} lacks members {missing} its promotion reserved")
    return messages


@invariant(_CONTENT)
def tt2_content(obs: Mapping[str, Any]) -> list[str]:
    """TT-2: every READY host entry holds exactly the content stored for its key."""
    truth, held = obs["content"]["truth"], obs["content"]["held"]
    return [
        f"READY key {key} holds {tag!r}, not {truth.get(key)!r}"
        for key, tag in sorted(held.items())
        if truth.get(key) != tag
    ]


@invariant(_SNAPSHOT)
def tt3_accounting(snap: Mapping[str, Any]) -> list[str]:
    """TT-3: each promotion's members are STORING, owned by it alone; host used <= capacity."""
    host = snap["host"]
    state = {key: entry_state for key, entry_state, _ in host["entries"]}
    owned = [member for _, reserved in snap["promotions"] for member in reserved]
    messages = [f"key {key} reserved by two promotions" for key in _duplicates(owned)]
    for chunk, reserved in snap["promotions"]:
        if not reserved:
            messages.append(f"promotion {chunk} reserves nothing")
        for member in reserved:
            if state.get(member) != EntryState.STORING.value:
                now = state.get(member, "absent")
                messages.append(f"promotion {chunk} member {member} is {now}, not storing")
    if len(host["entries"]) > host["capacity"]:
        messages.append(f"host holds {len(host['entries'])} > capacity {host['capacity']}")
    return messages


@invariant(_SNAPSHOT)
def tt4_termination(snap: Mapping[str, Any]) -> list[str]:
    """TT-4: nothing in flight names a resolved operation; every operation is in flight once."""
    promotions = [key for key, _ in snap["promotions"]]
    writes = [key for key, _ in snap["writes"]]
    messages = [f"promotion {key} in flight twice" for key in _duplicates(promotions)]
    messages += [
        f"resolved promotion {key} still in flight"
        for key in sorted(set(promotions) & set(snap["failed"]))
    ]
    held = {key for key, _ in snap["remote"]}
    messages += [f"landed write {key} still queued" for key in sorted(set(writes) & held)]
    return messages


@invariant(_CONTENT)
def tt5_miss_not_error(obs: Mapping[str, Any]) -> list[str]:
    """TT-5: a failed promotion ends REMOVED: members gone, nothing loaded, chunk remembered."""
    snap = obs["tiers"]
    present = {key for key, _, _ in snap["host"]["entries"]}
    flying = {key for key, _ in snap["promotions"]}
    messages = []
    for chunk, resolution, _, reserved, loaded in obs["content"]["resolved"]:
        if resolution == "promoted":
            continue
        if chunk not in snap["failed"] or chunk in flying:
            messages.append(f"{resolution} promotion {chunk} is not a remembered miss")
        kept = sorted(set(reserved) & present)
        if kept or loaded:
            messages.append(f"{resolution} promotion {chunk} kept {kept} and loaded {loaded!r}")
    return messages


@invariant(_CONTENT)
def tt6_tenants(obs: Mapping[str, Any]) -> list[str]:
    """TT-6: a promotion looked up under salt s loads only content written under salt s."""
    tenant_of = obs["content"]["tenant_of"]
    messages = []
    for chunk, resolution, salt, _, loaded in obs["content"]["resolved"]:
        if resolution != "promoted":
            continue
        # A tag of no tenant (garbage) is TT-2's to report; this one names other tenants.
        foreign = sorted({tenant_of[tag] for tag in loaded if tag in tenant_of} - {salt})
        if foreign:
            messages.append(f"promotion {chunk} under salt {salt!r} loaded content of {foreign}")
    return messages


@invariant(_CONTENT)
def tt7_independence(obs: Mapping[str, Any]) -> list[str]:
    """TT-7: queued and remote chunks carry their members' stored content, whatever the host did."""
    snap, content = obs["tiers"], obs["content"]
    truth = content["truth"]
    messages = []
    for name in ("remote", "writes"):
        payloads = content[name]
        for chunk, members in snap[name]:
            expected = tuple(truth.get(member) for member in members)
            if tuple(payloads.get(chunk, ())) != expected:
                messages.append(f"{name} chunk {chunk} carries {payloads.get(chunk)!r}")
    return messages


@invariant(_SNAPSHOT)
def tt8_counters(snap: Mapping[str, Any]) -> list[str]:
    """TT-8: promotions started = resolved + in flight; writes enqueued = landed+failed+queued."""
    c = snap["counters"]
    messages = [f"counter {name} is negative" for name, n in sorted(c.items()) if n < 0]
    settled = c["promoted"] + sum(c[name] for name in _FAILURES) + len(snap["promotions"])
    if c["promotions_started"] != settled:
        started = c["promotions_started"]
        messages.append(f"promotions_started {started} != resolved+flying {settled}")
    queued = c["written"] + c["writes_failed"] + len(snap["writes"])
    if c["writes_enqueued"] != queued:
        messages.append(f"writes_enqueued {c['writes_enqueued']} != landed+failed+queued {queued}")
    if c["lookup_faults"] > c["lookups"]:
        messages.append(f"lookup_faults {c['lookup_faults']} > lookups {c['lookups']}")
    return messages
