"""The claim rule as a pure function: how far a request's prefix may be loaded from the host.

A claim from a computed prefix ``start`` ends at a token ``t`` such that

- ``t`` is a multiple of :attr:`Geometry.align` (the planner's claim unit and the scheduler
  block), ``start < t`` and ``t <= claimable_prefix_tokens(num_tokens)``: the last token is
  always computed;
- every group's needed units (:meth:`Geometry.needed_units`) are READY in the host store: full
  attention every unit, a sliding window its reach, a mamba group the state at exactly ``t``
  (MB-1: never attention KV without the recurrent state of the same position);
- for each EAGLE group (:attr:`Geometry.eagle`: vLLM drops EAGLE's block from it), the unit
  after ``t`` is READY too, its proof (:meth:`Geometry.proof_unit`, vLLM's
  ``eagle_proof_margin``): the proof is read, never loaded, and must be one of the request's
  own full units, ``t + u_g <= num_tokens``;
- no needed key is remembered as failed (failure memory: a failed key counts as absent);
- the keys come from the request's own salted hashes (the salt enters the first block hash,
  so different salts share no key: SEC-1).

The answer is the largest such ``t``, unless waiting could give more: when a larger candidate
has every needed key READY or STORING (none absent, none failed), the answer is DEFER, as
vLLM defers on HIT_PENDING.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

from spec.connector.geometry import Geometry
from spec.store import LookupResult

__all__ = ["ClaimDecision", "claim_candidates", "claim_keys", "decide_claim", "needed_keys"]


class ClaimDecision(NamedTuple):
    """``end``: the claim end (``start`` when nothing is claimable); ``defer``: wait instead."""

    end: int
    defer: bool


def claim_candidates(geometry: Geometry, start: int, num_tokens: int) -> range:
    """Claim ends to try, largest first: aligned, above ``start``, within the claimable prefix.

    Pure. Pre: ``start >= 0``; ``num_tokens`` an int >= 0 (the planner raises
    :class:`~spec.errors.ConfigError`, field ``num_tokens``, otherwise). Post: the multiples of
    :attr:`Geometry.align` in ``(start, claimable_prefix_tokens(num_tokens)]``, descending,
    and for each EAGLE group at most ``num_tokens - u_g`` (its proof unit is one of the
    request's full units); empty when there is none.
    """
    align = geometry.align
    limit = geometry.planner.claimable_prefix_tokens(num_tokens)
    for g in geometry.proof_groups:
        limit = min(limit, num_tokens - geometry.planner.units[g])
    limit = max(limit, 0)
    limit -= limit % align
    lowest = (start // align + 1) * align
    return range(limit, lowest - 1, -align)


def needed_keys(
    geometry: Geometry, block_hashes: Sequence[bytes], start: int, end: int
) -> tuple[bytes, ...]:
    """Every group's needed keys for a claim from ``start`` to ``end``, in group order.

    Pure. Pre: ``start`` and ``end`` as :meth:`Geometry.needed_units`; ``block_hashes`` reach
    ``end`` (``IndexError`` otherwise). Post: within a group, units in ascending order.
    """
    return tuple(
        geometry.key(block_hashes, ref)
        for g in range(geometry.num_groups)
        for ref in geometry.needed_units(g, start, end)
    )


def claim_keys(
    geometry: Geometry, block_hashes: Sequence[bytes], start: int, end: int
) -> tuple[bytes, ...]:
    """The keys a claim from ``start`` to ``end`` must find READY: :func:`needed_keys` (what
    the claim loads) and then each EAGLE group's proof unit (read, never loaded).

    Pure. Pre: as :func:`needed_keys`, and ``block_hashes`` reach each proof unit's end
    (``end + u_g``, which :func:`claim_candidates` guarantees). Post: the needed keys first,
    the proof keys after them in group order.
    """
    proofs = (geometry.proof_unit(g, end) for g in range(geometry.num_groups))
    return needed_keys(geometry, block_hashes, start, end) + tuple(
        geometry.key(block_hashes, ref) for ref in proofs if ref is not None
    )


def decide_claim(
    geometry: Geometry,
    block_hashes: Sequence[bytes],
    num_tokens: int,
    start: int,
    *,
    status: Callable[[bytes], LookupResult],
    failed: Collection[bytes],
) -> ClaimDecision:
    """Apply the module rule. Pure: ``status`` (the store's per-key lookup) must not mutate.

    Pre: ``block_hashes`` are the request's salted hashes of its ``num_tokens`` tokens;
    ``start`` is a multiple of the scheduler block. Post: ``end`` is ``start`` or an aligned
    candidate whose keys (:func:`claim_keys`: proof units included) are all READY and not
    failed; ``defer`` is True exactly when a larger candidate's keys are all READY or STORING
    and none failed (then ``end`` is ``start``).
    """
    ready_end = start
    hopeful_end = start
    for end in claim_candidates(geometry, start, num_tokens):
        verdicts = [
            LookupResult.MISS if key in failed else status(key)
            for key in claim_keys(geometry, block_hashes, start, end)
        ]
        if LookupResult.MISS in verdicts:
            continue
        hopeful_end = max(hopeful_end, end)
        if all(v is LookupResult.HIT for v in verdicts):
            ready_end = end
            break
    if hopeful_end > ready_end:
        return ClaimDecision(start, True)
    return ClaimDecision(ready_end, False)
