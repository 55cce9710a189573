"""``HybridKVConnector``'s metrics through vLLM 0.33's own pipeline, and its KV cache events.

The path a counter takes (``scheduler.py:2588-2603``, ``kv_connector/utils.py:143-153``,
``v1/metrics/loggers.py``):

1. each worker's ``get_kv_connector_stats`` returns the worker-side counters moved since its
   last call (:class:`HybridKVStats`); vLLM's ``KVOutputAggregator`` sums the ranks' objects
   with :meth:`HybridKVStats.aggregate`;
2. the scheduler's ``update_from_output`` aggregates its own connector's
   ``get_kv_connector_stats`` (the scheduler-side counters) into that, and ``make_stats`` ships
   ``to_dict()`` to the front-end;
3. the front-end rebuilds the object with ``build_kv_connector_stats`` (the log line, summed
   over the logging interval) and hands the dict to :class:`HybridKVPromMetrics` (one Prometheus
   counter per name, ``vllm:hybridkv_<name>_total``).

So every name below is produced on exactly one side (:data:`SCHEDULER_COUNTERS`,
:data:`WORKER_COUNTERS`), and each payload holds increments, never totals: summing is the only
merge, and a counter read twice never counts twice. Every value is a non-negative number
(:func:`counters_non_negative`), because each increment is a difference of monotone counts.

Worker-side counters are per rank: with tensor parallelism bytes and seconds are the sum over
ranks (each rank moves its own shard), while job counts come from the scheduler, counted once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.metrics.utils import create_metric_per_engine

from hybridkv.connector import ConnectorCore, JobResult, RequestView, TransferJob, TransferKind
from hybridkv.connector.claims import decide_claim, some_group_passes
from hybridkv.connector.counts import COUNTED
from hybridkv.store import EventKind, LookupResult, StoreEvent
from hybridkv.vllm.events import BlockPayloads
from hybridkv.vllm.reclaim import ReclaimGuard

_HIT, _MISS = LookupResult.HIT, LookupResult.MISS

__all__ = [
    "ALL_COUNTERS",
    "COUNTERS",
    "REMOTE_COUNTERS",
    "SCHEDULER_COUNTERS",
    "WORKER_COUNTERS",
    "GroupAgreement",
    "HybridKVPromMetrics",
    "HybridKVStats",
    "TransferMeter",
    "counters_non_negative",
    "scheduler_counter_values",
    "scheduler_counters",
    "scheduler_mark",
    "store_events_to_vllm",
]

SCHEDULER_COUNTERS: dict[str, str] = {
    "lookups": "get_num_new_matched_tokens calls (a waiting request is asked every step)",
    "lookups_deferred": "lookups answered None: a load of the request in flight, a key "
    "that could lengthen the claim still being stored, or another request loading the same "
    "prefix or no room in the pool for the loads waiting to run (hybridkv.vllm.admission)",
    "claims": "lookups answered with a positive claim",
    "claimed_tokens": "tokens offered by those claims (a claim vLLM could not allocate for is "
    "offered again next step and counted again)",
    "hit_tokens": "tokens vLLM accepted from the host tier (num_external_tokens of "
    "update_state_after_alloc); vLLM's external prefix-cache hits",
    "load_jobs": "load jobs built (one per alignment segment of an accepted claim)",
    "load_jobs_failed": "load jobs reported failed (the request is recomputed or fails, per "
    "kv_load_failure_policy)",
    "store_jobs": "store jobs built",
    "store_jobs_failed": "store jobs reported failed (their host entries are dropped)",
    "stores_refused": "store attempts refused for lack of host space (nothing evictable)",
    "delayed_frees": "finished requests whose block free was delayed while a store read them",
    "deadlines_fired": "load jobs abandoned at the load deadline (load_deadline_steps); their "
    "requests are recomputed (0 without a deadline)",
    "restarts_deferred": "lookups of a request restarted by a failed load answered None because "
    "vLLM refused to re-admit it in a step that ran nothing (hybridkv.vllm.reclaim)",
    "restarts_whole": "restarted requests then answered a claim of 0 (whole-request recompute) "
    "to avoid vLLM 0.33's re-admission wedge",
    "group_prefix_disagreements": "decided lookups where the KV cache groups' own longest "
    "loadable prefixes differ (the claim takes the common one); once per request and position",
}
WORKER_COUNTERS: dict[str, str] = {
    "loads_done": "load jobs this worker reported successful",
    "load_blocks": "blocks those loads moved (one block of one group each)",
    "load_bytes": "bytes those loads moved into GPU blocks",
    "load_seconds": "seconds from a load's submission to the step that reported it, summed "
    "over load jobs reported successful",
    "stores_done": "store jobs this worker reported successful",
    "store_blocks": "blocks those stores moved",
    "store_bytes": "bytes those stores moved into host memory",
    "store_seconds": "seconds from a store's submission (wait_for_save) to the step that "
    "reported it, summed over store jobs reported successful",
    "transfer_failures": "load and store jobs this worker reported failed",
    "jobs_abandoned": "late load jobs this worker stopped at the load deadline (cancelled if "
    "queued, waited for if running) before reporting them failed",
}
REMOTE_COUNTERS: dict[str, str] = {
    "remote_lookups": "remote lookups asked (scheduler side; those waiting together share one "
    "pipelined EXISTS round trip)",
    "remote_lookup_faults": "of those, the ones a failed or timed-out round trip answered "
    "(0 present)",
    "remote_chunks_found": "leading chunks those lookups found on the server",
    "promotions_started": "chunks reserved in the host tier for a fetch from the remote tier",
    "promotions_refused": "present chunks not promoted because the host tier had no room",
    "promoted": "promotions resolved PROMOTED (verified bytes in the host slots, READY)",
    "missing": "promotions resolved MISSING (the chunk vanished between lookup and fetch)",
    "fault": "promotions resolved FAULT (connection reset, server gone): recomputed",
    "timeout": "promotions resolved TIMEOUT (past remote_timeout_ms, or never reported)",
    "corrupt": "promotions resolved CORRUPT (verification failed; nothing loaded)",
    "promotion_deadlines": "promotions the scheduler resolved TIMEOUT for lack of a report",
    "late_reports": "fetch reports of promotions already resolved TIMEOUT (ignored)",
    "writes_ordered": "chunks the scheduler ordered written behind (all members READY)",
    "remote_lookups_waited": "lookups of the host tier answered None because the request's "
    "remote lookup was not answered yet (at most remote_lookup_wait_ms per request in all)",
    "remote_lookups_late": "remote lookups not answered within that wait: the request went on "
    "without the remote hit (a late answer still serves it if it is still waiting)",
    "remote_lookups_refused": "remote lookups not asked because the lookup queue was full",
    "remote_lookup_breaker_trips": "times the scheduler side's circuit breaker opened after a "
    "run of failures (trips - closes is 1 while the tier is skipped or probed)",
    "remote_lookup_breaker_closes": "times a probe closed the scheduler side's breaker",
    "remote_lookup_breaker_probes": "lookups let through to probe the server after a backoff",
    "remote_lookup_breaker_skips": "lookups answered no hit at once, the breaker open",
    "remote_writes_enqueued": "chunks copied from host slots and queued for one SET (worker)",
    "remote_writes_dropped": "write-behinds dropped because remote_max_pending_writes were "
    "queued (never waited for)",
    "remote_written": "queued chunks the server acknowledged",
    "remote_writes_failed": "queued chunks whose SET failed or timed out (or was skipped by "
    "the breaker once queued)",
    "remote_writes_skipped": "write orders dropped, not copied, while the worker's breaker "
    "was open",
    "remote_fetches": "fetch orders of promoted chunks resolved (worker)",
    "remote_fetches_late": "of those, the ones whose result came past remote_timeout_ms: "
    "TIMEOUT, nothing loaded",
    "remote_breaker_trips": "times the worker side's circuit breaker opened after a run of "
    "failures (trips - closes is 1 while the tier is skipped or probed)",
    "remote_breaker_closes": "times a probe closed the worker side's breaker",
    "remote_breaker_probes": "fetches or writes let through to probe the server after a backoff",
    "remote_breaker_skips": "fetches (resolved FAULT) and writes (dropped) that did not ask the "
    "server, the breaker open",
    "remote_fetched_bytes": "bytes written into host slots by verified fetches",
    "remote_written_bytes": "bytes of host slots copied into queued writes",
    "remote_fetches_unauthenticated": "fetched values refused because they carry no valid MAC "
    "under this engine's fleet key (remote_secret_*): planted, tampered, or written by an "
    "engine with another secret or none; counted under corrupt too, the first logged",
}
"""The remote tier's counters (hybridkv.vllm.remote; present only with ``remote_url``)."""
COUNTERS: dict[str, str] = {**SCHEDULER_COUNTERS, **WORKER_COUNTERS}
"""Every counter name of the host tier and what it counts (docs/howto/serve.md lists the same)."""
ALL_COUNTERS: dict[str, str] = {**COUNTERS, **REMOTE_COUNTERS}
"""With the remote tier's (docs/howto/share-prefix-cache.md lists those)."""
"""Every counter name and what it counts (docs/howto/serve.md lists the same)."""


def counters_non_negative(data: Mapping[str, Any]) -> bool:
    """Every value of a stats payload is a number >= 0 (a bool is not a number)."""
    return all(
        isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in data.values()
    )


@dataclass
class HybridKVStats(KVConnectorStats):
    """Counter increments (``data``: name -> number >= 0), summed over the workers, then the
    scheduler, then the logging interval. Names: :data:`COUNTERS`."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: self.data[name] for name in ALL_COUNTERS if name in self.data}

    def is_empty(self) -> bool:
        return not any(self.data.values())


# A scheduler-side mark (:func:`scheduler_mark`): the core's counts in ``COUNTED`` order, then
# the facade's own eight, at these positions.
_CORE = {name: i for i, name in enumerate(COUNTED)}
_FACADE = range(len(COUNTED), len(COUNTED) + 8)
_OVERRIDDEN, _DEFERRED, _WHOLE, _DISAGREED, _FIRED, _ANSWERED, _ADMIT_DEFERRED, _ADMIT_TOKENS = (
    _FACADE
)
# Each counter of SCHEDULER_COUNTERS, in order, as one position of the mark; ``lookups`` and
# ``lookups_deferred`` also add facade positions, ``claims`` and ``claimed_tokens`` take the
# load admission rule's deferrals off (scheduler_counter_values).
_PICK = itemgetter(
    _CORE["lookups"],
    _CORE["deferred"],
    _CORE["claims"],
    _CORE["claimed_tokens"],
    _CORE["loaded_tokens"],
    _CORE["load_jobs"],
    _CORE["load_jobs_failed"],
    _CORE["store_jobs"],
    _CORE["store_jobs_failed"],
    _CORE["stores_refused"],
    _CORE["delayed_frees"],
    _FIRED,
    _DEFERRED,
    _WHOLE,
    _DISAGREED,
)


def scheduler_mark(
    core: ConnectorCore,
    disagreements: int,
    guard: ReclaimGuard | None = None,
    *,
    deadlines_fired: int = 0,
    deadline_answers: int = 0,
    admission: tuple[int, int] = (0, 0),
) -> tuple[int, ...]:
    """Every count the scheduler side's counters are computed from, as one flat tuple: the
    core's :meth:`~hybridkv.connector.ConnectorCore.counts`, then ``guard``'s overridden,
    deferred and whole answers, ``disagreements``, ``deadlines_fired``, ``deadline_answers``
    and ``admission``: the DEFER answers the load admission rule gave in front of the core's
    async claims and those claims' tokens (hybridkv.vllm.admission). Equal marks give equal
    counters; O(1), one C call for the core's."""
    overridden, deferred, whole = (
        (guard.overridden, guard.deferred, guard.whole) if guard is not None else (0, 0, 0)
    )
    return (
        *core.counts(),
        overridden,
        deferred,
        whole,
        disagreements,
        deadlines_fired,
        deadline_answers,
        *admission,
    )


def scheduler_counter_values(mark: tuple[int, ...]) -> tuple[int, ...]:
    """The values of :data:`SCHEDULER_COUNTERS`, in order, of a :func:`scheduler_mark`.

    Each value is a sum of positions of the mark, so the function is linear: applied to the
    difference of two marks (position by position) it gives the difference of their counters,
    which is how the stats hook builds its increments without building either side's dict."""
    values = _PICK(mark)
    # A lookup the admission rule deferred was counted by the core as a claim of its tokens;
    # vLLM was answered None: a deferred lookup, no claim.
    admitted_away = mark[_ADMIT_DEFERRED]
    return (
        values[0] + mark[_OVERRIDDEN] + mark[_ANSWERED],
        values[1] + mark[_DEFERRED] + admitted_away,
        values[2] - admitted_away,
        values[3] - mark[_ADMIT_TOKENS],
        *values[4:],
    )


def scheduler_counters(
    core: ConnectorCore,
    disagreements: int,
    guard: ReclaimGuard | None = None,
    *,
    deadlines_fired: int = 0,
    deadline_answers: int = 0,
    admission: tuple[int, int] = (0, 0),
) -> dict[str, int]:
    """The scheduler side's counts since creation (monotone; increments are differences).
    ``guard``'s answers replace the core's for restarted requests, and ``deadline_answers``
    (claims of 0 for requests whose load missed its deadline) for abandoned ones: both count as
    lookups the core never saw."""
    mark = scheduler_mark(
        core,
        disagreements,
        guard,
        deadlines_fired=deadlines_fired,
        deadline_answers=deadline_answers,
        admission=admission,
    )
    return dict(zip(SCHEDULER_COUNTERS, scheduler_counter_values(mark), strict=True))


class TransferMeter:
    """The worker side's counts since creation: each job is timed from its submission (loads:
    ``start_load_kv``; stores: ``wait_for_save``, after the forward) to the
    ``get_transfer_results`` that reported it, so a time is at most one step late."""

    def __init__(self, group_bytes: Iterable[int]) -> None:
        self._group_bytes = tuple(group_bytes)
        self._jobs: dict[int, tuple[TransferKind, int, int]] = {}  # id -> (kind, blocks, bytes)
        self._started: dict[int, float] = {}
        self._unstarted: list[int] = []  # stores bound, submitted at wait_for_save
        self.counts: dict[str, int | float] = dict.fromkeys(WORKER_COUNTERS, 0)

    def bound(self, jobs: Iterable[TransferJob]) -> None:
        """This step's jobs reached the worker; the loads are submitted now, and so are stores
        of an earlier step whose ``wait_for_save`` never came (the worker submits them at the
        bind)."""
        self.saving()
        now = time.perf_counter()
        for job in jobs:
            size = sum(self._group_bytes[item.group_idx] for item in job.items)
            self._jobs[job.job_id] = (job.kind, len(job.items), size)
            if job.kind is TransferKind.LOAD:
                self._started[job.job_id] = now
            else:
                self._unstarted.append(job.job_id)

    def saving(self) -> None:
        """``wait_for_save``: the stores bound this step are submitted now."""
        now = time.perf_counter()
        for job_id in self._unstarted:
            self._started[job_id] = now
        self._unstarted = []

    def reported(self, results: Iterable[JobResult]) -> None:
        """Fold the jobs this ``get_transfer_results`` reported."""
        now = time.perf_counter()
        counts = self.counts
        for result in results:
            bound = self._jobs.pop(result.job_id, None)
            started = self._started.pop(result.job_id, now)
            if bound is None:  # never seen bound: counting it must not fail the step
                continue
            kind, blocks, size = bound
            if not result.success:
                counts["transfer_failures"] += 1
                continue
            side = "load" if kind is TransferKind.LOAD else "store"
            counts[f"{side}s_done"] += 1
            counts[f"{side}_blocks"] += blocks
            counts[f"{side}_bytes"] += size
            counts[f"{side}_seconds"] += now - started


class GroupAgreement:
    """Counts lookups where the groups' own longest loadable prefixes differ.

    A group's own prefix is the claim rule (:func:`hybridkv.connector.claims.decide_claim`)
    applied with every other group's keys taken as READY and this group's STORING keys as
    absent: how far this group alone could serve (:meth:`group_ends`). vLLM reconciles the
    groups' GPU hits to the common boundary silently (``kv_cache_coordinator.py``); this counter
    makes the offload tier's version visible. Counted once per request and asked position (a
    request waiting for blocks is asked again each step with the same answer).

    When the rule gave the answer, every group alone reaches its end and no end past it is
    reached by all, so the prefixes differ exactly when one group alone passes it
    (:func:`~hybridkv.connector.claims.some_group_passes`, which reads only past the answer);
    only an answer the rule did not give is checked group by group.
    """

    def __init__(self) -> None:
        self.count = 0
        self._seen: dict[str, tuple[int, int]] = {}

    def observe(self, core: ConnectorCore, view: RequestView, start: int, claimed: int = 0) -> None:
        """After a decided lookup (not deferred) of ``view`` at ``start`` that claimed
        ``claimed`` tokens, the core's answer to it (nothing changed in between)."""
        position = (start, len(view.token_ids))
        if self._seen.get(view.request_id) == position:
            return
        self._seen[view.request_id] = position
        geometry, end = core.geometry, start + claimed
        if (end // geometry.align + 1) * geometry.align > geometry.claim_limit(position[1]):
            # No candidate end lies past the answer: each group alone ends there too (or at
            # the start, where every group ends when no candidate lies past it).
            return
        if claimed or core.answers_by_rule(view.request_id):
            differ = some_group_passes(
                geometry,
                core.request_keys(view).key,
                position[1],
                start,
                end,
                status=core.store.status,
                failed=core.failed_keys(),
            )
        else:
            # The groups disagree as soon as one group's end differs from the first's: the
            # scans of the groups after it could not make them agree again.
            ends = self._ends(core, view, start)
            first = next(ends)
            differ = any(end != first for end in ends)
        if differ:
            self.count += 1

    def forget(self, request_id: str) -> None:
        self._seen.pop(request_id, None)

    @staticmethod
    def group_ends(core: ConnectorCore, view: RequestView, start: int) -> tuple[int, ...]:
        """Each group's own claim end from ``start`` (``start`` when it has nothing)."""
        return tuple(GroupAgreement._ends(core, view, start))

    @staticmethod
    def _ends(core: ConnectorCore, view: RequestView, start: int) -> Iterator[int]:
        """:meth:`group_ends`, one group at a time, each scanned only when asked for."""
        geometry, status = core.geometry, core.store.status
        keys = core.request_keys(view)
        failed = core.failed_keys()

        def ready_only(key: bytes) -> LookupResult:  # STORING counts as absent here
            found = status(key)
            return found if found is _HIT else _MISS

        # Only group g is scanned: every other group's keys count as READY and never failed,
        # so their scans could not lower or defer the answer (decide_claim's ``groups``).
        for g in range(geometry.num_groups):
            yield decide_claim(
                geometry,
                keys.key,
                len(view.token_ids),
                start,
                status=ready_only,
                failed=failed,
                groups=(g,),
            ).end


def store_events_to_vllm(
    events: Iterable[StoreEvent],
    unit_tokens: tuple[int, ...],
    payloads: BlockPayloads | None = None,
    present: Callable[[bytes], bool] = lambda key: False,
) -> Iterator[KVCacheEvent]:
    """The host store's events as vLLM KV cache events (medium ``CPU``), in order.

    A key is vLLM's block hash at its block's end plus the 4-byte big-endian group index, so
    each event names ``block_hashes`` and ``group_idx`` as vLLM's block pool does for the same
    block (``block_size`` is the group's block: the connector moves whole blocks). ``payloads``
    (:mod:`hybridkv.vllm.events`) add the block's ``parent_block_hash``, ``token_ids`` and LoRA
    as vLLM publishes them; a key without one (no request seen, e.g. a remote promotion) keeps
    ``token_ids=[]`` and ``parent_block_hash=None``, as vLLM's OffloadingConnector does by
    default. STORED -> ``BlockStored`` per key; REMOVED (a failed store) and EVICTED ->
    ``BlockRemoved`` per group, and the key's payload is forgotten unless ``present`` says the
    key is back in the host store (stored again since).
    """
    for event in events:
        if event.kind is EventKind.STORED:
            for key in event.keys:
                group = int.from_bytes(key[-4:], "big")
                payload = None if payloads is None else payloads.get(key)
                yield BlockStored(
                    block_hashes=[maybe_convert_block_hash(key[:-4])],
                    parent_block_hash=None if payload is None else payload.parent_block_hash,
                    token_ids=[] if payload is None else payload.token_ids.tolist(),
                    block_size=unit_tokens[group],
                    lora_id=None if payload is None else payload.lora_id,
                    medium=MEDIUM_CPU,
                    lora_name=None if payload is None else payload.lora_name,
                    group_idx=group,
                )
            continue
        by_group: dict[int, list[Any]] = {}
        for key in event.keys:
            group = int.from_bytes(key[-4:], "big")
            by_group.setdefault(group, []).append(maybe_convert_block_hash(key[:-4]))
            if payloads is not None and not present(key):
                payloads.forget(key)
        for group, hashes in sorted(by_group.items()):
            yield BlockRemoved(block_hashes=hashes, medium=MEDIUM_CPU, group_idx=group)


class HybridKVPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per name of :data:`COUNTERS` (``vllm:hybridkv_<name>``; the
    client adds ``_total``), labelled per engine as vLLM's own metrics are."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for name, documentation in ALL_COUNTERS.items():
            metric = self._counter_cls(
                name=f"vllm:hybridkv_{name}",
                documentation=f"hybridkv: {documentation}",
                labelnames=labelnames,
            )
            self.counters[name] = create_metric_per_engine(metric, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self.counters.get(name)
            if per_engine is not None and value:
                per_engine[engine_idx].inc(value)
