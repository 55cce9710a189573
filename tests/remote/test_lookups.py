"""Lookups off the caller's thread (hybridkv.remote.lookups, .lookup_book) and fetches side by
side (hybridkv.remote.fetches), over a fake client whose EXISTS is held at a gate and whose GET
sleeps: no call the caller makes waits on the server.

- An unanswered lookup: WAIT while the request's wait lasts (in time and in asks), then GO (no
  remote hit), never again WAIT for that request (no wedge); a late answer still serves it when
  it comes in.
- An answered lookup: READY with what the server holds, the same answer every time it is read
  (vLLM asks again each step), and no new lookup while it covers the chunks asked.
- The queue's bound refuses a lookup (GO); the breaker open: GO at once, the server not asked.
- Fetches: n slow GETs in a pool of n threads take about one GET, not n; a GET past the deadline
  is LATE; a call that never returns within the batch's wait is LATE and its result is dropped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
from _fake_chunk_client import FakeClient, SlowClient

from hybridkv.errors import HybridKVConfigError
from hybridkv.remote import (
    LATE,
    BreakerConfig,
    CircuitBreaker,
    ClientFault,
    Consult,
    FetchPool,
    GuardedClient,
    LookupBook,
    LookupMode,
    LookupPolicy,
    LookupQueue,
    redis_key,
)

A, B, C = b"a" * 32, b"b" * 32, b"c" * 32


def GatedClient() -> SlowClient:
    """A slow server whose EXISTS waits until the test sets ``release``."""
    client = SlowClient()
    client.release.clear()
    return client


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _book(client: FakeClient, wait_s: float = 0.02, **kw: object) -> tuple[LookupBook, Clock]:
    clock = Clock()
    policy = LookupPolicy(wait_s=wait_s, **kw)  # type: ignore[arg-type]
    queue = LookupQueue(client, workers=policy.workers, max_queued=policy.max_queued)
    return LookupBook(queue, policy, clock=clock), clock


def test_an_unanswered_lookup_waits_a_bounded_time_then_goes_without() -> None:
    server = GatedClient()
    server.data[redis_key(A)] = b"x"
    book, clock = _book(server, wait_s=0.02)
    assert book.consult("r", [(A,), (B,)]).verdict is Consult.WAIT
    clock.now = 0.019
    assert book.consult("r", [(A,), (B,)]).verdict is Consult.WAIT
    clock.now = 0.020
    assert book.consult("r", [(A,), (B,)]).verdict is Consult.GO  # the wait is spent
    clock.now = 5.0
    assert book.consult("r", [(A,), (B,)]).verdict is Consult.GO
    assert book.consult("r", [(A,), (B,), (C,)]).verdict is Consult.GO  # a new lookup: no new wait
    assert book.count == {"asked": 2, "refused": 0, "waits": 2, "late": 2}
    # The late answer still serves the request while it waits.
    server.release.set()
    assert book.settle(5.0)
    answer = book.consult("r", [(A,), (B,), (C,)])
    assert (answer.verdict, answer.present, answer.first) == (Consult.READY, {A}, True)
    book.queue.close()


def test_the_wait_is_bounded_in_asks_too() -> None:
    """An engine that spins through empty steps faster than the server answers: the clock
    hardly moves, and the request still stops waiting after ``wait_asks`` steps."""
    server = GatedClient()
    book, _ = _book(server, wait_s=60.0, wait_asks=3)
    verdicts = [book.consult("r", [(A,)]).verdict for _ in range(5)]
    assert verdicts == [Consult.WAIT] * 3 + [Consult.GO] * 2
    assert (book.count["waits"], book.count["late"]) == (3, 1)
    server.release.set()
    book.queue.close()


def test_an_answered_lookup_is_the_requests_answer_every_time() -> None:
    server = GatedClient()
    server.release.set()
    server.data[redis_key(B)] = b"x"
    book, _ = _book(server)
    assert book.consult("r", [(A,), (B,)]).verdict is Consult.WAIT
    assert book.settle(5.0)
    first = book.consult("r", [(A,), (B,)])
    again = book.consult("r", [(B,)])  # a subset (the host now holds A): no new lookup
    assert (first.verdict, first.present, first.first) == (Consult.READY, {B}, True)
    assert (again.verdict, again.present, again.first) == (Consult.READY, {B}, False)
    server.data[redis_key(A)] = b"x"  # written later: this request's answer stands
    assert book.consult("r", [(A,), (B,)]).present == {B}
    assert server.calls["exists"] == 1
    assert book.count["asked"] == 1
    book.forget("r")  # another request (or this one after it finished) asks afresh
    assert book.consult("s", [(A,), (B,)]).verdict is Consult.WAIT
    assert book.settle(5.0)
    assert book.consult("s", [(A,), (B,)]).present == {A, B}
    book.queue.close()


@pytest.mark.parametrize("mode", [LookupMode.ASYNC, LookupMode.SYNC])
def test_a_chunk_is_present_only_if_every_shard_is(mode: LookupMode) -> None:
    """Tensor parallelism (hybridkv.remote.shards): a chunk is asked as every shard's key and
    is present only if the server holds all of them; a shard missing on one rank is a miss.
    Two requests' lookups queued together still answer each its own chunks."""
    server = GatedClient()
    for key in (A, b"a1", B, b"c1"):  # B's rank 1 shard and C's rank 0 shard missing
        server.data[redis_key(key)] = b"x"
    book, _ = _book(server, mode=mode, workers=1)
    if mode is LookupMode.ASYNC:
        book.consult("first", [(C, b"c1")])  # taken by the thread, held at the gate
        assert _eventually(lambda: book.queue.queued() == 0)
        assert book.consult("r", [(A, b"a1"), (B, b"b1")]).verdict is Consult.WAIT
        assert book.consult("s", [(C, b"c1"), (A, b"a1")]).verdict is Consult.WAIT
        server.release.set()
        assert book.settle(5.0)
        assert server.calls["exists"] == 2  # r and s went together
    else:
        server.release.set()
    r = book.consult("r", [(A, b"a1"), (B, b"b1")])
    s = book.consult("s", [(C, b"c1"), (A, b"a1")])
    assert (r.verdict, r.present) == (Consult.READY, {A})
    assert (s.verdict, s.present) == (Consult.READY, {A})
    with pytest.raises(HybridKVConfigError, match="chunks"):
        book.consult("t", [()])
    book.queue.close()


def test_a_fault_answers_nothing_present() -> None:
    server = FakeClient()
    server.fail_next["exists"] = ClientFault.TIMEOUT
    book, _ = _book(server)
    book.consult("r", [(A,)])
    assert book.settle(5.0)
    answer = book.consult("r", [(A,)])
    assert (answer.verdict, answer.fault, answer.present) == (
        Consult.READY,
        ClientFault.TIMEOUT,
        frozenset(),
    )
    book.queue.close()


def test_zero_wait_never_defers_and_sync_mode_answers_at_once() -> None:
    server = GatedClient()
    book, _ = _book(server, wait_s=0)
    assert book.consult("r", [(A,)]).verdict is Consult.GO
    server.release.set()
    book.queue.close()
    sync, _ = _book(server, mode=LookupMode.SYNC)
    server.data[redis_key(A)] = b"x"
    answer = sync.consult("r", [(A,), (B,)])
    assert (answer.verdict, answer.present) == (Consult.READY, {A})
    sync.queue.close()


def test_a_full_queue_refuses_and_the_request_goes_without() -> None:
    server = GatedClient()
    book, _ = _book(server, workers=1, max_queued=1)
    assert book.consult("r1", [(A,)]).verdict is Consult.WAIT  # taken by the thread
    assert _eventually(lambda: book.queue.queued() == 0)
    assert book.consult("r2", [(B,)]).verdict is Consult.WAIT  # queued
    assert book.consult("r3", [(C,)]).verdict is Consult.GO  # refused
    assert book.count["refused"] == 1
    assert book.queue.counts().refused == 1
    server.release.set()
    assert book.settle(5.0)
    book.queue.close()
    assert book.queue.ask([A]) is None  # closed


def test_lookups_waiting_together_go_in_one_round_trip() -> None:
    server = GatedClient()
    server.data[redis_key(B)] = b"x"
    queue = LookupQueue(server, workers=1)
    first = queue.ask([redis_key(A)])
    assert _eventually(lambda: queue.queued() == 0)  # the thread holds it at the gate
    burst = [queue.ask([redis_key(k) for k in keys]) for keys in ([A, B], [C], [B, C, A])]
    server.release.set()
    assert queue.settle(5.0)
    assert server.calls["exists"] == 2  # the first, then the burst of three in one
    assert first is not None
    assert first.answer() == (False,)
    assert [lookup.answer() for lookup in burst if lookup is not None] == [
        (False, True),
        (False,),
        (True, False, False),
    ]
    queue.close()


class FaultOnBatch(SlowClient):
    """Times out every EXISTS of more than one key."""

    def exists(self, keys: Sequence[bytes]) -> tuple[bool, ...] | ClientFault:
        answer = super().exists(keys)
        return ClientFault.TIMEOUT if len(keys) > 1 else answer


def test_a_fault_answers_every_lookup_of_its_round_trip() -> None:
    server = FaultOnBatch()
    server.release.clear()
    queue = LookupQueue(server, workers=1)
    first = queue.ask([redis_key(A)])
    assert _eventually(lambda: queue.queued() == 0)
    batch = [queue.ask([redis_key(A)]), queue.ask([redis_key(B)])]
    server.release.set()
    assert queue.settle(5.0)
    assert first is not None
    assert first.answer() == (False,)
    assert [lookup.answer() for lookup in batch if lookup is not None] == [ClientFault.TIMEOUT] * 2
    counts = queue.counts()  # three lookups, two round trips, one of them faulted
    assert (counts.answered, counts.round_trips, counts.faulted) == (3, 2, 1)
    queue.close()


def test_an_open_breaker_answers_go_at_once_without_asking() -> None:
    server = FakeClient()
    clock = Clock()
    breaker = CircuitBreaker(BreakerConfig(failures=1, backoff_s=1.0), clock)
    queue = LookupQueue(GuardedClient(server, breaker))
    book = LookupBook(queue, LookupPolicy(), breaker=breaker, clock=clock)
    server.fail_next["exists"] = ClientFault.FAULT
    book.consult("r", [(A,)])
    assert book.settle(5.0)
    assert book.consult("r", [(A,)]).fault is ClientFault.FAULT
    assert (queue.counts().round_trips, queue.counts().faulted) == (1, 1)
    calls = server.calls["exists"]
    assert book.consult("s", [(B,)]).verdict is Consult.GO
    assert server.calls["exists"] == calls
    assert breaker.counts().skips == 1
    clock.now = 1.0  # the backoff is over: the next lookup is the probe
    assert book.consult("s", [(B,)]).verdict is Consult.WAIT
    assert book.settle(5.0)
    assert book.consult("s", [(B,)]).verdict is Consult.READY
    assert breaker.counts().closes == 1
    queue.close()


def test_closing_answers_queued_lookups_fault() -> None:
    server = GatedClient()
    queue = LookupQueue(server, workers=1)
    first = queue.ask([A])
    assert _eventually(lambda: queue.queued() == 0)
    second = queue.ask([B])
    assert first is not None
    assert second is not None
    queue.close()
    assert second.ready()
    assert second.answer() is ClientFault.FAULT
    with pytest.raises(HybridKVConfigError, match="lookup"):
        first.answer()
    server.release.set()
    assert first.wait(5.0)


def test_fetches_run_side_by_side_and_a_late_one_is_late() -> None:
    pool = FetchPool(workers=4)
    started = time.monotonic()
    found = pool.run([lambda i=i: (time.sleep(0.1), i)[1] for i in range(4)], 1.0)
    elapsed = time.monotonic() - started
    assert found == [0, 1, 2, 3]
    assert elapsed < 0.3, elapsed  # one after another: >= 0.4 s
    # A result past the deadline is LATE even though it came back.
    assert pool.run([lambda: (time.sleep(0.06), "x")[1], lambda: "y"], 0.05) == [LATE, "y"]
    # A call still running when the batch's wait ends is LATE; its result is dropped.
    hold = threading.Event()
    started = time.monotonic()
    assert pool.run([lambda: hold.wait(5.0), lambda: "z"], 0.05) == [LATE, "z"]
    assert time.monotonic() - started < 1.0
    hold.set()
    assert pool.run([], 0.05) == []
    pool.close()


def test_bad_bounds_name_the_field() -> None:
    with pytest.raises(HybridKVConfigError, match="fetch_workers"):
        FetchPool(0)
    with pytest.raises(HybridKVConfigError, match="lookup_queue"):
        LookupQueue(FakeClient(), max_queued=0)
    with pytest.raises(HybridKVConfigError, match="remote_lookup_wait_ms"):
        LookupPolicy(wait_s=-1)
    with pytest.raises(HybridKVConfigError, match="wait_asks"):
        LookupPolicy(wait_asks=0)
    with pytest.raises(HybridKVConfigError, match="lookup_mode"):
        LookupPolicy(mode="async")  # type: ignore[arg-type]


def _eventually(predicate: object, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.001)
    return False
