"""What the core remembers about host keys: failed loads, and the salt each key was stored under.

The reference connector (``spec.connector.scheduler_side``) keeps the same two tables and, at
every ``build_connector_meta``, rescans both to forget the keys the host no longer holds: work
that grows with every key ever stored. Here a key is forgotten through its *departure*: a key
leaves the host only when it is evicted (``prepare_store`` reports it) or its store fails
(``complete_store(success=False)`` drops it), and the core makes both calls, so it records each
departure as it happens and :meth:`KeyMemory.prune` looks at those keys alone. The prune still
asks the store, because a departed key may have been reserved again before the prune (the
reference keeps it then, and so does this one).

A store mutated behind the core's back is noticed through its eviction and removal counters
(``StoreStats``, O(1)); the prune then falls back to the reference's full rescan.

``epoch`` moves whenever the failure memory changes, so a cached claim answer (which depends
on it) knows when to recompute.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from hybridkv.store import HostStore, LookupResult

__all__ = ["KeyMemory"]

_MISS = LookupResult.MISS


class KeyMemory:
    """Failed keys (with the job id from which they are avoided) and the salt of stored keys."""

    __slots__ = ("_departed", "_departures", "_failed", "_salts", "epoch")

    def __init__(self, store: HostStore) -> None:
        """Nothing remembered; departures counted from ``store``'s present counters."""
        self._failed: dict[bytes, int] = {}
        self._salts: dict[bytes, str | None] = {}
        self._departed: set[bytes] = set()  # keys seen leaving the store since the last prune
        self._departures = _departures(store)  # the store's departures accounted for
        self.epoch = 0

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is remembered as failed (it counts as absent)."""
        return key in self._failed

    def __len__(self) -> int:
        return len(self._failed)

    @property
    def failed(self) -> Mapping[bytes, int]:
        """The failure memory itself (key -> job id), for membership tests in C: a claim search
        asks it once per unit, and ``in`` on this object is a Python call each time. Read only.
        """
        return self._failed

    def failed_keys(self) -> frozenset[bytes]:
        """The keys remembered as failed."""
        return frozenset(self._failed)

    def remember_failed(self, keys: Iterable[bytes], since: int) -> None:
        """A load of ``keys`` failed; jobs numbered ``since`` and up must avoid them (MB-5)."""
        for key in keys:
            if key not in self._failed:
                self._failed[key] = since
                self.epoch += 1

    def stored(self, keys: Iterable[bytes]) -> None:
        """A store of ``keys`` succeeded: the host holds fresh copies, none is failed now."""
        if not self._failed:
            return  # nothing remembered as failed (almost always): no key to look up
        for key in keys:
            if self._failed.pop(key, None) is not None:
                self.epoch += 1

    def salt(self, keys: Iterable[bytes], salt: str | None, *, overwrite: bool = False) -> None:
        """Record the salt of the request that stored ``keys`` (SEC-1's evidence)."""
        salts = self._salts
        for key in keys:
            if overwrite or key not in salts:
                salts[key] = salt

    def departed(self, keys: Sequence[bytes]) -> None:
        """``keys`` left the store (evicted, or dropped by a failed store)."""
        if keys:
            self._departed.update(keys)
            self._departures += len(keys)

    def prune(self, store: HostStore) -> None:
        """Forget the failures and salts of keys ``store`` no longer holds (agrees with the
        reference's full rescan, module docstring)."""
        _, _, removed, evicted = store.status_counts()  # read every step: no StoreStats built
        seen = evicted + removed
        if seen == self._departures and not self._departed:
            return  # nothing left the store since the last prune (most steps)
        if seen != self._departures:
            candidates: Iterable[bytes] = [*self._failed, *self._salts]
            self._departures = seen
        else:
            candidates = self._departed
        status = store.status
        for key in candidates:
            if status(key) is _MISS:
                if self._failed.pop(key, None) is not None:
                    self.epoch += 1
                self._salts.pop(key, None)
        self._departed = set()

    def snapshot(self) -> dict[str, Any]:
        """``failed_keys`` and ``key_salts`` of the reference connector's snapshot schema."""
        return {
            "failed_keys": tuple(sorted((k.hex(), since) for k, since in self._failed.items())),
            "key_salts": tuple(sorted((k.hex(), s) for k, s in self._salts.items())),
        }


def _departures(store: HostStore) -> int:
    _, _, removed, evicted = store.status_counts()  # read every step: no StoreStats built
    return evicted + removed
