"""The reference connector, scheduler side: claims, load and store jobs, failure memory.

:class:`ReferenceConnector` implements :class:`spec.connector_api.SchedulerConnector` over a
:class:`~spec.store.HostStore`, in vLLM's call order: ``get_num_new_matched_tokens`` (pure: the
claim rule of :mod:`spec.connector.claims`), ``update_state_after_alloc`` (pins the keys and
builds the load jobs), ``build_connector_meta`` (emits them with this step's store jobs),
``update_connector_output`` (learns job outcomes from ``KVConnectorOutput.completed_jobs``)
and ``request_finished_all_groups`` (delays the free while the request's stores run).

Design decisions:

- Load mode: ``LoadMode.ASYNC`` (vLLM's default: the request waits in WAITING_FOR_REMOTE_KVS)
  or ``LoadMode.SYNC`` (loaded before the step's forward). A request with a load in flight is
  answered DEFER (vLLM returns ``(None, False)`` while transfers are in flight).
- Failure memory: the keys of a failed load job are remembered and count as absent in every
  later claim, so the re-ask claims the longest prefix that avoids them. The entries are then
  evicted from the host as soon as no load pins them (``HostStore.evict``, at the report of the
  last load that pinned them): their data may be bad, and ``prepare_store`` never overwrites a
  present key, so a failed entry left in place would stay unclaimable for as long as the host
  held it (a hot shared prefix: for good). Evicted, the chunk is computed and stored again by
  the next request that needs it. A remembered key is forgotten when the host no longer holds
  it (checked at each ``build_connector_meta``) or when a store of it completes successfully.
- Store outcomes reach the connector through ``KVConnectorOutput.completed_jobs`` (vLLM's
  ``kv_connector_worker_meta.completed_jobs``); delayed frees reach the worker through
  ``ConnectorMeta.delayed_free_ids``.
- ``get_num_new_matched_tokens`` writes nothing but the asked position of the request (its
  ``num_computed_tokens``), which ``update_state_after_alloc`` needs to recompute the claim and
  which ``build_connector_meta`` clears: between two ``schedule()`` calls it is empty.
- Store sources are pinned (``TR-1``): once bound to the GPU block pool
  (``bind_gpu_block_pool``, vLLM's hook of the same name), the connector takes one pool
  reference on every block a store job reads when it emits the job and drops it when the job
  reports. The managers free blocks of RUNNING requests too (a mamba state once the next one is
  written, a block that slides out of a window), and a store of such a block may still be
  reading it: without the pin the block could be reallocated and overwritten mid-copy. vLLM's
  native connector fences such blocks and flushes the store when one is reused
  (``offloading/scheduler.py:2136-2164``); a pin costs a block for the store's duration and
  never stalls the forward. The scheduler counts the pins as references held outside a table
  (``GR-1``) through :meth:`ReferenceConnector.held_blocks`.

Snapshot schema (subject ``"connector"``, read by :mod:`spec.invariants.connector`)::

    kinds:   (str, ...)        group kinds            units: (int, ...) offload unit per group
    align:   int               claim alignment        next_job_id: int
    jobs:    ((job_id, kind, request_id, cache_salt, sync, items), ...) in flight, by id;
             items ((group_idx, block_id, key_hex, end_token), ...)
    loads:   ((request_id, start, end, num_tokens, sync, cache_salt, job_ids, reported_ids,
               failed_ids, items), ...)  the latest load of each request, by request id
    failed_keys: ((key_hex, since_job_id), ...)  remembered failures; since_job_id = the next
             job id when the failure was learned (jobs from it on were built after)
    key_salts: ((key_hex, cache_salt), ...)     the salt of the request that stored each key
    delayed: (request_id, ...) finished requests whose free waits for their stores
    store_spans: ((job_id, start, end), ...) each in-flight store job's step ``[start, end)``
    checkpoints: ((alignment, hash_block_size, cache_hit_alignment, drop_eagle_block,
             hash_lookahead), ...) per group,
             where a step leaves mamba states (spec.connector.checkpoints)
    store:   the host store's snapshot (spec.store)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from enum import Enum
from typing import Any

from spec.block_pool import BlockId, BlockPool
from spec.connector.checkpoints import CheckpointRule
from spec.connector.claims import decide_claim
from spec.connector.geometry import Geometry
from spec.connector.loads import (
    LoadRecord,
    load_items,
    restored_units,
    resume_point,
    segments,
)
from spec.connector.stores import items_by_end, store_items, stored_low
from spec.connector_api import (
    BlockTable,
    Claim,
    ClaimKind,
    ConnectorMeta,
    JobId,
    KVConnectorOutput,
    RequestId,
    RequestView,
    StepView,
    TransferItem,
    TransferJob,
    TransferKind,
)
from spec.errors import ConfigError
from spec.hashing import request_block_hashes
from spec.kinds import GroupKind
from spec.managers.group_spec import GroupSpec
from spec.planner import HybridOffloadPlanner
from spec.store import (
    HostStore,
    LookupResult,
    PrepareLoadOutput,
    PrepareStoreOutput,
    StorePriority,
)

__all__ = ["LoadMode", "ReferenceConnector"]


class LoadMode(Enum):
    """How a claim is loaded: ASYNC (vLLM's default) or SYNC (before the step's forward)."""

    ASYNC = "async"
    SYNC = "sync"


class ReferenceConnector:
    """The scheduler-side reference connector (module docstring)."""

    def __init__(
        self,
        planner: HybridOffloadPlanner,
        store: HostStore,
        group_kinds: Sequence[GroupKind],
        hash_block_size: int,
        chunk_size: int,
        *,
        sliding_windows: Sequence[int] = (),
        load_mode: LoadMode = LoadMode.ASYNC,
        checkpoints: Sequence[CheckpointRule] = (),
        eagle_groups: Sequence[int] = (),
    ) -> None:
        """A connector over ``store`` for the planner's geometry.

        Pre: ``group_kinds`` equal the planner's; ``hash_block_size`` and ``chunk_size`` equal
        the planner's; ``sliding_windows``, ``checkpoints`` (where a step leaves mamba states)
        and ``eagle_groups`` (whose claims need a proof unit) as :meth:`Geometry.build`;
        ``load_mode`` a
        :class:`LoadMode`. Refusal: :class:`ConfigError` naming the field, nothing built.
        Post: no request known, no job, no failure remembered.
        """
        for name, value, expected in (
            ("hash_block_size", hash_block_size, planner.hash_block_size),
            ("chunk_size", chunk_size, planner.chunk_size),
        ):
            if value != expected or isinstance(value, bool):
                raise ConfigError(name, value, f"differs from the planner's {expected}", "match")
        if not isinstance(load_mode, LoadMode):
            raise ConfigError("load_mode", load_mode, "not a LoadMode", "pass LoadMode.ASYNC")
        self.geometry = Geometry.build(
            planner, group_kinds, sliding_windows, checkpoints, eagle_groups
        )
        self.store = store
        self.load_mode = load_mode
        self._next_job = 1
        self._jobs: dict[JobId, tuple[TransferJob, str | None]] = {}
        self._store_spans: dict[JobId, tuple[int, int]] = {}  # MB-8 reads them
        self._unsent_loads: list[JobId] = []
        self._loads: dict[RequestId, LoadRecord] = {}
        self._failed: dict[bytes, int] = {}
        self._key_salts: dict[bytes, str | None] = {}
        self._delayed: set[RequestId] = set()
        self._unsent_delayed: set[RequestId] = set()
        self._asked: dict[RequestId, int] = {}
        self._finished: set[RequestId] = set()  # finished while their load was in flight
        self._pool: BlockPool | None = None

    def bind_gpu_block_pool(self, pool: BlockPool) -> None:
        """Pin store sources in ``pool`` from now on (vLLM ``bind_gpu_block_pool``).

        Pre: no store job is in flight (its blocks would be released without being pinned:
        ``ConfigError``), or ``pool`` is the clone of the pool the connector was bound to (the
        explorer's copies rebind after cloning). Post: only the binding changes.
        """
        if self._pool is None and any(j.kind is TransferKind.STORE for j, _ in self._jobs.values()):
            raise ConfigError("pool", pool, "bound while stores are in flight", "bind first")
        self._pool = pool

    def held_blocks(self) -> tuple[BlockId, ...]:
        """The pool references the connector holds: one per block of each in-flight store.

        Empty when no pool is bound. Frame: nothing changes.
        """
        if self._pool is None:
            return ()
        return tuple(BlockId(b) for b in self._store_sources())

    @classmethod
    def from_groups(
        cls,
        planner: HybridOffloadPlanner,
        store: HostStore,
        groups: Sequence[GroupSpec],
        *,
        load_mode: LoadMode = LoadMode.ASYNC,
        eagle_groups: Sequence[int] = (),
    ) -> ReferenceConnector:
        """The constructor with kinds and sliding-window reaches read off ``groups``.

        Pre: ``groups`` as :meth:`Geometry.from_groups` (a SLIDING group then needs only its
        window); ``eagle_groups`` as ``__init__``. Post and refusal: those of ``__init__``
        (:class:`ConfigError` naming the field, nothing built).
        """
        reaches = Geometry.from_groups(planner, groups).reaches
        return cls(
            planner,
            store,
            tuple(g.kind for g in groups),
            planner.hash_block_size,
            planner.chunk_size,
            sliding_windows=reaches,
            load_mode=load_mode,
            eagle_groups=eagle_groups,
        )

    # ----------------------------------------------------------------- claims

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> Claim:
        """The claim rule of :mod:`spec.connector.claims` beyond ``num_computed_tokens``.

        Pre: ``num_computed_tokens`` is an int >= 0, a multiple of the scheduler block
        (``ConfigError`` otherwise). Post: DEFER while the request has a load in flight or a
        STORING key could lengthen the claim; else NONE or a claim of ``end - start`` tokens,
        SYNC or ASYNC by ``load_mode``; a claim's keys are then the host's most recent.
        Frame: the asked position is recorded, and for a claim the host's recency moves.

        Why a claim refreshes its keys: vLLM may keep a waiting request many steps after it
        asked (token budget, free blocks, load admission), and the running requests' stores
        evict by recency meanwhile, so the chunks about to be loaded were often the next
        victims. The refresh is recency only (``HostStore.refresh``), head most recent, over
        the units the load would read (:func:`spec.connector.loads.load_items` without the
        block table): every unit :meth:`Geometry.needed_units` names below ``end``, per group.
        """
        start = self._checked_start(num_computed_tokens)
        self._asked[request.request_id] = start
        record = self._loads.get(request.request_id)
        if record is not None and record.in_flight:
            return Claim(ClaimKind.DEFER)
        decision = decide_claim(
            self.geometry,
            self._hashes(request),
            len(request.token_ids),
            start,
            status=self.store.status,
            failed=self._remembered_failures(),
        )
        if decision.defer:
            return Claim(ClaimKind.DEFER)
        if decision.end == start:
            return Claim(ClaimKind.NONE)
        self.store.refresh(self._claimed_keys(request, start, decision.end))
        kind = ClaimKind.ASYNC if self.load_mode is LoadMode.ASYNC else ClaimKind.SYNC
        return Claim(kind, decision.end - start)

    def _claimed_keys(self, request: RequestView, start: int, end: int) -> list[bytes]:
        """The keys a load of ``[start, end)`` reads, head first
        (:func:`spec.connector.loads.restored_units`)."""
        hashes = self._hashes(request)
        return [self.geometry.key(hashes, ref) for ref in restored_units(self.geometry, start, end)]

    def update_state_after_alloc(
        self, request: RequestView, block_ids: BlockTable, num_external_tokens: int
    ) -> None:
        """Pin the keys of the accepted claim and build its load jobs (emitted next meta).

        Pre: ``num_external_tokens`` == 0 (nothing happens), or this ``schedule()`` asked for
        the request and no load of it is in flight (``ConfigError`` otherwise). Post: one load
        job per alignment segment (:mod:`spec.connector.loads`) into the real blocks of
        ``block_ids``, its keys pinned and touched; a shortened claim loads what the host holds
        for its end. Refusal: nothing changes.
        """
        if num_external_tokens == 0:
            return
        rid = request.request_id
        start = self._asked.get(rid)
        if start is None:
            raise ConfigError(
                "num_external_tokens", num_external_tokens, "no claim was asked", "ask first"
            )
        record = self._loads.get(rid)
        if record is not None and record.in_flight:
            raise ConfigError("request", rid, "has a load in flight", "wait for finished_recving")
        end = start + num_external_tokens
        hashes = self._hashes(request)
        items = self._load_items(hashes, block_ids, start, end, loadable=self._loadable)
        keys = tuple(item.key for item in items)
        if items:
            pinned = self.store.prepare_load(keys)
            if not isinstance(pinned, PrepareLoadOutput):
                raise ConfigError("num_external_tokens", num_external_tokens, "not ready", "ask")
            self.store.touch(keys)
        sync = self.load_mode is LoadMode.SYNC
        jobs = []
        for part in segments(items, self.geometry.align):
            job = TransferJob(self._new_job_id(), TransferKind.LOAD, rid, part, sync)
            self._jobs[job.job_id] = (job, request.cache_salt)
            self._unsent_loads.append(job.job_id)
            jobs.append(job.job_id)
        self._loads[rid] = LoadRecord(
            start, end, len(request.token_ids), sync, request.cache_salt, items, tuple(jobs)
        )

    # ----------------------------------------------------------------- the step

    def build_connector_meta(self, step: StepView) -> ConnectorMeta:
        """This step's loads (built since the last call), stores and delayed frees.

        Post: every scheduled request's units completed by this step are reserved in the host
        (head first, per end position, stopping at the first refusal) and form one store job
        per request; the failure memory and the salt record forget keys the host no longer
        holds; the asked positions are cleared.
        """
        loads = tuple(self._jobs[job_id][0] for job_id in self._unsent_loads)
        self._unsent_loads = []
        stores = []
        for scheduled in step.scheduled:
            job = self._store_job(
                scheduled.request,
                scheduled.block_ids,
                scheduled.num_computed_tokens,
                scheduled.num_computed_tokens + scheduled.num_scheduled_tokens,
                limit=scheduled.store_limit,
            )
            if job is not None:
                stores.append(job)
        delayed = frozenset(self._unsent_delayed)
        self._unsent_delayed = set()
        self._forget_absent_keys()
        self._asked = {}
        return ConnectorMeta(loads, tuple(stores), delayed)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Fold every job result of ``output.completed_jobs``, in order.

        Pre: each result names a job in flight (``ConfigError`` otherwise, nothing changed for
        that and later results). Post: a load job's keys are unpinned (success or not); a
        failed load job's keys are remembered; a store job completes its keys (READY or
        dropped) and a success clears their failure memory; a delayed request whose last
        store reported is no longer delayed. The request-level sets carry nothing more.
        """
        for result in output.completed_jobs:
            entry = self._jobs.pop(result.job_id, None)
            if entry is None:
                raise ConfigError("completed_jobs", result.job_id, "no such job", "report once")
            self._store_spans.pop(result.job_id, None)
            job = entry[0]
            keys = tuple(item.key for item in job.items)
            if job.kind is TransferKind.LOAD:
                self._load_reported(job, keys, result.success)
            else:
                self.store.complete_store(keys, success=result.success)
                if self._pool is not None:
                    self._pool.free_blocks(BlockId(item.block_id) for item in job.items)
                if result.success:
                    for key in keys:
                        self._failed.pop(key, None)
                if job.request_id in self._delayed and not self._stores_of(job.request_id):
                    self._delayed.discard(job.request_id)

    def request_finished_all_groups(self, request: RequestView, block_ids: BlockTable) -> bool:
        """True (delay the free until ``finished_sending``) iff a store of it is in flight and
        no load of it is.

        Post: the request's asked position is forgotten, and its load record; a load still in
        flight keeps its record until its last job reports (its jobs report into it); a delayed
        request is announced to the worker in the next metadata. A load still in flight is the
        scheduler's own hold (vLLM frees an aborted load's blocks at its finished_recving), and
        the only one: vLLM deletes a finished request at its first report and asserts at a
        second (``scheduler.py:3565-3581``), so such a request is never delayed as well; its
        stores' sources stay pinned until they report. Never refuses.
        """
        rid = request.request_id
        # Its units on the host, head most recent (HostStore.refresh): the next victims are
        # the tails of the least recent requests, which shortens their prefixes instead of
        # breaking them.
        hashes = self._hashes(request)
        refs = sorted(
            (ref for g in range(self.geometry.num_groups)
             for ref in self.geometry.units_ending_in(g, 0, len(request.token_ids))),
            key=lambda ref: (ref.end, ref.group_idx),
        )  # fmt: skip
        self.store.refresh([self.geometry.key(hashes, ref) for ref in refs])
        self._asked.pop(rid, None)
        record = self._loads.get(rid)
        if record is not None:
            if record.in_flight:
                self._finished.add(rid)
                return False
            del self._loads[rid]
        if not self._stores_of(rid):
            return False
        self._delayed.add(rid)
        self._unsent_delayed.add(rid)
        return True

    # ----------------------------------------------------------------- queries

    def has_transfers(self, request_id: RequestId) -> bool:
        """Whether a load or store job of the request is in flight (or built, not yet sent).

        Pure: any request id may be asked (False when unknown).
        """
        return any(job.request_id == request_id for job, _ in self._jobs.values())

    def busy_blocks(self) -> frozenset[int]:
        """Blocks an in-flight job reads (store) or writes (load): not to be freed or reused.

        Pure: the blocks of every job built and not yet reported, sent or not.
        """
        return frozenset(item.block_id for job, _ in self._jobs.values() for item in job.items)

    def invalid_blocks(self, request_id: RequestId) -> frozenset[int]:
        """The destination blocks of the failed jobs of the request's latest load (may be
        empty). Pre: the request has a load record (``ConfigError`` otherwise)."""
        return self._record(request_id).bad_blocks

    def first_invalid_token(self, request: RequestView) -> int:
        """Where the request's latest load leaves every group valid (shared truncation).

        The largest aligned position at or below the claim end at which every group's needed
        keys (mamba: the state exactly there) were loaded by successful jobs; the claim start
        when none is. Pre: a load record exists (``ConfigError`` otherwise). Frame: nothing.
        """
        record = self._record(request.request_id)
        return resume_point(self.geometry, self._hashes(request), record)

    def failed_keys(self) -> frozenset[bytes]:
        """The keys the failure memory holds now.

        Pure (a fresh frozenset).
        """
        return frozenset(self._failed)

    # ----------------------------------------------------------------- seeding

    def seed(self, request: RequestView, num_tokens: int, groups: Iterable[int] = ()) -> int:
        """Make the host hold READY the units of ``request``'s first ``num_tokens`` tokens.

        For a seeded start: ``groups`` limits the groups stored (empty: all), so a test can
        seed attention KV without the mamba state. Post: the absent keys are READY and
        recorded with the request's salt (a key already present is left as it is, STORING
        included); returns how many were stored. Refusal NO_SPACE: :class:`ConfigError`
        (field ``store_capacity``), nothing changes.
        """
        wanted = sorted(set(groups) or range(self.geometry.num_groups))
        hashes = self._hashes(request)
        keys = [
            self.geometry.key(hashes, ref)
            for g in wanted
            for ref in self.geometry.units_ending_in(g, 0, num_tokens)
        ]
        prepared = self.store.prepare_store(keys)
        if not isinstance(prepared, PrepareStoreOutput):
            raise ConfigError("store_capacity", self.store.capacity, "too small to seed", "raise")
        self.store.complete_store(prepared.keys_to_store, success=True)
        for key in prepared.keys_to_store:
            self._key_salts[key] = request.cache_salt
        return len(prepared.keys_to_store)

    # ----------------------------------------------------------------- copies and views

    def clone(self) -> ReferenceConnector:
        """An independent copy (same class, the store copied too). Values are frozen, so
        copying the containers suffices.

        Frame: nothing changes in ``self``. Post: the copy's :meth:`snapshot` and
        :meth:`freeze` equal ``self``'s, and mutating one never changes the other, except
        through the GPU pool binding, which is shared: bind the copy to the pool's clone
        (:meth:`bind_gpu_block_pool`, as the scheduler's ``clone`` does) before it emits or
        completes a store.
        """
        twin = type(self).__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin.store = self.store.copy()
        twin._jobs = dict(self._jobs)
        twin._store_spans = dict(self._store_spans)
        twin._unsent_loads = list(self._unsent_loads)
        twin._loads = dict(self._loads)
        twin._failed = dict(self._failed)
        twin._key_salts = dict(self._key_salts)
        twin._delayed = set(self._delayed)
        twin._unsent_delayed = set(self._unsent_delayed)
        twin._asked = dict(self._asked)
        twin._finished = set(self._finished)
        return twin

    def snapshot(self) -> dict[str, Any]:
        """The plain dict of the module docstring's schema. Frame: nothing changes."""
        return {
            "kinds": tuple(kind.value for kind in self.geometry.kinds),
            "units": self.geometry.planner.units,
            "align": self.geometry.align,
            "next_job_id": self._next_job,
            "jobs": tuple(_plain_job(job, salt) for _, (job, salt) in sorted(self._jobs.items())),
            "loads": tuple(_plain_load(rid, rec) for rid, rec in sorted(self._loads.items())),
            "failed_keys": tuple(sorted((k.hex(), since) for k, since in self._failed.items())),
            "key_salts": tuple(sorted((k.hex(), s) for k, s in self._key_salts.items())),
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

    def freeze(self) -> Hashable:
        """A hashable key of everything that decides the future (store counters excluded).

        Built from the frozen values the connector keeps (jobs, load records), not from
        :meth:`snapshot`: the explorer calls it for every state it reaches. The asked
        positions are left out: ``build_connector_meta`` clears them at the end of every
        ``schedule()``, so between two events they are always empty. The pool binding is left
        out too. Frame: nothing changes.
        """
        return (
            self._next_job,
            tuple(sorted(self._jobs.items())),
            tuple(sorted(self._store_spans.items())),
            tuple(sorted(self._loads.items())),
            tuple(sorted(self._failed.items())),
            tuple(sorted(self._key_salts.items(), key=lambda kv: kv[0])),
            tuple(sorted(self._delayed)),
            tuple(sorted(self._unsent_delayed)),
            tuple(self._unsent_loads),
            tuple(sorted(self._finished)),
            self.store.freeze(),
        )

    # ----------------------------------------------------------------- overridable steps
    # The mutation tests break the model by overriding exactly one of these.

    def _hashes(self, request: RequestView) -> list[bytes]:
        """The request's block hashes; the salt enters the first one (SEC-1)."""
        return request_block_hashes(
            request.token_ids, self.geometry.planner.hash_block_size, cache_salt=request.cache_salt
        )

    def _load_items(
        self,
        hashes: Sequence[bytes],
        block_ids: BlockTable,
        start: int,
        end: int,
        *,
        loadable: Callable[[bytes], bool],
    ) -> tuple[TransferItem, ...]:
        """The items of a load (:func:`spec.connector.loads.load_items`; MB-1)."""
        return load_items(self.geometry, hashes, block_ids, start, end, loadable=loadable)

    def _store_items(
        self, hashes: Sequence[bytes], block_ids: BlockTable, start: int, end: int
    ) -> tuple[TransferItem, ...]:
        """The items a step stores (:func:`spec.connector.stores.store_items`; MB-2)."""
        return store_items(self.geometry, hashes, block_ids, start, end)

    def _remembered_failures(self) -> Mapping[bytes, int]:
        """The failure memory the claim rule and loads consult."""
        return self._failed

    # ----------------------------------------------------------------- helpers

    def _checked_start(self, num_computed_tokens: int) -> int:
        block = self.geometry.scheduler_block
        value = num_computed_tokens
        if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value % block:
            raise ConfigError(
                "num_computed_tokens", value, f"not a multiple of {block} >= 0", "align it"
            )
        return value

    def _loadable(self, key: bytes) -> bool:
        """READY in the host and not remembered as failed."""
        failed = self._remembered_failures()
        return key not in failed and self.store.status(key) is LookupResult.HIT

    def _store_job(
        self,
        request: RequestView,
        block_ids: BlockTable,
        start: int,
        end: int,
        *,
        limit: int | None = None,
    ) -> TransferJob | None:
        hashes = self._hashes(request)
        taken: list[TransferItem] = []
        prompt = request.num_prompt_tokens
        found = self._store_items(hashes, block_ids, start, end)
        if limit is not None:  # ScheduledRequest.store_limit: the step's range stays as is
            found = tuple(item for item in found if item.end_token <= limit)
        for part in items_by_end(found):
            # Admission (spec.connector.stores.stored_low): NORMAL units of the part are
            # offered first, then its LOW ones. Refused NORMAL units or refused continuation
            # units would leave a hole in the stored prefix: the job stops there. Refused far
            # sliding units leave none (no claim reads them), so the next end is offered.
            by_class = (
                (
                    [i for i in part if not stored_low(self.geometry, i, prompt)],
                    StorePriority.NORMAL,
                ),
                ([i for i in part if stored_low(self.geometry, i, prompt)], StorePriority.LOW),
            )
            kept: set[bytes] = set()
            hole = False
            for items, priority in by_class:
                if not items:
                    continue
                # A mamba state serves only a claim ending at its unit, which loads the unit's
                # attention chunks too: bound to them when the call holds any.
                kinds = self.geometry.kinds
                mamba = [i.key for i in items if kinds[i.group_idx] is GroupKind.MAMBA]
                bound = mamba if len(mamba) < len(items) else []
                prepared = self.store.prepare_store([item.key for item in items], priority, bound)
                if isinstance(prepared, PrepareStoreOutput):
                    kept.update(prepared.keys_to_store)
                    continue
                hole = priority is StorePriority.NORMAL or items[0].end_token > prompt
                break
            taken.extend(item for item in part if item.key in kept)
            if hole:
                break
        if not taken:
            return None
        for item in taken:
            self._key_salts.setdefault(item.key, request.cache_salt)
        job = TransferJob(self._new_job_id(), TransferKind.STORE, request.request_id, tuple(taken))
        self._jobs[job.job_id] = (job, request.cache_salt)
        self._store_spans[job.job_id] = (start, end)
        if self._pool is not None:
            self._pool.touch(BlockId(item.block_id) for item in job.items)
        return job

    def _load_reported(self, job: TransferJob, keys: tuple[bytes, ...], success: bool) -> None:
        self.store.complete_load(keys)
        if not success:
            for key in keys:
                self._failed.setdefault(key, self._next_job)
        # Drop the failed entries no other load still pins (module docstring).
        self.store.evict([key for key in keys if key in self._failed])
        rid = job.request_id
        record = self._loads.get(rid)
        if record is not None and job.job_id in record.jobs:
            record = record.with_result(job.job_id, job.items, success=success)
            self._loads[rid] = record
            if rid in self._finished and not record.in_flight:
                del self._loads[rid]  # its request finished while it ran: nothing reads it now
                self._finished.discard(rid)

    def _forget_absent_keys(self) -> None:
        for table in (self._failed, self._key_salts):
            for key in [k for k in table if self.store.status(k) is LookupResult.MISS]:
                del table[key]

    def _store_sources(self) -> list[int]:
        return [
            item.block_id
            for _, (job, _) in sorted(self._jobs.items())
            if job.kind is TransferKind.STORE
            for item in job.items
        ]

    def _stores_of(self, request_id: RequestId) -> int:
        return sum(
            1
            for job, _ in self._jobs.values()
            if job.request_id == request_id and job.kind is TransferKind.STORE
        )

    def _record(self, request_id: RequestId) -> LoadRecord:
        record = self._loads.get(request_id)
        if record is None:
            raise ConfigError("request_id", request_id, "has no load recorded", "ask after a load")
        return record

    def _new_job_id(self) -> JobId:
        job_id = JobId(self._next_job)
        self._next_job += 1
        return job_id


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
