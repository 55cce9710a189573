"""The two-tier model (spec.tiers): chunk keys, the codec, the remote map, the store's
operations with each outcome, its snapshot, the TT-* predicates on hand-made defects, and the
bounded exhaustive exploration at the CI bound."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from tiers_harness import CONTROLS

from spec.errors import ConfigError
from spec.explorer import explore
from spec.invariants import check_all, invariants_for
from spec.store import EventKind, HostStore, LookupResult
from spec.tiers.chunk import FORMAT_VERSION, MAGIC, Verdict, chunk_key, encode, verify
from spec.tiers.model import (
    Claim,
    Evict,
    Fetch,
    Store,
    StoreDone,
    TierModel,
    TierScenario,
    TierStart,
    Vanish,
    Write,
)
from spec.tiers.remote import RemoteMap
from spec.tiers.two_tier import (
    COUNTER_NAMES,
    UNWRITTEN,
    Injection,
    PromoteRefusal,
    PromotionStarted,
    Resolution,
    TwoTierStore,
    WriteOutcome,
)

SC = TierScenario()
A, B = SC.members("s0", 1), SC.members("s0", 2)
A1 = SC.members("s1", 1)
TRUTH = SC.truth()


def tags(members: tuple[bytes, ...]) -> tuple[str, ...]:
    return tuple(TRUTH[key] for key in members)


def stored(store: TwoTierStore, members: tuple[bytes, ...]) -> None:
    """A GPU store of ``members`` that completes."""
    store.prepare_store(members)
    store.complete_store(members, tags(members))


def fresh(capacity: int = 4, max_pending: int = 2) -> TwoTierStore:
    return TwoTierStore(HostStore(capacity), max_pending=max_pending)


def on_server(store: TwoTierStore, members: tuple[bytes, ...]) -> bytes:
    """Put ``members``'s chunk on the server as another engine would; its chunk key."""
    key = store.chunk_key(members)
    store.remote.put(key, encode(members, tags(members)))
    return key


def holds(violations: dict[str, list[str]], inv_id: str, text: str) -> bool:
    return any(text in message for message in violations.get(inv_id, []))


# ----------------------------------------------------------------- chunk key and codec


def test_chunk_key_is_a_content_address() -> None:
    assert chunk_key(b"ns", A) == chunk_key(b"ns", list(A))
    assert chunk_key(b"ns", A) != chunk_key(b"ns", A[::-1])  # group order is part of it
    assert chunk_key(b"ns", A) != chunk_key(b"other", A)
    assert chunk_key(b"ns", A) != chunk_key(b"ns", A1)  # another salt, another key
    # Length-prefixed: moving a byte across the member boundary changes the key.
    assert chunk_key(b"", (b"ab", b"c")) != chunk_key(b"", (b"a", b"bc"))


@pytest.mark.parametrize(
    ("namespace", "members", "field"),
    [
        ("ns", A, "namespace"),
        (b"ns", (), "members"),
        (b"ns", b"key", "members"),
        (b"ns", (A[0], A[0]), "members"),
        (b"ns", (A[0], b""), "members"),
        (b"ns", (A[0], "key"), "members"),
    ],
)
def test_chunk_key_refuses_bad_arguments(namespace: Any, members: Any, field: str) -> None:
    with pytest.raises(ConfigError) as error:
        chunk_key(namespace, members)
    assert error.value.field == field


def test_encode_refuses_a_payload_count_that_differs() -> None:
    with pytest.raises(ConfigError) as error:
        encode(A, ("only one",))
    assert error.value.field == "payloads"
    with pytest.raises(ConfigError):
        encode(A, (1, 2))


def test_verify_accepts_the_chunk_as_written() -> None:
    value = encode(A, tags(A))
    assert (value.magic, value.version) == (MAGIC, FORMAT_VERSION)
    assert verify(value, A) is Verdict.PROMOTED


@pytest.mark.parametrize(
    "change",
    [
        {"magic": b"XXXX"},
        {"version": FORMAT_VERSION + 1},
        {"members": A[::-1]},
        {"lengths": (1, 1)},
        {"payloads": ("s0|1|0", "s0|1|9")},  # same lengths, digest differs
        {"payloads": ("s0|1|0",)},  # a member without its payload
    ],
)
def test_verify_finds_every_mismatch_corrupt(change: dict[str, Any]) -> None:
    assert verify(replace(encode(A, tags(A)), **change), A) is Verdict.CORRUPT


def test_verify_wants_exactly_the_expected_members() -> None:
    assert verify(encode(A, tags(A)), A1) is Verdict.CORRUPT
    assert verify(encode(A, tags(A)), A[:1]) is Verdict.CORRUPT


# ----------------------------------------------------------------- the remote map


def test_remote_map_holds_whole_values_and_may_lose_them() -> None:
    remote = RemoteMap()
    value = encode(A, tags(A))
    remote.put(b"k1", value)
    twin = remote.copy()
    assert remote.get(b"k1") == value
    assert remote.exists([b"k1", b"k2", b"k1"]) == 1
    assert remote.vanish(b"k1")
    assert not remote.vanish(b"k1")  # losing it twice is a no-op
    assert remote.get(b"k1") is None
    assert twin.items() == ((b"k1", value),)  # the copy is independent
    assert twin.freeze() != remote.freeze()


# ----------------------------------------------------------------- the two-tier store


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"namespace": "ns"}, "namespace"),
        ({"max_pending": 0}, "max_pending"),
        ({"max_pending": True}, "max_pending"),
    ],
)
def test_store_refuses_bad_configuration(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as error:
        TwoTierStore(HostStore(2), **kwargs)
    assert error.value.field == field


def test_store_wants_an_empty_host() -> None:
    host = HostStore(2)
    host.prepare_store([b"k"])
    with pytest.raises(ConfigError) as error:
        TwoTierStore(host)
    assert error.value.field == "host"


def test_write_behind_copies_at_enqueue_and_lands_whole() -> None:
    store = fresh()
    assert store.write_behind(A) is WriteOutcome.NOT_READY
    stored(store, A)
    assert store.write_behind(A) is WriteOutcome.ENQUEUED
    assert store.write_behind(A) is WriteOutcome.PRESENT  # queued already
    key = store.chunk_key(A)
    assert store.evict(A) == A  # eviction does not wait on the write, nor change it
    store.complete_write(key, success=True)
    assert store.remote.get(key) == encode(A, tags(A))
    stored(store, A)
    assert store.write_behind(A) is WriteOutcome.PRESENT  # the server holds it
    assert store.snapshot()["counters"]["written"] == 1


def test_a_full_queue_drops_and_a_failed_write_leaves_the_map() -> None:
    store = fresh(max_pending=1)
    stored(store, A)
    stored(store, B)
    assert store.write_behind(A) is WriteOutcome.ENQUEUED
    assert store.write_behind(B) is WriteOutcome.DROPPED
    store.complete_write(store.chunk_key(A), success=False)
    counters = store.snapshot()["counters"]
    assert (counters["writes_enqueued"], counters["writes_failed"]) == (1, 1)
    assert counters["writes_dropped"] == 1
    assert store.remote.items() == ()
    with pytest.raises(ConfigError) as error:
        store.complete_write(store.chunk_key(A), success=True)
    assert error.value.field == "chunk_key"


def test_complete_store_checks_payloads_and_a_failure_drops_the_slots() -> None:
    store = fresh()
    store.prepare_store(A)
    with pytest.raises(ConfigError) as error:
        store.complete_store(A, ("one",))
    assert error.value.field == "payloads"
    store.complete_store(A, None)
    assert store.host.lookup(A).hits == 0
    assert store.content(TRUTH)["held"] == {}


def test_remote_lookup_counts_and_a_fault_answers_zero() -> None:
    store = fresh()
    keys = [on_server(store, A), store.chunk_key(B)]
    assert store.remote_lookup(keys) == 1
    assert store.remote_lookup(keys, fault=True) == 0
    counters = store.snapshot()["counters"]
    assert (counters["lookups"], counters["lookup_faults"]) == (2, 1)


def test_promotion_that_verifies_makes_the_members_ready() -> None:
    store = fresh()
    key = on_server(store, A)
    started = store.promote(A)
    assert started == PromotionStarted(key, A, ())
    assert store.content(TRUTH)["held"] == {}  # STORING entries are not READY
    assert store.in_flight() == ((key,), ())
    done = store.complete_promotion(key, Injection.NONE)
    assert (done.resolution, done.loaded) == (Resolution.PROMOTED, tags(A))
    assert store.host.lookup(A).hits == 2
    assert store.content(TRUTH)["held"] == {k.hex(): TRUTH[k] for k in A}
    assert store.promote(A) is PromoteRefusal.HOST_HIT


@pytest.mark.parametrize(
    ("injection", "vanished", "resolution"),
    [
        (Injection.NONE, True, Resolution.MISSING),
        (Injection.FAULT, False, Resolution.FAULT),
        (Injection.TIMEOUT, False, Resolution.TIMEOUT),
        (Injection.CORRUPT, False, Resolution.CORRUPT),
    ],
)
def test_a_failed_promotion_removes_its_members_and_is_remembered(
    injection: Injection, vanished: bool, resolution: Resolution
) -> None:
    store = fresh()
    key = on_server(store, A)
    assert isinstance(store.promote(A), PromotionStarted)
    if vanished:
        assert store.vanish(key)
    done = store.complete_promotion(key, injection)
    assert (done.resolution, done.reserved, done.loaded) == (resolution, A, ())
    snap = store.snapshot()
    assert snap["host"]["entries"] == ()
    assert snap["host"]["events"][-1] == (EventKind.REMOVED.value, tuple(k.hex() for k in A))
    assert snap["counters"][resolution.value] == 1
    assert store.is_failed(key)
    assert store.promote(A) is PromoteRefusal.FAILED_BEFORE


def test_a_landed_write_clears_the_failure_memory() -> None:
    store = fresh()
    key = on_server(store, A)
    store.promote(A)
    store.vanish(key)
    store.complete_promotion(key, Injection.NONE)
    stored(store, A)
    assert store.write_behind(A) is WriteOutcome.ENQUEUED
    store.complete_write(key, success=True)
    assert not store.is_failed(key)


def test_promote_refusals_change_nothing() -> None:
    store = fresh(capacity=2)
    on_server(store, A)
    on_server(store, B)
    on_server(store, A1)
    store.prepare_store(B[:1])  # a GPU store writes one member of B
    before = store.snapshot()
    assert store.promote(B) is PromoteRefusal.PENDING
    assert store.snapshot() == before
    assert isinstance(store.promote(A[:1]), PromotionStarted)
    assert store.promote(A[:1]) is PromoteRefusal.IN_FLIGHT
    before = store.snapshot()
    assert store.promote(A1) is PromoteRefusal.NO_SPACE  # both entries STORING, none evictable
    assert store.snapshot() == before


def test_promotion_reserves_only_the_absent_members() -> None:
    store = fresh()
    key = on_server(store, A)
    stored(store, A[:1])
    started = store.promote(A)
    assert isinstance(started, PromotionStarted)
    assert started.reserved == A[1:]
    assert store.snapshot()["promotions"] == ((key.hex(), (A[1].hex(),)),)
    done = store.complete_promotion(key, Injection.NONE)
    assert done.loaded == (TRUTH[A[1]],)
    assert store.host.status(A[0]) is LookupResult.HIT


def test_complete_promotion_refuses_bad_arguments() -> None:
    store = fresh()
    key = on_server(store, A)
    with pytest.raises(ConfigError) as error:
        store.complete_promotion(key, Injection.NONE)
    assert error.value.field == "chunk_key"
    store.promote(A)
    with pytest.raises(ConfigError) as error:
        store.complete_promotion(key, "fault")  # type: ignore[arg-type]
    assert error.value.field == "injection"


def test_snapshot_has_the_contract_schema_and_copies_are_independent() -> None:
    store = fresh()
    stored(store, A)
    store.write_behind(A)
    twin = store.copy()
    snap = store.snapshot()
    assert sorted(snap) == ["counters", "failed", "host", "promotions", "remote", "writes"]
    assert tuple(snap["counters"]) == COUNTER_NAMES
    assert snap["writes"] == ((store.chunk_key(A).hex(), tuple(k.hex() for k in A)),)
    assert store.content(TRUTH)["writes"] == {store.chunk_key(A).hex(): tags(A)}
    store.complete_write(store.chunk_key(A), success=True)
    assert twin.snapshot() == snap
    assert twin.freeze() != store.freeze()
    assert check_all("tiers", store.snapshot()) == {}


def test_prepare_store_eviction_drops_slots() -> None:
    store = fresh(capacity=2)
    stored(store, A)
    store.prepare_store(B)
    assert store.content(TRUTH)["held"] == {}
    assert UNWRITTEN not in store.content(TRUTH)["held"].values()


# ----------------------------------------------------------------- the predicates


def _snapshot(**changes: Any) -> dict[str, Any]:
    store = fresh()
    key = on_server(store, A)
    store.promote(A)
    snap = store.snapshot()
    snap.update(changes)
    assert key.hex() == snap["remote"][0][0]
    return snap


def test_tier_invariants_are_registered_in_two_subjects() -> None:
    assert [i.id for i in invariants_for("tiers")] == ["TT-1", "TT-3", "TT-4", "TT-8"]
    assert [i.id for i in invariants_for("tiers_content")] == ["TT-2", "TT-5", "TT-6", "TT-7"]


def test_tt1_tt3_tt4_name_malformed_listings() -> None:
    snap = _snapshot()
    chunk, members = snap["remote"][0]
    bad = dict(
        snap,
        remote=((chunk, ()), (chunk, members)),
        writes=((chunk, (members[0], members[0])),),
        promotions=((chunk, ()), (chunk, members[:1]), ("ff", members[:1])),
    )
    found = check_all("tiers", bad)
    assert holds(found, "TT-1", "lists chunk")
    assert holds(found, "TT-1", "has members ()")
    assert holds(found, "TT-1", "has members")
    assert holds(found, "TT-3", "reserves nothing")
    assert holds(found, "TT-3", "reserved by two promotions")
    assert holds(found, "TT-4", "in flight twice")
    assert holds(found, "TT-4", "landed write")
    host = dict(snap["host"], capacity=1)
    assert holds(check_all("tiers", dict(snap, host=host)), "TT-3", "> capacity 1")


def test_tt8_names_negative_counters_and_lookup_faults() -> None:
    snap = _snapshot()
    counters = dict(snap["counters"], written=-1, lookup_faults=3)
    found = check_all("tiers", dict(snap, counters=counters))
    assert holds(found, "TT-8", "counter written is negative")
    assert holds(found, "TT-8", "lookup_faults 3 > lookups 0")


def test_tt5_names_a_failure_that_kept_or_loaded() -> None:
    snap = _snapshot()
    chunk, reserved = snap["promotions"][0]
    content = {"resolved": ((chunk, "fault", "s0", reserved, ("x",)),)}
    found = check_all("tiers_content", {"tiers": snap, "content": _content(content)})
    assert holds(found, "TT-5", "is not a remembered miss")
    assert holds(found, "TT-5", "kept [")


def _content(changes: dict[str, Any]) -> dict[str, Any]:
    base = {"truth": {}, "held": {}, "remote": {}, "writes": {}, "resolved": (), "tenant_of": {}}
    base.update(changes)
    return base


# ----------------------------------------------------------------- the model and its search


def test_scenario_refuses_bad_fields() -> None:
    for kwargs, field in [
        ({"salts": ()}, "salts"),
        ({"salts": ("s0", "s0")}, "salts"),
        ({"salts": ("a|b",)}, "salts"),
        ({"ends": 0}, "ends"),
        ({"capacity": True}, "capacity"),
    ]:
        with pytest.raises(ConfigError) as error:
            TierScenario(**kwargs)
        assert error.value.field == field


def test_actions_read_as_trace_steps() -> None:
    assert str(Store("s0", 1)) == "store s0@1"
    assert str(Claim("s1", True)) == "claim s1, lookup faults"
    assert str(Fetch("s0@2", Injection.TIMEOUT)) == "fetch s0@2 times out"
    assert str(Write("s0@1", True)) == "write s0@1 lands"
    assert str(Write("s0@1", False)) == "write s0@1 fails"
    assert str(StoreDone("s1", 2, False)) == "store s1@2 fails"
    assert str(Vanish("s0@1")) == "vanish s0@1"
    assert str(Evict("s0", 1)) == "evict s0@1"


def test_the_ci_bound_is_exhaustive_to_depth_and_reaches_every_outcome() -> None:
    """Both starts at the CI bound: no violation, and every resolution, write outcome and
    refusal of the contract occurs (so the checks saw each one)."""
    coverage: dict[str, int] = {}
    states = {}
    for name, (scenario, depth) in CONTROLS.items():
        result = explore(TierModel(scenario), depth, stop_at_first=False)
        assert result.violations == ()
        assert not result.budget_cut
        states[name] = result.states
        for label, n in result.coverage.items():
            coverage[label] = coverage.get(label, 0) + n
    for resolution in Resolution:
        assert coverage.get(f"fetch:{resolution.value}", 0) > 0, resolution
    for outcome in ("enqueued", "dropped", "present"):
        assert coverage.get(f"write:{outcome}", 0) > 0, outcome
    for label in ("claim:no_space", "claim:pending", "claim:failed_before", "claim:evicted:2"):
        assert coverage.get(label, 0) > 0, label
    assert coverage["claim:lookup_fault"] > 0
    assert coverage["vanish"] > 0
    assert coverage["store:no_space"] > 0
    # The figures docs/explanation/remote-tier.md gives.
    assert states == {"empty": 1270, "shared": 4753}


def test_a_corrupt_fetch_leaves_nothing_ready_in_the_model() -> None:
    model = TierModel(TierScenario(start=TierStart.SHARED))
    (state,) = model.initial_states()
    state = model.step(state, Claim("s0", False))
    state = model.step(state, Fetch("s0@1", Injection.CORRUPT))
    assert model.labels(state, Fetch("s0@1", Injection.CORRUPT)) == ["fetch", "fetch:corrupt"]
    assert model.content(state)["resolved"][0][1] == "corrupt"
    assert model.violations(state) == {}
    assert not model.is_final(state)  # s0@2's promotion is still in flight


def test_tt8_identities_hold_with_every_term_non_zero() -> None:
    """promotions_started = promoted + missing + fault + timeout + corrupt + in flight, and
    writes_enqueued = written + writes_failed + queued (drops apart), each term at least 1."""
    wide = TierScenario(salts=("s0",), ends=9)
    truth = wide.truth()
    chunks = [wide.members("s0", end) for end in range(1, 10)]
    store = TwoTierStore(HostStore(18), max_pending=2)
    keys = []
    for members in chunks[:6]:
        keys.append(store.chunk_key(members))
        store.remote.put(keys[-1], encode(members, tuple(truth[k] for k in members)))
        assert isinstance(store.promote(members), PromotionStarted)
    store.vanish(keys[1])
    injections = (Injection.NONE, Injection.NONE, Injection.FAULT, Injection.TIMEOUT)
    for key, injection in zip(keys, (*injections, Injection.CORRUPT), strict=False):
        store.complete_promotion(key, injection)
    for members in chunks[6:]:
        store.prepare_store(members)
        store.complete_store(members, tuple(truth[k] for k in members))
    outcomes = [store.write_behind(members) for members in chunks[6:]]
    assert outcomes == [WriteOutcome.ENQUEUED, WriteOutcome.ENQUEUED, WriteOutcome.DROPPED]
    store.complete_write(store.chunk_key(chunks[6]), success=True)
    store.complete_write(store.chunk_key(chunks[7]), success=False)
    assert store.write_behind(chunks[8]) is WriteOutcome.ENQUEUED
    snap = store.snapshot()
    c = snap["counters"]
    resolved = [c[r.value] for r in Resolution]
    assert resolved == [1, 1, 1, 1, 1]
    assert len(snap["promotions"]) == 1
    assert c["promotions_started"] == sum(resolved) + len(snap["promotions"]) == 6
    assert (c["written"], c["writes_failed"], len(snap["writes"])) == (1, 1, 1)
    assert c["writes_enqueued"] == 3
    assert c["writes_dropped"] == 1
    assert check_all("tiers", snap) == {}
    assert check_all("store", snap["host"]) == {}


def test_the_model_names_storing_entries_of_no_or_two_operations() -> None:
    """TT-3's half the snapshot cannot show (it lists no GPU store job): the model checks it."""
    model = TierModel(TierScenario(start=TierStart.SHARED))
    (state,) = model.initial_states()
    state = model.step(state, Claim("s0", False))  # promotes s0@1 and s0@2
    assert model.violations(state) == {}
    twice = state.copy()
    twice.jobs[("s0", 1)] = A  # a GPU store job over keys a promotion reserved
    found = model.violations(twice)["TT-3"]
    assert found == [f"key {k.hex()} reserved by 2 operations" for k in sorted(A)]
    orphan = model.step(next(iter(model.initial_states())), Store("s1", 1))
    assert model.violations(orphan) == {}
    del orphan.jobs[("s1", 1)]  # the job forgotten, its reservation kept
    found = model.violations(orphan)["TT-3"]
    assert found == [f"STORING key {k.hex()} owned by no operation" for k in sorted(A1)]
