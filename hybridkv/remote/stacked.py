"""Two chunk stores stacked, a near one over a far one (issue 31: host -> disk -> server), seen
by the remote tier as one :class:`~hybridkv.remote.client.ChunkClient`.

Both hold the same chunk values under the same keys (the codec's values, content-addressed), so
either copy of a chunk is the chunk; what the stack adds is the order:

- ``exists``: the near store first; only the keys it lacks are asked of the far one. A key is
  present where either holds it. A fault of one store answers for its own keys only (held by
  the other or absent); a fault of both is the answer.
- ``get``: the near store first; on a miss or a fault of the near store, the far one. A value
  from the far store is written to the near one before it is returned (the fill: the next
  read, or the next engine after a restart, finds it near), and a fill that fails is only
  counted: the value is returned either way. The caller verifies the value as it would any
  (:func:`~hybridkv.remote.decode_chunk`); a bad value from either store is refused there.
- ``set``: both, near then far; the first fault is returned (the remote tier then writes the
  chunk again on its next store: an identical value, which the near store skips).

The far store is usually behind its own circuit breaker
(:class:`~hybridkv.remote.breaker.GuardedClient`): a far store seen down answers SKIPPED at
once, and the near one keeps serving. No call raises (each store returns its faults).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from hybridkv.remote.client import ChunkClient
from hybridkv.remote.values import ClientFault

__all__ = ["STACK_COUNTER_NAMES", "StackedClient"]

STACK_COUNTER_NAMES = (
    "near_hits",
    "far_hits",
    "fills",
    "fills_failed",
    "near_faults",
    "far_faults",
)
"""What :meth:`StackedClient.counts` reports: reads served by each store, fills written and
failed, and the faults each store returned (any call)."""


class StackedClient:
    """``near`` over ``far`` (module docstring)."""

    def __init__(self, near: ChunkClient, far: ChunkClient) -> None:
        self.near = near
        self.far = far
        self._lock = threading.Lock()  # called from lookup, fetch and writer threads at once
        self._counts = dict.fromkeys(STACK_COUNTER_NAMES, 0)

    def exists(self, keys: Sequence[bytes]) -> tuple[bool, ...] | ClientFault:
        """Per key, whether either store holds it; the far store is asked only for the keys
        the near one lacks. Frame: counters only."""
        near = self.near.exists(keys)
        if isinstance(near, ClientFault):
            self._count("near_faults")
            held = [False] * len(keys)
        else:
            held = list(near)
        rest = [key for key, here in zip(keys, held, strict=True) if not here]
        if not rest:
            return tuple(held)
        far = self.far.exists(rest)
        if isinstance(far, ClientFault):
            self._count("far_faults")
            return far if isinstance(near, ClientFault) else tuple(held)
        answers = iter(far)
        return tuple(here or next(answers) for here in held)

    def get(self, key: bytes) -> bytes | ClientFault | None:
        """The near store's value, else the far store's (written to the near one first)."""
        near = self.near.get(key)
        if isinstance(near, bytes):
            self._count("near_hits")
            return near
        if isinstance(near, ClientFault):
            self._count("near_faults")
        far = self.far.get(key)
        if isinstance(far, ClientFault):
            self._count("far_faults")
            return far
        if far is None:
            return None
        self._count("far_hits")
        filled = self.near.set(key, far, 0)
        self._count("fills" if filled is None else "fills_failed")
        return far

    def set(self, key: bytes, value: bytes, ttl_s: int) -> ClientFault | None:
        """Write both (the near store keeps no TTL: it evicts by its own limit); the first
        fault, or None."""
        near = self.near.set(key, value, 0)
        if near is not None:
            self._count("near_faults")
        far = self.far.set(key, value, ttl_s)
        if far is not None:
            self._count("far_faults")
        return near if near is not None else far

    def close(self) -> None:
        """Close both."""
        self.near.close()
        self.far.close()

    def counts(self) -> dict[str, int]:
        """A copy of the counters (:data:`STACK_COUNTER_NAMES`)."""
        with self._lock:
            return dict(self._counts)

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1
