"""Deterministic client aborts: which clients are impatient, and how patient, is a function of
the request.

``hybridkv simulate --aborts RATE`` makes each request's client impatient with probability
RATE: it waits between 1 and :data:`ABORT_WINDOW_STEPS` steps after the request arrives for the
first output token and cancels the request if none has come by then (a time-to-first-token
timeout, as load balancers and chat clients set). A request waiting for room or for a slow load
is the one such a client cancels, so aborts meet loads in flight. Both decisions hash the run's
seed with the request's trace index, never timing, so the same trace and seed make the same
clients impatient in every run and with either connector.
"""

from __future__ import annotations

import hashlib
import math

from hybridkv.errors import HybridKVConfigError

__all__ = ["ABORT_WINDOW_STEPS", "AbortPlan"]

ABORT_WINDOW_STEPS = 16


class AbortPlan:
    """Which clients are impatient, at ``rate``, for ``seed``, and how patient."""

    def __init__(self, rate: float, seed: int = 0) -> None:
        """Pre: ``0 <= rate <= 1``. Refusal: :class:`HybridKVConfigError` (field ``--aborts``)."""
        if (
            isinstance(rate, bool)
            or not isinstance(rate, (int, float))
            or not math.isfinite(rate)
            or not 0 <= rate <= 1
        ):
            raise HybridKVConfigError(
                "--aborts", rate, "must be a probability in [0, 1]", "pass e.g. --aborts 0.2"
            )
        self.rate = float(rate)
        self.seed = seed

    def patience(self, index: int) -> int | None:
        """Steps after arrival the client of the request at trace ``index`` waits for a first
        token before cancelling, or None when it waits as long as it takes. Pure."""
        if self.rate == 0.0:
            return None
        digest = hashlib.sha256(b"abort|%d|%d" % (self.seed, index)).digest()
        if int.from_bytes(digest[:8], "big") / 2**64 >= self.rate:
            return None
        return 1 + int.from_bytes(digest[8:16], "big") % ABORT_WINDOW_STEPS
