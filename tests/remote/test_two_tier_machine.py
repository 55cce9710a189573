"""A hypothesis state machine over two engines' HostStore + RemoteTier on one real server.

Two engines (each a :class:`TwoTierStore`: host store, slot bytes, remote tier with its own
connection) share one redis-server. Rules store chunks "from the GPU", write them behind,
run the writers, look up, promote in two phases, evict host entries, and inject the faults the
contract names on the real server: a chunk vanishes (DEL), a value is overwritten with other
bytes (corrupt), a reply never comes within the deadline (TIMEOUT; each engine talks through
a proxy that can swallow replies, so the timing does not depend on the machine's load), or
the server is killed and restarted (FAULT, everything vanishes). A plain model kept here from
the contract alone predicts every outcome, the index, the failed chunks, the queues and the
counters.

After every step the invariants check, on each engine's ``snapshot()`` (the contract's
schema): TT-8 (counters add up), TT-3 (each STORING host entry belongs to exactly one
promotion in flight; ``used <= capacity``), TT-4 (nothing in flight names a resolved op), and
on the bytes, TT-2/TT-6 (every READY host entry holds exactly the content written under its
key; keys carry the salt, so a cross-tenant load would show as wrong bytes). The spec's own
predicates run on the same export too: every TT-* snapshot predicate of
:mod:`spec.invariants.tiers` (TT-1, TT-3, TT-4, TT-8) and every ST-* on its ``host`` part.

Runs: the profile's max_examples capped at 40 machines (ci) of 25 steps; nightly 300.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from _redis_server import CuttingProxy, RedisServer
from _remote_helpers import content
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hybridkv.remote import (
    Admission,
    Chunk,
    PromoteOutcome,
    PromoteRefusal,
    Promotion,
    RemoteConfig,
    RemoteTier,
    SlotBuffer,
    TwoTierStore,
    make_chunk,
    redis_key,
)
from hybridkv.store import HostStore, LookupResult, Refusal
from spec.invariants import check_all

pytestmark = pytest.mark.remote

SLOT = 64
# Long enough that a loaded 2-core machine never times out a healthy call; each stalled
# call costs this much, so a machine run stalls at most once (STALLS).
DEADLINE_S = 1.0
STALLS = 1
SALTS = (b"tenant-s", b"tenant-t")
STEPS = 3
CHUNKS = {
    salt: [make_chunk(b"m", [b"%s/g%d/u%d" % (salt, g, i) for g in range(2)]) for i in range(STEPS)]
    for salt in SALTS
}
ALL = [chunk for salt in SALTS for chunk in CHUNKS[salt]]


class _Given:
    """Stands in for ``st.data()`` when a compound rule calls a rule with a fixed chunk."""

    def __init__(self, chunk: Chunk) -> None:
        self.chunk = chunk

    def draw(self, strategy: Any) -> Any:
        return self.chunk if strategy is not _ROLL else 1


_ROLL = st.integers(0, 5)


def st_just_data(chunk: Chunk) -> Any:
    """A data object whose draws give ``chunk`` (and never the 1-in-6 "any chunk" roll)."""
    return _Given(chunk)


class Engine:
    """One engine and its model: index, failed, queued writes, promotions, counters."""

    def __init__(self, port: int, capacity: int) -> None:
        # Through a proxy that can stall replies: a deterministic "past the deadline".
        self.proxy = CuttingProxy(port)
        tier = RemoteTier(
            RemoteConfig(port=self.proxy.port, deadline_s=DEADLINE_S, max_pending=3),
            background=False,
        )
        self.store = TwoTierStore(
            HostStore(capacity),
            tier,
            SlotBuffer.allocate(capacity, SLOT),
        )
        self.index: set[bytes] = set()
        self.failed: set[bytes] = set()
        self.queue: list[Chunk] = []
        self.promotions: dict[bytes, Promotion] = {}
        self.counters: dict[str, int] = dict.fromkeys(
            ("promotions_started", "promoted", "missing", "fault", "timeout", "corrupt",
             "writes_enqueued", "written", "writes_failed", "writes_dropped", "lookups",
             "lookup_faults"), 0
        )  # fmt: skip


class TwoTierMachine(RuleBasedStateMachine):
    """Two engines on one real server beside a plain model of the contract."""

    port = 0
    server: RedisServer | None = None

    def __init__(self) -> None:
        super().__init__()
        assert self.server is not None
        self.admin = redis.Redis(port=self.port, socket_timeout=5)
        self.admin.flushall()
        self.engines = [Engine(self.port, 4), Engine(self.port, 6)]
        self.stalls = 0
        self.remote: dict[bytes, str] = {}  # chunk key -> "whole" | "corrupt": the server

    def teardown(self) -> None:
        for engine in self.engines:
            engine.proxy.stalled = False
            engine.store.tier.close()
            engine.proxy.close()
        self.admin.close()

    # --- the host side ---

    @rule(e=st.integers(0, 1), chunk=st.sampled_from(ALL))
    def store_from_gpu(self, e: int, chunk: Chunk) -> None:
        store = self.engines[e].store
        if any(store.host.status(k) is not LookupResult.MISS for k in chunk.members):
            return
        if isinstance(store.host.prepare_store(chunk.members), Refusal):
            return
        for key, slot in zip(chunk.members, store.host.slots(chunk.members), strict=True):
            store.slots.view(slot)[:] = content(key, SLOT)
        store.host.complete_store(chunk.members, True)

    @rule(e=st.integers(0, 1), chunk=st.sampled_from(ALL))
    def publish(self, e: int, chunk: Chunk) -> None:
        """The common path in one step: store from the GPU, write behind, run the writer."""
        self.store_from_gpu(e, chunk)
        self.write_behind(e, st_just_data(chunk))
        self.write_pending(e)

    @rule(e=st.integers(0, 1), chunk=st.sampled_from(ALL))
    def evict_host(self, e: int, chunk: Chunk) -> None:
        self.engines[e].store.host.evict(list(chunk.members))

    # --- writes ---

    @rule(e=st.integers(0, 1), data=st.data())
    def write_behind(self, e: int, data: st.DataObject) -> None:
        engine = self.engines[e]
        # Mostly a chunk the engine holds READY (the interesting case), sometimes any.
        host = engine.store.host
        held = [c for c in ALL if host.lookup(c.members).hits == len(c.members)]
        chunk = data.draw(st.sampled_from(held) if held else st.sampled_from(ALL))
        if data.draw(_ROLL) == 0:
            chunk = data.draw(st.sampled_from(ALL))
        ready = engine.store.host.lookup(chunk.members).hits == len(chunk.members)
        verdict = engine.store.write_behind(chunk)
        if not ready:
            assert verdict is Refusal.NOT_READY
        elif chunk.key in engine.index and chunk.key not in engine.failed:
            assert verdict is Admission.KNOWN
        elif chunk in engine.queue:
            assert verdict is Admission.PENDING
        elif len(engine.queue) >= 3:
            assert verdict is Admission.DROPPED
            engine.counters["writes_dropped"] += 1
        else:
            assert verdict is Admission.ENQUEUED
            engine.queue.append(chunk)
            engine.counters["writes_enqueued"] += 1

    @rule(e=st.integers(0, 1))
    def write_pending(self, e: int) -> None:
        engine = self.engines[e]
        assert engine.store.tier.write_pending() == len(engine.queue)
        for chunk in engine.queue:
            self._written(engine, chunk)
        engine.queue.clear()

    def _written(self, engine: Engine, chunk: Chunk) -> None:
        self.remote[chunk.key] = "whole"
        engine.index.add(chunk.key)
        engine.failed.discard(chunk.key)
        engine.counters["written"] += 1

    # --- reads ---

    @rule(e=st.integers(0, 1), salt=st.sampled_from(SALTS))
    def lookup(self, e: int, salt: bytes) -> None:
        engine = self.engines[e]
        chunks = CHUNKS[salt]
        expected = 0
        for chunk in chunks:
            if chunk.key in engine.failed or chunk.key not in self.remote:
                break
            expected += 1
        asked = []
        for chunk in chunks:
            if chunk.key in engine.failed:
                break
            asked.append(chunk)
        assert engine.store.remote_lookup(chunks) == expected
        engine.counters["lookups"] += 1
        for chunk in asked:
            if chunk.key not in self.remote:
                engine.index.discard(chunk.key)

    @rule(e=st.integers(0, 1), data=st.data())
    def prepare_promote(self, e: int, data: st.DataObject) -> None:
        engine = self.engines[e]
        host = engine.store.host
        # Mostly a chunk the server holds and the host lacks (a read-through), sometimes any.
        wanted = [
            c
            for c in ALL
            if c.key in self.remote and all(host.status(k) is LookupResult.MISS for k in c.members)
        ]
        chunk = data.draw(st.sampled_from(wanted) if wanted else st.sampled_from(ALL))
        if data.draw(_ROLL) == 0:
            chunk = data.draw(st.sampled_from(ALL))
        absent = all(host.status(k) is LookupResult.MISS for k in chunk.members)
        out = engine.store.prepare_promote(chunk)
        if chunk.key in engine.failed:
            assert out is PromoteRefusal.FAILED
        elif not absent:
            assert out is PromoteRefusal.PRESENT
        elif out is PromoteRefusal.NO_SPACE:
            stats = host.stats()
            assert stats.capacity - stats.used + stats.evictable < len(chunk.members)
        else:
            assert isinstance(out, Promotion)
            engine.promotions[chunk.key] = out
            engine.counters["promotions_started"] += 1

    @rule(e=st.integers(0, 1), data=st.data())
    def promote(self, e: int, data: st.DataObject) -> None:
        """Both phases at once, as a read-through on a host miss does."""
        engine = self.engines[e]
        self.prepare_promote(e, data)
        if engine.promotions:
            key = data.draw(st.sampled_from(sorted(engine.promotions)))
            self._complete(engine, key)

    @precondition(lambda self: any(engine.promotions for engine in self.engines))
    @rule(e=st.integers(0, 1), data=st.data())
    def complete_promote(self, e: int, data: st.DataObject) -> None:
        engine = self.engines[e]
        if not engine.promotions:
            return
        self._complete(engine, data.draw(st.sampled_from(sorted(engine.promotions))))

    def _complete(self, engine: Engine, key: bytes) -> None:
        promotion = engine.promotions.pop(key)
        expected = {
            "whole": PromoteOutcome.PROMOTED,
            "corrupt": PromoteOutcome.CORRUPT,
        }.get(self.remote.get(key, ""), PromoteOutcome.MISSING)
        self._resolve(engine, promotion, expected)

    @precondition(lambda self: self.stalls < STALLS)
    @rule(e=st.integers(0, 1), data=st.data())
    def past_the_deadline(self, e: int, data: st.DataObject) -> None:
        """One server call of engine ``e`` gets no reply within the deadline."""
        engine = self.engines[e]
        kinds = ["lookup"] + ["write"] * bool(engine.queue) + ["fetch"] * bool(engine.promotions)
        kind = data.draw(st.sampled_from(kinds))
        self.stalls += 1
        engine.proxy.stalled = True
        try:
            if kind == "write":
                assert engine.store.tier.write_pending(limit=1) == 1
                chunk = engine.queue.pop(0)
                engine.counters["writes_failed"] += 1
                # The server applied the SET; only its reply was lost. The chunk is there
                # whole, but the tier does not know it: FAILED, not indexed.
                self.remote[chunk.key] = "whole"
            elif kind == "fetch":
                key = data.draw(st.sampled_from(sorted(engine.promotions)))
                self._resolve(engine, engine.promotions.pop(key), PromoteOutcome.TIMEOUT)
            else:
                salt = data.draw(st.sampled_from(SALTS))
                assert engine.store.remote_lookup(CHUNKS[salt]) == 0
                engine.counters["lookups"] += 1
                if CHUNKS[salt][0].key not in engine.failed:  # else no round trip was made
                    engine.counters["lookup_faults"] += 1
        finally:
            engine.proxy.stalled = False

    @precondition(lambda self: any(engine.promotions for engine in self.engines))
    @rule(e=st.integers(0, 1), data=st.data())
    def server_killed_mid_load(self, e: int, data: st.DataObject) -> None:
        engine = self.engines[e]
        if not engine.promotions:
            return
        key = data.draw(st.sampled_from(sorted(engine.promotions)))
        assert self.server is not None
        self.server.kill()
        self.remote.clear()  # a restarted server is empty: every chunk vanished
        try:
            self._resolve(engine, engine.promotions.pop(key), PromoteOutcome.FAULT)
        finally:
            self.server.restart()
            self.admin = redis.Redis(port=self.port, socket_timeout=5)

    def _resolve(self, engine: Engine, promotion: Promotion, expected: PromoteOutcome) -> None:
        chunk = promotion.chunk
        assert engine.store.complete_promote(promotion) is expected
        engine.counters[expected.value] += 1
        host = engine.store.host
        if expected is PromoteOutcome.PROMOTED:
            assert host.lookup(chunk.members).hits == len(chunk.members)
            return
        assert all(host.status(k) is LookupResult.MISS for k in chunk.members)
        engine.failed.add(chunk.key)
        if expected in (PromoteOutcome.MISSING, PromoteOutcome.CORRUPT):
            engine.index.discard(chunk.key)

    # --- the server loses or damages chunks ---

    @rule(chunk=st.sampled_from(ALL))
    def vanish(self, chunk: Chunk) -> None:
        self.admin.delete(redis_key(chunk.key))
        self.remote.pop(chunk.key, None)

    @rule(chunk=st.sampled_from(ALL), junk=st.binary(max_size=40))
    def corrupt(self, chunk: Chunk, junk: bytes) -> None:
        self.admin.set(redis_key(chunk.key), b"HKVC" + junk)
        self.remote[chunk.key] = "corrupt"

    # --- invariants ---

    @invariant()
    def model_agrees(self) -> None:
        for engine in self.engines:
            snap = engine.store.snapshot()
            assert snap["remote"] == tuple(sorted(c.plain() for c in ALL if c.key in engine.index))
            assert snap["failed"] == tuple(sorted(k.hex() for k in engine.failed))
            assert snap["writes"] == tuple(sorted(c.plain() for c in engine.queue))
            assert snap["promotions"] == tuple(
                sorted(p.chunk.plain() for p in engine.promotions.values())
            )
            assert snap["counters"] == engine.counters

    @invariant()
    def the_specs_predicates_hold_on_the_library_snapshot(self) -> None:
        # The oracle's own TT-* snapshot predicates (spec.invariants.tiers) and the host
        # store's ST-* read the library's export: the contract's schema, both sides.
        for engine in self.engines:
            snap = engine.store.snapshot()
            assert check_all("tiers", snap) == {}
            assert check_all("store", snap["host"]) == {}

    @invariant()
    def tt8_counters_add_up(self) -> None:
        for engine in self.engines:
            snap = engine.store.snapshot()
            c = snap["counters"]
            resolved = sum(c[k] for k in ("promoted", "missing", "fault", "timeout", "corrupt"))
            assert c["promotions_started"] == resolved + len(snap["promotions"])
            assert c["writes_enqueued"] == c["written"] + c["writes_failed"] + len(snap["writes"])

    @invariant()
    def tt3_storing_entries_belong_to_one_promotion(self) -> None:
        for engine in self.engines:
            snap = engine.store.snapshot()
            host = snap["host"]
            assert host["used"] <= host["capacity"]
            storing = sorted(key for key, state, _ in host["entries"] if state == "storing")
            owned = sorted(m for _, members in snap["promotions"] for m in members)
            assert storing == owned

    @invariant()
    def tt2_tt6_ready_entries_hold_their_own_content(self) -> None:
        for engine in self.engines:
            store = engine.store
            for key_hex, state, _ in store.host.snapshot()["entries"]:
                if state == "ready":
                    key = bytes.fromhex(key_hex)
                    (slot,) = store.host.slots([key])
                    assert bytes(store.slots.view(slot)) == content(key, SLOT)


def test_two_tier_machine(module_redis: RedisServer) -> None:
    TwoTierMachine.port = module_redis.port
    TwoTierMachine.server = module_redis
    cap = 300 if settings().max_examples > 200 else 40
    run_state_machine_as_test(
        TwoTierMachine,
        settings=settings(
            settings(), max_examples=min(settings().max_examples, cap), stateful_step_count=25
        ),
    )
