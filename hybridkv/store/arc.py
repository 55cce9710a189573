"""Adaptive Replacement Cache over ``OrderedDict`` lists, O(1) per key operation.

Agrees with the reference ``spec.policies.arc`` (Megiddo & Modha, FAST 2003, as vLLM 0.33's
CPU tier runs it). Lists, least recent first: ``T1`` resident keys seen once, ``T2`` resident
keys used again once READY, ``B1`` / ``B2`` ghosts evicted from T1 / T2. The target ``p``
(size T1 should have, ``0 <= p <= capacity``) rises by ``max(1, |B2|/|B1|)`` on a B1 ghost
hit and falls by ``max(1, |B1|/|B2|)`` on a B2 ghost hit; the ghost moves to its MRU end.

Victims: walk the evictable keys of T1 and T2 once, least recent first; while the remaining T1
size is at least ``floor(p)`` take from T1, otherwise (or when T1 has none left) from T2, and
as a last resort T1 again. Victims become the most recent ghosts of their list; each ghost list
is then cut to ``capacity`` from its least recent end (``popitem(last=False)``, no copy).

``p`` is an exact fraction, as in the reference, so the snapshot's ``target`` agrees. It is
kept as a numerator and a denominator in lowest terms (ints: ``Fraction`` arithmetic is pure
Python, several calls per step on a host that evicts) and read as a ``Fraction``
(:attr:`ARCPolicy.target`).
Touching a STORING entry keeps it in T1 (its first use is its store, not a reuse).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from fractions import Fraction
from typing import Any

from hybridkv.store.policy import Evictable, EvictionPolicy

__all__ = ["ARCPolicy"]

_ZERO_P = (0, 1)
_ABSENT = object()  # pop() default: tells "not in this list" from any stored value


class ARCPolicy(EvictionPolicy):
    """ARC over resident keys. ``resident()`` lists T1 then T2, each least recent first."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._p = _ZERO_P  # target p as (numerator, denominator > 0), lowest terms
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()

    def on_insert(self, key: bytes) -> None:
        """``key`` enters T1 at its MRU end and stops being a ghost."""
        self._t1[key] = None
        self._b1.pop(key, None)
        self._b2.pop(key, None)

    def on_access(self, key: bytes, *, ready: bool) -> None:
        """T1 -> T2 when READY (T1's MRU end when STORING); T2 -> its MRU end."""
        if key in self._t1:
            if ready:
                del self._t1[key]
                self._t2[key] = None
            else:
                self._t1.move_to_end(key)
        else:
            self._t2.move_to_end(key)

    def on_miss(self, key: bytes) -> None:
        """A ghost hit adapts ``p`` and moves the ghost to its list's MRU end."""
        if key in self._b1:
            self._p = self._adapted(self._p, key)
            self._b1.move_to_end(key)
        elif key in self._b2:
            self._p = self._adapted(self._p, key)
            self._b2.move_to_end(key)

    def on_remove(self, key: bytes) -> None:
        """A dropped store leaves no ghost."""
        if self._t1.pop(key, _ABSENT) is _ABSENT:
            del self._t2[key]

    def on_evict(self, keys: Sequence[bytes]) -> None:
        """Each victim becomes its list's most recent ghost; ghost lists are cut to capacity."""
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        for key in keys:
            if t1.pop(key, _ABSENT) is _ABSENT:
                del t2[key]
                b2[key] = None
            else:
                b1[key] = None
        for ghost in (b1, b2):
            while len(ghost) > self.capacity:
                ghost.popitem(last=False)

    def victims(self, n: int, evictable: Evictable, incoming: Sequence[bytes]) -> tuple[bytes, ...]:
        """The ``n`` victims with ``p`` first adapted to ``incoming``; pure."""
        if n <= 0:
            return ()
        numerator, denominator = self._target_after(incoming)
        target = numerator // denominator  # floor(p)
        t1: Iterator[bytes] = filter(evictable, self._t1)
        t2: Iterator[bytes] = filter(evictable, self._t2)
        t1_size = len(self._t1)
        picked: list[bytes] = []
        while len(picked) < n:
            key = next(t1, None) if t1_size >= target else None
            if key is not None:
                t1_size -= 1
            else:
                key = next(t2, None)
                if key is None:
                    key = next(t1, None)
                    if key is None:
                        break
                    t1_size -= 1
            picked.append(key)
        return tuple(picked)

    def resident(self) -> tuple[bytes, ...]:
        """T1 then T2, each least recently used first."""
        return (*self._t1, *self._t2)

    def ghosts(self) -> tuple[bytes, ...]:
        """B1 then B2, each least recently used first."""
        return (*self._b1, *self._b2)

    def extra(self) -> dict[str, Any]:
        """The four lists (hex keys, least recent first) and ``target`` as (numer, denom)."""
        lists = {"t1": self._t1, "t2": self._t2, "b1": self._b1, "b2": self._b2}
        view: dict[str, Any] = {name: tuple(k.hex() for k in keys) for name, keys in lists.items()}
        view["target"] = self._p
        return view

    def copy(self) -> ARCPolicy:
        """An independent copy."""
        twin = ARCPolicy(self.capacity)
        twin._p = self._p
        twin._t1, twin._t2 = OrderedDict(self._t1), OrderedDict(self._t2)
        twin._b1, twin._b2 = OrderedDict(self._b1), OrderedDict(self._b2)
        return twin

    @property
    def target(self) -> Fraction:
        """The target size ``p`` of T1, exact."""
        return Fraction(*self._p)

    def _target_after(self, misses: Sequence[bytes]) -> tuple[int, int]:
        # Ghost hits change only p (ghost sizes stay), so folding them is exact and pure.
        target = self._p
        b1, b2 = self._b1, self._b2
        if b1 or b2:
            for key in misses:
                if key in b1 or key in b2:  # only a ghost moves p
                    target = self._adapted(target, key)
        return target

    def _adapted(self, target: tuple[int, int], key: bytes) -> tuple[int, int]:
        """``p`` after a miss on ``key``: up by ``max(1, |B2|/|B1|)`` (at most capacity) on a
        B1 ghost, down by ``max(1, |B1|/|B2|)`` (at least 0) on a B2 ghost; in lowest terms."""
        n, d = target
        b1, b2 = len(self._b1), len(self._b2)
        if key in self._b1:
            n, d = (n * b1 + b2 * d, d * b1) if b2 > b1 else (n + d, d)
            if n >= self.capacity * d:
                return (self.capacity, 1)
        elif key in self._b2:
            n, d = (n * b2 - b1 * d, d * b2) if b1 > b2 else (n - d, d)
            if n <= 0:
                return _ZERO_P
        else:
            return target
        common = math.gcd(n, d)
        return (n // common, d // common)
