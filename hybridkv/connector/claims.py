"""The claim rule, searched in time linear in the units it looks at.

Must agree with ``spec.connector.claims.decide_claim`` (the oracle; never imported here) on
every input: same end, same DEFER. The rule: among the aligned candidate ends ``t`` (multiples
of ``align`` in ``(start, claimable_prefix_tokens(num_tokens)]``), call a candidate *hopeful*
when none of its needed keys (:meth:`ConnectorGeometry.first_needed`) is absent or remembered
as failed. Let ``H`` be the largest hopeful candidate. The answer is a claim of ``H`` when all
of ``H``'s needed keys are READY, DEFER when one is STORING, and nothing when no candidate is
hopeful. (The reference walks the candidates down and stops at the first all-READY one; when
that is not ``H`` its answer is DEFER, so the two statements are the same.)

Why this is fast: the reference rebuilds the needed keys of every candidate, O(candidates x
units). Here a key that is absent at unit ``k`` of group ``g`` rules out every candidate
``t' <= t`` whose range still contains ``k``, that is every ``t'`` in ``(k * u_g, t]`` (a
range's first unit never grows as ``t`` falls), so the search jumps straight below ``k * u_g``.
Each group remembers one interval of units it has seen hopeful, so a range a later candidate
shares with an earlier one is not looked up again. Every unit is looked up O(1) times.

A full-attention group needs every unit from the same first one (``start // u``) at every
candidate, so its candidates are hopeful exactly up to its lowest bad unit: it is scanned from
the bottom (:meth:`_GroupScan.lowest_bad`), which reads only the good prefix and one bad unit,
and the search asks it before any sliding group (``ConnectorGeometry.scan_order``): a prefix
the host lacks ends the search after one lookup instead of one per candidate. A mamba group
(one state per candidate) is asked before it: asked first, a stored attention prefix would be
read whole even when no candidate has its mamba state.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import NamedTuple

from hybridkv.connector.geometry import ConnectorGeometry
from hybridkv.kinds import GroupKind
from hybridkv.store import LookupResult

__all__ = ["ClaimDecision", "decide_claim"]

KeyOf = Callable[[int, int], bytes]
"""``(group_idx, unit) -> offload key``."""

_HIT = LookupResult.HIT
_PENDING = LookupResult.HIT_PENDING


class ClaimDecision(NamedTuple):
    """``end``: the claim end (``start`` when nothing is claimable); ``defer``: wait instead."""

    end: int
    defer: bool


class _GroupScan:
    """One group's look at the candidates: its hopeful interval and the STORING units seen."""

    __slots__ = (
        "_bad_at",
        "_failed",
        "_g",
        "_good_to",
        "_key_of",
        "_mamba",
        "_ok_hi",
        "_ok_lo",
        "_pending",
        "_reach",
        "_read",
        "_status",
    )

    def __init__(
        self,
        g: int,
        geometry: ConnectorGeometry,
        key_of: KeyOf,
        status: Callable[[bytes], LookupResult],
        failed: Container[bytes],
        *,
        read: list[bytes],
    ) -> None:
        self._g = g
        # geometry.first_needed, decided once per scan instead of once per candidate.
        kind = geometry.kinds[g]
        self._mamba = kind is GroupKind.MAMBA
        self._reach = geometry.reaches[g] if kind is GroupKind.SLIDING else None
        self._key_of = key_of
        self._status = status
        self._failed = failed
        self._read = read.append  # a C method: recording costs no Python call
        self._ok_lo = self._ok_hi = 0  # units [ok_lo, ok_hi) are known hopeful
        # lowest_bad's memory: units [lo, good_to) are good, bad_at the lowest bad (-1: none).
        self._good_to = self._bad_at = -1
        self._pending: list[int] = []

    def highest_bad(self, lo: int, hi: int) -> int:
        """The highest unit in ``[lo, hi)`` whose key is absent or failed; -1 if none."""
        ok_lo, ok_hi = self._ok_lo, self._ok_hi
        g, key_of, status, failed, read = (
            self._g,
            self._key_of,
            self._status,
            self._failed,
            self._read,
        )
        j = hi - 1
        while j >= lo:
            if ok_lo <= j < ok_hi:
                j = ok_lo - 1
                continue
            key = key_of(g, j)
            read(key)
            verdict = status(key)
            if (verdict is not _HIT and verdict is not _PENDING) or key in failed:
                if ok_hi > j:  # later candidates only look below j
                    self._ok_lo = self._ok_hi = 0
                return j
            if verdict is _PENDING:
                self._pending.append(j)
            j -= 1
        if ok_lo <= hi and ok_hi >= lo and ok_hi > ok_lo:
            self._ok_lo, self._ok_hi = min(lo, ok_lo), max(hi, ok_hi)
        else:
            self._ok_lo, self._ok_hi = lo, hi
        return -1

    def lowest_bad(self, lo: int, hi: int) -> int:
        """The lowest unit in ``[lo, hi)`` whose key is absent or failed; -1 if none.

        For a group whose ranges all start at the same ``lo`` (full attention) and whose ``hi``
        never grows (the candidates fall): each unit is read at most once per search."""
        bad = self._bad_at
        if 0 <= bad < hi:
            return bad
        g, key_of, status, failed, read = (
            self._g,
            self._key_of,
            self._status,
            self._failed,
            self._read,
        )
        j = max(lo, self._good_to)
        while j < hi:
            key = key_of(g, j)
            read(key)
            verdict = status(key)
            if (verdict is not _HIT and verdict is not _PENDING) or key in failed:
                self._bad_at = self._good_to = j
                return j
            if verdict is _PENDING:
                self._pending.append(j)
            j += 1
        self._good_to = j
        return -1

    def has_pending(self, lo: int, hi: int) -> bool:
        """Whether a unit in ``[lo, hi)`` (already found hopeful) is STORING."""
        return any(lo <= j < hi for j in self._pending)

    def needed(self, start: int, end: int, unit: int) -> tuple[int, int]:
        """The unit range the group needs for a claim ``[start, end)``
        (:meth:`ConnectorGeometry.first_needed` to ``end // unit``)."""
        last = end // unit
        if self._mamba:
            return last - 1, last
        reach = self._reach
        if reach is not None:
            return max(start, end - reach) // unit, last
        return start // unit, last


def decide_claim(
    geometry: ConnectorGeometry,
    key_of: KeyOf,
    num_tokens: int,
    start: int,
    *,
    status: Callable[[bytes], LookupResult],
    failed: Container[bytes],
    groups: tuple[int, ...] | None = None,
    read: list[bytes] | None = None,
) -> ClaimDecision:
    """Apply the module rule. Pure: ``status`` (the store's per-key lookup) must not mutate.

    ``groups``: look at these groups only (default: every group), i.e. the rule with every
    other group's keys taken as READY (a per-group prefix, :mod:`hybridkv.vllm.metrics`).
    ``read``: when given, every key whose status the search reads is appended to it, in
    order; the answer is a function of those keys' statuses (and of ``failed``), so a caller
    may keep it while they hold (the core's claim memo).

    Pre: ``key_of`` reaches every unit of the request's ``num_tokens`` tokens; ``start`` is a
    multiple of the scheduler block. Post: ``end`` is ``start`` or the largest hopeful
    candidate with every needed key READY; ``defer`` exactly when that candidate has a STORING
    key (then ``end`` is ``start``).
    """
    align = geometry.align
    limit = geometry.claim_limit(num_tokens)
    lowest = (start // align + 1) * align
    units = geometry.units
    read = [] if read is None else read
    kinds = geometry.kinds
    scans = []
    for g in geometry.scan_order if groups is None else groups:
        scan = _GroupScan(g, geometry, key_of, status, failed, read=read)
        first_bad = scan.lowest_bad if kinds[g] is GroupKind.FULL else scan.highest_bad
        scans.append((units[g], scan, first_bad))
    t = limit
    while t >= lowest:
        for u, scan, first_bad in scans:
            lo, hi = scan.needed(start, t, u)
            bad = first_bad(lo, hi)
            if bad >= 0:
                t = bad * u // align * align  # every candidate above bad * u needs unit bad
                break
        else:
            if any(scan.has_pending(*scan.needed(start, t, u)) for u, scan, _ in scans):
                return ClaimDecision(start, True)
            return ClaimDecision(t, False)
    return ClaimDecision(start, False)
