"""The connector core, scheduler side: claims, load and store jobs, failure memory, pins.

:class:`ConnectorCore` is the optimized twin of ``spec.connector.ReferenceConnector`` (never
imported here) and must agree with it on every observable: claims, job ids and contents, host
store calls (so the store's entries, policy order and events), failure memory, delayed frees
and pinned blocks (tests/differential/test_connector_agreement.py drives both with the spec
scheduler and compares after every call). It satisfies
:class:`~hybridkv.connector.api.SchedulerConnector` over an optimized
:class:`~hybridkv.store.HostStore`, in vLLM's call order:

- ``get_num_new_matched_tokens``: the claim rule (:mod:`hybridkv.connector.claims`); DEFER
  while the request has a load in flight or a STORING key could lengthen the claim.
- ``update_state_after_alloc``: pins the claimed keys and builds one load job per alignment
  segment (:mod:`hybridkv.connector.loads`).
- ``build_connector_meta``: emits those loads, one store job per scheduled request of the units
  its forward completes, decode tokens and mamba boundary states included
  (:mod:`hybridkv.connector.stores`), and the delayed frees to announce.
- ``update_connector_output``: folds job results: loads unpin (a failed load's keys are
  remembered, so the re-ask salvages the longest prefix that avoids them), stores complete.
- ``request_finished_all_groups``: delays the block free while a store of the request runs.
- ``_set_salvage``: a benchmark control, never a user setting (see its docstring).
- ``bind_gpu_block_pool`` / ``held_blocks``: store sources are pinned in the GPU block pool from
  the job's emission to its report (TR-1).
- ``chunk_members`` / ``reserve_promotion`` / ``complete_promotion``: the remote tier's entry
  (issue 12, :mod:`hybridkv.vllm.remote`). A promotion's keys enter the store STORING through
  the core like a store job's and leave it READY or removed; nothing calls these unless a
  remote tier is configured, so without one the core is exactly the reference's twin.
- ``reset_cache`` / ``release_store_pins``: vLLM's ``reset_prefix_cache`` (issue 17: new
  weights make every stored unit stale). Beyond the reference too, and called only by a reset:
  nothing stored before a reset is ever claimed or loaded after it (see each docstring).

What makes it cheap (the reference re-hashes every request and rescans every job each call):
hashes grow incrementally per request and each offload key is built once
(:mod:`hybridkv.connector.requests`); the claim search is
linear in the units it inspects (:mod:`hybridkv.connector.claims`) and its answer is remembered
per waiting request until the store's statuses or the failure memory change; per-request
counters replace scans over the jobs in flight; the failure memory and salt record forget keys
through the departures the core itself causes (:mod:`hybridkv.connector.memory`) instead of
rescanning every remembered key each step.

The core owns its store: keys enter and leave it through the core (``seed`` included).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import Enum
from typing import Any, NamedTuple

from hybridkv.connector.api import (
    BlockTable,
    Claim,
    ClaimKind,
    ConnectorMeta,
    GpuBlockPool,
    JobId,
    KVConnectorOutput,
    RequestId,
    RequestView,
    StepView,
    TransferItem,
    TransferJob,
    TransferKind,
)
from hybridkv.connector.checkpoints import CheckpointRule
from hybridkv.connector.claims import decide_claim
from hybridkv.connector.geometry import ConnectorGeometry
from hybridkv.connector.loads import LoadRecord, load_items, resume_point, segments
from hybridkv.connector.memory import KeyMemory
from hybridkv.connector.requests import RequestKeys
from hybridkv.connector.stores import items_by_end, low_priority, store_items
from hybridkv.errors import HybridKVConfigError
from hybridkv.kinds import GroupKind
from hybridkv.planner import HybridOffloadPlanner
from hybridkv.store import (
    EntryState,
    HostStore,
    LookupResult,
    PrepareLoadOutput,
    PrepareStoreOutput,
    StorePriority,
)

__all__ = ["ConnectorCore", "ConnectorStats", "LoadMode"]

_LOAD, _STORE = TransferKind.LOAD, TransferKind.STORE
_MISS = LookupResult.MISS
_NORMAL, _LOW = StorePriority.NORMAL, StorePriority.LOW


class LoadMode(Enum):
    """How a claim is loaded: ASYNC (vLLM's default) or SYNC (before the step's forward)."""

    ASYNC = "async"
    SYNC = "sync"


class ConnectorStats(NamedTuple):
    """What the core did since creation (counts) and holds now (the last four).

    ``hashes_computed`` counts block hashes over all requests: each full hash block of a
    request is hashed once in its life, however often the request is asked or stored.
    """

    lookups: int
    deferred: int
    claims: int
    claimed_tokens: int
    loaded_tokens: int
    load_jobs: int
    load_items: int
    load_jobs_failed: int
    store_jobs: int
    store_items: int
    store_jobs_failed: int
    stores_refused: int
    delayed_frees: int
    hashes_computed: int
    requests: int
    jobs_in_flight: int
    held_blocks: int
    failed_keys: int


_COUNTERS = ConnectorStats._fields[:14]


class ConnectorCore:
    """The scheduler-side connector core (module docstring)."""

    def __init__(
        self,
        planner: HybridOffloadPlanner,
        store: HostStore,
        group_kinds: Iterable[GroupKind],
        hash_block_size: int,
        chunk_size: int,
        *,
        sliding_windows: Iterable[int] = (),
        load_mode: LoadMode = LoadMode.ASYNC,
        checkpoints: Iterable[CheckpointRule] = (),
    ) -> None:
        """A core over ``store`` for the planner's geometry (the reference's constructor).

        Pre: ``group_kinds`` equal the planner's; ``hash_block_size`` and ``chunk_size`` equal
        the planner's; ``sliding_windows`` empty or each group's window reach
        (``sliding_window - 1 + extra_retained_tokens``, 0 for other kinds); ``checkpoints``
        empty or one :class:`~hybridkv.connector.checkpoints.CheckpointRule` per group (where a
        step leaves mamba states; empty: no group exports a prefill checkpoint); ``store`` an empty
        :class:`~hybridkv.store.HostStore` this core will own. Refusal:
        :class:`HybridKVConfigError` naming the field, nothing built. Post: no request known,
        no job, nothing remembered.
        """
        if not isinstance(planner, HybridOffloadPlanner):
            raise HybridKVConfigError("planner", planner, "is not a HybridOffloadPlanner", _FIX)
        for name, value, expected in (
            ("hash_block_size", hash_block_size, planner.hash_block_size),
            ("chunk_size", chunk_size, planner.chunk_size),
        ):
            if value != expected or isinstance(value, bool):
                raise HybridKVConfigError(
                    name, value, f"differs from the planner's {expected}", "match"
                )
        if not isinstance(load_mode, LoadMode):
            raise HybridKVConfigError("load_mode", load_mode, "not a LoadMode", "LoadMode.ASYNC")
        if not isinstance(store, HostStore):
            raise HybridKVConfigError("store", store, "is not a hybridkv HostStore", _FIX)
        self.geometry = ConnectorGeometry.build(
            planner, tuple(group_kinds), tuple(sliding_windows), tuple(checkpoints)
        )
        self.store = store
        self.load_mode = load_mode
        self._next_job = 1
        self._jobs: dict[JobId, tuple[TransferJob, str | None]] = {}
        self._unsent_loads: list[JobId] = []
        self._loads: dict[RequestId, LoadRecord] = {}
        self._memory = KeyMemory(store)
        self._claim_memo: dict[RequestId, tuple[tuple[Any, ...], int, bool]] = {}
        self._delayed: set[RequestId] = set()
        self._unsent_delayed: set[RequestId] = set()
        self._asked: dict[RequestId, int] = {}
        self._finished: set[RequestId] = set()  # finished while their load was in flight
        self._pool: GpuBlockPool | None = None
        self._requests: dict[RequestId, RequestKeys] = {}
        self._stores_of: dict[RequestId, int] = {}
        self._jobs_of: dict[RequestId, int] = {}
        self._store_items = 0  # items of the store jobs in flight (len(held_blocks()) if bound)
        self._store_spans: dict[JobId, tuple[int, int]] = {}  # each store job's step (MB-8)
        self._count = dict.fromkeys(_COUNTERS, 0)
        self._salvage = True
        self._restarting: set[RequestId] = set()  # salvage off: failed, not scheduled since
        # Promotions from the remote tier in flight: their keys are STORING, owned by no job.
        self._promoting: set[bytes] = set()
        # In flight at a reset (reset_cache, release_store_pins): dropped when they report,
        # whatever they report, since the KV they carry predates the reset.
        self._stale_jobs: set[JobId] = set()
        self._stale_promotions: set[bytes] = set()
        self._unpinned: set[JobId] = set()  # store jobs whose pool references were given back
        self.resets = 0

    # ----------------------------------------------------------------- benchmark control

    def _set_salvage(self, enabled: bool) -> None:
        """Switch the re-claim after a failed load on (the default) or off.

        A benchmark control for ``tools/bench_salvage.py``, in-package only (like the facade's
        ``_register`` hooks; no configuration key reaches it). On, the core behaves as its
        contract says: when vLLM's ``recompute`` policy restarts a request whose load failed
        and asks again, the claim rule salvages the longest prefix that avoids the failed keys.
        Off, a request with a failed load job is answered NONE from that failure until it is
        next scheduled (or finishes): vLLM's whole-request recompute, what a connector without
        failure salvage leaves it with. Nothing else changes (the failure memory, the evictions
        of failed keys, stores), so a run with it off differs from one with it on only by the
        re-claim. Post: only the switch changes; requests already restarting keep their answer.
        """
        if not isinstance(enabled, bool):
            raise HybridKVConfigError("enabled", enabled, "not a bool", "pass True or False")
        self._salvage = enabled

    # ----------------------------------------------------------------- the pool

    def bind_gpu_block_pool(self, pool: GpuBlockPool) -> None:
        """Pin store sources in ``pool`` from now on (vLLM ``bind_gpu_block_pool``).

        Pre: no store job is in flight while unbound (field ``pool``: their blocks were never
        pinned), or ``pool`` replaces the pool already bound. Post: only the binding changes.
        """
        if self._pool is None and any(j.kind is _STORE for j, _ in self._jobs.values()):
            raise HybridKVConfigError(
                "pool", pool, "bound while stores are in flight", "bind first"
            )
        self._pool = pool

    def held_blocks(self) -> tuple[int, ...]:
        """The pool references the core holds: every block of each in-flight store, by job id.

        Empty when no pool is bound. Frame: nothing changes.
        """
        if self._pool is None:
            return ()
        return tuple(
            item.block_id
            for job_id, (job, _) in self._jobs.items()
            if job.kind is _STORE and job_id not in self._unpinned
            for item in job.items
        )

    # ----------------------------------------------------------------- claims

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> Claim:
        """The claim beyond ``num_computed_tokens`` (a multiple of the scheduler block >= 0,
        field ``num_computed_tokens``).

        Post: DEFER while the request has a load in flight or a STORING key could lengthen the
        claim; else NONE or a claim of ``end - start`` tokens, SYNC or ASYNC by ``load_mode``.
        Frame: only the asked position (and the request's hash chain) is recorded.
        """
        start = self._checked_start(num_computed_tokens)
        rid = request.request_id
        self._asked[rid] = start
        self._count["lookups"] += 1
        record = self._loads.get(rid)
        if record is not None and record.in_flight:
            self._count["deferred"] += 1
            return Claim(ClaimKind.DEFER)
        if rid in self._restarting:
            return Claim(ClaimKind.NONE)  # salvage off (``_set_salvage``)
        end, defer = self._decide(request, start)
        if defer:
            self._count["deferred"] += 1
            return Claim(ClaimKind.DEFER)
        if end == start:
            return Claim(ClaimKind.NONE)
        self._count["claims"] += 1
        self._count["claimed_tokens"] += end - start
        kind = ClaimKind.ASYNC if self.load_mode is LoadMode.ASYNC else ClaimKind.SYNC
        return Claim(kind, end - start)

    def update_state_after_alloc(
        self, request: RequestView, block_ids: BlockTable, num_external_tokens: int
    ) -> None:
        """Pin the keys of the accepted claim and build its load jobs (emitted next meta).

        Pre: ``num_external_tokens`` == 0 (nothing happens), or this ``schedule()`` asked for
        the request and no load of it is in flight (field ``num_external_tokens`` /
        ``request`` otherwise). Post: one load job per alignment segment into the real blocks
        of ``block_ids``, its keys pinned and touched. Refusal: nothing changes.
        """
        if num_external_tokens == 0:
            return
        rid = request.request_id
        start = self._asked.get(rid)
        if start is None:
            raise HybridKVConfigError(
                "num_external_tokens", num_external_tokens, "no claim was asked", "ask first"
            )
        record = self._loads.get(rid)
        if record is not None and record.in_flight:
            raise HybridKVConfigError(
                "request", rid, "has a load in flight", "wait for finished_recving"
            )
        end = start + num_external_tokens
        keys = self._keys(request)
        items = load_items(self.geometry, keys, block_ids, start, end, loadable=self._loadable)
        item_keys = tuple(item.key for item in items)
        if items:
            pinned = self.store.prepare_load(item_keys)
            if not isinstance(pinned, PrepareLoadOutput):
                raise HybridKVConfigError(
                    "num_external_tokens", num_external_tokens, "not ready", "ask again"
                )
            self.store.touch(item_keys)
        sync = self.load_mode is LoadMode.SYNC
        jobs = []
        for part in segments(items, self.geometry.align):
            job = TransferJob(self._new_job_id(), _LOAD, rid, part, sync)
            self._add_job(job, request.cache_salt)
            self._unsent_loads.append(job.job_id)
            jobs.append(job.job_id)
        self._loads[rid] = LoadRecord(
            start=start,
            end=end,
            num_tokens=len(request.token_ids),
            sync=sync,
            cache_salt=request.cache_salt,
            items=items,
            jobs=tuple(jobs),
        )
        count = self._count
        count["loaded_tokens"] += num_external_tokens
        count["load_jobs"] += len(jobs)
        count["load_items"] += len(items)

    # ----------------------------------------------------------------- the step

    def build_connector_meta(self, step: StepView) -> ConnectorMeta:
        """This step's loads (built since the last call), stores and delayed frees.

        Post: every scheduled request's units completed by this step are reserved in the host
        (head first, per end position, stopping at the first refusal) and form one store job
        per request; the failure memory and salt record forget keys the host no longer holds;
        the asked positions are cleared. Pre: each of ``step.no_unit_ids`` completes no unit in
        this step (it is treated as scheduled with nothing to store).
        """
        jobs = self._jobs
        loads = tuple(jobs[job_id][0] for job_id in self._unsent_loads)
        self._unsent_loads = []
        stores = []
        for scheduled in step.scheduled:
            self._restarting.discard(scheduled.request.request_id)
            start = scheduled.num_computed_tokens
            job = self._store_job(
                scheduled.request,
                scheduled.block_ids,
                start,
                start + scheduled.num_scheduled_tokens,
            )
            if job is not None:
                stores.append(job)
        if self._restarting and step.no_unit_ids:  # scheduled too: no longer restarting
            self._restarting.difference_update(step.no_unit_ids)
        delayed = frozenset(self._unsent_delayed)
        self._unsent_delayed = set()
        self._memory.prune(self.store)
        self._asked.clear()
        return ConnectorMeta(loads, tuple(stores), delayed)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Fold every job result of ``output.completed_jobs``, in order.

        Pre: each result names a job in flight (field ``completed_jobs`` otherwise; earlier
        results stay folded, that one and later ones change nothing). Post: a load job's keys
        are unpinned, a failed one's remembered; a store job completes its keys (READY or
        dropped), unpins its blocks, and a success clears their failure memory; a delayed
        request whose last store reported is no longer delayed.
        """
        for result in output.completed_jobs:
            entry = self._jobs.pop(result.job_id, None)
            if entry is None:
                raise HybridKVConfigError(
                    "completed_jobs", result.job_id, "no such job", "report once"
                )
            self._store_spans.pop(result.job_id, None)
            job = entry[0]
            rid = job.request_id
            self._job_left(rid)
            keys = tuple(item.key for item in job.items)
            if job.kind is _LOAD:
                self._load_reported(job, keys, result.success)
            else:
                self._store_reported(job, keys, result.success)

    def request_finished_all_groups(self, request: RequestView, block_ids: BlockTable) -> bool:
        """True (delay the free until ``finished_sending``) iff a store of it is in flight and
        no load of it is.

        A request finished while its load is in flight is already held by the scheduler until
        that load reports (vLLM: ``finish_requests`` delays its free to ``finished_recving``),
        so it is never delayed here too: vLLM frees and deletes the request at the first of the
        two reports and fails an assert at the second (``scheduler.py:3565-3581``). Its stores
        still read their sources safely: those stay pinned until each store reports.

        Post: the request's hash chain, asked position and (unless in flight) load record are
        forgotten; a delayed request is announced to the worker in the next metadata.
        """
        rid = request.request_id
        self._asked.pop(rid, None)
        self._requests.pop(rid, None)
        self._claim_memo.pop(rid, None)
        self._restarting.discard(rid)
        record = self._loads.get(rid)
        if record is not None:
            if record.in_flight:
                self._finished.add(rid)  # dropped when its load's last job reports
                return False  # the load's report frees it (docstring)
            del self._loads[rid]
        if not self._stores_of.get(rid):
            return False
        self._delayed.add(rid)
        self._unsent_delayed.add(rid)
        self._count["delayed_frees"] += 1
        return True

    # ----------------------------------------------------------------- queries

    def has_transfers(self, request_id: RequestId) -> bool:
        """Whether a load or store job of the request is in flight (or built, not yet sent)."""
        return bool(self._jobs_of.get(request_id))

    def delayed_requests(self) -> frozenset[RequestId]:
        """The finished requests whose block free waits for their stores (delayed by
        :meth:`request_finished_all_groups`, until their last store reports)."""
        return frozenset(self._delayed)

    def busy_blocks(self) -> frozenset[int]:
        """Blocks an in-flight job reads (store) or writes (load)."""
        return frozenset(item.block_id for job, _ in self._jobs.values() for item in job.items)

    def invalid_blocks(self, request_id: RequestId) -> frozenset[int]:
        """The destination blocks of the failed jobs of the request's latest load.

        Pre: the request has a load record (field ``request_id``).
        """
        return frozenset(self._record(request_id).bad_blocks)

    def first_invalid_token(self, request: RequestView) -> int:
        """Where the request's latest load leaves every group valid (shared truncation): the
        largest aligned position whose needed keys all came from successful jobs, else the
        claim start. Pre: a load record exists (field ``request_id``)."""
        record = self._record(request.request_id)
        return resume_point(self.geometry, self._keys(request), record)

    def request_keys(self, request: RequestView) -> RequestKeys:
        """The request's offload keys for a look from outside (the per-group prefix metric).

        With the engine's block hashes in the view, the core's own chain when it has one that
        matches (its keys already built, nothing hashed); otherwise a fresh chain, not kept.
        Frame: nothing the core answers or reports changes.
        """
        keys = self._requests.get(request.request_id)
        if request.block_hashes is None or keys is None or not keys.matches(request):
            keys = RequestKeys.for_view(self.geometry, request)
        keys.sync(request)  # engine hashes: bookkeeping only, nothing computed or counted
        return keys

    def failed_keys(self) -> frozenset[bytes]:
        """The keys the failure memory holds now."""
        return self._memory.failed_keys()

    def counts(self) -> tuple[int, ...]:
        """The counts of :meth:`stats` (its first 14 fields, in order), without the holdings
        and without building it: what the facade's stats hook compares each step. O(1)."""
        return tuple(self._count.values())

    def stats(self) -> ConnectorStats:
        """Counts since creation and holdings now, in O(1)."""
        held = self._store_items if self._pool is not None else 0  # == len(held_blocks())
        now = (len(self._requests), len(self._jobs), held, len(self._memory))
        return ConnectorStats._make((*map(self._count.__getitem__, _COUNTERS), *now))

    # ----------------------------------------------------------------- seeding

    def seed(self, request: RequestView, num_tokens: int, groups: Iterable[int] = ()) -> int:
        """Make the host hold READY the units of ``request``'s first ``num_tokens`` tokens.

        ``groups`` limits the groups stored (empty: all). Post: the keys are READY and recorded
        with the request's salt; returns how many were stored. Refusal (no space): field
        ``store_capacity``, nothing stored.
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

    def chunk_members(
        self, request: RequestView, end: int, *, recurrent: bool = True
    ) -> tuple[bytes, ...]:
        """The remote tier's chunk ending at ``end``: the key of every group's unit that ends
        exactly there (attention blocks and, with ``recurrent``, the mamba state), in group
        order; empty when no unit ends there. Pre: ``request`` has at least ``end`` tokens.
        Frame: only the request's hash chain grows."""
        keys = self._keys(request)
        kinds = self.geometry.kinds
        return tuple(
            keys.key(g, end // u - 1)
            for g, u in enumerate(self.geometry.units)
            if end > 0 and end % u == 0 and (recurrent or kinds[g] is not GroupKind.MAMBA)
        )

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
        if not keys or any(self.store.status(key) is not _MISS for key in keys):
            return None
        prepared = self.store.prepare_store(list(keys))
        if not isinstance(prepared, PrepareStoreOutput):
            return None
        self._memory.departed(prepared.evicted_keys)
        self._memory.salt(keys, cache_salt)
        self._promoting.update(keys)
        return self.store.slots(keys)

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

    def job_kind(self, job_id: JobId) -> TransferKind | None:
        """The kind of the job in flight ``job_id``; None when none is."""
        entry = self._jobs.get(job_id)
        return None if entry is None else entry[0].kind

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
        jobs = self._jobs.values()
        self._stale_jobs.update(job.job_id for job, _ in jobs if job.kind is _STORE)
        self._stale_promotions.update(self._promoting)
        loading = {item.key: None for job, _ in jobs if job.kind is _LOAD for item in job.items}
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

        Returns the blocks released, one per reference. Post: :meth:`held_blocks` is empty.
        Frame: the jobs stay in flight and report as usual; the host keeps their keys STORING
        until then, so no slot they write is reused before they finish.
        """
        if self._pool is None:
            return ()
        released: list[int] = []
        for job_id, (job, _) in self._jobs.items():
            if job.kind is _STORE and job_id not in self._unpinned:
                self._unpinned.add(job_id)
                self._stale_jobs.add(job_id)
                self._store_items -= len(job.items)
                released.extend(item.block_id for item in job.items)
        if released:
            self._pool.free_blocks(released)
        return tuple(released)

    # ----------------------------------------------------------------- snapshot

    def snapshot(self) -> dict[str, Any]:
        """The reference connector's plain snapshot (``spec.connector.scheduler_side`` schema,
        which the MB-* and SEC-1 predicates read). Frame: nothing changes."""
        return {
            "kinds": tuple(kind.value for kind in self.geometry.kinds),
            "units": self.geometry.units,
            "align": self.geometry.align,
            "next_job_id": self._next_job,
            "jobs": tuple(_plain_job(job, salt) for _, (job, salt) in sorted(self._jobs.items())),
            "loads": tuple(_plain_load(rid, rec) for rid, rec in sorted(self._loads.items())),
            **self._memory.snapshot(),
            "delayed": tuple(sorted(self._delayed)),
            "store_spans": tuple((int(j), a, b) for j, (a, b) in sorted(self._store_spans.items())),
            "checkpoints": tuple(
                (
                    r.alignment,
                    r.hash_block_size,
                    r.cache_hit_alignment,
                    r.drop_eagle_block,
                    r.hash_lookahead,
                )
                for r in self.geometry.checkpoints
            ),
            "store": self.store.snapshot(),
        }

    # ----------------------------------------------------------------- helpers

    def _keys(self, request: RequestView) -> RequestKeys:
        """The request's hash chain, grown to its current tokens (SEC-1: salted)."""
        keys = self._requests.get(request.request_id)
        if keys is None or not keys.matches(request):
            keys = RequestKeys.for_view(self.geometry, request)
            self._requests[request.request_id] = keys
        self._count["hashes_computed"] += keys.sync(request)
        return keys

    def _decide(self, request: RequestView, start: int) -> tuple[int, bool]:
        """The claim rule's answer, remembered per request: a scheduler asks a waiting request
        again every step, and the answer changes only with its tokens, its start, the store's
        statuses (every status change moves one of the store's reserved, stored, removed or
        evicted counters) or the failure memory."""
        memo_key = (
            start,
            len(request.token_ids),
            request.cache_salt,
            self.store.status_counts(),  # reserved, stored, removed, evicted
            self._memory.epoch,
        )
        memo = self._claim_memo.get(request.request_id)
        if memo is not None and memo[0] == memo_key:
            return memo[1], memo[2]
        end, defer = decide_claim(
            self.geometry,
            self._keys(request).key,
            len(request.token_ids),
            start,
            status=self.store.status,
            failed=self._memory.failed,
        )
        self._claim_memo[request.request_id] = (memo_key, end, defer)
        return end, defer

    def _checked_start(self, value: int) -> int:
        block = self.geometry.scheduler_block
        if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value % block:
            raise HybridKVConfigError(
                "num_computed_tokens", value, f"not a multiple of {block} >= 0", "align it"
            )
        return value

    def _loadable(self, key: bytes) -> bool:
        """READY in the host and not remembered as failed."""
        return key not in self._memory and self.store.status(key) is LookupResult.HIT

    def _store_job(
        self, request: RequestView, block_ids: BlockTable, start: int, end: int
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
        for part in items_by_end(store_items(geometry, keys, block_ids, start, end)):
            # Admission (hybridkv.connector.stores.low_priority): the part's NORMAL units, then
            # its LOW ones, which may only displace LOW entries. A refusal that leaves a hole in
            # a claimable prefix (a NORMAL unit or a continuation) ends the job.
            low = [item for item in part if low_priority(geometry, item, prompt)]
            calls = ((part, _NORMAL),) if not low else ((_without(part, low), _NORMAL), (low, _LOW))
            accepted: set[bytes] = set()
            ended = False
            for items, priority in calls:
                if not items:
                    continue
                prepared = store.prepare_store([item.key for item in items], priority)
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

    def _load_reported(self, job: TransferJob, keys: tuple[bytes, ...], success: bool) -> None:
        self.store.complete_load(keys)
        if not success:
            self._count["load_jobs_failed"] += 1
            self._memory.remember_failed(keys, self._next_job)
        # Drop the failed entries no other load still pins: their data may be bad, and left in
        # place they would stay unclaimable while present (the reference's rule).
        if self._memory:  # evict([]) changes nothing: skipped while nothing is remembered
            self._memory.departed(self.store.evict([key for key in keys if key in self._memory]))
        rid = job.request_id
        record = self._loads.get(rid)
        if not (success or self._salvage or rid in self._finished):
            self._restarting.add(rid)
        if record is not None and job.job_id in record.jobs:
            record.job_reported(job.job_id, job.items, success=success)
            if rid in self._finished and not record.in_flight:
                del self._loads[rid]
                self._finished.discard(rid)

    def _store_reported(self, job: TransferJob, keys: tuple[bytes, ...], success: bool) -> None:
        stale = job.job_id in self._stale_jobs
        if stale:  # emitted before a reset: its keys never become READY (reset_cache)
            self._stale_jobs.discard(job.job_id)
            success = False
        self.store.complete_store(keys, success=success)
        if job.job_id in self._unpinned:
            self._unpinned.discard(job.job_id)  # its pool references went back at the reset
        else:
            self._store_items -= len(job.items)
            if self._pool is not None:
                self._pool.free_blocks([item.block_id for item in job.items])
        rid = job.request_id
        left = self._stores_of[rid] - 1
        if left:
            self._stores_of[rid] = left
        else:
            del self._stores_of[rid]
        if success:
            self._memory.stored(keys)
        else:
            if not stale:
                self._count["store_jobs_failed"] += 1
            self._memory.departed(keys)
        if not left:
            self._delayed.discard(rid)

    def _add_job(self, job: TransferJob, salt: str | None) -> None:
        self._jobs[job.job_id] = (job, salt)
        rid = job.request_id
        self._jobs_of[rid] = self._jobs_of.get(rid, 0) + 1

    def _job_left(self, rid: RequestId) -> None:
        left = self._jobs_of[rid] - 1
        if left:
            self._jobs_of[rid] = left
        else:
            del self._jobs_of[rid]

    def _record(self, request_id: RequestId) -> LoadRecord:
        record = self._loads.get(request_id)
        if record is None:
            raise HybridKVConfigError(
                "request_id", request_id, "has no load recorded", "ask after a load"
            )
        return record

    def _new_job_id(self) -> JobId:
        job_id = JobId(self._next_job)
        self._next_job += 1
        return job_id


_FIX = "build it with hybridkv (planner, store) for this layout"


def _plain_item(item: TransferItem) -> tuple[int, int, str, int]:
    return (item.group_idx, item.block_id, item.key.hex(), item.end_token)


def _plain_job(job: TransferJob, salt: str | None) -> tuple[Any, ...]:
    items = tuple(_plain_item(item) for item in job.items)
    return (int(job.job_id), job.kind.value, job.request_id, salt, job.sync, items)


def _plain_load(rid: RequestId, rec: LoadRecord) -> tuple[Any, ...]:
    return (
        rid,
        rec.start,
        rec.end,
        rec.num_tokens,
        rec.sync,
        rec.cache_salt,
        tuple(int(j) for j in rec.jobs),
        tuple(sorted(int(j) for j in rec.reported)),
        tuple(sorted(int(j) for j in rec.failed)),
        tuple(_plain_item(item) for item in rec.items),
    )


def _without(part: Sequence[TransferItem], low: list[TransferItem]) -> list[TransferItem]:
    """The items of ``part`` not in ``low`` (a sublist of it), in order."""
    skipped = {item.key for item in low}
    return [item for item in part if item.key not in skipped]
