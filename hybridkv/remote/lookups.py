"""Lookups asked off the caller's thread: a bounded queue and a few threads that run EXISTS.

vLLM calls the scheduler side's lookup inside ``schedule()``; a synchronous EXISTS there makes
every step wait on the server (up to the deadline when it is paused). :class:`LookupQueue`
takes the question, returns a :class:`Lookup` at once, and answers it on one of its threads;
the caller reads the answer on a later call, when it is ready. Nothing here applies an answer:
the caller does, on its own thread (the host store is not thread-safe).

Bounds: at most ``max_queued`` lookups waiting for a thread (a question beyond it is refused,
:meth:`LookupQueue.ask` returns None, and the caller goes on without the remote tier), and
each EXISTS waits at most the client's deadline, so every accepted lookup is answered. A
thread takes every lookup waiting when it wakes and asks them in one pipelined EXISTS (one
round trip for a burst); a fault answers each of them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.errors import HybridKVConfigError
from hybridkv.remote.client import ChunkClient
from hybridkv.remote.values import ClientFault

__all__ = ["Lookup", "LookupCounts", "LookupQueue"]


class Lookup:
    """One question (``keys``, the server keys asked) and, once :meth:`ready`, its answer."""

    __slots__ = ("_answer", "_done", "keys")

    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self.keys = keys
        self._answer: tuple[bool, ...] | ClientFault = ClientFault.FAULT
        self._done = threading.Event()

    def ready(self) -> bool:
        """Whether the answer is in (never changes back)."""
        return self._done.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the answer; whether it is in."""
        return self._done.wait(timeout_s)

    def answer(self) -> tuple[bool, ...] | ClientFault:
        """Per key whether the server holds it, or the fault that answered the question.

        Errors: HybridKVConfigError (field ``lookup``) before :meth:`ready`."""
        if not self._done.is_set():
            raise HybridKVConfigError("lookup", self.keys[:1], "is not answered", "ready() first")
        return self._answer

    def resolve(self, answer: tuple[bool, ...] | ClientFault) -> None:
        """Set the answer (the queue's threads, or the caller for a synchronous ask)."""
        self._answer = answer
        self._done.set()


@dataclass(frozen=True, slots=True)
class LookupCounts:
    """The queue's monotone counts: lookups ``asked`` (accepted), ``refused`` (queue full),
    ``answered``; EXISTS ``round_trips`` sent to the server (one answers every lookup of its
    batch; a call the breaker skipped is none) and, of those, ``faulted`` (FAULT or TIMEOUT:
    each of its lookups answered by the fault)."""

    asked: int
    refused: int
    answered: int
    round_trips: int = 0
    faulted: int = 0


class LookupQueue:
    """``workers`` daemon threads answering queued lookups through ``client`` (EXISTS)."""

    def __init__(self, client: ChunkClient, *, workers: int = 2, max_queued: int = 64) -> None:
        """Post: empty, its threads started. Errors: HybridKVConfigError on a bound < 1."""
        for field, value in (("lookup_workers", workers), ("lookup_queue", max_queued)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise HybridKVConfigError(field, value, "must be an int >= 1", "e.g. 2")
        self._client = client
        self.max_queued = max_queued
        self._lock = threading.Condition()
        self._queue: deque[Lookup] = deque()
        self._running = 0
        self._closed = False
        self._asked = self._refused = self._answered = 0
        self._trips = self._faulted = 0
        self._threads = [
            threading.Thread(target=self._loop, name=f"hybridkv-lookup-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def ask(self, keys: Sequence[bytes]) -> Lookup | None:
        """Queue one EXISTS of ``keys``; the lookup to read later, or None (queue full or
        closed: nothing queued, ``refused`` grew). Never waits on the server."""
        lookup = Lookup(tuple(keys))
        with self._lock:
            if self._closed or len(self._queue) >= self.max_queued:
                self._refused += 1
                return None
            self._queue.append(lookup)
            self._asked += 1
            self._lock.notify()
        return lookup

    def ask_now(self, keys: Sequence[bytes]) -> Lookup:
        """EXISTS of ``keys`` on the caller's thread (the synchronous path kept for
        comparison); the lookup, already answered."""
        lookup = Lookup(tuple(keys))
        found = self._client.exists(lookup.keys)
        lookup.resolve(found)
        with self._lock:
            self._asked += 1
            self._answered += 1
            self._count_trip(found)
        return lookup

    def settle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until no lookup is queued or running; whether none is.
        For tests and benchmarks that step an engine only once its lookups are answered."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._queue and not self._running, timeout_s)

    def queued(self) -> int:
        """Lookups waiting for a thread now (not those a thread is asking)."""
        with self._lock:
            return len(self._queue)

    def counts(self) -> LookupCounts:
        """The monotone counts now. Frame: nothing changes."""
        with self._lock:
            return LookupCounts(
                self._asked, self._refused, self._answered, self._trips, self._faulted
            )

    def close(self, timeout_s: float = 0.0) -> bool:
        """Stop taking lookups; queued ones are answered FAULT; wait up to ``timeout_s`` for
        the threads to end (each after its EXISTS, bounded by the client's deadline), so the
        caller may then close the client under none of them. Whether they all ended."""
        with self._lock:
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            self._lock.notify_all()
        for lookup in dropped:
            lookup.resolve(ClientFault.FAULT)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    def _loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: bool(self._queue) or self._closed)
                if not self._queue:
                    return
                # Every lookup waiting now goes in one pipelined round trip: a burst of new
                # requests (vLLM admits many at once) is answered in one EXISTS, not one each.
                batch = list(self._queue)
                self._queue.clear()
                self._running += len(batch)
            self._answer(batch)

    def _count_trip(self, found: tuple[bool, ...] | ClientFault) -> None:
        """Count one EXISTS's answer (under the lock): a skip asked no server."""
        if found is not ClientFault.SKIPPED:
            self._trips += 1
            self._faulted += isinstance(found, ClientFault)

    def _answer(self, batch: list[Lookup]) -> None:
        answers: list[tuple[bool, ...] | ClientFault] = [ClientFault.FAULT] * len(batch)
        found: tuple[bool, ...] | ClientFault = ClientFault.FAULT  # if the client raised
        try:
            found = self._client.exists([key for lookup in batch for key in lookup.keys])
            at = 0
            for i, lookup in enumerate(batch):
                if isinstance(found, ClientFault):
                    answers[i] = found
                else:
                    answers[i] = found[at : at + len(lookup.keys)]
                    at += len(lookup.keys)
        finally:  # a client that raised (it must not) still answers: FAULT, no wedge
            for lookup, answer in zip(batch, answers, strict=True):
                lookup.resolve(answer)
            with self._lock:
                self._running -= len(batch)
                self._answered += len(batch)
                self._count_trip(found)
                self._lock.notify_all()
