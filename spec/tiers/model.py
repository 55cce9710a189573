"""The explorer adapter for the two-tier store: one engine, a host tier, a shared remote map.

A :class:`TierScenario` names the universe: tenants (``salts``), prefix steps per tenant
(``ends``), groups per chunk (``groups``), the host capacity and the write queue bound. A
member key is ``sha256(salt/end)[:8]`` + the 4-byte group index (the shape of a host key: a
block hash with the salt chained in, then the group), its true content the tag
``"salt|end|group"``. The ``shared`` start has another engine's writes of the first tenant's
chunks on the server; ``empty`` has nothing anywhere.

Actions (each prints as a trace step):

- ``store s0@1`` / ``store s0@1 completes|fails``: a GPU store job of a chunk; on completion
  the chunk is offered to :meth:`~spec.tiers.two_tier.TwoTierStore.write_behind`;
- ``evict s0@1``: host pressure from elsewhere drops a READY chunk;
- ``claim s0`` / ``claim s0, lookup faults``: a request of tenant ``s0`` misses the host:
  remote_lookup, then a promotion of each leading chunk the host lacks, in prefix order, ending
  at a failed chunk or a refusal (enabled only when it would start a promotion);
- ``fetch s0@1`` / ``... faults|times out|corrupted``: a promotion resolves;
- ``write s0@1 lands|fails``: a queued SET resolves;
- ``vanish s0@1``: the server loses a chunk.

Every state is checked against every invariant of the subjects ``tiers``, ``tiers_content``
and ``store`` (the TT and ST families). A state that is not final (a job, a promotion or a
write in flight) and enables nothing is a wedge, reported as TT-4.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from spec.errors import ConfigError
from spec.invariants import check_all
from spec.store import EntryState, HostStore, LookupResult, PrepareStoreOutput
from spec.tiers.chunk import encode
from spec.tiers.two_tier import (
    Injection,
    PromoteRefusal,
    PromotionStarted,
    Resolved,
    TwoTierStore,
)

__all__ = [
    "Claim",
    "Evict",
    "Fetch",
    "Store",
    "StoreDone",
    "TierAction",
    "TierModel",
    "TierScenario",
    "TierStart",
    "TierState",
    "Vanish",
    "Write",
]


class TierStart(Enum):
    """What exists before the first action."""

    EMPTY = "empty"
    SHARED = "shared"


@dataclass(frozen=True, slots=True)
class TierScenario:
    """The universe of one exploration; every field small (the search is exhaustive)."""

    salts: tuple[str, ...] = ("s0", "s1")
    ends: int = 2
    groups: int = 2
    capacity: int = 4
    max_pending: int = 1
    start: TierStart = TierStart.EMPTY

    def __post_init__(self) -> None:
        """Pre: at least one distinct salt without ``|``; ``ends``, ``groups``, ``capacity``,
        ``max_pending`` ints >= 1 (``ConfigError`` naming the field otherwise)."""
        if not self.salts or len(set(self.salts)) != len(self.salts):
            raise ConfigError("salts", self.salts, "must be distinct and non-empty", "name each")
        if any(not isinstance(s, str) or not s or "|" in s for s in self.salts):
            raise ConfigError("salts", self.salts, "are not plain names", "use e.g. 's0'")
        for name in ("ends", "groups", "capacity", "max_pending"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, value, "must be an int >= 1", "give at least 1")

    def members(self, salt: str, end: int) -> tuple[bytes, ...]:
        """The host keys of the chunk of ``salt`` ending at ``end``, in group order. Pure."""
        block_hash = hashlib.sha256(f"{salt}/{end}".encode()).digest()[:8]
        return tuple(block_hash + group.to_bytes(4, "big") for group in range(self.groups))

    def chunks(self) -> tuple[tuple[str, int], ...]:
        """Every (salt, end) of the universe, tenant by tenant, in prefix order. Pure."""
        return tuple((salt, end) for salt in self.salts for end in range(1, self.ends + 1))

    def truth(self) -> dict[bytes, str]:
        """Each member key's true content tag ``"salt|end|group"``. Pure."""
        return {
            key: f"{salt}|{end}|{group}"
            for salt, end in self.chunks()
            for group, key in enumerate(self.members(salt, end))
        }


@dataclass(frozen=True, slots=True)
class Store:
    """A GPU store job of a chunk begins (its members reserved STORING)."""

    salt: str
    end: int

    def __str__(self) -> str:
        return f"store {self.salt}@{self.end}"


@dataclass(frozen=True, slots=True)
class StoreDone:
    """The store job of a chunk ends; a success offers the chunk to write-behind."""

    salt: str
    end: int
    ok: bool

    def __str__(self) -> str:
        return f"store {self.salt}@{self.end} {'completes' if self.ok else 'fails'}"


@dataclass(frozen=True, slots=True)
class Evict:
    """The host evicts a READY chunk (pressure from elsewhere)."""

    salt: str
    end: int

    def __str__(self) -> str:
        return f"evict {self.salt}@{self.end}"


@dataclass(frozen=True, slots=True)
class Claim:
    """A request of tenant ``salt`` misses the host: lookup, then promotions."""

    salt: str
    lookup_fault: bool

    def __str__(self) -> str:
        return f"claim {self.salt}" + (", lookup faults" if self.lookup_fault else "")


_FETCH_WORDS = {
    Injection.NONE: "",
    Injection.FAULT: " faults",
    Injection.TIMEOUT: " times out",
    Injection.CORRUPT: " corrupted",
}


@dataclass(frozen=True, slots=True)
class Fetch:
    """The promotion of chunk ``name`` resolves, the wire doing ``injection``."""

    name: str
    injection: Injection

    def __str__(self) -> str:
        return f"fetch {self.name}{_FETCH_WORDS[self.injection]}"


@dataclass(frozen=True, slots=True)
class Write:
    """The queued SET of chunk ``name`` lands or fails."""

    name: str
    ok: bool

    def __str__(self) -> str:
        return f"write {self.name} {'lands' if self.ok else 'fails'}"


@dataclass(frozen=True, slots=True)
class Vanish:
    """The server loses chunk ``name``."""

    name: str

    def __str__(self) -> str:
        return f"vanish {self.name}"


TierAction = Store | StoreDone | Evict | Claim | Fetch | Write | Vanish


@dataclass(slots=True)
class TierState:
    """The store, GPU store jobs in flight ((salt, end) -> reserved keys), each promotion's
    lookup salt (chunk key -> salt), and the promotions the last action resolved."""

    store: TwoTierStore
    jobs: dict[tuple[str, int], tuple[bytes, ...]]
    salts: dict[bytes, str]
    resolved: tuple[tuple[str, str, str, tuple[str, ...], tuple[str, ...]], ...] = ()

    def copy(self) -> TierState:
        """An independent copy. Frame: nothing changes in ``self``."""
        return TierState(self.store.copy(), dict(self.jobs), dict(self.salts), self.resolved)


class TierModel:
    """:class:`spec.explorer.Model` over :class:`TierState`."""

    stuck_invariant_id = "TT-4"

    def __init__(self, scenario: TierScenario) -> None:
        """Pre: a :class:`TierScenario`. Post: a model of it; nothing explored yet."""
        self.scenario = scenario
        self._truth = scenario.truth()
        self._tenant_of = {tag: tag.split("|", 1)[0] for tag in self._truth.values()}
        self._labels: list[str] = []
        # Each chunk's key, through a store's own chunk_key (a patched key shows in names).
        namer = TwoTierStore(HostStore(1))
        self._keys = tuple(namer.chunk_key(scenario.members(s, e)) for s, e in scenario.chunks())

    # --- the Model protocol ---

    def initial_states(self) -> Iterable[TierState]:
        """One state: an empty host; the remote map per the scenario's start. Pure."""
        sc = self.scenario
        store = TwoTierStore(HostStore(sc.capacity), max_pending=sc.max_pending)
        if sc.start is TierStart.SHARED:
            for end in range(1, sc.ends + 1):
                members = sc.members(sc.salts[0], end)
                tags = tuple(self._truth[key] for key in members)
                store.remote.put(store.chunk_key(members), encode(members, tags))
        return [TierState(store, {}, {})]

    def enabled(self, state: TierState) -> Iterable[TierAction]:
        """Every action of the module docstring that may happen in ``state``. Pure."""
        store = state.store
        actions: list[TierAction] = []
        for salt, end in self.scenario.chunks():
            statuses = {store.host.status(k) for k in self.scenario.members(salt, end)}
            if (salt, end) in state.jobs:
                actions += [StoreDone(salt, end, True), StoreDone(salt, end, False)]
            elif statuses == {LookupResult.MISS}:
                actions.append(Store(salt, end))
            elif statuses == {LookupResult.HIT}:
                actions.append(Evict(salt, end))
        for salt in self.scenario.salts:
            if self._claim(state.copy(), Claim(salt, lookup_fault=False)):
                actions += [Claim(salt, False), Claim(salt, True)]
        promotions, writes = (self._ordered(keys) for keys in store.in_flight())
        for key in promotions:
            actions += [Fetch(self._name(key), injection) for injection in Injection]
        for key in writes:
            actions += [Write(self._name(key), True), Write(self._name(key), False)]
        held = self._ordered(key for key, _ in store.remote.items())
        actions += [Vanish(self._name(key)) for key in held]
        return actions

    def step(self, state: TierState, action: TierAction) -> TierState:
        """The successor of ``state`` under ``action``; ``state`` is left unchanged.

        Pre: ``action`` is enabled in ``state``. Post: the successor; the labels of the
        transition are kept for :meth:`labels`.
        """
        twin = state.copy()
        twin.resolved = ()
        self._labels = [type(action).__name__.lower()]
        if isinstance(action, Claim):
            self._claim(twin, action)
        elif isinstance(action, Fetch):
            self._fetch(twin, action)
        else:
            self._move(twin, action)
        return twin

    def key(self, state: TierState) -> Hashable:
        """Everything that decides the future and the violations. Pure."""
        return (
            state.store.freeze(),
            tuple(sorted(state.jobs.items())),
            tuple(sorted(state.salts.items())),
            state.resolved,
        )

    def violations(self, state: TierState) -> Mapping[str, list[str]]:
        """Every failing TT-* and ST-* invariant of ``state``, plus TT-3's half the snapshot
        cannot show (:meth:`owners`). Pure."""
        snap = state.store.snapshot()
        failing = dict(check_all("tiers", snap))
        failing.update(check_all("store", snap["host"]))
        failing.update(check_all("tiers_content", {"tiers": snap, "content": self.content(state)}))
        orphans = self.owners(state, snap)
        if orphans:
            failing.setdefault("TT-3", []).extend(orphans)
        return failing

    def owners(self, state: TierState, snap: Mapping[str, Any]) -> list[str]:
        """TT-3's "exactly one operation" for STORING entries: each is reserved by one GPU
        store job or one promotion. The snapshot lists promotions but no GPU store job (the
        contract's schema), so the model, which knows its jobs, checks this half. Pure."""
        owned = [key.hex() for keys in state.jobs.values() for key in keys]
        owned += [key for _, reserved in snap["promotions"] for key in reserved]
        storing = [
            k for k, entry, _ in snap["host"]["entries"] if entry == EntryState.STORING.value
        ]
        messages = [
            f"STORING key {key} owned by no operation" for key in storing if key not in owned
        ]
        messages += [
            f"key {key} reserved by {owned.count(key)} operations"
            for key in sorted(set(owned))
            if owned.count(key) > 1
        ]
        return messages

    def is_final(self, state: TierState) -> bool:
        """Nothing in flight: no store job, no promotion, no write. Pure."""
        promotions, writes = state.store.in_flight()
        return not (state.jobs or promotions or writes)

    def labels(self, state: TierState, action: TierAction) -> Iterable[str]:
        """The action's kind and what it caused (``fetch:corrupt``, ``write:dropped``...).

        Pre: called right after ``step(state, action)``. Frame: nothing changes.
        """
        return list(self._labels)

    # --- helpers the tests use too ---

    def content(self, state: TierState) -> dict[str, Any]:
        """The content oracle of ``state``, with ``resolved`` and ``tenant_of``. Pure."""
        oracle = state.store.content(self._truth)
        oracle["resolved"] = state.resolved
        oracle["tenant_of"] = dict(self._tenant_of)
        return oracle

    # --- transitions ---

    def _claim(self, state: TierState, action: Claim) -> bool:
        """Run a claim on ``state`` (mutated); whether it started a promotion."""
        sc, store = self.scenario, state.store
        steps = [sc.members(action.salt, end) for end in range(1, sc.ends + 1)]
        found = store.remote_lookup([store.chunk_key(m) for m in steps], fault=action.lookup_fault)
        started = False
        for members in steps[:found]:
            result = store.promote(members)
            if isinstance(result, PromotionStarted):
                state.salts[result.chunk_key] = action.salt
                self._labels.append(f"claim:evicted:{len(result.evicted)}")
                started = True
            elif result not in (PromoteRefusal.HOST_HIT, PromoteRefusal.IN_FLIGHT):
                self._labels.append(f"claim:{result.value}")
                break
        if action.lookup_fault:
            self._labels.append("claim:lookup_fault")
        return started

    def _fetch(self, state: TierState, action: Fetch) -> None:
        key = next(k for k in state.store.in_flight()[0] if self._name(k) == action.name)
        done: Resolved = state.store.complete_promotion(key, action.injection)
        salt = state.salts.pop(key)
        hexes = tuple(member.hex() for member in done.reserved)
        state.resolved = ((key.hex(), done.resolution.value, salt, hexes, done.loaded),)
        self._labels.append(f"fetch:{done.resolution.value}")

    def _move(self, state: TierState, action: Store | StoreDone | Evict | Write | Vanish) -> None:
        sc, store = self.scenario, state.store
        if isinstance(action, Store):
            prepared = store.prepare_store(sc.members(action.salt, action.end))
            if isinstance(prepared, PrepareStoreOutput) and prepared.keys_to_store:
                state.jobs[(action.salt, action.end)] = prepared.keys_to_store
            else:
                self._labels.append("store:no_space")
        elif isinstance(action, StoreDone):
            self._store_done(state, action)
        elif isinstance(action, Evict):
            store.evict(sc.members(action.salt, action.end))
        elif isinstance(action, Write):
            key = next(k for k in store.in_flight()[1] if self._name(k) == action.name)
            store.complete_write(key, action.ok)
        else:  # Vanish: the last kind _move receives
            key = next(k for k, _ in store.remote.items() if self._name(k) == action.name)
            store.vanish(key)

    def _store_done(self, state: TierState, action: StoreDone) -> None:
        reserved = state.jobs.pop((action.salt, action.end))
        tags = tuple(self._truth[key] for key in reserved) if action.ok else None
        state.store.complete_store(reserved, tags)
        if action.ok:
            members = self.scenario.members(action.salt, action.end)
            self._labels.append(f"write:{state.store.write_behind(members).value}")

    def _name(self, chunk_key: bytes) -> str:
        """``salt@end`` of the first chunk of the universe whose key is ``chunk_key``."""
        universe = self.scenario.chunks()
        salt, end = universe[self._rank(chunk_key)]
        return f"{salt}@{end}"

    def _rank(self, chunk_key: bytes) -> int:
        """The index in the universe of the first chunk whose key is ``chunk_key``."""
        return self._keys.index(chunk_key)

    def _ordered(self, keys: Iterable[bytes]) -> list[bytes]:
        """``keys`` in the universe's order (tenant by tenant, prefix order), for readable
        traces."""
        return sorted(keys, key=self._rank)
