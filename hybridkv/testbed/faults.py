"""Deterministic fault injection: whether a transfer job fails is a function of the job.

``hybridkv simulate --faults RATE`` fails each transfer job with probability RATE. The decision
hashes the run's seed with what identifies the job's work (direction, request, first key), not
with wall-clock timing or submission order, so the same trace and seed fail the same jobs in
every run and in every implementation of the connector: a run with the optimized connector and
a run with the reference connector can be compared fault for fault.
"""

from __future__ import annotations

import hashlib

from hybridkv.errors import HybridKVConfigError

__all__ = ["FaultPlan"]


class FaultPlan:
    """Which jobs fail, at ``rate``, for ``seed``."""

    def __init__(self, rate: float, seed: int = 0) -> None:
        """Pre: ``0 <= rate <= 1``. Refusal: :class:`HybridKVConfigError` (field ``--faults``)."""
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise HybridKVConfigError(
                "--faults", rate, "must be a probability in [0, 1]", "pass e.g. --faults 0.05"
            )
        self.rate = float(rate)
        self.seed = seed

    def fails(self, direction: str, request_id: str, first_key: bytes) -> bool:
        """Does the job that moves ``first_key`` first for ``request_id`` fail? Pure."""
        if self.rate == 0.0:
            return False
        digest = hashlib.sha256(
            b"%d|%s|%s|" % (self.seed, direction.encode(), request_id.encode()) + first_key
        ).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < self.rate
