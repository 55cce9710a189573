"""The spec's invariants evaluated on vLLM 0.33's real state and HybridKVConnector's, each step.

:class:`InvariantChecker` watches an :class:`hybridkv.vllm.harness.inprocess.InProcessEngine` whose
connector is HybridKVConnector. After every engine step (:meth:`InvariantChecker.after_step`) it
converts what it can observe into the plain snapshots the spec's predicates read and runs the
predicates of :data:`CHECKED` on them; a violation raises :class:`spec.errors.InvariantViolation`
naming every failing id. Nothing here restates a predicate: the converters only translate.

What is observed, and which snapshot it feeds:

- vLLM's ``BlockPool`` (reference counts, the free queue, the cached-block hash map) ->
  ``block_pool`` (BP-*);
- that pool with every KV cache group's ``req_to_blocks``, the references held outside any
  table (the connector core's store pins, vLLM's deferred frees) and the engine loop's
  concurrent batches (GR-5's mamba bound: 2 states under sync, 3 under async scheduling) ->
  ``kv_cache_groups`` (GR-*);
- the connector core's :meth:`~hybridkv.connector.ConnectorCore.snapshot` -> ``connector``
  (MB-*, SEC-1), and its host store's snapshot -> ``store`` (ST-*);
- the pool, the tables and the core's jobs in flight -> ``system`` (TR-1);
- vLLM's request states and queues, the core's loads, the frees the connector delayed (until
  vLLM gets their ``finished_sending``) and the step's claims (both recorded from vLLM's calls
  of the connector) -> ``scheduler`` (SC-1, SC-5, SC-7, SC-8);
- each request's status, computed and output tokens from step to step, and the core's jobs in
  flight -> ``progress`` (SC-12: issue 29's wedge, vLLM spinning with nothing scheduled, caught
  within :data:`PROGRESS_WINDOW` steps instead of at a step cap).

:data:`NOT_CHECKED` gives, for every other registered invariant, why it cannot be evaluated on
this state (a test keeps the two lists covering the registry).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterator, Mapping
from typing import Any

from spec.errors import InvariantViolation
from spec.invariants import ALL_INVARIANTS

__all__ = [
    "CHECKED",
    "EXERCISED",
    "NOT_CHECKED",
    "PROGRESS_WINDOW",
    "InvariantChecker",
    "ProgressWatch",
    "snapshots",
]

CHECKED: dict[str, tuple[str, ...]] = {
    "block_pool": ("BP-1", "BP-2", "BP-3", "BP-4", "BP-5", "BP-6", "BP-7"),
    "kv_cache_groups": ("GR-1", "GR-2", "GR-3", "GR-4", "GR-5", "GR-8"),
    "connector": ("MB-1", "MB-2", "MB-3", "MB-4", "MB-5", "MB-6", "MB-7", "MB-8", "SEC-1"),
    "store": tuple(f"ST-{n}" for n in range(1, 11)),
    "system": ("TR-1",),
    "scheduler": ("SC-1", "SC-5", "SC-7", "SC-8"),
    "progress": ("SC-12",),
}

PROGRESS_WINDOW = 48
"""SC-12's window on vLLM: steps with work left, no transfer in flight and no request's status,
computed or output tokens changing. Legitimate idle steps are few (a pause draining the batch
queue, a deferred request's turn); a wedge spins until the harness's step cap."""

NOT_CHECKED: dict[str, str] = {
    "GR-6": "vLLM keeps no per-allocation reservation count to read",
    "GR-7": "vLLM keeps no per-allocation reservation count to read",
    "SC-2": "the claim's outcome inside schedule() is not observable after the step",
    "SC-3": "the liveness bound is the random traces' wedge guard (max_steps), which raises",
    "SC-4": "recoveries are the spec scheduler's record; vLLM keeps none",
    "SC-6": "vLLM 0.33 keeps no count of WAITING_FOR_REMOTE_KVS requests to recount",
    "SC-10": "the pool model's (spec.scheduler.pool_model): on vLLM, blocks shared through the "
    "GPU prefix cache count once per holder, so a per-request sum is no pool count; SC-12's "
    "window catches the wedge itself",
    "SC-11": "the admission rule's condition in the pool model; on vLLM a sum of held blocks "
    "double-counts the GPU prefix hits that the rule relies on (as SC-10)",
    "SC-9": "not yet fed: the load ages it reads would have to be observed from vLLM's queues; "
    "tests/vllm/test_hybridkv_deadline.py checks abandonment at the facade's deadline instead",
    "TR-2": "needs each store source's content in the spec's value encoding; the forward's "
    "content check (wrong_reads) covers reads instead",
    "DATA-1": "the forward checks every slot it reads (InProcessReport.wrong_reads == 0)",
    **{
        f"TT-{n}": "the remote tier's: the single-engine traces run none, and the two-engine "
        "traces (_two_engine_traces) are checked on each engine's own state; the two-tier "
        "snapshot is checked by the remote tier's own tests (spec.tiers, issue 12)"
        for n in range(1, 9)
    },
    **{
        f"DK-{n}": "the disk tier's: a vLLM step shows no disk directory; the tier's snapshot "
        "and directory are checked by its own tests (spec.disk, tests/differential, issue 31)"
        for n in range(1, 8)
    },
}
"""Registered invariants not evaluated here, and why. The planner's (PL-*, listed by
:func:`planner_ids`) read a chunk plan, not a step's state; the planner's own tests check them."""

EXERCISED = (
    "store_in_flight",
    "load_in_flight",
    "pinned_outside_tables",
    "store_of_preempted",
    "delayed_free",
    "parked_load",
    "claim_accepted",
)
"""Situations (:attr:`InvariantChecker.situations`) each layout's batch of random traces must
reach, so the predicates are seen to run on states where they can fail."""

_SUBJECT_OF = {inv.id: inv.subject for inv in ALL_INVARIANTS.values()}


def planner_ids() -> tuple[str, ...]:
    """The planner's invariants (subject ``planner``): they read a chunk plan, not a step."""
    return tuple(sorted(i for i, s in _SUBJECT_OF.items() if s == "planner"))


# ------------------------------------------------------------------ vLLM's block pool


def _hash_key(key: bytes) -> tuple[str, int]:
    """vLLM's ``BlockHashWithGroupId`` (hash bytes + 4-byte big-endian group) -> (hex, group)."""
    return key[:-4].hex(), int.from_bytes(key[-4:], "big")


def _carried(pool: Any) -> Iterator[tuple[int, str, int]]:
    """(block id, hash, group) of every key a block carries: its own hash and the partial
    prefix entries vLLM 0.33 tracks beside it (``cached_block_hashes_by_block``)."""
    for block in pool.blocks:
        if block.block_hash is not None:
            yield (block.block_id, *_hash_key(block.block_hash))
    for block_id, keys in pool.cached_block_hashes_by_block.items():
        for key in keys:
            yield (block_id, *_hash_key(key))


def _cache_entries(pool: Any) -> Iterator[tuple[str, int, tuple[int, ...]]]:
    # BlockHashToBlockMap has no public iteration: its one field maps a key to a block or to
    # a {block id: block} dict (block_pool.py:58-61).
    for key, blocks in pool.cached_block_hash_to_block._cache.items():
        ids = tuple(sorted(blocks)) if isinstance(blocks, dict) else (blocks.block_id,)
        yield (*_hash_key(key), ids)


def pool_snapshot(pool: Any) -> dict[str, Any]:
    """vLLM's ``BlockPool`` in the ``block_pool`` schema
    (:meth:`spec.block_pool.BlockPool.snapshot`)."""
    return {
        "num_blocks": pool.num_gpu_blocks,
        "ref_counts": tuple(block.ref_cnt for block in pool.blocks),
        "free_queue": tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks()),
        "num_free_blocks": pool.free_block_queue.num_free_blocks,
        "block_hashes": tuple(sorted(_carried(pool))),
        "cached": tuple(sorted(_cache_entries(pool))),
    }


# ------------------------------------------------------------------ groups and tables


def _kind(spec: Any) -> str:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    if isinstance(spec, MambaSpec):
        return "mamba"
    if isinstance(spec, SlidingWindowSpec):
        return "sliding"
    if isinstance(spec, FullAttentionSpec):
        return "full"
    raise TypeError(f"kv_cache_spec {type(spec).__name__}: no spec kind for it")


def _tables(engine: Any) -> list[dict[str, tuple[int, ...]]]:
    """Per group: request id -> its table's block ids (vLLM's ``req_to_blocks``)."""
    managers = engine.scheduler.kv_cache_manager.coordinator.single_type_managers
    return [
        {rid: tuple(b.block_id for b in blocks) for rid, blocks in m.req_to_blocks.items()}
        for m in managers
    ]


def _deferred(engine: Any) -> list[int]:
    """Blocks vLLM popped off a table but returns to the pool only after a fence."""
    return [b.block_id for _fence, blocks in engine.scheduler.deferred_frees for b in blocks]


def groups_snapshot(engine: Any, pool: dict[str, Any], processed: Mapping[str, int]) -> dict:
    """The ``kv_cache_groups`` schema (:meth:`spec.managers.KVCacheCoordinator.snapshot`) without
    the reservation counts vLLM does not keep (GR-6, GR-7 are not evaluated), with the engine
    loop's ``concurrent_batches`` (GR-5)."""
    core = engine.scheduler.connector.core
    groups = []
    tables = _tables(engine)
    for gid, group in enumerate(engine.scheduler.kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        groups.append(
            {
                "kv_cache_group_id": gid,
                "kind": _kind(spec),
                "block_size": spec.block_size,
                "sliding_window": getattr(spec, "sliding_window", None) or 0,
                "extra_retained_tokens": getattr(spec, "extra_retained_tokens", 0),
                "num_speculative_blocks": getattr(spec, "num_speculative_blocks", 0),
                "num_prefill_checkpoint_blocks": getattr(spec, "num_prefill_checkpoint_blocks", 0),
                "tables": tuple(
                    sorted((rid, processed.get(rid, 0), ids) for rid, ids in tables[gid].items())
                ),
            }
        )
    return {
        "block_pool": pool,
        "groups": tuple(groups),
        "held_outside": (*core.held_blocks(), *_deferred(engine)),
        "concurrent_batches": _concurrent_batches(engine),
    }


def _concurrent_batches(engine: Any) -> int:
    """The steps the engine loop in use keeps scheduled at once (GR-5's bound): 1 under
    ``EngineCore.step``, the batch queue's size (vLLM's ``max_concurrent_batches``, 2) under
    async scheduling's ``step_with_batch_queue``."""
    core = engine.loop.core
    return 1 if core.batch_queue is None else int(core.batch_queue_size)


# ------------------------------------------------------------------ the whole system


def _in_flight(core_snap: Mapping[str, Any], released: Collection[int] = ()) -> tuple[Any, ...]:
    """The core's jobs (built or sent, not yet reported) in the ``system`` schema; the core's
    items carry no source value (TR-2 is not evaluated). ``released``: store jobs whose pool
    references a prefix-cache reset gave back (``ConnectorCore.release_store_pins``): they
    complete dropped, their keys never READY (``_stale_jobs``), so what they read from blocks
    vLLM freed is never trusted, and TR-1's "held" does not apply to them."""
    return tuple(
        (job_id, kind, rid, tuple((g, block, end, None) for g, block, _key, end in items))
        for job_id, kind, rid, _salt, _sync, items in core_snap["jobs"]
        if job_id not in released
    )


def system_snapshot(engine: Any, pool: Mapping[str, Any], core_snap: Mapping[str, Any]) -> dict:
    """The ``system`` schema (:meth:`spec.system.engine.Engine.snapshot`) for TR-1."""
    connector = engine.scheduler.connector
    core = getattr(connector, "core", None)
    released = frozenset(getattr(core, "_unpinned", ()))
    return {
        "ref_counts": pool["ref_counts"],
        "tables": tuple(
            (gid, rid, ids)
            for gid, table in enumerate(_tables(engine))
            for rid, ids in table.items()
        ),
        "in_flight": _in_flight(core_snap, released),
    }


# ------------------------------------------------------------------ the scheduler


def _status(request: Any) -> str:
    # The spec's names are vLLM's lower-cased (finished ones only need the "finished" prefix).
    return str(request.status.name).lower()


def _loading(core_snap: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Requests with a load job in flight: request id -> the blocks those jobs write."""
    jobs = {row[0]: row for row in core_snap["jobs"]}
    found: dict[str, tuple[int, ...]] = {}
    for row in core_snap["loads"]:
        rid, job_ids, reported = row[0], row[6], row[7]
        pending = [jobs[j] for j in job_ids if j not in reported and j in jobs]
        if pending:
            found[rid] = tuple(block for job in pending for _g, block, _k, _e in job[5])
    return found


def scheduler_snapshot(
    engine: Any,
    core_snap: Mapping[str, Any],
    claims: tuple[dict[str, Any], ...],
    delayed: frozenset[str],
) -> dict[str, Any]:
    """The ``scheduler`` schema (:meth:`spec.scheduler.state.SchedulerState.snapshot`) for SC-1,
    SC-5, SC-7 and SC-8 (``last_step``, ``age`` and ``recoveries`` are left out: SC-3, SC-4,
    SC-6 and SC-9 are not evaluated).

    ``kv_holding`` is vLLM's ``kv_holding_waiting`` (waiting requests that hold blocks). A load
    vLLM waits for is a core load with a job in flight, or one vLLM has been told finished (or
    failed) and promotes at the next ``schedule()``; a load still in flight for a request that
    finished (aborted while waiting) is parked. Holds, as the spec scheduler records them:
    ``delayed``, the requests whose free the connector delayed (``request_finished_all_groups``
    answered True) and whose ``finished_sending`` has not reached vLLM yet, and each parked
    load.
    """
    sched = engine.scheduler
    requests = sched.requests
    loading = _loading(core_snap)
    told = set(sched.finished_recving_kv_req_ids) | set(sched.failed_recving_kv_req_ids)
    # A load in flight for a request vLLM no longer knows is parked too (and SC-8, TR-1 say
    # whether its blocks are still held).
    live = {rid for rid, r in requests.items() if not r.is_finished()}
    parked = {rid: blocks for rid, blocks in loading.items() if rid not in live}
    loads = sorted((set(loading) | told) - set(parked))
    holds: dict[str, list[str]] = {}
    for rid in sorted(delayed):
        holds.setdefault(rid, []).append("store")
    for rid in parked:
        holds.setdefault(rid, []).append("load")
    per_group = _tables(engine)
    holding = sorted({rid for table in per_group for rid, ids in table.items() if any(ids)})
    return {
        "config": {
            "claim_unit": engine.block_size,
            "groups": tuple(
                (_kind(g.kv_cache_spec), g.kv_cache_spec.block_size)
                for g in sched.kv_cache_config.kv_cache_groups
            ),
        },
        "requests": tuple(
            {
                "id": rid,
                "status": _status(r),
                "num_computed_tokens": r.num_computed_tokens,
                "num_tokens": r.num_tokens,
            }
            for rid, r in requests.items()
        ),
        "waiting": tuple(r.request_id for r in sched.waiting),
        "kv_holding": tuple(r.request_id for r in sched.kv_holding_waiting),
        "running": tuple(r.request_id for r in sched.running),
        "loads": tuple((rid, 0, 0, rid in told) for rid in loads),
        "parked": tuple(sorted(parked.items())),
        "holds": tuple((rid, tuple(reasons)) for rid, reasons in sorted(holds.items())),
        "tables": tuple((rid, tuple(table.get(rid, ()) for table in per_group)) for rid in holding),
        "claims": claims,
    }


# ------------------------------------------------------------------ all of them


def progress_snapshot(engine: Any, idle: int, window: int = PROGRESS_WINDOW) -> dict[str, Any]:
    """The ``progress`` schema (:mod:`spec.invariants.liveness`): ``idle`` as
    :class:`ProgressWatch` counted it."""
    unfinished = sorted(rid for rid, r in engine.scheduler.requests.items() if not r.is_finished())
    return {"window": window, "idle": idle, "unfinished": tuple(unfinished)}


class ProgressWatch:
    """Counts consecutive idle steps: work left, no core job in flight, and no request whose
    status, computed tokens or output tokens changed since the step before (SC-12)."""

    def __init__(self) -> None:
        self.idle = 0
        self.longest = 0
        self._last: tuple[tuple[str, str, int, int], ...] = ()

    def observe(self, engine: Any) -> int:
        """Fold one step in; the idle steps so far."""
        requests = engine.scheduler.requests
        now = tuple(
            sorted(
                (rid, r.status.name, r.num_computed_tokens, r.num_output_tokens)
                for rid, r in requests.items()
            )
        )
        live = any(not r.is_finished() for r in requests.values())
        moved = now != self._last or engine.scheduler.connector.core.stats().jobs_in_flight > 0
        self.idle = self.idle + 1 if live and not moved else 0
        self.longest = max(self.longest, self.idle)
        self._last = now
        return self.idle


def snapshots(
    engine: Any,
    claims: tuple[dict[str, Any], ...],
    processed: Mapping[str, int],
    delayed: frozenset[str],
    idle: int = 0,
) -> dict[str, dict[str, Any]]:
    """Every subject of :data:`CHECKED` -> its snapshot of ``engine`` now (``claims``,
    ``processed``, ``delayed``: what :class:`InvariantChecker` recorded from vLLM's calls;
    ``idle``: the idle steps its :class:`ProgressWatch` counted)."""
    core = engine.scheduler.connector.core
    core_snap = core.snapshot()
    pool = pool_snapshot(engine.scheduler.kv_cache_manager.block_pool)
    return {
        "block_pool": pool,
        "kv_cache_groups": groups_snapshot(engine, pool, processed),
        "connector": core_snap,
        "store": core_snap["store"],
        "system": system_snapshot(engine, pool, core_snap),
        "scheduler": scheduler_snapshot(engine, core_snap, claims, delayed),
        "progress": progress_snapshot(engine, idle),
    }


class InvariantChecker:
    """Runs :data:`CHECKED` on an engine after each of its steps (module docstring).

    It records, from vLLM's own calls, what a snapshot cannot show afterwards: each
    ``get_num_new_matched_tokens`` answer of the step (SC-1), the processed-token basis vLLM
    last trimmed each request's windows at (``remove_skipped_blocks``; GR-4, GR-5), and the
    delayed frees (``request_finished_all_groups`` answered True) until vLLM receives their
    ``finished_sending`` (``update_connector_output``; SC-8).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.evaluated: Counter[str] = Counter()
        self.situations: Counter[str] = Counter()
        self.steps = 0
        self._claims: list[dict[str, Any]] = []
        self._processed: dict[str, int] = {}
        self._delayed: set[str] = set()
        self.progress = ProgressWatch()
        connector = engine.scheduler.connector
        asked = connector.get_num_new_matched_tokens

        def get_num_new_matched_tokens(request: Any, num_computed_tokens: int) -> Any:
            answer = asked(request, num_computed_tokens)
            tokens, is_async = answer
            self._claims.append(
                {
                    "request_id": request.request_id,
                    "num_computed_tokens": num_computed_tokens,
                    "accepted": tokens or 0,
                    "unit": engine.block_size,
                    "kind": "async" if is_async else "sync",
                }
            )
            return answer

        connector.get_num_new_matched_tokens = get_num_new_matched_tokens
        coordinator = engine.scheduler.kv_cache_manager.coordinator
        trim = coordinator.remove_skipped_blocks

        def remove_skipped_blocks(request_id: str, processed: int, *args: Any, **kw: Any) -> Any:
            self._processed[request_id] = processed
            return trim(request_id, processed, *args, **kw)

        coordinator.remove_skipped_blocks = remove_skipped_blocks
        finishing = connector.request_finished_all_groups

        def request_finished_all_groups(request: Any, block_ids: Any) -> Any:
            answer = finishing(request, block_ids)
            if answer[0]:
                self._delayed.add(request.request_id)
            return answer

        connector.request_finished_all_groups = request_finished_all_groups
        folding = connector.update_connector_output

        def update_connector_output(connector_output: Any) -> None:
            folding(connector_output)
            self._delayed -= set(connector_output.finished_sending or ())

        connector.update_connector_output = update_connector_output

    def violations(self) -> dict[str, list[str]]:
        """Every failing id of :data:`CHECKED` on the engine now -> its messages."""
        snaps = snapshots(
            self.engine,
            tuple(self._claims),
            self._processed,
            frozenset(self._delayed),
            self.progress.idle,
        )
        self._tally(snaps)
        failing: dict[str, list[str]] = {}
        for subject, ids in CHECKED.items():
            for inv_id in ids:
                self.evaluated[inv_id] += 1
                try:
                    messages = ALL_INVARIANTS[inv_id].violations(snaps[subject])
                except (KeyError, IndexError) as error:
                    # A predicate looking up an id the state does not know (a hold or a load
                    # of a request vLLM already dropped) is a broken state too.
                    messages = [f"the state names what it does not hold: {error!r}"]
                if messages:
                    failing[inv_id] = messages
        return failing

    def _tally(self, snaps: Mapping[str, dict[str, Any]]) -> None:
        """Count the steps whose state exercises the predicates (a check that ran only on idle
        states would prove little): stores and loads in flight, pins outside the tables, a
        store still reading blocks of a request vLLM preempted, delayed frees, parked loads,
        blocks carrying a partial-prefix key beside their own, accepted claims (SC-1)."""
        jobs = snaps["connector"]["jobs"]
        statuses = {r["id"]: r["status"] for r in snaps["scheduler"]["requests"]}
        carried = Counter(block for block, _h, _g in snaps["block_pool"]["block_hashes"])
        seen = {
            "store_in_flight": any(job[1] == "store" for job in jobs),
            "load_in_flight": any(job[1] == "load" for job in jobs),
            "pinned_outside_tables": bool(snaps["kv_cache_groups"]["held_outside"]),
            "store_of_preempted": any(
                job[1] == "store" and statuses.get(job[2]) == "preempted" for job in jobs
            ),
            "delayed_free": bool(self._delayed),
            "parked_load": bool(snaps["scheduler"]["parked"]),
            "multi_key_block": any(n > 1 for n in carried.values()),
            "claim_accepted": any(c["accepted"] for c in snaps["scheduler"]["claims"]),
        }
        self.situations.update(name for name, hit in seen.items() if hit)
        self.situations["steps_checked"] += 1

    def after_step(self) -> None:
        """Check now; forget the step's claims. Raises InvariantViolation naming every
        failing id (the first id is the exception's ``invariant_id``)."""
        self.steps += 1
        self.progress.observe(self.engine)
        failing = self.violations()
        self._claims = []
        if failing:
            detail = "; ".join(f"{i}: {' | '.join(m[:3])}" for i, m in failing.items())
            raise InvariantViolation(next(iter(failing)), f"step {self.steps}: {detail}")
