"""Keys that enter or leave the host store from outside the step's jobs.

Besides the reference's ``seed``, two callers beyond the reference connector reach the
core's store this way, and neither runs unless configured:

- the remote tier (issue 12, :mod:`hybridkv.vllm.remote`) promotes a chunk into the host: its
  keys enter STORING, owned by no job, and leave READY or removed
  (:meth:`OutsideWork.reserve_promotion`, :meth:`OutsideWork.complete_promotion`);
- ``seed`` stores a request's units READY with no job (tests and warm starts);
- vLLM's ``reset_prefix_cache`` (issue 17: new weights make every stored unit stale) empties
  the host of what it holds and marks what is in flight stale, so nothing stored before a
  reset is ever claimed or loaded after it (:meth:`OutsideWork.reset_cache`,
  :meth:`OutsideWork.release_store_pins`).

They share the staleness bookkeeping: a promotion reserved before a reset completes dropped.
:class:`OutsideWork` is a mixin of :class:`hybridkv.connector.core.ConnectorCore`, which owns
every attribute it declares.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hybridkv.connector.api import (
    GpuBlockPool,
    JobId,
    RequestId,
    RequestView,
    TransferJob,
    TransferKind,
)
from hybridkv.connector.geometry import ConnectorGeometry
from hybridkv.connector.memory import KeyMemory
from hybridkv.connector.requests import RequestKeys
from hybridkv.errors import HybridKVConfigError
from hybridkv.store import EntryState, HostStore, LookupResult, PrepareStoreOutput

__all__ = ["OutsideWork"]


class OutsideWork:
    """Promotions from the remote tier and prefix-cache resets (module docstring)."""

    geometry: ConnectorGeometry
    store: HostStore
    resets: int
    _count: dict[str, int]
    _memory: KeyMemory
    _jobs: dict[JobId, tuple[TransferJob, str | None]]
    _next_job: int
    _pool: GpuBlockPool | None
    _store_items: int
    _claim_memo: dict[RequestId, Any]
    _promoting: set[bytes]  # keys promotions hold STORING, owned by no job
    _stale_jobs: set[JobId]  # in flight at a reset: dropped whatever they report
    _stale_promotions: set[bytes]
    _unpinned: set[JobId]  # store jobs whose pool references went back at a reset

    # ----------------------------------------------------------------- seeding

    def seed(self, request: RequestView, num_tokens: int, groups: Iterable[int] = ()) -> int:
        """Store READY at once, with no job and no transfer, every unit of ``request`` within
        its first ``num_tokens`` tokens (tests and warm starts).

        ``groups``: only these groups (empty: every group). Returns how many keys were stored,
        each recorded with the request's salt. Refusal: field ``store_capacity`` when the host
        cannot take them; nothing is stored then.
        """
        wanted = sorted(set(groups) or range(self.geometry.num_groups))
        keys = RequestKeys.for_view(self.geometry, request)  # not kept: seeds do not finish
        self._count["hashes_computed"] += keys.sync(request)
        units = self.geometry.units
        wanted_keys = [keys.key(g, j) for g in wanted for j in range(num_tokens // units[g])]
        prepared = self.store.prepare_store(wanted_keys)
        if not isinstance(prepared, PrepareStoreOutput):
            raise HybridKVConfigError(
                "store_capacity", self.store.capacity, "too small to seed", "raise it"
            )
        self._memory.departed(prepared.evicted_keys)
        self.store.complete_store(prepared.keys_to_store, success=True)
        self._memory.salt(prepared.keys_to_store, request.cache_salt, overwrite=True)
        return len(prepared.keys_to_store)

    # ----------------------------------------------------------------- remote tier

    def reserve_promotion(
        self, keys: tuple[bytes, ...], cache_salt: str | None
    ) -> tuple[int, ...] | None:
        """Reserve ``keys`` STORING for a fetch from the remote tier; their host slots.

        None (nothing changes) unless every key is absent from the host (a present key belongs
        to the host or to another operation) or when the store cannot make room. Post: the
        keys are STORING and owned by this promotion (READY unpinned entries may have been
        evicted for them, as for any store); the claim rule DEFERs on them like on any STORING
        key until :meth:`complete_promotion`.
        """
        store = self.store
        if not keys or any(store.status(key) is not LookupResult.MISS for key in keys):
            return None
        prepared = store.prepare_store(list(keys))
        if not isinstance(prepared, PrepareStoreOutput):
            return None
        self._memory.departed(prepared.evicted_keys)
        self._memory.salt(keys, cache_salt)
        self._promoting.update(keys)
        return store.slots(keys)

    def complete_promotion(self, keys: tuple[bytes, ...], success: bool) -> None:
        """Resolve a promotion: READY (the fetch wrote verified bytes into every slot) or
        dropped (REMOVED; the claim then ends before them). Pre: ``keys`` were reserved by
        :meth:`reserve_promotion` and not resolved (field ``keys``)."""
        if not keys or not self._promoting.issuperset(keys):
            raise HybridKVConfigError("keys", len(keys), "no promotion of them", "reserve first")
        self._promoting.difference_update(keys)
        if self._stale_promotions.intersection(keys):  # reserved before a reset: dropped
            self._stale_promotions.difference_update(keys)
            success = False
        self.store.complete_store(keys, success=success)
        if success:
            self._memory.stored(keys)
        else:
            self._memory.departed(keys)

    def promotions_in_flight(self) -> int:
        """Keys reserved by promotions not yet resolved."""
        return len(self._promoting)

    # ----------------------------------------------------------------- reset (issue 17)

    def reset_cache(self) -> int:
        """Forget every unit the host holds or receives from before now (vLLM's
        ``reset_prefix_cache``: the weights changed, so stored KV is stale).

        Post: every READY entry no load pins is evicted (returned: how many); each key a load
        in flight pins is remembered failed, so no claim counts it and it is evicted when its
        last load reports (the load itself still lands in the blocks it was granted); every
        store job and promotion in flight completes dropped whatever it reports, so its keys
        never become READY. Frame: requests, their hash chains, the jobs in flight, their
        pins and their reports stay as they were; a key stored after this call is fresh.
        """
        self.resets += 1
        jobs = [job for job, _ in self._jobs.values()]
        self._stale_jobs.update(job.job_id for job in jobs if job.kind is TransferKind.STORE)
        self._stale_promotions.update(self._promoting)
        loading = {
            item.key: None for job in jobs if job.kind is TransferKind.LOAD for item in job.items
        }
        self._memory.remember_failed(loading, self._next_job)
        ready = [
            bytes.fromhex(key)
            for key, state, pins in self.store.snapshot()["entries"]
            if state == EntryState.READY.value and pins == 0
        ]  # a reset is rare: the plain snapshot is the one list of entries the store offers
        evicted = self.store.evict(ready)
        self._memory.departed(evicted)
        self._claim_memo.clear()
        return len(evicted)

    def release_store_pins(self) -> tuple[int, ...]:
        """Give back the pool reference of every block a store in flight reads (vLLM refuses
        to reset its prefix cache while any block is referenced); each such store completes
        dropped, since its source blocks may be reused and overwritten before it has read them.

        Returns the blocks released, one per reference. Post: ``held_blocks()`` is empty.
        Frame: the jobs stay in flight and report as usual; the host keeps their keys STORING
        until then, so no slot they write is reused before they finish.
        """
        if self._pool is None:
            return ()
        released: list[int] = []
        for job_id, (job, _) in self._jobs.items():
            if job.kind is TransferKind.STORE and job_id not in self._unpinned:
                self._unpinned.add(job_id)
                self._stale_jobs.add(job_id)
                self._store_items -= len(job.items)
                released.extend(item.block_id for item in job.items)
        if released:
            self._pool.free_blocks(released)
        return tuple(released)
