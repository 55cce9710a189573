"""The remote tier against a real Redis/Valkey server, and every fault the contract names.

Each fault test ends the same way: the promotion resolves with the contract's outcome, the
chunk's members are dropped from the host (REMOVED, nothing READY: nothing wrong is loaded),
the claim ends before the failed chunk so exactly what is missing is recomputed, the tier
keeps working afterwards (nothing wedged), and the counters add up (TT-8).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _redis_server import CuttingProxy, RedisServer
from _remote_helpers import check_counters, chunk_of, content, host_bytes, store_from_gpu
from redis import Redis

from hybridkv.remote import (
    Admission,
    Chunk,
    PromoteOutcome,
    PromoteRefusal,
    RemoteConfig,
    RemoteTier,
    SlotBuffer,
    TwoTierStore,
    encode_chunk,
    redis_key,
)
from hybridkv.store import EventKind, HostStore

pytestmark = pytest.mark.remote

SLOT = 4096  # a page-sized member: replies span several TCP reads


def engine(port: int, capacity: int = 16, **config: Any) -> TwoTierStore:
    """One engine's host store over the shared server (writes run when the test says)."""
    config.setdefault("deadline_s", 2.0)
    tier = RemoteTier(RemoteConfig(port=port, **config), background=False)
    return TwoTierStore(HostStore(capacity), tier, SlotBuffer.allocate(capacity, SLOT))


def chunks(n: int, salt: bytes = b"s") -> list[Chunk]:
    return [chunk_of(i, groups=3, salt=salt, slot=SLOT) for i in range(n)]


def publish(store: TwoTierStore, items: list[Chunk]) -> None:
    """Store each chunk from the "GPU" and write it behind, synchronously."""
    for chunk in items:
        store_from_gpu(store, chunk)
        assert store.write_behind(chunk) is Admission.ENQUEUED
    assert store.tier.write_pending() == len(items)
    assert store.snapshot()["counters"]["written"] >= len(items)


def assert_loaded(store: TwoTierStore, chunk: Chunk) -> None:
    assert store.host.lookup(chunk.members).hits == len(chunk.members)
    assert host_bytes(store, chunk) == [content(k, SLOT) for k in chunk.members]


def assert_dropped(store: TwoTierStore, chunk: Chunk, outcome: PromoteOutcome) -> None:
    """Nothing of ``chunk`` is in the host; it is remembered as failed; counters add up."""
    assert all(store.host.status(k).value == "miss" for k in chunk.members)
    removed = [e for e in store.host.take_events() if e.kind is EventKind.REMOVED]
    assert [e.keys for e in removed] == [chunk.members]
    snap = store.snapshot()
    assert chunk.key.hex() in snap["failed"]
    assert snap["counters"][outcome.value] >= 1
    assert snap["promotions"] == ()
    check_counters(snap)


@pytest.fixture
def two(shared_redis: RedisServer) -> Iterator[tuple[TwoTierStore, TwoTierStore]]:
    a, b = engine(shared_redis.port), engine(shared_redis.port)
    yield a, b
    a.tier.close()
    b.tier.close()


def test_engine_b_promotes_what_engine_a_wrote(two: tuple[TwoTierStore, TwoTierStore]) -> None:
    a, b = two
    items = chunks(4)
    publish(a, items)
    assert b.remote_lookup(items) == 4
    for chunk in items:
        assert b.promote(chunk) is PromoteOutcome.PROMOTED
        assert_loaded(b, chunk)
    snap = b.snapshot()
    assert snap["counters"]["promoted"] == snap["counters"]["promotions_started"] == 4
    assert snap["remote"] == ()  # b wrote nothing: its index holds only its own writes
    assert a.snapshot()["remote"] == tuple(sorted(c.plain() for c in items))
    check_counters(snap)


def test_different_salts_never_hit(two: tuple[TwoTierStore, TwoTierStore]) -> None:
    a, b = two
    tenant_s, tenant_t = chunks(3, b"tenant-s"), chunks(3, b"tenant-t")
    publish(a, tenant_s)
    assert {c.key for c in tenant_s}.isdisjoint(c.key for c in tenant_t)
    assert b.remote_lookup(tenant_t) == 0
    assert b.promote(tenant_t[0]) is PromoteOutcome.MISSING
    assert_dropped(b, tenant_t[0], PromoteOutcome.MISSING)
    assert b.remote_lookup(tenant_s) == 3
    assert b.promote(tenant_s[0]) is PromoteOutcome.PROMOTED
    assert_loaded(b, tenant_s[0])


def test_server_killed_between_lookup_and_fetch(redis_server: RedisServer) -> None:
    a, b = engine(redis_server.port), engine(redis_server.port, deadline_s=1.0)
    items = chunks(3)
    publish(a, items)
    assert b.remote_lookup(items) == 3
    assert b.promote(items[0]) is PromoteOutcome.PROMOTED
    redis_server.kill()
    started = time.monotonic()
    assert b.promote(items[1]) is PromoteOutcome.FAULT
    assert time.monotonic() - started < 2.0
    assert_dropped(b, items[1], PromoteOutcome.FAULT)
    assert_loaded(b, items[0])  # what was promoted before the crash stays right
    # The claim ends before the failed chunk: chunk 0 is on the host, 1 and 2 are recomputed.
    assert b.host.lookup(items[0].members).hits == 3
    assert b.remote_lookup(items[1:]) == 0  # stops before the failed chunk: no round trip
    assert b.snapshot()["counters"]["lookup_faults"] == 0
    assert b.remote_lookup(items[2:]) == 0  # the server is gone: a fault, counted
    assert b.snapshot()["counters"]["lookup_faults"] == 1
    # Nothing wedged: the server comes back (empty) and the engines carry on.
    redis_server.restart()
    assert b.remote_lookup(items) == 0  # everything vanished with the crash: misses
    store_from_gpu(b, items[1])  # b recomputed chunk 1 and writes it behind
    assert b.write_behind(items[1]) is Admission.ENQUEUED
    b.tier.write_pending()
    assert b.snapshot()["failed"] == ()
    assert a.promote(items[1]) is PromoteRefusal.PRESENT  # a holds it on its host already
    c = engine(redis_server.port)
    assert c.promote(items[1]) is PromoteOutcome.PROMOTED
    assert_loaded(c, items[1])
    for store in (a, b, c):
        check_counters(store.snapshot())
        store.tier.close()


def test_server_killed_while_the_get_is_in_flight(redis_server: RedisServer) -> None:
    a, b = engine(redis_server.port), engine(redis_server.port, deadline_s=5.0)
    items = chunks(2)
    publish(a, items)
    assert b.remote_lookup(items) == 2
    admin = redis_server.admin()
    admin.client_pause(10_000, all=True)  # the GET waits in the server...
    killer = threading.Timer(0.3, redis_server.kill)  # ...until the server dies under it
    killer.start()
    started = time.monotonic()
    outcome = b.promote(items[0])
    killer.join()
    assert outcome is PromoteOutcome.FAULT
    assert time.monotonic() - started < 3.0  # the crash, not the 5 s deadline, ended it
    assert_dropped(b, items[0], PromoteOutcome.FAULT)
    redis_server.restart()
    assert b.remote_lookup(items) == 0  # the failed chunk ends the claim at once
    assert b.remote_lookup(items[1:]) == 0  # the restarted server is empty: a miss
    store_from_gpu(b, items[0])  # recomputed, written behind again: the memory ends
    assert b.write_behind(items[0]) is Admission.ENQUEUED
    assert b.tier.write_pending() == 1
    assert b.snapshot()["failed"] == ()
    for store in (a, b):
        check_counters(store.snapshot())
        store.tier.close()


@pytest.mark.parametrize("cut_after", [0, 100, 5000])
def test_connection_reset_mid_reply(shared_redis: RedisServer, cut_after: int) -> None:
    """The connection dies after ``cut_after`` bytes of the GET's reply (half a chunk)."""
    a = engine(shared_redis.port)
    proxy = CuttingProxy(shared_redis.port)
    b = engine(proxy.port)
    items = chunks(2)
    publish(a, items)
    assert b.remote_lookup(items) == 2  # the connection is up
    proxy.cut_after = cut_after
    assert b.promote(items[0]) is PromoteOutcome.FAULT
    assert proxy.cuts == 1
    assert_dropped(b, items[0], PromoteOutcome.FAULT)
    # The next call reconnects: the other chunk loads whole and right.
    assert b.promote(items[1]) is PromoteOutcome.PROMOTED
    assert_loaded(b, items[1])
    proxy.close()
    for store in (a, b):
        check_counters(store.snapshot())
        store.tier.close()


def test_idle_connection_reset_reconnects(two: tuple[TwoTierStore, TwoTierStore]) -> None:
    a, b = two
    items = chunks(1)
    publish(a, items)
    assert b.remote_lookup(items) == 1
    # Every connection but the killer's own, the engine's pooled one included, is reset.
    Redis(port=b.tier.config.port).client_kill_filter(_type="normal", skipme=True)
    outcome = b.promote(items[0])
    # redis-py finds the dead idle connection at checkout and reconnects once; either way the
    # chunk is loaded whole and right, or dropped as a fault: never half.
    assert outcome in (PromoteOutcome.PROMOTED, PromoteOutcome.FAULT)
    if outcome is PromoteOutcome.PROMOTED:
        assert_loaded(b, items[0])
    else:
        assert_dropped(b, items[0], outcome)


def test_slow_server_past_the_deadline(shared_redis: RedisServer) -> None:
    a = engine(shared_redis.port)
    # Deadlines and pauses leave room for a loaded 2-core machine's scheduling delays.
    b = engine(shared_redis.port, deadline_s=0.5)
    items = chunks(3)
    publish(a, items)
    assert b.remote_lookup(items) == 3
    admin = shared_redis.admin()
    admin.client_pause(2500, all=True)
    started = time.monotonic()
    assert b.promote(items[0]) is PromoteOutcome.TIMEOUT
    assert time.monotonic() - started < 1.5
    assert b.remote_lookup(items[1:]) == 0  # a lookup past the deadline is a fault: 0
    store_from_gpu(b, chunks(1, b"other")[0])
    assert b.write_behind(chunks(1, b"other")[0]) is Admission.ENQUEUED
    assert b.tier.write_pending() == 1  # the SET times out: FAILED, not stuck
    snap = b.snapshot()
    assert snap["counters"]["writes_failed"] == 1
    assert snap["counters"]["lookup_faults"] == 1
    assert_dropped(b, items[0], PromoteOutcome.TIMEOUT)
    admin.client_unpause()
    # The timed-out reply never reaches a later call: chunk 1 loads with its own bytes.
    assert b.promote(items[1]) is PromoteOutcome.PROMOTED
    assert_loaded(b, items[1])
    for store in (a, b):
        check_counters(store.snapshot())
        store.tier.close()


def test_deleted_between_lookup_and_fetch(two: tuple[TwoTierStore, TwoTierStore]) -> None:
    a, b = two
    items = chunks(3)
    publish(a, items)
    assert b.remote_lookup(items) == 3
    Redis(port=b.tier.config.port).delete(redis_key(items[1].key))
    assert b.promote(items[0]) is PromoteOutcome.PROMOTED
    assert b.promote(items[1]) is PromoteOutcome.MISSING
    assert_dropped(b, items[1], PromoteOutcome.MISSING)
    # Exactly what is missing is recomputed: the claim is chunk 0 (host), then it stops.
    assert b.host.lookup(items[0].members).hits == 3
    assert b.remote_lookup(items) == 1
    assert b.remote_lookup(items[1:]) == 0
    # a wrote it: a's lookup sees it vanish and forgets it from its index.
    assert a.remote_lookup(items) == 1
    assert items[1].plain() not in a.snapshot()["remote"]


def test_ttl_expiry_is_a_miss(shared_redis: RedisServer) -> None:
    a = engine(shared_redis.port, ttl_s=1)
    b = engine(shared_redis.port)
    items = chunks(1)
    publish(a, items)
    ttl = shared_redis.admin().ttl(redis_key(items[0].key))
    assert 0 < ttl <= 1
    assert b.remote_lookup(items) == 1
    time.sleep(1.2)
    assert b.promote(items[0]) is PromoteOutcome.MISSING
    assert_dropped(b, items[0], PromoteOutcome.MISSING)
    for store in (a, b):
        store.tier.close()


def test_maxmemory_eviction_is_a_miss_and_never_half(shared_redis: RedisServer) -> None:
    admin = shared_redis.admin()
    used = int(admin.info("memory")["used_memory"])
    admin.config_set("maxmemory-policy", "allkeys-lru")
    admin.config_set("maxmemory", used + 256 * 1024)
    a = engine(shared_redis.port, capacity=128)
    b = engine(shared_redis.port, capacity=128)
    items = chunks(60)  # 60 x 12 KiB: about three times what fits
    publish(a, items)
    present = [bool(admin.exists(redis_key(c.key))) for c in items]
    assert 0 < sum(present) < len(items)
    outcomes = [b.promote(c) for c in items]
    for chunk, outcome, there in zip(items, outcomes, present, strict=True):
        if outcome is PromoteOutcome.PROMOTED:
            assert_loaded(b, chunk)
        else:
            assert outcome is PromoteOutcome.MISSING
            assert not b.host.lookup(chunk.members).hits
        assert (outcome is PromoteOutcome.PROMOTED) <= there  # nothing returns from eviction
    counters = b.snapshot()["counters"]
    assert counters["promoted"] + counters["missing"] == 60
    assert counters["missing"] >= 60 - sum(present)
    check_counters(b.snapshot())
    for store in (a, b):
        store.tier.close()


def test_full_server_without_eviction_fails_the_write(shared_redis: RedisServer) -> None:
    admin = shared_redis.admin()
    admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) + 1024)
    a = engine(shared_redis.port)
    chunk = chunks(1)[0]
    store_from_gpu(a, chunk)
    a.write_behind(chunk)
    a.tier.write_pending()  # OOM error reply: FAILED, not raised
    snap = a.snapshot()
    assert (snap["counters"]["written"], snap["counters"]["writes_failed"]) == (0, 1)
    assert snap["remote"] == ()
    check_counters(snap)
    a.tier.close()


@pytest.mark.parametrize("damage", ["other bytes", "another chunk's value", "one byte flipped"])
def test_corrupted_value_is_never_loaded(
    two: tuple[TwoTierStore, TwoTierStore], damage: str
) -> None:
    a, b = two
    items = chunks(2)
    publish(a, items)
    name = redis_key(items[0].key)
    server = Redis(port=b.tier.config.port)
    value = bytearray(server.get(name) or b"")
    if damage == "other bytes":
        server.set(name, b"not a chunk at all")
    elif damage == "another chunk's value":
        server.set(
            name, encode_chunk(items[1].members, [content(k, SLOT) for k in items[1].members])
        )
    else:
        value[-1] ^= 0x01
        server.set(name, bytes(value))
    assert b.remote_lookup(items) == 2  # the server holds a value; only reading tells
    assert b.promote(items[0]) is PromoteOutcome.CORRUPT
    assert_dropped(b, items[0], PromoteOutcome.CORRUPT)
    assert b.remote_lookup(items) == 0  # the claim ends before the corrupt chunk


def test_write_behind_never_waits_on_a_paused_server(shared_redis: RedisServer) -> None:
    tier = RemoteTier(RemoteConfig(port=shared_redis.port, deadline_s=1.0, max_pending=4))
    store = TwoTierStore(HostStore(32), tier, SlotBuffer.allocate(32, SLOT))
    items = chunks(6)
    for chunk in items:
        store_from_gpu(store, chunk)
    admin = shared_redis.admin()
    admin.client_pause(2500, all=True)
    started = time.monotonic()
    verdicts = [store.write_behind(chunk) for chunk in items]
    # TT-7: the host evicts the members at once; the queued copies are the tier's own.
    store.host.evict([k for c in items for k in c.members])
    elapsed = time.monotonic() - started
    assert elapsed < 0.5  # a call that waited on a SET would take the 1 s deadline
    assert verdicts.count(Admission.ENQUEUED) == 4
    assert verdicts.count(Admission.DROPPED) == 2
    assert tier.flush(10.0)
    snap = store.snapshot()
    assert snap["counters"]["written"] + snap["counters"]["writes_failed"] == 4
    assert snap["counters"]["writes_dropped"] == 2
    check_counters(snap)
    time.sleep(max(0.0, 2.6 - (time.monotonic() - started)))
    for chunk in items:
        got = admin.get(redis_key(chunk.key))
        if got is not None:  # written whole, with the bytes of the moment it was enqueued
            assert got == encode_chunk(chunk.members, [content(k, SLOT) for k in chunk.members])
    tier.close()
