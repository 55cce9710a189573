"""The load admission rule: an async claim is deferred while it could fill the pool (issue 29).

A request whose async load vLLM admitted holds its blocks from the allocation until it runs,
and vLLM cannot preempt it (it is not running). If such requests hold so much of the pool that
none can allocate its next chunk, and nothing runs, nothing ever frees a block: a wedge (LV-1).
vLLM 0.33 reserves room for the other in-flight prefills before it admits an async load, but
undercounts a sliding-window group whose skipped prefix is padded with null blocks, so the
connector must keep the condition itself. An async claim the claim rule
(:mod:`spec.connector.claims`) makes is answered DEFER instead when

1. **shared load:** another request's load, still in flight, covers a block of the claimed
   range with the same prefix (equal block hash at the last block both ranges cover: hashes
   chain, so equal there means equal below). Once it lands vLLM caches those blocks and the
   deferred request's next ask sees them as its GPU prefix hit, instead of a second copy;
2. **room:** the blocks the admitted-but-not-running loads need to run their next chunk, this
   claim's included, exceed the pool. That is the capacity condition (LV-2): kept, the first
   such request can always run once the running requests finish or are preempted.

With no other load held the rule never defers (vLLM's start-up check fits one whole request),
so a deferred request waits only on loads that run.

A request's need to run its next chunk, per group (:func:`blocks_to_run`): full attention holds
the whole sequence; a sliding window its reach plus the chunk, plus one block for an unaligned
edge; a mamba group its few states. Never more than the sequence's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from spec.kinds import GroupKind

__all__ = [
    "Admission",
    "AsyncClaim",
    "GroupHold",
    "HeldLoad",
    "admit",
    "blocks_to_run",
]


class Admission(Enum):
    """The rule's answer to one async claim."""

    ADMIT = "admit"
    DEFER_SHARED = "defer_shared"  # another in-flight load covers the same prefix
    DEFER_ROOM = "defer_room"  # the held loads' needs, this one's included, exceed the pool

    @property
    def defers(self) -> bool:
        """True for both DEFER answers."""
        return self is not Admission.ADMIT


@dataclass(frozen=True, slots=True)
class GroupHold:
    """What one KV cache group holds for a request: its kind and block size, a sliding
    window's reach (``sliding_window - 1`` plus retained extra tokens; 0 otherwise) and a mamba
    group's states per request (0 otherwise)."""

    kind: GroupKind
    block_size: int
    reach: int = 0
    states: int = 0


def blocks_to_run(groups: Sequence[GroupHold], num_tokens: int, computed: int, chunk: int) -> int:
    """Real blocks a request of ``num_tokens`` holds while it computes its next chunk
    (at most ``chunk`` tokens) from ``computed``. Pure."""
    total = 0
    for g in groups:
        whole = -(-num_tokens // g.block_size)
        if g.kind is GroupKind.FULL:
            total += whole
        elif g.kind is GroupKind.SLIDING:
            step = min(chunk, max(num_tokens - computed, 0))
            total += min(whole, -(-(g.reach + step) // g.block_size) + 1)
        else:
            total += min(whole, g.states)
    return total


@dataclass(frozen=True, slots=True)
class AsyncClaim:
    """An async claim of ``[start, end)`` for ``request_id``: ``need`` is
    :func:`blocks_to_run` from ``end``; ``block_hashes`` the request's, one per hash block."""

    request_id: str
    start: int
    end: int
    need: int
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class HeldLoad:
    """A request whose async load was admitted and which has not run since: ``loading`` while
    its copy is in flight (False once landed, waiting to run); its load covers
    ``[start, end)``; ``need`` is :func:`blocks_to_run` from ``end``."""

    request_id: str
    loading: bool
    start: int
    end: int
    need: int
    block_hashes: tuple[bytes, ...]


def _shares(claim: AsyncClaim, load: HeldLoad, hash_block_size: int) -> bool:
    """Whether ``load`` covers a block of the claimed range with the claim's prefix."""
    low, high = max(claim.start, load.start), min(claim.end, load.end)
    if low >= high:
        return False
    last = high // hash_block_size - 1
    mine, theirs = claim.block_hashes, load.block_hashes
    return 0 <= last < min(len(mine), len(theirs)) and mine[last] == theirs[last]


def admit(
    claim: AsyncClaim, held: Sequence[HeldLoad], capacity: int, hash_block_size: int
) -> Admission:
    """Apply the module rule to ``claim`` given the loads ``held`` by other requests.

    Pure. Pre: ``capacity`` is the pool's usable blocks (> 0); ``held`` excludes the claiming
    request. Post: DEFER_SHARED when an in-flight load shares the claimed prefix; else
    DEFER_ROOM when ``claim.need`` plus every held need exceeds ``capacity``; else ADMIT.
    """
    others = [h for h in held if h.request_id != claim.request_id]
    if any(h.loading and _shares(claim, h, hash_block_size) for h in others):
        return Admission.DEFER_SHARED
    if claim.need + sum(h.need for h in others) > capacity:
        return Admission.DEFER_ROOM
    return Admission.ADMIT
