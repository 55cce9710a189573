"""A waiting request's remembered claim (``ConnectorCore._decide``), and what keys it.

A scheduler asks a waiting request again every step; the claim rule's answer changes only
with the request's tokens, its start, salt, the failure memory, the load mode or the status of
a key the search read, so the core keeps the last answer with those keys and their statuses
and checks them instead of searching again.
"""

from __future__ import annotations

from hybridkv.connector.api import Claim
from hybridkv.connector.counts import LoadMode
from hybridkv.store import EntryState

__all__ = ["ClaimMemo", "MemoKey"]

MemoKey = tuple[int, int, str | None, int, LoadMode]
"""A claim memo's key: start, token count, salt, failure epoch, load mode."""


class ClaimMemo:
    """One waiting request's remembered answer (:meth:`ConnectorCore._decide`): valid for
    ``key`` (start, token count, salt, failure epoch, load mode) while the keys in ``read``
    have the statuses ``states``; ``counts``: the store's status counters when that last
    held; ``claimed``: the keys the claim's load would read, head first, once the core has
    listed them (:meth:`ConnectorCore._refresh_claim`), else None."""

    __slots__ = ("claim", "claimed", "counts", "key", "read", "states")

    def __init__(
        self,
        key: MemoKey,
        claim: Claim,
        read: list[bytes],
        states: tuple[EntryState | None, ...],
        counts: tuple[int, int, int, int],
    ) -> None:
        self.key, self.claim, self.read, self.states, self.counts = (
            key,
            claim,
            read,
            states,
            counts,
        )
        self.claimed: tuple[bytes, ...] | None = None
