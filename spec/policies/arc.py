"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003) as vLLM 0.33's CPU tier runs it.

Lists, each least recent first:

- ``T1``: resident keys seen once (a new entry lands here, STORING or not);
- ``T2``: resident keys used again after their data became READY;
- ``B1`` / ``B2``: ghosts, keys evicted from T1 / T2, remembered without data.

The target ``p`` (vLLM's ``target_t1_size``) is the size T1 should have, ``0 <= p <= capacity``:

- a miss on a key in B1 raises it by ``max(1, |B2| / |B1|)`` (recency is paying off);
- a miss on a key in B2 lowers it by ``max(1, |B1| / |B2|)`` (frequency is paying off);
  either way the ghost moves to its list's most recent end.

Choosing ``n`` victims walks both lists once, least recent first, skipping keys the store
marks unevictable: while the remaining T1 size is at least ``floor(p)`` take the next T1
victim, otherwise (or if T1 has none left) the next T2 victim, and as a last resort T1 again.
Each victim becomes the most recent ghost of its list; then each ghost list is cut to
``capacity`` from its least recent end.

Choices that follow vLLM 0.33 rather than the paper (``cpu/policies/arc.py``):

- ``|T1| >= floor(p)`` picks T1 (the paper: ``|T1| > p``, or ``== p`` on a B2 hit);
- ghost lists are bounded separately by ``capacity`` (the paper: ``|T1| + |B1| <= c`` and
  ``|L1| + |L2| <= 2c`` with its case-IV balancing);
- touching a STORING entry keeps it in T1 (its first use is its store, not a reuse).

Deviation from vLLM: ``p`` is an exact ``Fraction``; vLLM keeps a float, so the two may differ
by rounding when ``p`` lands within an ulp of an integer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import Any

from spec.policies.base import Evictable, EvictionPolicy

__all__ = ["ARCPolicy"]


class ARCPolicy(EvictionPolicy):
    """ARC over resident keys. ``resident()`` lists T1 then T2, each least recent first."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.target = Fraction(0)
        # dicts keep insertion order: first key = least recently used.
        self._t1: dict[bytes, None] = {}
        self._t2: dict[bytes, None] = {}
        self._b1: dict[bytes, None] = {}
        self._b2: dict[bytes, None] = {}

    def on_insert(self, key: bytes) -> None:
        """See :meth:`EvictionPolicy.on_insert`: ``key`` enters T1 and leaves the ghosts.

        Pre: ``key`` is not resident (not checked). Post: ``key`` is T1's most recent; its
        ghost, if any, is forgotten; ``target`` is unchanged. Never refuses.
        """
        self._t1[key] = None
        self._b1.pop(key, None)
        self._b2.pop(key, None)

    def on_access(self, key: bytes, *, ready: bool) -> None:
        """See :meth:`EvictionPolicy.on_access`: T1 -> T2 when READY; T2 -> its MRU end.

        Pre: ``key`` is resident (``KeyError`` otherwise, nothing changed). Post: a READY key
        of T1 or a key of T2 is T2's most recent; a STORING key of T1 is T1's most recent.
        Ghosts and ``target`` are unchanged.
        """
        if key in self._t1:
            del self._t1[key]
            if ready:
                self._t2[key] = None
            else:
                self._t1[key] = None
        else:
            _to_mru(self._t2, key)

    def on_miss(self, key: bytes) -> None:
        """See :meth:`EvictionPolicy.on_miss`: a ghost hit adapts ``p`` and refreshes the ghost.

        Pre: ``key`` is not resident (not checked). Post: a key of B1 raised ``target`` by
        ``max(1, |B2| / |B1|)`` (at most ``capacity``), a key of B2 lowered it by
        ``max(1, |B1| / |B2|)`` (at least 0), and the ghost is its list's most recent; for any
        other key nothing changes.
        """
        self.target = self._adapted(self.target, key)
        for ghost in (self._b1, self._b2):
            if key in ghost:
                _to_mru(ghost, key)

    def on_remove(self, key: bytes) -> None:
        """See :meth:`EvictionPolicy.on_remove`: no ghost is left for a dropped store.

        Pre: ``key`` is resident (``KeyError`` otherwise, nothing changed). Post: ``key`` left
        T1 or T2; ghosts and ``target`` are unchanged.
        """
        if key in self._t1:
            del self._t1[key]
        else:
            del self._t2[key]

    def on_evict(self, keys: Sequence[bytes]) -> None:
        """See :meth:`EvictionPolicy.on_evict`: each victim becomes a ghost; ghosts are trimmed.

        Pre: ``keys`` are resident and distinct. Post: a T1 victim is B1's most recent ghost, a
        T2 victim B2's, in ``keys`` order; each ghost list is then cut to ``capacity`` from its
        least recent end; ``target`` is unchanged. A key that is not resident raises
        ``KeyError`` after the keys before it became ghosts, and the lists are not trimmed (the
        store never passes one).
        """
        for key in keys:
            if key in self._t1:
                del self._t1[key]
                self._b1[key] = None
            else:
                del self._t2[key]
                self._b2[key] = None
        for ghost in (self._b1, self._b2):
            for old in list(ghost)[: max(0, len(ghost) - self.capacity)]:
                del ghost[old]

    def victims(self, n: int, evictable: Evictable, incoming: Sequence[bytes]) -> tuple[bytes, ...]:
        """See :meth:`EvictionPolicy.victims`, with ``p`` adapted to ``incoming`` first.

        Pure: ``p`` is adapted on a local value, ``target`` is unchanged. Pre: ``n >= 0``.
        """
        target = math.floor(self._target_after(incoming))
        t1 = (key for key in self._t1 if evictable(key))
        t2 = (key for key in self._t2 if evictable(key))
        t1_size = len(self._t1)
        picked: list[bytes] = []
        while len(picked) < n:
            key = next(t1, None) if t1_size >= target else None
            if key is None:
                key = next(t2, None)
            if key is None:
                key = next(t1, None)
            if key is None:
                break
            if key in self._t1:
                t1_size -= 1
            picked.append(key)
        return tuple(picked)

    def resident(self) -> tuple[bytes, ...]:
        """T1 then T2, each least recently used first.

        Pure.
        """
        return (*self._t1, *self._t2)

    def ghosts(self) -> tuple[bytes, ...]:
        """B1 then B2, each least recently used first.

        Pure.
        """
        return (*self._b1, *self._b2)

    def extra(self) -> dict[str, Any]:
        """The four lists (hex keys, least recent first) and ``target`` as (numer, denom).

        Pure.
        """
        lists = {"t1": self._t1, "t2": self._t2, "b1": self._b1, "b2": self._b2}
        view: dict[str, Any] = {name: tuple(k.hex() for k in keys) for name, keys in lists.items()}
        view["target"] = (self.target.numerator, self.target.denominator)
        return view

    def copy(self) -> ARCPolicy:
        """See :meth:`EvictionPolicy.copy`.

        Frame: nothing changes in ``self``. Post: the copy has the same four lists, in order,
        and the same ``target``.
        """
        twin = ARCPolicy(self.capacity)
        twin.target = self.target
        twin._t1, twin._t2 = dict(self._t1), dict(self._t2)
        twin._b1, twin._b2 = dict(self._b1), dict(self._b2)
        return twin

    def _target_after(self, misses: Iterable[bytes]) -> Fraction:
        # Ghost hits change only p (ghost sizes stay), so folding them is exact and pure.
        target = self.target
        for key in misses:
            target = self._adapted(target, key)
        return target

    def _adapted(self, target: Fraction, key: bytes) -> Fraction:
        if key in self._b1:
            step = max(Fraction(1), Fraction(len(self._b2), len(self._b1)))
            return min(target + step, Fraction(self.capacity))
        if key in self._b2:
            step = max(Fraction(1), Fraction(len(self._b1), len(self._b2)))
            return max(target - step, Fraction(0))
        return target


def _to_mru(order: dict[bytes, None], key: bytes) -> None:
    del order[key]
    order[key] = None
