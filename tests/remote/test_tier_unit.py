"""RemoteTier and TwoTierStore over an in-memory client: queue, drops, outcomes, counters.

No server: the fake client (``_fake_chunk_client.py``) answers as Redis would and fails on demand,
so the write-behind queue, the fault mapping into outcomes and the TT-8 counters are checked
on every CI machine. The same paths run against a real server in test_faults_real.py.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from _fake_chunk_client import FakeClient
from _remote_helpers import SLOT, check_counters, chunk_of, content, host_bytes, store_from_gpu

from hybridkv.errors import HybridKVConfigError, HybridKVError
from hybridkv.remote import (
    REMOTE_COUNTER_NAMES,
    Admission,
    Chunk,
    ClientFault,
    PromoteOutcome,
    PromoteRefusal,
    RemoteConfig,
    RemoteTier,
    SlotBuffer,
    TwoTierStore,
    encode_chunk,
    redis_key,
)
from hybridkv.store import EventKind, HostStore, Refusal


def two_tier(capacity: int = 6, **config: Any) -> tuple[TwoTierStore, FakeClient]:
    client = FakeClient()
    tier = RemoteTier(RemoteConfig(**config), client, background=False)
    return TwoTierStore(HostStore(capacity), tier, SlotBuffer.allocate(capacity, SLOT)), client


def test_write_behind_copies_at_enqueue_and_writes_once() -> None:
    store, client = two_tier()
    chunk = chunk_of(0)
    store_from_gpu(store, chunk)
    assert store.write_behind(chunk) is Admission.ENQUEUED
    assert store.write_behind(chunk) is Admission.PENDING
    # The host slots change (evicted and reused) before the write runs: the queued copy holds.
    for slot in store.host.slots(chunk.members):
        store.slots.view(slot)[:] = b"X" * SLOT
    assert store.snapshot()["writes"] == (chunk.plain(),)
    assert store.tier.write_pending() == 1
    value = client.data[redis_key(chunk.key)]
    assert value == encode_chunk(chunk.members, [content(k) for k in chunk.members])
    assert store.write_behind(chunk) is Admission.KNOWN
    snap = store.snapshot()
    assert snap["remote"] == (chunk.plain(),)
    assert snap["writes"] == ()
    assert snap["counters"]["writes_enqueued"] == snap["counters"]["written"] == 1
    check_counters(snap)


def test_write_behind_needs_every_member_ready() -> None:
    store, _ = two_tier()
    chunk = chunk_of(0)
    store.host.prepare_store(chunk.members[:1])
    assert store.write_behind(chunk) is Refusal.NOT_READY
    assert store.snapshot()["counters"]["writes_enqueued"] == 0


def test_full_queue_drops_and_never_enqueues() -> None:
    store, _ = two_tier(capacity=8, max_pending=2)
    chunks = [chunk_of(i) for i in range(4)]
    for chunk in chunks:
        store_from_gpu(store, chunk)
    verdicts = [store.write_behind(chunk) for chunk in chunks]
    assert verdicts == [Admission.ENQUEUED] * 2 + [Admission.DROPPED] * 2
    c = store.snapshot()["counters"]
    assert (c["writes_enqueued"], c["writes_dropped"]) == (2, 2)
    assert store.tier.write_pending(limit=1) == 1
    assert store.write_behind(chunks[2]) is Admission.ENQUEUED  # room again
    assert store.tier.write_pending() == 2
    check_counters(store.snapshot())


def test_failed_write_counts_and_is_not_indexed() -> None:
    store, client = two_tier(ttl_s=30)
    chunk = chunk_of(0)
    store_from_gpu(store, chunk)
    client.fail_next["set"] = ClientFault.TIMEOUT
    store.write_behind(chunk)
    store.tier.write_pending()
    snap = store.snapshot()
    assert snap["remote"] == ()
    assert snap["counters"]["writes_failed"] == 1
    assert store.write_behind(chunk) is Admission.ENQUEUED  # not known: written again
    store.tier.write_pending()
    assert client.ttls[redis_key(chunk.key)] == 30
    check_counters(store.snapshot())


def test_background_writer_never_blocks_the_caller() -> None:
    client = FakeClient()
    client.gate.clear()  # every SET hangs until the gate opens
    tier = RemoteTier(RemoteConfig(max_pending=3), client)
    chunks = [chunk_of(i) for i in range(6)]
    started = time.monotonic()
    verdicts = [tier.write_behind(c, [content(k) for k in c.members]) for c in chunks]
    assert time.monotonic() - started < 1.0
    assert verdicts.count(Admission.ENQUEUED) == 3
    assert verdicts.count(Admission.DROPPED) == 3
    assert not tier.flush(0.05)  # the SET is held
    client.gate.set()
    assert tier.flush(5.0)
    tier.close()
    assert client.closed
    snap = tier.snapshot()
    assert snap["counters"]["written"] == 3
    assert tier.write_behind(chunks[5], [b"", b""]) is Admission.DROPPED  # closed
    check_counters(tier.snapshot())


def test_close_writes_what_is_queued_without_a_thread() -> None:
    client = FakeClient()
    tier = RemoteTier(RemoteConfig(), client, background=False)
    tier.write_behind(chunk_of(0), [b"a", b"b"])
    tier.close()
    assert tier.snapshot()["writes"] == ()
    assert len(client.data) == 1


def test_promote_round_trip_into_slots() -> None:
    writer, client = two_tier()
    chunk = chunk_of(0)
    store_from_gpu(writer, chunk)
    writer.write_behind(chunk)
    writer.tier.write_pending()
    reader = TwoTierStore(
        HostStore(4),
        RemoteTier(RemoteConfig(), client, background=False),
        SlotBuffer.allocate(4, SLOT),
    )
    assert reader.remote_lookup([chunk, chunk_of(1)]) == 1
    promotion = reader.prepare_promote(chunk)
    assert not isinstance(promotion, PromoteRefusal)
    assert reader.snapshot()["promotions"] == (chunk.plain(),)
    states = {e[1] for e in reader.snapshot()["host"]["entries"]}
    assert states == {"storing"}
    assert reader.complete_promote(promotion) is PromoteOutcome.PROMOTED
    assert host_bytes(reader, chunk) == [content(k) for k in chunk.members]
    assert reader.host.lookup(chunk.members).hits == 2
    snap = reader.snapshot()
    assert snap["counters"]["promoted"] == snap["counters"]["promotions_started"] == 1
    assert snap["promotions"] == ()
    assert reader.promote(chunk) is PromoteRefusal.PRESENT
    check_counters(snap)


@pytest.mark.parametrize(
    ("damage", "outcome"),
    [
        ("vanish", PromoteOutcome.MISSING),
        ("fault", PromoteOutcome.FAULT),
        ("timeout", PromoteOutcome.TIMEOUT),
        ("corrupt", PromoteOutcome.CORRUPT),
        ("short payload", PromoteOutcome.CORRUPT),
    ],
)
def test_failed_promotion_drops_members_and_ends_claims(damage: str, outcome: Any) -> None:
    store, client = two_tier()
    first, second = chunk_of(0), chunk_of(1)
    for chunk in (first, second):
        store_from_gpu(store, chunk)
        store.write_behind(chunk)
    store.tier.write_pending()
    store.host.evict(list(second.members))
    name = redis_key(second.key)
    if damage == "vanish":
        del client.data[name]
    elif damage in ("fault", "timeout"):
        client.fail_next["get"] = ClientFault(damage)
    elif damage == "corrupt":
        client.data[name] = client.data[name][:-1] + b"?"
    else:  # verified, but a payload the host slot cannot hold
        client.data[name] = encode_chunk(second.members, [b"short", content(second.members[1])])
    store.host.take_events()
    assert store.promote(second) is outcome
    events = store.host.take_events()
    assert [e.kind for e in events] == [EventKind.REMOVED]
    assert events[0].keys == second.members
    assert store.host.lookup(second.members).hits == 0
    snap = store.snapshot()
    assert snap["failed"] == (second.key.hex(),)
    assert snap["counters"][outcome.value] == 1
    assert (second.plain() in snap["remote"]) is (damage in ("fault", "timeout"))
    # The claim ends before the failed chunk; a second promotion is refused.
    assert store.remote_lookup([first, second]) == 1
    assert store.promote(second) is PromoteRefusal.FAILED
    check_counters(snap)
    # A fresh write of the chunk clears the memory: the server holds a verified copy again.
    store_from_gpu(store, second)
    store.write_behind(second)
    store.tier.write_pending()
    assert store.snapshot()["failed"] == ()


def test_lookup_fault_answers_zero_and_counts() -> None:
    store, client = two_tier()
    chunk = chunk_of(0)
    store_from_gpu(store, chunk)
    store.write_behind(chunk)
    store.tier.write_pending()
    client.fail_next["exists"] = ClientFault.FAULT
    assert store.remote_lookup([chunk]) == 0
    assert store.remote_lookup([]) == 0
    c = store.snapshot()["counters"]
    assert (c["lookups"], c["lookup_faults"]) == (2, 1)
    client.data.clear()  # vanished: the next lookup sees it and forgets it
    assert store.remote_lookup([chunk]) == 0
    assert store.snapshot()["remote"] == ()


def test_promotion_refused_without_room_changes_nothing() -> None:
    store, client = two_tier(capacity=2)
    held = chunk_of(0)
    store_from_gpu(store, held)
    store.host.prepare_load(list(held.members))  # pinned: cannot be evicted
    client.data[redis_key(chunk_of(1).key)] = b"whatever"
    before = store.snapshot()
    assert store.promote(chunk_of(1)) is PromoteRefusal.NO_SPACE
    assert store.snapshot() == before


def test_fetch_without_a_promotion_is_an_error() -> None:
    tier = RemoteTier(RemoteConfig(), FakeClient(), background=False)
    with pytest.raises(HybridKVConfigError) as caught:
        tier.fetch(chunk_of(0))
    assert caught.value.field == "chunk"
    assert tier.begin_promotion(chunk_of(0))
    assert not tier.begin_promotion(chunk_of(0))  # already in flight


def test_errors_name_their_field() -> None:
    cases: list[tuple[Any, str]] = [
        (lambda: RemoteConfig(host=""), "remote_host"),
        (lambda: RemoteConfig(port=0), "remote_port"),
        (lambda: RemoteConfig(port=True), "remote_port"),
        (lambda: RemoteConfig(connect_timeout_s=0), "remote_connect_timeout"),
        (lambda: RemoteConfig(deadline_s=float("nan")), "remote_deadline"),
        (lambda: RemoteConfig(ttl_s=-1), "remote_ttl"),
        (lambda: RemoteConfig(max_pending=0), "remote_max_pending"),
        (lambda: RemoteConfig(namespace="x"), "remote_namespace"),
        (lambda: RemoteTier("cfg", FakeClient()), "config"),
        (lambda: SlotBuffer(bytearray(10), 0), "slot_bytes"),
        (lambda: SlotBuffer(bytearray(10), 4), "buffer"),
        (lambda: SlotBuffer(b"readonly", 4), "buffer"),
        (lambda: SlotBuffer(object(), 4), "buffer"),
        (lambda: SlotBuffer.allocate(0, 4), "num_slots"),
        (lambda: SlotBuffer.allocate(2, 4).view(2), "slot"),
        (
            lambda: TwoTierStore(
                HostStore(3),
                RemoteTier(RemoteConfig(), FakeClient(), background=False),
                SlotBuffer.allocate(2, 4),
            ),
            "slots",
        ),
    ]
    for build, field in cases:
        with pytest.raises(HybridKVConfigError) as caught:
            build()
        assert caught.value.field == field, field


def test_slot_buffer_over_a_shared_buffer() -> None:
    backing = bytearray(12)
    slots = SlotBuffer(backing, 4)
    slots.view(1)[:] = b"abcd"
    assert backing[4:8] == b"abcd"
    assert slots.num_slots == 3


def test_writer_thread_resolves_under_concurrent_writes() -> None:
    client = FakeClient()
    tier = RemoteTier(RemoteConfig(max_pending=1000), client)
    chunks = [chunk_of(i, salt=b"t%d" % t) for t in range(4) for i in range(25)]

    def enqueue(part: list[Chunk]) -> None:
        for c in part:
            tier.write_behind(c, [b"x", b"y"])

    threads = [threading.Thread(target=enqueue, args=(chunks[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tier.flush(5.0)
    tier.close()
    snap = tier.snapshot()
    assert snap["counters"]["written"] == 100 == len(snap["remote"])
    check_counters(snap)


def test_a_chunk_in_flight_through_a_shared_tier_is_not_promoted_twice() -> None:
    client = FakeClient()
    tier = RemoteTier(RemoteConfig(), client, background=False)
    one = TwoTierStore(HostStore(4), tier, SlotBuffer.allocate(4, SLOT))
    two = TwoTierStore(HostStore(4), tier, SlotBuffer.allocate(4, SLOT))
    chunk = chunk_of(0)
    assert not isinstance(one.prepare_promote(chunk), PromoteRefusal)
    before = two.snapshot()
    assert two.prepare_promote(chunk) is PromoteRefusal.PRESENT
    assert two.snapshot() == before


def test_a_lost_race_for_the_promotion_undoes_the_reservation() -> None:
    class Racing(RemoteTier):
        """Another thread begins the same promotion between the check and the begin."""

        def in_flight(self, chunk: Chunk) -> bool:
            return False

    tier = Racing(RemoteConfig(), FakeClient(), background=False)
    one = TwoTierStore(HostStore(4), tier, SlotBuffer.allocate(4, SLOT))
    two = TwoTierStore(HostStore(4), tier, SlotBuffer.allocate(4, SLOT))
    chunk = chunk_of(0)
    assert not isinstance(one.prepare_promote(chunk), PromoteRefusal)
    with pytest.raises(HybridKVError, match="TT-3"):
        two.prepare_promote(chunk)
    assert two.host.stats().used == 0


def test_snapshot_is_exactly_the_contract_schema() -> None:
    store, _ = two_tier()
    chunk = chunk_of(0)
    store_from_gpu(store, chunk)
    store.write_behind(chunk)
    snap = store.snapshot()
    assert list(snap) == ["host", "remote", "promotions", "writes", "failed", "counters"]
    assert snap["host"] == store.host.snapshot()
    assert tuple(snap["counters"]) == REMOTE_COUNTER_NAMES
    assert snap["writes"] == ((chunk.key.hex(), tuple(m.hex() for m in chunk.members)),)
    assert "host" not in store.tier.snapshot()


# --- the index: bounded, aging, forgetting what the server lost ---


def _payloads(chunk: Chunk) -> list[bytes]:
    return [content(key) for key in chunk.members]


def test_the_index_keeps_the_most_recent_writes_and_a_forgotten_chunk_is_written_again() -> None:
    client = FakeClient()
    tier = RemoteTier(RemoteConfig(index_entries=2), client, background=False)
    chunks = [chunk_of(step) for step in range(3)]
    for chunk in chunks:
        assert tier.write_behind(chunk, _payloads(chunk)) is Admission.ENQUEUED
        assert tier.write_pending() == 1
    # Three written, two remembered: the oldest went first.
    assert tier.snapshot()["remote"] == tuple(sorted(c.plain() for c in chunks[1:]))
    assert tier.write_behind(chunks[2], _payloads(chunks[2])) is Admission.KNOWN
    assert tier.write_behind(chunks[0], _payloads(chunks[0])) is Admission.ENQUEUED
    assert tier.write_pending() == 1
    snap = tier.snapshot()
    assert snap["remote"] == tuple(sorted(c.plain() for c in (chunks[0], chunks[2])))
    assert snap["counters"]["written"] == 4
    check_counters(snap)


def test_under_a_ttl_a_write_counts_for_half_the_ttl_then_the_chunk_is_renewed() -> None:
    now = [100.0]
    tier = RemoteTier(RemoteConfig(ttl_s=60), FakeClient(), background=False, clock=lambda: now[0])
    chunk = chunk_of(0)
    assert tier.write_behind(chunk, _payloads(chunk)) is Admission.ENQUEUED
    assert tier.write_pending() == 1
    now[0] += 29.9
    assert tier.write_behind(chunk, _payloads(chunk)) is Admission.KNOWN
    now[0] += 0.1  # half the TTL gone: the server copy may expire soon, write it again
    assert tier.write_behind(chunk, _payloads(chunk)) is Admission.ENQUEUED
    assert tier.write_pending() == 1
    assert tier.write_behind(chunk, _payloads(chunk)) is Admission.KNOWN
    assert tier.snapshot()["counters"]["written"] == 2


def test_forget_drops_a_chunk_seen_missing_so_its_next_store_writes_it_again() -> None:
    client = FakeClient()
    tier = RemoteTier(RemoteConfig(), client, background=False)
    chunk = chunk_of(0)
    tier.write_behind(chunk, _payloads(chunk))
    tier.write_pending()
    del client.data[redis_key(chunk.key)]  # the server evicted it
    assert tier.write_behind(chunk, _payloads(chunk)) is Admission.KNOWN  # not seen yet
    assert tier.forget(chunk.key) is True
    assert tier.forget(chunk.key) is False
    assert tier.write_behind(chunk, _payloads(chunk)) is Admission.ENQUEUED
    tier.write_pending()
    assert redis_key(chunk.key) in client.data


def test_index_entries_is_checked() -> None:
    with pytest.raises(HybridKVConfigError, match="remote_index_entries"):
        RemoteConfig(index_entries=0)
