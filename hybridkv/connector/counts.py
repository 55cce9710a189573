"""What the scheduler-side core counts, and how a claim is loaded.

:class:`ConnectorStats` is the value :meth:`ConnectorCore.stats` returns: counters since the
core was built (monotone, so a reader takes differences) followed by what the core holds at
the moment of the call. :data:`COUNTED` names the counters in the order
:meth:`ConnectorCore.counts` gives them.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

__all__ = ["COUNTED", "ConnectorStats", "LoadMode"]


class LoadMode(Enum):
    """Whether a claim loads asynchronously (vLLM's default: the request waits in
    WAITING_FOR_REMOTE_KVS) or synchronously, inside the step that admits it."""

    ASYNC = "async"
    SYNC = "sync"


class ConnectorStats(NamedTuple):
    """Counters since creation, then four holdings now (requests known, jobs in flight,
    store-source blocks pinned, keys the failure memory holds).

    ``hashes_computed`` counts block hashes over all requests: a request's full hash block is
    hashed once in its life, however often the request is asked about or stored.
    """

    lookups: int
    deferred: int
    claims: int
    claimed_tokens: int
    loaded_tokens: int
    load_jobs: int
    load_items: int
    load_jobs_failed: int
    store_jobs: int
    store_items: int
    store_jobs_failed: int
    stores_refused: int
    delayed_frees: int
    hashes_computed: int
    requests: int
    jobs_in_flight: int
    held_blocks: int
    failed_keys: int


COUNTED: tuple[str, ...] = ConnectorStats._fields[:-4]
"""The counter fields of :class:`ConnectorStats` (all but the four holdings), in order."""
