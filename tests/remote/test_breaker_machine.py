"""The circuit breaker as a Hypothesis state machine: calls let through, resolved in any order,
a clock that moves, and the breaker's properties after every step.

The callers keep the breaker's one promise (every call ``allow()`` let through is recorded
once); the machine checks what the breaker promises back:

- trips - closes is 1 exactly while it is not CLOSED (``breaker_counters``' reading);
- HALF_OPEN never sticks: with no call out, it is not HALF_OPEN;
- in HALF_OPEN exactly one call is out that was let through as the probe;
- skips count exactly the calls refused (and the drops reported by ``skipped``);
- while OPEN within its backoff, nothing is let through;
- in CLOSED, ``failures`` failures recorded in a row (with no success between) open it.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridkv.remote import BreakerConfig, BreakerState, CircuitBreaker, Permit

FAILURES, BACKOFF = 3, 2.0


class BreakerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.breaker = CircuitBreaker(BreakerConfig(FAILURES, BACKOFF), lambda: self.now)
        self.out: list[Permit] = []  # permits of the calls let through, not recorded yet
        self.refused = 0
        self.run = 0  # failures recorded in a row while CLOSED

    @rule()
    def call(self) -> None:
        before = self.breaker.counts()
        within_backoff = before.state is BreakerState.OPEN and self.breaker.skipping()
        permit = self.breaker.allow()
        after = self.breaker.counts()
        if within_backoff:
            assert permit is Permit.REFUSED
        assert (permit is Permit.PROBE) == (after.probes > before.probes)
        if permit is Permit.REFUSED:
            self.refused += 1
        else:
            self.out.append(permit)

    @precondition(lambda self: self.out)
    @rule(which=st.integers(0, 10), ok=st.booleans())
    def resolve(self, which: int, ok: bool) -> None:
        permit = self.out.pop(which % len(self.out))
        state = self.breaker.counts().state
        self.breaker.record(permit, ok)
        if state is BreakerState.CLOSED:
            self.run = 0 if ok else self.run + 1
            if self.run >= FAILURES:
                assert self.breaker.counts().state is BreakerState.OPEN
                self.run = 0
        else:
            self.run = 0

    @precondition(lambda self: self.breaker.skipping())
    @rule()
    def drop(self) -> None:
        self.breaker.skipped()
        self.refused += 1

    @rule(seconds=st.sampled_from([0.1, 1.0, BACKOFF]))
    def tick(self, seconds: float) -> None:
        self.now += seconds

    @invariant()
    def promises_hold(self) -> None:
        counts = self.breaker.counts()
        assert counts.trips - counts.closes == (counts.state is not BreakerState.CLOSED)
        assert counts.skips == self.refused
        if not self.out:
            assert counts.state is not BreakerState.HALF_OPEN
        if counts.state is BreakerState.HALF_OPEN:
            assert self.out.count(Permit.PROBE) == 1


BreakerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40)
test_breaker_machine = BreakerMachine.TestCase
