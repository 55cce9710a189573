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
- ``chunk_members`` and the promotions and resets of :mod:`hybridkv.connector.outside` (the
  remote tier's entry, vLLM's ``reset_prefix_cache``): beyond the reference, and called only
  when a remote tier is configured or a reset asked, so without them the core is exactly the
  reference's twin.

What makes it cheap (the reference re-hashes every request and rescans every job each call):
hashes grow incrementally per request and each offload key is built once
(:mod:`hybridkv.connector.requests`); the claim search is
linear in the units it inspects (:mod:`hybridkv.connector.claims`) and its answer is remembered
per waiting request until a key it read changes status or the failure memory changes; per-request
counters replace scans over the jobs in flight; the failure memory and salt record forget keys
through the departures the core itself causes (:mod:`hybridkv.connector.memory`) instead of
rescanning every remembered key each step.

The core owns its store: keys enter and leave it through the core (``seed`` included).
:mod:`hybridkv.connector.counts` holds its counters' value and :class:`LoadMode`,
:mod:`hybridkv.connector.snapshot` its plain snapshot. Mixins hold the parts that read apart
(each declares the attributes this class owns): :mod:`hybridkv.connector.queries` (read-only
queries), :mod:`hybridkv.connector.outside` (promotions, seeds, resets),
:mod:`hybridkv.connector.store_jobs` (a step's store job of one request) and
:mod:`hybridkv.connector.reports` (folding job results); :mod:`hybridkv.connector.memo` is the
claim memo's value.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hybridkv.connector.api import (
    BlockTable,
    Claim,
    ClaimKind,
    ConnectorMeta,
    GpuBlockPool,
    JobId,
    RequestId,
    RequestView,
    StepView,
    TransferJob,
    TransferKind,
)
from hybridkv.connector.checkpoints import CheckpointRule
from hybridkv.connector.claims import decide_claim
from hybridkv.connector.counts import COUNTED, ConnectorStats, LoadMode
from hybridkv.connector.geometry import ConnectorGeometry
from hybridkv.connector.loads import (
    LoadRecord,
    claimed_keys,
    load_items,
    resume_point,
    segments,
)
from hybridkv.connector.memo import ClaimMemo, MemoKey
from hybridkv.connector.memory import KeyMemory
from hybridkv.connector.outside import OutsideWork
from hybridkv.connector.queries import CoreQueries
from hybridkv.connector.reports import JobReports
from hybridkv.connector.requests import RequestKeys
from hybridkv.connector.store_jobs import StoreJobs
from hybridkv.errors import HybridKVConfigError
from hybridkv.kinds import GroupKind
from hybridkv.planner import HybridOffloadPlanner
from hybridkv.store import (
    EntryState,
    HostStore,
    PrepareLoadOutput,
)

__all__ = ["ConnectorCore", "ConnectorStats", "LoadMode"]

_LOAD, _STORE = TransferKind.LOAD, TransferKind.STORE

# Values, so one of each serves every lookup (a Claim checks its fields when built).
_DEFER, _NONE = Claim(ClaimKind.DEFER), Claim(ClaimKind.NONE)
_NO_IDS: frozenset[RequestId] = frozenset()
_NO_JOBS = ConnectorMeta((), (), _NO_IDS)  # a step with no job and no delayed free
_READY = EntryState.READY


class ConnectorCore(CoreQueries, OutsideWork, StoreJobs, JobReports):
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
        eagle_groups: Iterable[int] = (),
    ) -> None:
        """A core over ``store`` for the planner's geometry (the reference's constructor).

        Pre: ``group_kinds`` equal the planner's; ``hash_block_size`` and ``chunk_size`` equal
        the planner's; ``sliding_windows`` empty or each group's window reach
        (``sliding_window - 1 + extra_retained_tokens``, 0 for other kinds); ``checkpoints``
        empty or one :class:`~hybridkv.connector.checkpoints.CheckpointRule` per group (where a
        step leaves mamba states; empty: no group exports a prefill checkpoint); ``eagle_groups``
        the groups vLLM drops EAGLE's block from (their claims need a proof unit,
        :class:`~hybridkv.connector.geometry.ConnectorGeometry`, as the reference's
        ``eagle_groups``); ``store`` an empty
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
            planner,
            tuple(group_kinds),
            tuple(sliding_windows),
            tuple(checkpoints),
            tuple(eagle_groups),
        )
        self.store = store
        self.load_mode = load_mode
        self._next_job = 1
        self._jobs: dict[JobId, tuple[TransferJob, str | None]] = {}
        self._unsent_loads: list[JobId] = []
        self._loads: dict[RequestId, LoadRecord] = {}
        self._memory = KeyMemory(store)
        self._claim_memo: dict[RequestId, ClaimMemo] = {}  # per waiting request (_decide)
        # Claims are values: one per size and load mode serves every request.
        self._claims: dict[tuple[LoadMode, int], Claim] = {}
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
        self._count = dict.fromkeys(COUNTED, 0)
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

    # ----------------------------------------------------------------- claims

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> Claim:
        """The claim beyond ``num_computed_tokens`` (a multiple of the scheduler block >= 0,
        field ``num_computed_tokens``).

        Post: DEFER while the request has a load in flight or a STORING key could lengthen the
        claim; else NONE or a claim of ``end - start`` tokens, SYNC or ASYNC by ``load_mode``,
        whose keys are then the host's most recent (:meth:`_refresh_claim`). Frame: only the
        asked position (and the request's hash chain) is recorded, and the host's recency
        moves for a claim.
        """
        start = num_computed_tokens
        if type(start) is not int or start < 0 or start % self.geometry.scheduler_block:
            start = self._checked_start(start)  # refused, or an int subclass taken as it is
        rid = request.request_id
        self._asked[rid] = start
        count = self._count
        count["lookups"] += 1
        record = self._loads.get(rid)
        if record is not None and record.in_flight:
            count["deferred"] += 1
            return _DEFER
        if rid in self._restarting:
            return _NONE  # salvage off (``_set_salvage``)
        # The memo (_decide), its cheapest check here: a waiting request is asked every step.
        # The load mode is a public attribute a test may switch: it picks the claim's kind.
        memo_key = (
            start,
            len(request.token_ids),
            request.cache_salt,
            self._memory.epoch,
            self.load_mode,
        )
        memo = self._claim_memo.get(rid)
        if memo is not None and memo.key == memo_key and memo.counts == self.store.status_counts():
            claim = memo.claim
        else:
            claim = self._decide(request, memo_key, memo)
        if claim.num_tokens:
            count["claims"] += 1
            count["claimed_tokens"] += claim.num_tokens
            self._refresh_claim(request, start, start + claim.num_tokens)
        elif claim is _DEFER:
            count["deferred"] += 1
        return claim

    def _refresh_claim(self, request: RequestView, start: int, end: int) -> None:
        """The keys a load of the claim ``[start, end)`` would read, refreshed head most
        recent (``HostStore.refresh``: recency only, as a finished request's chunks).

        vLLM asks a waiting request's claim each time its waiting loop reaches it, and the
        request may then wait many steps (the step's token budget, free blocks, the load
        admission rule) before its load pins those keys. Meanwhile the running requests'
        stores evict by recency, and a conversation whose last turn ended a while ago is the
        least recent: left as it was, its claim was evicted just before it was loaded, and
        recomputed and stored again. Refreshed at each answer, the chunks a request is about
        to read are as recent as the announcement. Measured with
        ``tools/host_pressure_seeds.py`` over 11 chat and 10 traffic seeds of the bench's
        sliding + full traces at half the working set, both engine loops and both policies
        (docs/benchmarks/vs-native.md). The list is kept with the claim's memo, so a request
        asked again with the same answer costs one walk of its keys in the policy: about
        0.7 ms for a 128k-token claim in 16-token units (LRU; the memo alone answers in
        1 us), for each step such a request waits at the head of vLLM's queue."""
        memo = self._claim_memo.get(request.request_id)
        claimed = memo.claimed if memo is not None else None
        if claimed is None:
            claimed = claimed_keys(self.geometry, self._keys(request), start, end)
            if memo is not None:
                memo.claimed = claimed
        self.store.refresh(claimed)

    def answers_by_rule(self, request_id: RequestId) -> bool:
        """Whether a decided answer (a claim or NONE) for the request comes from the claim rule:
        False only while salvage is off and the request restarts after a failed load (answered
        NONE without a search, ``_set_salvage``). Frame: nothing changes."""
        return request_id not in self._restarting

    def update_state_after_alloc(
        self, request: RequestView, block_ids: BlockTable, num_external_tokens: int
    ) -> None:
        """vLLM accepted ``num_external_tokens`` of the claim: pin their keys in the host and
        build the load jobs the next metadata carries.

        Nothing happens for 0. Otherwise the request must have been asked in this
        ``schedule()`` (field ``num_external_tokens``) and have no load in flight (field
        ``request``); a refusal changes nothing. Post: one load job per alignment segment,
        into the real blocks of ``block_ids``; the keys pinned and touched.
        """
        if not num_external_tokens:
            return  # nothing accepted: no load, nothing recorded
        rid = request.request_id
        if rid not in self._asked:
            raise HybridKVConfigError(
                "num_external_tokens", num_external_tokens, "no claim was asked", "ask first"
            )
        record = self._loads.get(rid)
        if record is not None and record.in_flight:
            raise HybridKVConfigError(
                "request", rid, "has a load in flight", "wait for finished_recving"
            )
        start = self._asked[rid]
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
        parts = segments(items, self.geometry.align)
        # Ids count up in segment order (_new_job_id's numbering), taken at once: a load of a
        # long prefix has one job per segment, so per-job calls were much of its cost.
        first = self._next_job
        self._next_job = first + len(parts)
        jobs = tuple(map(JobId, range(first, self._next_job)))
        if parts:
            table, salt = self._jobs, request.cache_salt
            for job_id, part in zip(jobs, parts, strict=True):
                table[job_id] = (TransferJob(job_id, _LOAD, rid, part, sync), salt)
            self._jobs_of[rid] = self._jobs_of.get(rid, 0) + len(parts)
            self._unsent_loads.extend(jobs)
        self._loads[rid] = LoadRecord(
            start=start,
            end=end,
            num_tokens=len(request.token_ids),
            sync=sync,
            cache_salt=request.cache_salt,
            items=items,
            jobs=jobs,
        )
        count = self._count
        count["loaded_tokens"] += num_external_tokens
        count["load_jobs"] += len(jobs)
        count["load_items"] += len(items)

    # ----------------------------------------------------------------- each step

    def build_connector_meta(self, step: StepView) -> ConnectorMeta:
        """The metadata of ``step``: the load jobs built since the last call, this step's
        store jobs and the delayed frees not yet announced.

        Pre: no request of ``step.no_unit_ids`` completes a unit in this step (each counts as
        scheduled, storing nothing). Post: for each scheduled request, the units this step
        completes are reserved in the host, head first and end by end, up to the first
        refusal, as one store job; keys the host no longer holds leave the failure memory and
        the salt record; no asked position is kept.
        """
        stores = []
        for scheduled in step.scheduled:
            self._restarting.discard(scheduled.request.request_id)
            start = scheduled.num_computed_tokens
            job = self._store_job(
                scheduled.request,
                scheduled.block_ids,
                start,
                start + scheduled.num_scheduled_tokens,
                scheduled.store_limit,
            )
            if job is not None:
                stores.append(job)
        if self._restarting and step.no_unit_ids:  # scheduled too: no longer restarting
            self._restarting.difference_update(step.no_unit_ids)
        return self._step_meta(stores)

    def build_unit_free_meta(self, scheduled_ids: Iterable[RequestId]) -> ConnectorMeta:
        """:meth:`build_connector_meta` of a step in which no scheduled request completes a
        unit, ``scheduled_ids`` naming every request it schedules: the same metadata and the
        same changes as ``build_connector_meta(StepView(0, (), no_unit_ids=...))`` with those
        ids, without a view of the step (most decode steps store nothing).

        Pre: as :meth:`build_connector_meta`'s for ``no_unit_ids``."""
        if self._restarting:  # scheduled: no longer restarting
            self._restarting.difference_update(scheduled_ids)
        return self._step_meta(())

    def _step_meta(self, stores: Sequence[TransferJob]) -> ConnectorMeta:
        """The end of every metadata, once its store jobs are built: the loads built since the
        last one and the delayed frees not yet announced are taken, departed keys pruned from
        the memory, asked positions forgotten."""
        if self._unsent_loads:
            jobs = self._jobs
            loads = tuple([jobs[job_id][0] for job_id in self._unsent_loads])
            self._unsent_loads = []
        else:
            loads = ()
        if self._unsent_delayed:
            delayed = frozenset(self._unsent_delayed)
            self._unsent_delayed = set()
        else:
            delayed = _NO_IDS
        self._memory.prune(self.store)
        self._asked.clear()
        if not (loads or stores or delayed):
            return _NO_JOBS  # most decode steps: one shared value (frozen, so never changed)
        return ConnectorMeta(loads, tuple(stores), delayed)

    def request_finished_all_groups(self, request: RequestView, block_ids: BlockTable) -> bool:
        """True (delay the free until ``finished_sending``) iff a store of it is in flight and
        no load of it is.

        A request finished while its load is in flight is already held by the scheduler until
        that load reports (vLLM: ``finish_requests`` delays its free to ``finished_recving``),
        so it is never delayed here too: vLLM frees and deletes the request at the first of the
        two reports and fails an assert at the second (``scheduler.py:3565-3581``). Its stores
        still read their sources safely: those stay pinned until each store reports.

        Post: the request's hash chain, asked position and (unless in flight) load record are
        forgotten; a delayed request is announced to the worker in the next metadata. Only the
        request's id is read, neither its tokens nor ``block_ids`` (vLLM frees the blocks).
        """
        rid = request.request_id
        self._refresh_finished(request)
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

    def _refresh_finished(self, request: RequestView) -> None:
        """A finished request's chunks on the host, every group's, refreshed with its head the
        most recent (``HostStore.refresh``: recency only). Stores and loads leave a request's
        tail the most recent, so the next victims were its head, and a prefix that lost its
        head serves no claim at all; after the refresh the victims are the tails of the least
        recent requests, which only shortens their claims (vLLM's native LRU commits a
        finished request's keys the same way). Measured over 16 trace seeds of the bench's
        sliding + full chats and traffic at half the working set (docs/benchmarks/vs-native.md)."""
        chain = self._keys(request)
        end = min(len(request.token_ids), chain.hashed_tokens)
        units = self.geometry.units
        ranked = sorted(
            ((j + 1) * unit, g) for g, unit in enumerate(units) for j in range(end // unit)
        )
        self.store.refresh([chain.key(g, end_token // units[g] - 1) for end_token, g in ranked])

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

    # ----------------------------------------------------------------- helpers

    def _keys(self, request: RequestView) -> RequestKeys:
        """The request's hash chain, grown to its current tokens (SEC-1: salted)."""
        keys = self._requests.get(request.request_id)
        if keys is None or not keys.matches(request):
            keys = RequestKeys.for_view(self.geometry, request)
            self._requests[request.request_id] = keys
        self._count["hashes_computed"] += keys.sync(request)
        return keys

    def _decide(self, request: RequestView, memo_key: MemoKey, memo: ClaimMemo | None) -> Claim:
        """The claim rule's answer at ``memo_key``'s start, remembered per request (``memo``,
        the last one, which the caller found stale or keyed otherwise): a scheduler asks a
        waiting request again every step, and the answer changes only with its tokens, its
        start, the failure memory or the status of a key the search read.

        The search (:func:`~hybridkv.connector.claims.decide_claim`) is deterministic: which
        key it reads next depends only on what it read before, so while every key it read has
        its status, the same search reads the same keys and gives the same answer. The memo
        keeps those keys and their statuses and compares them again (one C-level pass,
        :meth:`HostStore.entry_states`) instead of searching; it used to be dropped whenever any
        key of the store changed status, which on a busy host is every step. Before that pass,
        the caller compares the store's status counters (:meth:`HostStore.status_counts`, moved
        by every status change of any key) with those of the memo's last check: unchanged, no
        key can have moved, and nothing is read."""
        store = self.store
        if (
            memo is not None
            and memo.key == memo_key
            and store.entry_states(memo.read) == memo.states
        ):
            memo.counts = store.status_counts()
            return memo.claim
        start = memo_key[0]
        read: list[bytes] = []
        end, defer = decide_claim(
            self.geometry,
            self._keys(request).key,
            len(request.token_ids),
            start,
            status=store.status,
            failed=self._memory.failed,
            read=read,
        )
        claim = _DEFER if defer else _NONE if end == start else self._claim(end - start)
        self._claim_memo[request.request_id] = ClaimMemo(
            memo_key, claim, read, store.entry_states(read), store.status_counts()
        )
        return claim

    def _claim(self, num_tokens: int) -> Claim:
        """The claim of ``num_tokens`` > 0 tokens, SYNC or ASYNC by ``load_mode``."""
        mode = self.load_mode
        claim = self._claims.get((mode, num_tokens))
        if claim is None:
            kind = ClaimKind.ASYNC if mode is LoadMode.ASYNC else ClaimKind.SYNC
            claim = self._claims[mode, num_tokens] = Claim(kind, num_tokens)
        return claim

    def _loadable(self, keys: list[bytes]) -> list[bool]:
        """Per key of ``keys``, whether a load may read it: READY in the host, and no failed
        load of it is remembered (the states in one C-level pass)."""
        states = self.store.entry_states(keys)
        failed = self._memory.failed
        if failed:
            return [
                state is _READY and key not in failed
                for key, state in zip(keys, states, strict=True)
            ]
        return [state is _READY for state in states]

    def _checked_start(self, value: int) -> int:
        """``num_computed_tokens`` as asked: an int >= 0 on the scheduler block's grid."""
        block = self.geometry.scheduler_block
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and value >= 0
            and not value % block
        ):
            return value
        raise HybridKVConfigError(
            "num_computed_tokens", value, f"not a multiple of {block} >= 0", "align it"
        )


_FIX = "build it with hybridkv (planner, store) for this layout"
