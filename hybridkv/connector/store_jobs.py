"""How the scheduler-side core builds a step's store job for one request.

:class:`StoreJobs` is a mixin of :class:`hybridkv.connector.core.ConnectorCore`, which owns
every attribute it declares (and grows the request's hash chain, ``_keys``). Which items a
step completes and which of them are admitted LOW is :mod:`hybridkv.connector.stores`'; here
they are reserved in the host, end by end, as ``spec.connector.ReferenceConnector``'s
``_store_job`` does (the same ``prepare_store`` calls, so the same policy order and events),
salted, pinned in the GPU block pool from emission to report (TR-1) and numbered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hybridkv.connector.api import (
    BlockTable,
    GpuBlockPool,
    JobId,
    RequestId,
    RequestView,
    TransferItem,
    TransferJob,
    TransferKind,
)
from hybridkv.connector.geometry import ConnectorGeometry
from hybridkv.connector.memory import KeyMemory
from hybridkv.connector.requests import RequestKeys
from hybridkv.connector.stores import items_by_end, low_priority, store_items
from hybridkv.kinds import GroupKind
from hybridkv.store import HostStore, PrepareStoreOutput, StorePriority

__all__ = ["StoreJobs"]

_STORE = TransferKind.STORE
_NORMAL, _LOW = StorePriority.NORMAL, StorePriority.LOW
_MAMBA = GroupKind.MAMBA


def _bound_keys(geometry: ConnectorGeometry, items: Sequence[TransferItem]) -> list[bytes]:
    """The keys of a store call bound to its unit (``HostStore.prepare_store``'s ``bound``):
    its mamba states, when the call holds another chunk too. A mamba state at a unit's end
    serves only a claim ending there, and that claim loads every attention chunk of the unit
    (a GPU hit reaching the unit would have held the state too), so without them it is dead.
    A sliding chunk is not bound: it also serves claims whose GPU hit covers its unit's
    full-attention chunk (binding it cost 448 prefill tokens on one bench row)."""
    kinds = geometry.kinds
    mamba = [item.key for item in items if kinds[item.group_idx] is _MAMBA]
    return mamba if len(mamba) < len(items) else []


class StoreJobs:
    """The core's store jobs, built (module docstring)."""

    geometry: ConnectorGeometry
    store: HostStore
    _keys: Callable[[RequestView], RequestKeys]  # the core's: the chain grown to the tokens
    _count: dict[str, int]
    _memory: KeyMemory
    _jobs: dict[JobId, tuple[TransferJob, str | None]]
    _jobs_of: dict[RequestId, int]
    _store_spans: dict[JobId, tuple[int, int]]
    _stores_of: dict[RequestId, int]
    _store_items: int
    _next_job: int
    _pool: GpuBlockPool | None

    def _store_job(
        self,
        request: RequestView,
        block_ids: BlockTable,
        start: int,
        end: int,
        limit: int | None = None,
    ) -> TransferJob | None:
        """One store job of the units ``(start, end]`` completes (agrees with the reference's
        ``_store_job``: same ``prepare_store`` calls, so the same policy order and events)."""
        geometry = self.geometry
        if not geometry.completes_a_unit(start, end):
            return None  # no unit ends in this step (most decode steps): nothing to do
        keys = self._keys(request)
        taken: list[TransferItem] = []
        store = self.store
        prompt = request.num_prompt_tokens
        found = store_items(geometry, keys, block_ids, start, end)
        if limit is not None and found and found[-1].end_token > limit:  # sorted by end
            found = [item for item in found if item.end_token <= limit]
        for part in items_by_end(found):
            # Admission (hybridkv.connector.stores.low_priority): the part's NORMAL units, then
            # its LOW ones, which take free slots only. A refusal that leaves a hole in
            # a claimable prefix (a NORMAL unit or a continuation) ends the job.
            low = [item for item in part if low_priority(geometry, item, prompt)]
            calls = ((part, _NORMAL),) if not low else ((_without(part, low), _NORMAL), (low, _LOW))
            accepted: set[bytes] = set()
            ended = False
            for items, priority in calls:
                if not items:
                    continue
                bound = _bound_keys(self.geometry, items)
                prepared = store.prepare_store([item.key for item in items], priority, bound)
                if not isinstance(prepared, PrepareStoreOutput):
                    self._count["stores_refused"] += 1
                    ended = priority is _NORMAL or items[0].end_token > prompt
                    break
                self._memory.departed(prepared.evicted_keys)
                accepted.update(prepared.keys_to_store)
            taken.extend(item for item in part if item.key in accepted)
            if ended:
                break  # later ends would leave a hole in the stored prefix
        if not taken:
            return None
        salt = request.cache_salt
        self._memory.salt((item.key for item in taken), salt)
        job = TransferJob(self._new_job_id(), _STORE, request.request_id, tuple(taken))
        self._add_job(job, salt)
        self._store_spans[job.job_id] = (start, end)
        self._store_items += len(taken)
        rid = request.request_id
        self._stores_of[rid] = self._stores_of.get(rid, 0) + 1
        if self._pool is not None:
            self._pool.touch([item.block_id for item in taken])
        self._count["store_jobs"] += 1
        self._count["store_items"] += len(taken)
        return job

    def _add_job(self, job: TransferJob, salt: str | None) -> None:
        self._jobs[job.job_id] = (job, salt)
        rid = job.request_id
        self._jobs_of[rid] = self._jobs_of.get(rid, 0) + 1

    def _new_job_id(self) -> JobId:
        """Job ids count up from 1 in creation order, as the reference numbers them."""
        self._next_job += 1
        return JobId(self._next_job - 1)


def _without(part: Sequence[TransferItem], low: list[TransferItem]) -> list[TransferItem]:
    """The items of ``part`` not in ``low`` (a sublist of it), in order."""
    skipped = {item.key for item in low}
    return [item for item in part if item.key not in skipped]
