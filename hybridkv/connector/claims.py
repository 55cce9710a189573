"""The claim rule, searched in time linear in the units it looks at.

Must agree with ``spec.connector.claims.decide_claim`` (the oracle; never imported here) on
every input: same end, same DEFER. The rule: among the aligned candidate ends ``t`` (multiples
of ``align`` in ``(start, claimable_prefix_tokens(num_tokens)]``), call a candidate *hopeful*
when none of its needed keys (:meth:`ConnectorGeometry.first_needed`) is absent or remembered
as failed. Let ``H`` be the largest hopeful candidate. The answer is a claim of ``H`` when all
of ``H``'s needed keys are READY, DEFER when one is STORING, and nothing when no candidate is
hopeful. (The reference walks the candidates down and stops at the first all-READY one; when
that is not ``H`` its answer is DEFER, so the two statements are the same.)

An EAGLE/MTP group (``ConnectorGeometry.proofs``) also needs its proof unit, the one after
``t``, among the needed keys (read, never loaded): the rule is the same with that group's range
one unit longer, so an absent proof unit ``k`` rules out every candidate from ``(k - 1) * u_g``
up, and :meth:`ConnectorGeometry.claim_limit` keeps the proof unit among the request's.

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

from hybridkv.connector.geometry import ConnectorGeometry, PlanRow
from hybridkv.kinds import GroupKind
from hybridkv.store import LookupResult

__all__ = ["ClaimDecision", "decide_claim", "some_group_passes"]

KeyOf = Callable[[int, int], bytes]
"""``(group_idx, unit) -> offload key``."""
Plan = tuple[PlanRow, ...]
"""``(group, unit, kind, reach, proof)`` per group scanned (:attr:`ConnectorGeometry.scan_plan`)."""

_HIT = LookupResult.HIT
_PENDING = LookupResult.HIT_PENDING
_FULL, _MAMBA = GroupKind.FULL, GroupKind.MAMBA


class ClaimDecision(NamedTuple):
    """``end``: the claim end (``start`` when nothing is claimable); ``defer``: wait instead."""

    end: int
    defer: bool


class _Search:
    """One search's reading of the keys and its memory of what it read, per group of the plan
    (row ``i``): a FULL group's units ``[lo, lo_mark[i])`` are good and ``hi_mark[i]`` is its
    lowest bad unit (-1: none found); a SLIDING group's units ``[lo_mark[i], hi_mark[i])`` are
    known hopeful (empty when ``hi_mark[i] <= lo_mark[i]``). A MAMBA group needs no memory: it
    needs one state per candidate and the candidates fall, so no state is asked twice."""

    __slots__ = ("failed", "hi_mark", "key_of", "lo_mark", "pending", "record", "status")

    def __init__(
        self,
        key_of: KeyOf,
        status: Callable[[bytes], LookupResult],
        failed: Container[bytes],
        record: Callable[[bytes], None],
        rows: int,
    ) -> None:
        self.key_of = key_of
        self.status = status
        self.failed = failed
        self.record = record
        self.lo_mark = [0] * rows
        self.hi_mark = [-1] * rows
        self.pending: list[tuple[int, int]] = []  # (row, unit) of the STORING units seen

    def highest_bad(self, i: int, g: int, lo: int, hi: int) -> int:
        """The highest unit in ``[lo, hi)`` of group ``g`` (row ``i``) whose key is absent or
        failed; -1 if none."""
        ok_lo, ok_hi = self.lo_mark[i], self.hi_mark[i]
        key_of, status, failed, record = self.key_of, self.status, self.failed, self.record
        j = hi - 1
        while j >= lo:
            if ok_lo <= j < ok_hi:
                j = ok_lo - 1
                continue
            key = key_of(g, j)
            record(key)
            verdict = status(key)
            if (verdict is not _HIT and verdict is not _PENDING) or key in failed:
                if ok_hi > j:  # later candidates only look below j
                    self.lo_mark[i], self.hi_mark[i] = 0, -1
                return j
            if verdict is _PENDING:
                self.pending.append((i, j))
            j -= 1
        if ok_lo <= hi and ok_hi >= lo and ok_hi > ok_lo:
            self.lo_mark[i], self.hi_mark[i] = min(lo, ok_lo), max(hi, ok_hi)
        else:
            self.lo_mark[i], self.hi_mark[i] = lo, hi
        return -1

    def lowest_bad(self, i: int, g: int, lo: int, hi: int) -> int:
        """The lowest unit in ``[lo, hi)`` of group ``g`` (row ``i``) whose key is absent or
        failed; -1 if none.

        For a group whose ranges all start at the same ``lo`` (full attention) and whose ``hi``
        never grows (the candidates fall): each unit is read at most once per search."""
        bad = self.hi_mark[i]
        if 0 <= bad < hi:
            return bad
        key_of, status, failed, record = self.key_of, self.status, self.failed, self.record
        j = max(lo, self.lo_mark[i])
        while j < hi:
            key = key_of(g, j)
            record(key)
            verdict = status(key)
            if (verdict is not _HIT and verdict is not _PENDING) or key in failed:
                self.lo_mark[i] = self.hi_mark[i] = j
                return j
            if verdict is _PENDING:
                self.pending.append((i, j))
            j += 1
        self.lo_mark[i] = j
        return -1

    def pending_at(self, plan: Plan, start: int, end: int) -> bool:
        """Whether a unit a group needs for a claim ``[start, end)`` was seen STORING."""
        for i, j in self.pending:
            _, u, kind, reach, proof = plan[i]
            last = end // u + proof
            if kind is _MAMBA:
                first = last - 1
            elif kind is _FULL:
                first = start // u
            else:
                first = max(start, end - reach) // u
            if first <= j < last:
                return True
        return False


def _ignore(key: bytes) -> None:
    """``read``'s stand-in when the caller keeps no record."""


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
    if limit < lowest:
        return ClaimDecision(start, False)  # no candidate end past the start: nothing to read
    plan = geometry.scan_plan if groups is None else geometry.plan_of(groups)
    search = _Search(key_of, status, failed, _ignore if read is None else read.append, len(plan))
    t = limit
    while t >= lowest:
        for i, (g, u, kind, reach, proof) in enumerate(plan):
            hi = t // u + proof  # an EAGLE group's proof unit past t (ConnectorGeometry)
            if kind is _MAMBA:  # the one state at t (geometry.first_needed), read here
                bad = hi - 1  # no proof: a mamba group never carries one
                key = key_of(g, bad)
                search.record(key)
                verdict = status(key)
                if (verdict is _HIT or verdict is _PENDING) and key not in failed:
                    if verdict is _PENDING:
                        search.pending.append((i, bad))
                    continue
            elif kind is _FULL:
                bad = search.lowest_bad(i, g, start // u, hi)
            else:
                bad = search.highest_bad(i, g, max(start, t - reach) // u, hi)
            if bad >= 0:
                # Every candidate above (bad - proof) * u needs unit bad.
                t = (bad - proof) * u // align * align
                break
        else:
            if search.pending and search.pending_at(plan, start, t):
                return ClaimDecision(start, True)
            return ClaimDecision(t, False)
    return ClaimDecision(start, False)


def some_group_passes(
    geometry: ConnectorGeometry,
    key_of: KeyOf,
    num_tokens: int,
    start: int,
    end: int,
    *,
    status: Callable[[bytes], LookupResult],
    failed: Container[bytes],
) -> bool:
    """Whether some group alone could claim past ``end``: a candidate end ``t > end`` whose
    needed keys of that one group are all READY (STORING counts as absent) and not failed.

    The per-group prefix metric (:class:`hybridkv.vllm.metrics.GroupAgreement`) asks it after
    the rule answered ``end``: each group alone reaches ``end`` (a claim is READY in every
    group), and the groups cannot all reach one end past it (that end would be hopeful in every
    group, so the rule would have claimed or deferred there), so the groups' own prefixes
    differ exactly when one group passes ``end``.

    Pre: ``end`` is ``start`` or a claim end the rule gives (every group's needed keys at
    ``end`` READY and not failed: a full-attention group's units below ``end`` are not read
    again); ``key_of`` reaches every unit of ``num_tokens`` tokens. Pure, as
    :func:`decide_claim`.
    """
    align = geometry.align
    limit = geometry.claim_limit(num_tokens)
    first = (end // align + 1) * align  # the lowest candidate past end
    if first > limit:
        return False
    ready = _Ready(key_of, status, failed)
    for row in geometry.scan_plan:
        g, u, kind, _, proof = row
        if kind is _FULL:
            # Every candidate needs the units from start // u up, so the group passes end iff
            # it reaches the first candidate past it (its proof unit included). At end == start
            # no unit was read, so the whole range is.
            lo = end // u + proof if end > start else start // u
            passes = ready.run(g, lo, first // u + proof) < lo
        elif kind is _MAMBA:
            passes = any(ready.state(g, t // u - 1) for t in range(limit, first - 1, -align))
        else:
            passes = ready.window_passes(row, start, first, limit, align)
        if passes:
            return True
    return False


class _Ready:
    """:func:`some_group_passes`'s reading: READY (not STORING) and not failed."""

    __slots__ = ("failed", "key_of", "status")

    def __init__(
        self, key_of: KeyOf, status: Callable[[bytes], LookupResult], failed: Container[bytes]
    ) -> None:
        self.key_of, self.status, self.failed = key_of, status, failed

    def run(self, g: int, lo: int, hi: int) -> int:
        """The highest unit in ``[lo, hi)`` of group ``g`` not READY or failed, read from the
        top; ``lo - 1`` when every one is."""
        key_of, status, failed = self.key_of, self.status, self.failed
        j = hi - 1
        while j >= lo:
            key = key_of(g, j)
            if status(key) is not _HIT or key in failed:
                return j
            j -= 1
        return j

    def state(self, g: int, j: int) -> bool:
        """Whether unit ``j`` of group ``g`` is READY and not failed."""
        key = self.key_of(g, j)
        return self.status(key) is _HIT and key not in self.failed

    def window_passes(self, row: PlanRow, start: int, first: int, limit: int, align: int) -> bool:
        """Whether a sliding group's window is READY at some candidate in ``[first, limit]``,
        from the top: a unit that is not rules out every candidate whose window (and proof
        unit) holds it."""
        g, u, _, reach, proof = row
        t = limit
        while t >= first:
            lo = max(start, t - reach) // u
            j = self.run(g, lo, t // u + proof)
            if j < lo:
                return True
            t = (j - proof) * u // align * align  # every candidate above needs unit j
        return False
