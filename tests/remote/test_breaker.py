"""The circuit breaker (hybridkv.remote.breaker) on a fake clock, alone and in front of a client.

CLOSED -> OPEN after ``failures`` consecutive failures; OPEN skips every call for ``backoff_s``;
then HALF_OPEN lets exactly one probe through; the probe's success closes it, its failure opens
it for another backoff. A success in between clears the failure run. Every skip is counted, and
a skipped call never reaches the server.
"""

from __future__ import annotations

import pytest
from _fake_chunk_client import FakeClient

from hybridkv.errors import HybridKVConfigError
from hybridkv.remote import (
    BreakerConfig,
    BreakerState,
    CircuitBreaker,
    ClientFault,
    GuardedClient,
    Permit,
    breaker_counters,
)

CLOSED, OPEN, HALF = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN
CALL, PROBE, REFUSED = Permit.CALL, Permit.PROBE, Permit.REFUSED


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _breaker(failures: int = 3, backoff_s: float = 5.0) -> tuple[CircuitBreaker, Clock]:
    clock = Clock()
    return CircuitBreaker(BreakerConfig(failures, backoff_s), clock), clock


def _fail(breaker: CircuitBreaker, times: int) -> None:
    for _ in range(times):
        assert breaker.allow() is CALL
        breaker.record(CALL, False)


def test_consecutive_failures_open_it_and_a_success_clears_the_run() -> None:
    breaker, _ = _breaker(failures=3)
    _fail(breaker, 2)
    assert breaker.allow() is CALL
    breaker.record(CALL, True)  # the run of failures ends
    _fail(breaker, 2)
    assert breaker.counts().state is CLOSED
    _fail(breaker, 1)
    counts = breaker.counts()
    assert (counts.state, counts.trips, counts.skips) == (OPEN, 1, 0)


def test_open_skips_until_the_backoff_then_one_probe_goes_through() -> None:
    breaker, clock = _breaker(failures=1, backoff_s=5.0)
    _fail(breaker, 1)
    for _ in range(4):
        assert breaker.skipping()
        assert breaker.allow() is REFUSED
    clock.now += 4.999
    assert breaker.allow() is REFUSED
    clock.now += 0.001
    assert not breaker.skipping()
    assert breaker.allow() is PROBE
    assert breaker.counts().state is HALF
    assert breaker.skipping()
    assert breaker.allow() is REFUSED  # a second caller while the probe is out: skipped
    counts = breaker.counts()
    assert (counts.probes, counts.skips) == (1, 6)


@pytest.mark.parametrize(("probe_ok", "state"), [(True, CLOSED), (False, OPEN)])
def test_the_probe_closes_it_or_opens_it_again(probe_ok: bool, state: BreakerState) -> None:
    breaker, clock = _breaker(failures=2, backoff_s=1.0)
    _fail(breaker, 2)
    clock.now += 1.0
    assert breaker.allow() is PROBE
    breaker.record(PROBE, probe_ok)
    counts = breaker.counts()
    assert counts.state is state
    assert (counts.trips, counts.closes, counts.probes) == (1, 1 if probe_ok else 0, 1)
    if not probe_ok:  # a fresh backoff from the failed probe
        clock.now += 0.5
        assert breaker.allow() is REFUSED
        clock.now += 0.5
        assert breaker.allow() is PROBE
    else:  # closed: a fresh run of failures is needed to open it again
        _fail(breaker, 1)
        assert breaker.counts().state is CLOSED


def test_a_late_result_while_open_changes_nothing() -> None:
    breaker, _ = _breaker(failures=1)
    assert breaker.allow() is CALL  # a call let through before the trip
    _fail(breaker, 1)
    breaker.record(CALL, True)  # the first call's late success
    assert breaker.counts().state is OPEN


def test_a_late_result_while_the_probe_is_out_is_not_the_probes() -> None:
    """Hypothesis' state machine found it: a call let through before the trip failing while
    the probe was out reopened the breaker, the probe still out, and the next backoff let a
    second probe through (two out at once)."""
    breaker, clock = _breaker(failures=1, backoff_s=1.0)
    assert breaker.allow() is CALL  # let through before the trip, resolved late
    _fail(breaker, 1)
    clock.now += 1.0
    assert breaker.allow() is PROBE
    breaker.record(CALL, False)  # the late call's failure: the probe is still out
    assert breaker.counts().state is HALF
    clock.now += 1.0
    assert breaker.allow() is REFUSED  # still one probe at most
    breaker.record(PROBE, True)
    counts = breaker.counts()
    assert (counts.state, counts.probes, counts.closes) == (CLOSED, 1, 1)
    with pytest.raises(HybridKVConfigError, match="permit"):
        breaker.record(REFUSED, True)


def test_a_dropped_call_is_counted_as_a_skip() -> None:
    breaker, _ = _breaker(failures=1)
    _fail(breaker, 1)
    assert breaker.skipping()
    breaker.skipped()
    assert breaker.counts().skips == 1
    assert breaker_counters("x_", breaker.counts()) == {
        "x_trips": 1,
        "x_closes": 0,
        "x_probes": 0,
        "x_skips": 1,
    }


def test_the_guarded_client_skips_the_server_while_open() -> None:
    server = FakeClient()
    server.data[b"k"] = b"v"
    breaker, clock = _breaker(failures=2, backoff_s=2.0)
    client = GuardedClient(server, breaker)
    server.fail_next["get"] = ClientFault.TIMEOUT
    assert client.get(b"k") is ClientFault.TIMEOUT
    assert client.get(b"k") == b"v"  # a success: the run is 1, cleared
    server.fail_next["exists"] = ClientFault.FAULT
    assert client.exists([b"k"]) is ClientFault.FAULT
    server.fail_next["set"] = ClientFault.FAULT
    assert client.set(b"j", b"w", 0) is ClientFault.FAULT
    assert breaker.counts().state is OPEN
    calls = dict(server.calls)
    assert client.get(b"k") is ClientFault.SKIPPED
    assert client.exists([b"k"]) is ClientFault.SKIPPED
    assert client.set(b"j", b"w", 0) is ClientFault.SKIPPED
    assert server.calls == calls  # the server was not asked
    clock.now += 2.0
    assert client.exists([b"k", b"z"]) == (True, False)  # the probe; "absent" is a success
    assert breaker.counts().state is CLOSED
    client.close()
    assert server.closed


@pytest.mark.parametrize(
    ("failures", "backoff_s", "field"),
    [
        (0, 1.0, "remote_breaker_failures"),
        (True, 1.0, "remote_breaker_failures"),
        (2.5, 1.0, "remote_breaker_failures"),
        (3, 0, "remote_breaker_backoff_ms"),
        (3, -1.0, "remote_breaker_backoff_ms"),
        (3, 7200.0, "remote_breaker_backoff_ms"),
        (3, True, "remote_breaker_backoff_ms"),
    ],
)
def test_bad_config_names_the_field(failures: object, backoff_s: object, field: str) -> None:
    with pytest.raises(HybridKVConfigError, match=field):
        BreakerConfig(failures, backoff_s)  # type: ignore[arg-type]
    with pytest.raises(HybridKVConfigError, match="config"):
        CircuitBreaker("closed")  # type: ignore[arg-type]
