"""Per request, the remote lookup asked for its claim and what to do while it is unanswered.

The scheduler side asks the server which chunks it holds (:mod:`hybridkv.remote.lookups` asks
off the scheduler thread) and must answer vLLM at once. :class:`LookupBook` keeps, per request,
its latest lookup, and tells the caller (:meth:`LookupBook.consult`):

- READY: an answered lookup covers every chunk asked now; here is what the server holds: a
  chunk only if it holds every one of the chunk's tensor-parallel shard keys (the all-ranks
  rule, :func:`hybridkv.remote.shards.held_per_chunk`; one key per chunk at TP 1).
- WAIT: the lookup is not answered, and the request has waited less than ``wait_s`` in all:
  defer the request (vLLM's ``get_num_new_matched_tokens`` answers None and asks again next
  step).
- GO: nothing to wait for: the request goes on without the remote tier's hit. The lookup is
  not answered and the request's wait is spent; or the queue is full; or the circuit breaker
  is open (:mod:`hybridkv.remote.breaker`: no server call at all).

Bounded deferral (liveness, SC-10..12): a request is deferred for its lookups for at most
``wait_s`` seconds in all, counted from its first WAIT, and at most ``wait_asks`` WAIT answers
(vLLM asks a waiting request once per step), however many lookups it asks (a preempted or
re-asked request does not get a new budget); after either it is never WAITed again. So a
paused or dead server delays each request at most ``wait_s`` and never wedges one, and a waiting
request holds no block and stays idle at most ``wait_asks`` steps: under SC-12's window on vLLM
(48 steps) even when the engine spins through empty steps faster than the server answers.

Deterministic answers: an answer, once in, is the request's answer for every chunk it covers,
however often vLLM asks; a new lookup is asked only for chunks no lookup of the request asked
(its prefix grew, the host lost a chunk). A late answer still serves a request that is still
waiting when it comes in. ``SYNC`` mode asks on the caller's thread (the path before issue 30,
kept for the stall benchmark's comparison): always READY or GO.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from hybridkv.errors import HybridKVConfigError
from hybridkv.remote.breaker import CircuitBreaker
from hybridkv.remote.codec import redis_key
from hybridkv.remote.lookups import Lookup, LookupQueue
from hybridkv.remote.shards import held_per_chunk
from hybridkv.remote.values import ClientFault

__all__ = ["Consult", "Consulted", "LookupBook", "LookupMode", "LookupPolicy"]


class LookupMode(Enum):
    """Where a lookup's EXISTS runs: on the lookup threads (ASYNC) or the caller's (SYNC)."""

    ASYNC = "async"
    SYNC = "sync"


@dataclass(frozen=True, slots=True)
class LookupPolicy:
    """How lookups are asked and how long a request may wait for one.

    Attributes:
        mode: ASYNC (default) or SYNC (:class:`LookupMode`).
        wait_s: the longest a request is deferred, in all, waiting for its lookups (>= 0;
            0: never deferred, a request whose answer is not in goes on without the hit).
        wait_asks: the most WAIT answers a request gets in all (>= 1): the same bound in
            steps.
        workers: lookup threads (>= 1).
        max_queued: lookups waiting for a thread at most (>= 1); beyond it a request goes on
            without the remote tier.
    """

    mode: LookupMode = LookupMode.ASYNC
    wait_s: float = 0.02
    wait_asks: int = 16
    workers: int = 2
    max_queued: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.mode, LookupMode):
            raise HybridKVConfigError("lookup_mode", self.mode, "is not a LookupMode", "ASYNC")
        wait = self.wait_s
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 60:
            raise HybridKVConfigError(
                "remote_lookup_wait_ms", wait, "must be seconds in [0, 60]", "e.g. 0.02"
            )
        asks = self.wait_asks
        if isinstance(asks, bool) or not isinstance(asks, int) or asks < 1:
            raise HybridKVConfigError("wait_asks", asks, "must be an int >= 1", "e.g. 16")


class Consult(Enum):
    """What the caller does with a request's claim now (module docstring)."""

    READY = "ready"
    WAIT = "wait"
    GO = "go"


@dataclass(frozen=True, slots=True)
class Consulted:
    """:meth:`LookupBook.consult`'s answer.

    Attributes:
        verdict: READY, WAIT or GO.
        present: READY: the asked chunk keys (first shard keys) whose every shard the server
            holds (empty on a fault).
        fault: READY: the fault that answered the lookup, or None.
        first: READY: whether this is the first time this lookup's answer is read.
    """

    verdict: Consult
    present: frozenset[bytes] = frozenset()
    fault: ClientFault | None = None
    first: bool = False


_WAIT = Consulted(Consult.WAIT)
_GO = Consulted(Consult.GO)


class _Asked:
    __slots__ = ("chunks", "covered", "late", "lookup", "read")

    def __init__(self, lookup: Lookup, chunks: tuple[tuple[bytes, ...], ...]) -> None:
        self.lookup = lookup
        self.chunks = chunks  # per chunk its shard keys, the first naming it
        self.covered = frozenset(keys[0] for keys in chunks)
        self.read = False  # the answer was handed out once
        self.late = False  # the request went on without it


class LookupBook:
    """The module's per-request records over ``queue`` (``breaker``: skip while open)."""

    def __init__(
        self,
        queue: LookupQueue,
        policy: LookupPolicy,
        *,
        breaker: CircuitBreaker | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.queue = queue
        self.policy = policy
        self.breaker = breaker
        self._clock = clock
        self._asked: dict[str, _Asked] = {}
        self._waited: dict[str, tuple[float, int]] = {}  # first WAIT's time, WAITs so far
        self.count = {"asked": 0, "refused": 0, "waits": 0, "late": 0}

    def consult(self, rid: str, chunks: Sequence[Sequence[bytes]]) -> Consulted:
        """What ``rid``'s claim over ``chunks`` (non-empty; per chunk its shard keys, in shard
        order, the first naming the chunk: :class:`Consulted` ``present`` holds those) does
        now (module docstring).

        Post: a lookup of every shard key of ``chunks`` is asked (``asked`` grew) unless an
        earlier one of the request covers the chunks, the queue refused it (``refused``) or
        the breaker is open (the breaker counts a skip); a WAIT counts ``waits``; the first GO
        of an unanswered lookup counts ``late``.
        Errors: HybridKVConfigError (field ``chunks``) on a chunk with no key.
        """
        if any(not keys for keys in chunks):
            raise HybridKVConfigError(
                "chunks", rid, "holds a chunk with no shard key", "pass every shard's key"
            )
        asked = self._asked.get(rid)
        if asked is None or not asked.covered.issuperset(keys[0] for keys in chunks):
            fresh = self._ask(tuple(tuple(keys) for keys in chunks))
            if fresh is None:
                return _GO
            self._asked[rid] = asked = fresh
        if asked.lookup.ready():
            return self._read(asked)
        if self.policy.mode is LookupMode.ASYNC and self._may_wait(rid):
            self.count["waits"] += 1
            return _WAIT
        if not asked.late:
            asked.late = True
            self.count["late"] += 1
        return _GO

    def forget(self, rid: str) -> None:
        """The request finished: drop its lookup (answered later, it is read by no one)."""
        self._asked.pop(rid, None)
        self._waited.pop(rid, None)

    def _may_wait(self, rid: str) -> bool:
        """Whether ``rid`` may wait once more, counting this WAIT (module docstring)."""
        now = self._clock()
        since, asks = self._waited.get(rid, (now, 0))
        if now - since >= self.policy.wait_s or asks >= self.policy.wait_asks:
            return False
        self._waited[rid] = (since, asks + 1)
        return True

    def clear(self) -> None:
        """Forget every request's lookup (a reset: the keys asked are of the old namespace);
        each request's wait so far still counts against its bound."""
        self._asked.clear()

    def settle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every asked lookup to be answered (tests, benches)."""
        return self.queue.settle(timeout_s)

    def _ask(self, chunks: tuple[tuple[bytes, ...], ...]) -> _Asked | None:
        breaker = self.breaker
        if breaker is not None and breaker.skipping():
            breaker.skipped()
            return None
        keys = [redis_key(key) for shard_keys in chunks for key in shard_keys]
        if self.policy.mode is LookupMode.SYNC:
            lookup: Lookup | None = self.queue.ask_now(keys)
        else:
            lookup = self.queue.ask(keys)
        if lookup is None:
            self.count["refused"] += 1
            return None
        self.count["asked"] += 1
        return _Asked(lookup, chunks)

    @staticmethod
    def _read(asked: _Asked) -> Consulted:
        first, asked.read = not asked.read, True
        answer = asked.lookup.answer()
        if isinstance(answer, ClientFault):
            return Consulted(Consult.READY, fault=answer, first=first)
        held = held_per_chunk(answer, asked.chunks)
        present = frozenset(keys[0] for keys, yes in zip(asked.chunks, held, strict=True) if yes)
        return Consulted(Consult.READY, present, first=first)
