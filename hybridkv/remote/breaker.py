"""A circuit breaker in front of the remote tier's server: stop asking a server that is down.

Without it every lookup, fetch and write asks a dead or paused server and waits (up to the
deadline) for a fault it could have predicted. The breaker counts consecutive failures (a
:class:`~hybridkv.remote.values.ClientFault` FAULT or TIMEOUT; any reply, even "absent", is a
success):

- CLOSED: every call goes to the server. ``failures`` consecutive failures open it (a trip).
- OPEN: no call goes to the server for ``backoff_s``; each is answered SKIPPED at once (a skip).
- HALF_OPEN: the backoff is over; exactly one call (the probe) goes to the server, the others
  are skipped until it resolves. A probe that succeeds closes the breaker; one that fails
  opens it again for another ``backoff_s``.

Every call the breaker lets through is paired with one :meth:`CircuitBreaker.record` of its
result under the :class:`Permit` it was let through with (:class:`GuardedClient` does both), so
a probe always resolves and HALF_OPEN never sticks. Only the probe's own result moves HALF_OPEN:
a call let through before the trip that resolves late (OPEN or HALF_OPEN) changes nothing, so
its failure is never taken for a failed probe while the probe is still out. Thread-safe: the
lookup threads, the fetch threads and the writer thread share one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

from hybridkv.errors import HybridKVConfigError
from hybridkv.remote.client import ChunkClient
from hybridkv.remote.values import ClientFault

__all__ = [
    "BreakerConfig",
    "BreakerCounts",
    "BreakerState",
    "CircuitBreaker",
    "GuardedClient",
    "Permit",
    "breaker_counters",
]

_T = TypeVar("_T")


class BreakerState(Enum):
    """Where the breaker is (module docstring)."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Permit(Enum):
    """What :meth:`CircuitBreaker.allow` answered: REFUSED (do not call the server), CALL
    (call it, CLOSED) or PROBE (call it: the one probe of HALF_OPEN). A CALL or PROBE is
    handed back to :meth:`CircuitBreaker.record` with the call's result."""

    REFUSED = "refused"
    CALL = "call"
    PROBE = "probe"


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """When the breaker opens and for how long.

    Attributes:
        failures: consecutive failed calls that open it (>= 1).
        backoff_s: seconds it stays open before one probe (> 0).
    """

    failures: int = 3
    backoff_s: float = 5.0

    def __post_init__(self) -> None:
        failures = self.failures
        if isinstance(failures, bool) or not isinstance(failures, int) or failures < 1:
            raise HybridKVConfigError(
                "remote_breaker_failures", failures, "must be an int >= 1", "e.g. 3"
            )
        backoff = self.backoff_s
        ok = isinstance(backoff, (int, float)) and not isinstance(backoff, bool)
        if not ok or not 0 < backoff <= 3600:
            raise HybridKVConfigError(
                "remote_breaker_backoff_ms", backoff, "must be seconds in (0, 3600]", "e.g. 5"
            )


@dataclass(frozen=True, slots=True)
class BreakerCounts:
    """What the breaker did so far (monotone counts, and the state now).

    Attributes:
        state: the state now.
        trips: times it opened from CLOSED (a failed probe opens it again, not counted here:
            ``trips - closes`` is 1 exactly while it is not CLOSED).
        closes: times a probe succeeded and closed it.
        probes: calls let through as probes (``probes - closes`` failed, counting one in
            flight).
        skips: calls answered SKIPPED without asking the server.
    """

    state: BreakerState
    trips: int
    closes: int
    probes: int
    skips: int


class CircuitBreaker:
    """The module's breaker over a ``clock`` (seconds, monotonic; tests pass a fake one)."""

    def __init__(self, config: BreakerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        """Post: CLOSED, every count 0."""
        if not isinstance(config, BreakerConfig):
            raise HybridKVConfigError("config", config, "is not a BreakerConfig", "build one")
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0  # consecutive, in CLOSED
        self._opened_at = 0.0
        self._trips = self._closes = self._probes = self._skips = 0

    def allow(self) -> Permit:
        """Whether to ask the server now. CALL or PROBE is a promise to :meth:`record` the
        result with that permit.

        CLOSED: CALL. OPEN: REFUSED (a skip) until ``backoff_s`` has passed since it opened,
        then HALF_OPEN and PROBE. HALF_OPEN: REFUSED (a skip) while the probe is out.
        """
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return Permit.CALL
            if self._state is BreakerState.OPEN and self._backoff_over():
                self._state = BreakerState.HALF_OPEN
                self._probes += 1
                return Permit.PROBE
            self._skips += 1
            return Permit.REFUSED

    def skipping(self) -> bool:
        """Whether :meth:`allow` would refuse now, without counting or moving anything: OPEN
        within its backoff, or HALF_OPEN (its probe out). For callers that drop work early."""
        with self._lock:
            if self._state is BreakerState.OPEN:
                return not self._backoff_over()
            return self._state is BreakerState.HALF_OPEN

    def skipped(self) -> None:
        """Count one call its caller dropped because :meth:`skipping` said so."""
        with self._lock:
            self._skips += 1

    def record(self, permit: Permit, ok: bool) -> None:
        """The result of a call :meth:`allow` let through with ``permit``: ``ok`` unless it
        failed.

        The PROBE (in HALF_OPEN): a success closes it, a failure opens it again. A CALL in
        CLOSED: a success clears the failure run; the ``failures``-th failure in a row opens it.
        A CALL in OPEN or HALF_OPEN was let through before the trip and resolved late: its
        result changes nothing (in HALF_OPEN the probe is still out).
        Errors: HybridKVConfigError (field ``permit``) on REFUSED (no call was made).
        """
        if permit is Permit.REFUSED:
            raise HybridKVConfigError(
                "permit", permit, "let no call through", "record only a CALL or PROBE's result"
            )
        with self._lock:
            state = self._state
            if permit is Permit.PROBE and state is BreakerState.HALF_OPEN:
                if ok:
                    self._state, self._failures = BreakerState.CLOSED, 0
                    self._closes += 1
                else:
                    self._open()  # open again: not a new trip (trips - closes stays 1)
            elif permit is Permit.CALL and state is BreakerState.CLOSED:
                self._failures = 0 if ok else self._failures + 1
                if self._failures >= self.config.failures:
                    self._open()
                    self._trips += 1

    def counts(self) -> BreakerCounts:
        """The state and the counts now. Frame: nothing changes."""
        with self._lock:
            return BreakerCounts(self._state, self._trips, self._closes, self._probes, self._skips)

    def _open(self) -> None:
        self._state, self._failures = BreakerState.OPEN, 0
        self._opened_at = self._clock()

    def _backoff_over(self) -> bool:
        return self._clock() - self._opened_at >= self.config.backoff_s


class GuardedClient:
    """A :class:`~hybridkv.remote.client.ChunkClient` behind a :class:`CircuitBreaker`: a call
    the breaker refuses answers :attr:`ClientFault.SKIPPED` at once; every other call's result
    is recorded (a FAULT or TIMEOUT is a failure, anything else a success)."""

    def __init__(self, client: ChunkClient, breaker: CircuitBreaker) -> None:
        self.client = client
        self.breaker = breaker

    def exists(self, keys: Sequence[bytes]) -> tuple[bool, ...] | ClientFault:
        return self._guarded(lambda: self.client.exists(keys))

    def get(self, key: bytes) -> bytes | ClientFault | None:
        return self._guarded(lambda: self.client.get(key))

    def set(self, key: bytes, value: bytes, ttl_s: int) -> ClientFault | None:
        return self._guarded(lambda: self.client.set(key, value, ttl_s))

    def close(self) -> None:
        self.client.close()

    def _guarded(self, call: Callable[[], _T]) -> _T | ClientFault:
        permit = self.breaker.allow()
        if permit is Permit.REFUSED:
            return ClientFault.SKIPPED
        reply = call()
        self.breaker.record(permit, not isinstance(reply, ClientFault))
        return reply


def breaker_counters(prefix: str, counts: BreakerCounts) -> dict[str, int]:
    """The counts as metrics counters named ``prefix`` + trips, closes, probes, skips. The
    state is ``trips - closes``: 1 while the tier is skipped or probed, 0 while it is asked."""
    return {
        prefix + "trips": counts.trips,
        prefix + "closes": counts.closes,
        prefix + "probes": counts.probes,
        prefix + "skips": counts.skips,
    }
