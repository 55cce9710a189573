"""Replay a recorded run's host-tier traffic under any eviction policy, MIN included.

A run of the connector core asks the host tier four things, in order: at each scheduled
request's last ask, how far its prefix can be claimed (:class:`Ask`); at each step, which
completed units to store (:class:`Offer`, one ``prepare_store`` call); at each finish, to
refresh the request's units (:class:`Refresh`); and, ``delay`` polls later, that those loads
and stores finished (:class:`Step` and :class:`Poll` mark the scheduler's steps and the
worker's reports). ``tools/host_tier_bound.py`` records these from
vLLM 0.33's real scheduler; :func:`replay` plays them back against a fresh
:class:`~hybridkv.store.HostStore` of a given capacity and policy, with the claim rule of
:func:`hybridkv.connector.claims.decide_claim`, and counts what would have been loaded.

What stays fixed is the request sequence: each ask's start (what the GPU prefix cache already
held), its tokens, and every offer. A policy that loaded more would have changed later GPU hits
and so later asks; a replay cannot see that. Replaying with the run's own policy reproduces the
run's claims (checked by the recorder's test), which is what makes the other policies' figures
comparable.

MIN (:class:`~hybridkv.store.belady.BeladyPolicy`) reads the future from the asks: a key is
*used* at an ask when the ask's claim in a store that never evicts would load it
(:func:`future_uses`). With ``bypass`` the replay may also decline to
store a key a full store would only keep by evicting a key needed sooner (MIN with bypass: the
optimum over every admission and eviction rule on this sequence, counted in key reads). LRU
and ARC replays keep each offer's admission class (:class:`~hybridkv.store.StorePriority`), as
the run's store did; MIN ignores it: it is the yardstick, not the store's rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybridkv.connector.claims import decide_claim
from hybridkv.connector.geometry import ConnectorGeometry
from hybridkv.errors import HybridKVConfigError
from hybridkv.store import (
    HostStore,
    LookupResult,
    PrepareLoadOutput,
    PrepareStoreOutput,
    StorePriority,
)
from hybridkv.store.belady import NEVER, BeladyPolicy, FutureUses
from hybridkv.store.policy import EvictionPolicy

_HIT, _MISS = LookupResult.HIT, LookupResult.MISS

__all__ = [
    "Ask",
    "Event",
    "Offer",
    "Poll",
    "Refresh",
    "ReplayResult",
    "Step",
    "loaded_keys",
    "needed_keys",
    "replay",
]


@dataclass(frozen=True, slots=True)
class Ask:
    """A scheduled request's last ask: ``keys[g][j]`` is unit ``j`` of group ``g``'s key.

    ``loaded``: the tokens the recorded run claimed here (what a faithful replay reproduces).
    """

    request_id: str
    start: int
    num_tokens: int
    keys: tuple[tuple[bytes, ...], ...]
    loaded: int


@dataclass(frozen=True, slots=True)
class Offer:
    """One ``prepare_store`` call of a step's store job: ``keys`` head first, at ``priority``
    (the admission class the connector gave them), with the keys it ``bound`` to its unit."""

    keys: tuple[bytes, ...]
    priority: StorePriority = StorePriority.NORMAL
    bound: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class Refresh:
    """A finished request's ``HostStore.refresh``: its units' keys, head first."""

    keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Step:
    """The end of one scheduler step's ``build_connector_meta``."""


@dataclass(frozen=True, slots=True)
class Poll:
    """One ``update_connector_output``: jobs made ``delay`` steps before it report here."""


Event = Ask | Offer | Refresh | Step | Poll


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What a replay loaded, and what a store without limit would have offered.

    ``claimed``: tokens claimed over all asks; ``ends``: each ask's claimed tokens, in order;
    ``key_reads``: keys loaded; ``deferred``: asks the claim rule answered
    DEFER (a STORING key could lengthen the claim; counted as claiming nothing);
    ``stored`` / ``evicted`` / ``bypassed`` / ``refused``: keys reserved, evicted and declined
    (bypass), and ``prepare_store`` calls refused for want of space.
    """

    policy: str
    capacity: int
    claimed: int
    ends: tuple[int, ...]
    key_reads: int
    deferred: int
    stored: int
    evicted: int
    bypassed: int
    refused: int


def needed_keys(geometry: ConnectorGeometry, ask: Ask, end: int) -> tuple[bytes, ...]:
    """The keys a claim ``[ask.start, end)`` loads: each group's needed units, group order."""
    if end <= ask.start:
        return ()
    out: list[bytes] = []
    for g, unit in enumerate(geometry.units):
        first = geometry.first_needed(g, ask.start, end)
        out.extend(ask.keys[g][first : end // unit])
    return tuple(out)


def loaded_keys(geometry: ConnectorGeometry, ask: Ask, end: int) -> tuple[bytes, ...]:
    """:func:`needed_keys` in the order the connector core loads and touches them: by the
    token their unit ends at, then by group (``hybridkv.connector.loads.load_items``). The
    order is the policy's recency order, so a replay that touched them in group order would
    rank them differently from the run it replays (ARC's T2 most visibly)."""
    if end <= ask.start:
        return ()
    ranked: list[tuple[int, int, bytes]] = []
    for g, unit in enumerate(geometry.units):
        first = geometry.first_needed(g, ask.start, end)
        ranked.extend(((j + 1) * unit, g, ask.keys[g][j]) for j in range(first, end // unit))
    ranked.sort(key=lambda item: (item[0], item[1]))
    return tuple(key for _, _, key in ranked)


def unlimited(events: Sequence[Event]) -> int:
    """A capacity no replay of ``events`` can fill: every offered key fits."""
    return sum(len(event.keys) for event in events if isinstance(event, Offer)) + 1


def future_uses(geometry: ConnectorGeometry, events: Sequence[Event], delay: int) -> FutureUses:
    """Each key's uses: the asks that would load it if the store never evicted.

    A store without limit (every offered key kept) gives each ask its longest claim on this
    sequence; a key is used at an ask when that claim needs it (the window's units only, for a
    sliding group). A key outside every such claim is never worth keeping.
    """
    ends = replay(events, geometry, unlimited(events), "lru", delay=delay).ends
    asks = (event for event in events if isinstance(event, Ask))
    pairs: list[tuple[int, bytes]] = []
    positions = (i for i, event in enumerate(events) if isinstance(event, Ask))
    for position, ask, claimed in zip(positions, asks, ends, strict=True):
        pairs.extend((position, key) for key in needed_keys(geometry, ask, ask.start + claimed))
    return FutureUses(pairs)


def replay(
    events: Sequence[Event],
    geometry: ConnectorGeometry,
    capacity: int,
    policy: str,
    *,
    delay: int,
    bypass: bool = False,
) -> ReplayResult:
    """Play ``events`` against a fresh store of ``capacity`` entries evicting by ``policy``.

    ``policy``: ``"lru"``, ``"arc"`` (the store's own) or ``"min"`` (Belady, offline).
    ``delay``: polls between a job's step and its report (the run's copy delay). ``bypass``
    (``"min"`` only, field ``bypass``): decline stores MIN would not keep.
    Pre: the events of one run in order, each ask's ``keys`` reaching its tokens.
    """
    if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
        raise HybridKVConfigError("delay", delay, "must be an int >= 0", "pass the run's delay")
    if bypass and policy != "min":
        raise HybridKVConfigError("bypass", bypass, "needs the future", "use it with min")
    future = future_uses(geometry, events, delay) if policy == "min" else FutureUses(())
    chosen: str | EvictionPolicy = BeladyPolicy(capacity, future) if policy == "min" else policy
    store = HostStore(capacity, chosen)
    steps = polls = 0
    loads: list[tuple[int, tuple[bytes, ...]]] = []  # (step made, keys pinned)
    stores: list[tuple[int, tuple[bytes, ...]]] = []  # (step made, keys STORING)
    ends: list[int] = []
    key_reads = deferred = bypassed = refused = 0
    for position, event in enumerate(events):
        future.advance(position)
        if isinstance(event, Ask):
            end, defer, keys = _claim(store, geometry, event)
            deferred += defer
            if keys:
                loads.append((steps, keys))
            key_reads += len(keys)
            ends.append(end - event.start)
        elif isinstance(event, Offer):
            keys = event.keys
            if isinstance(chosen, BeladyPolicy) and bypass:
                pinned = frozenset(key for _, held in loads for key in held)
                keys, declined = _admitted(store, chosen, keys, pinned)
                bypassed += declined
            reserved = _offer(store, event, keys, run_rules=policy != "min")
            if reserved is None:
                refused += 1
            elif reserved:
                stores.append((steps, reserved))
        elif isinstance(event, Refresh):
            store.refresh(event.keys)
        elif isinstance(event, Step):
            steps += 1
        else:
            # The worker's rule (hybridkv.vllm.harness.delayed): a job reports at its delay-th poll
            # counted from its own step's poll, and delays 0 and 1 both mean that first poll,
            # so jobs made in step s report at poll index s + max(delay - 1, 0).
            due = polls - max(delay - 1, 0)
            loads = _finish(loads, due, store.complete_load)
            stores = _finish(stores, due, lambda keys: store.complete_store(keys, success=True))
            polls += 1
    stats = store.stats()
    return ReplayResult(
        policy=policy + (" bypass" if bypass else ""),
        capacity=capacity,
        claimed=sum(ends),
        ends=tuple(ends),
        key_reads=key_reads,
        deferred=deferred,
        stored=stats.reserved,
        evicted=stats.evicted,
        bypassed=bypassed,
        refused=refused,
    )


def _offer(
    store: HostStore, offer: Offer, keys: tuple[bytes, ...], *, run_rules: bool
) -> tuple[bytes, ...] | None:
    """The keys ``offer`` (as ``keys``) reserves, None when refused. LRU and ARC keep the run's
    admission classes and unit bindings (``run_rules``); MIN, the yardstick, ignores both."""
    prepared = store.prepare_store(
        keys,
        offer.priority if run_rules else StorePriority.NORMAL,
        offer.bound if run_rules else (),
    )
    return prepared.keys_to_store if isinstance(prepared, PrepareStoreOutput) else None


def _claim(
    store: HostStore, geometry: ConnectorGeometry, ask: Ask
) -> tuple[int, bool, tuple[bytes, ...]]:
    """The claim rule's end at ``ask`` on ``store``, whether it deferred, and the keys it loads
    (pinned and touched here, in the connector's order)."""
    end, defer = decide_claim(
        geometry,
        _key_of(ask.keys),
        ask.num_tokens,
        ask.start,
        status=store.status,
        failed=frozenset(),
    )
    keys = loaded_keys(geometry, ask, end)
    if keys:
        loading = store.prepare_load(keys)
        assert isinstance(loading, PrepareLoadOutput)  # the claim rule saw them READY
        store.touch(keys)
    return end, defer, keys


def _key_of(keys: tuple[tuple[bytes, ...], ...]) -> Callable[[int, int], bytes]:
    """The claim rule's ``(group, unit) -> key`` over an ask's recorded keys."""

    def key_of(g: int, j: int) -> bytes:
        return keys[g][j]

    return key_of


def _finish(
    jobs: list[tuple[int, tuple[bytes, ...]]],
    due: int,
    complete: Callable[[tuple[bytes, ...]], None],
) -> list[tuple[int, tuple[bytes, ...]]]:
    left = []
    for made, keys in jobs:
        if made <= due:
            complete(keys)
        else:
            left.append((made, keys))
    return left


def _admitted(
    store: HostStore,
    policy: BeladyPolicy,
    keys: tuple[bytes, ...],
    pinned: frozenset[bytes],
) -> tuple[tuple[bytes, ...], int]:
    """MIN with bypass: keep a new key only while a free slot, or an evictable key (READY,
    unpinned, not offered) next used later than it, is left; a key never used again is never
    stored. Returns the keys to offer and how many were declined."""
    stats = store.stats()
    free = stats.capacity - stats.used
    offered = frozenset(keys)

    def evictable(key: bytes) -> bool:
        return store.status(key) is _HIT and key not in pinned and key not in offered

    later = [-minus_next for minus_next, _, _ in policy.ranked(evictable)]  # furthest first
    kept: list[bytes] = []
    declined = 0
    for key in keys:
        if store.status(key) is not _MISS:
            kept.append(key)  # present: prepare_store skips it
            continue
        use = policy.future.next_use(key)
        if use == NEVER:
            declined += 1
        elif free > 0:
            free -= 1
            kept.append(key)
        elif later and later[0] > use:
            later.pop(0)
            kept.append(key)
        else:
            declined += 1
    return tuple(kept), declined
