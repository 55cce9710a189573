"""Which failed transfers of ``hybridkv simulate`` were seen to recover: observed, not assumed.

A failed load job is *recovered* when every token position it was to bring was later served
again to its request (recomputed, reloaded or hit on the GPU: :class:`TokenLedger` events) and
no block that request read or loaded afterwards failed the content check. A failed store job
is recovered when none of its keys was handed to a load while its entry could still be read,
and every key is gone from the host store once the failure is reported. A failure whose
request was aborted or failed (``FINISHED_ABORTED``/``FINISHED_ERROR``) before recovering is
counted apart: its tokens are never served, by design of that request's end.

Nothing here is true by construction: a failure is recovered only when the run shows it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from spec.connector_api import RequestId

__all__ = ["RecoveryOutcome", "RecoveryWatch"]


@dataclass(frozen=True, slots=True)
class RecoveryOutcome:
    """The failures a run saw and which of them it saw recover.

    Attributes:
        failed_loads, failed_stores: failed jobs reported to the simulation.
        recovered_loads, recovered_stores: those observed to recover (module docstring).
        ended: failed loads whose request was aborted or failed before recovering.
    """

    failed_loads: int
    failed_stores: int
    recovered_loads: int
    recovered_stores: int
    ended: int

    @property
    def recovered(self) -> int:
        """Failed jobs, loads and stores, observed to recover."""
        return self.recovered_loads + self.recovered_stores


@dataclass
class _LoadFailure:
    rid: RequestId
    lo: int
    owed: bytearray  # 1 per position of [lo, lo + len) not served again since the failure
    wrong_before: int  # the request's wrong-content count when the job was issued


@dataclass
class _StoreFailure:
    keys: frozenset[bytes]
    served: bool = False
    gone: bool = False


@dataclass
class RecoveryWatch:
    """Follows failed jobs until their recovery is observed (module docstring)."""

    _loads: list[_LoadFailure] = field(default_factory=list)
    _storing: dict[int, frozenset[bytes]] = field(default_factory=dict)  # store jobs in flight
    _stores: list[_StoreFailure] = field(default_factory=list)
    _read_while_storing: set[int] = field(default_factory=set)  # store jobs a load read from

    # ----------------------------------------------------------------- stores
    def store_issued(self, job_id: int, keys: Iterable[bytes]) -> None:
        """A store job was handed to the data plane."""
        self._storing[job_id] = frozenset(keys)

    def store_reported(self, job_id: int, *, success: bool) -> None:
        """A store job reported; a failed one is followed until its entries are gone."""
        keys = self._storing.pop(job_id, frozenset())
        served = job_id in self._read_while_storing
        self._read_while_storing.discard(job_id)
        if not success:
            self._stores.append(_StoreFailure(keys, served=served))

    def load_issued(self, keys: Iterable[bytes]) -> None:
        """A load job was handed to the data plane: a key of a failed store whose entry is not
        yet gone (or of a store still running) was served."""
        wanted = set(keys)
        for failure in self._stores:
            if not failure.gone and wanted & failure.keys:
                failure.served = True
        for job_id, stored in self._storing.items():
            if wanted & stored:
                self._read_while_storing.add(job_id)

    def check_gone(self, holds: Callable[[bytes], bool]) -> None:
        """After the step's reports: a failed store whose keys the host no longer holds is
        gone (checked once, at the end of the step that reported it)."""
        for failure in self._stores:
            if not failure.gone and not any(holds(key) for key in failure.keys):
                failure.gone = True

    # ----------------------------------------------------------------- loads
    def load_failed(self, rid: RequestId, lo: int, missing: bytes, wrong_before: int) -> None:
        """A load job of ``rid`` for the positions from ``lo`` failed; ``missing`` has a 1 per
        position not in place when it reported (a load its request lost before the report,
        at a deadline or a preemption, may find some served again already)."""
        self._loads.append(_LoadFailure(rid, lo, bytearray(missing), wrong_before))

    def served(self, rid: RequestId, lo: int, hi: int) -> None:
        """Positions ``[lo, hi)`` of ``rid`` were served (any source)."""
        for failure in self._loads:
            if failure.rid != rid:
                continue
            a = max(lo, failure.lo) - failure.lo
            b = min(hi, failure.lo + len(failure.owed)) - failure.lo
            if a < b:
                failure.owed[a:b] = bytes(b - a)

    # ----------------------------------------------------------------- the end
    def outcome(
        self, wrong_of: Callable[[RequestId], int], ended: Callable[[RequestId], bool]
    ) -> RecoveryOutcome:
        """What was observed to recover, given each request's wrong-content count now and
        whether it was aborted or failed."""
        recovered_loads = ended_count = 0
        for failure in self._loads:
            healed = not any(failure.owed) and wrong_of(failure.rid) == failure.wrong_before
            if healed:
                recovered_loads += 1
            elif ended(failure.rid):
                ended_count += 1
        recovered_stores = sum(1 for f in self._stores if f.gone and not f.served)
        return RecoveryOutcome(
            len(self._loads), len(self._stores), recovered_loads, recovered_stores, ended_count
        )
