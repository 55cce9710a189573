"""How the engine builds, copies and observes its parts: scheduler, connector, worker, store.

Every call the engine makes into :mod:`spec.scheduler` and :mod:`spec.connector` beyond the
:mod:`spec.connector_api` protocols goes through here, so the engine reads as the event loop
only. The connector owns the host store; the scheduler owns the connector and the KV cache
coordinator.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any

from spec.block_pool import BlockId
from spec.connector.scheduler_side import ReferenceConnector
from spec.connector.worker_side import ReferenceWorker
from spec.connector_api import RequestId
from spec.errors import ConfigError
from spec.hashing import request_block_hashes
from spec.planner import HybridOffloadPlanner
from spec.scheduler.config import RecoveryMode
from spec.scheduler.recovery import FailureReport
from spec.scheduler.request import Request
from spec.scheduler.scheduler import Scheduler
from spec.store import HostStore, PrepareStoreOutput

if TYPE_CHECKING:
    from spec.system.engine import Engine, EngineConfig, RequestSpec

__all__ = [
    "add_request",
    "build",
    "clone",
    "connector_of",
    "failure_reports",
    "freeze",
    "has_work",
    "ref_counts",
    "reset_prefix_cache",
    "seed_host",
    "seed_store",
    "statuses",
    "step_labels",
    "subject_snapshots",
    "tables",
]


def build(
    config: EngineConfig,
    *,
    connector_cls: type[ReferenceConnector] | None = None,
    scheduler_cls: type[Scheduler] | None = None,
) -> tuple[Scheduler, ReferenceWorker]:
    """A fresh scheduler (with its connector and an empty store) and a fresh worker.

    ``connector_cls`` and ``scheduler_cls`` (default: the reference classes) let a test build
    one deliberately broken variant; copies keep the classes (:func:`clone`).

    Pre: a valid ``config`` (else the planner, the store or the scheduler raises
    :class:`ConfigError` naming the field). Post: the connector runs over an empty LRU host
    store of ``store_capacity`` entries and is bound to the scheduler's pool; nothing is
    shared between two calls but ``config``.
    """
    connector_cls = connector_cls or ReferenceConnector
    scheduler_cls = scheduler_cls or Scheduler
    groups = config.groups
    planner = HybridOffloadPlanner(
        tuple((g.kind, g.block_size) for g in groups),
        config.scheduler.hash_block_size,
        config.chunk_size,
        config.max_model_len,
    )
    connector = connector_cls(
        planner,
        HostStore(config.store_capacity),
        tuple(g.kind for g in groups),
        config.scheduler.hash_block_size,
        config.chunk_size,
    )
    return scheduler_cls(config.scheduler, connector), ReferenceWorker()


def connector_of(scheduler: Scheduler) -> ReferenceConnector:
    """The reference connector :func:`build` gave the scheduler.

    Refusal: a scheduler driving another connector (or none) raises :class:`ConfigError`.
    """
    connector = scheduler.connector
    if not isinstance(connector, ReferenceConnector):
        raise ConfigError("connector", connector, "is not a ReferenceConnector", "use build()")
    return connector


def clone(scheduler: Scheduler, worker: ReferenceWorker) -> tuple[Scheduler, ReferenceWorker]:
    """Independent copies of the scheduler, its connector (and store) and the worker.

    Pre: the scheduler drives a :class:`ReferenceConnector` (:class:`ConfigError` otherwise,
    nothing changes). Post: :func:`freeze` of the copies equals that of the originals; the
    connector's copy is bound to the scheduler copy's pool. Frame: nothing changes.
    """
    connector = connector_of(scheduler).clone()
    twin: Scheduler = scheduler.clone(connector)
    return twin, worker.clone()


def add_request(scheduler: Scheduler, spec: RequestSpec) -> None:
    """Hand ``spec`` to the scheduler as a new request.

    Pre: ``spec.request_id`` is new to the scheduler. Post: the request is WAITING at the
    tail of the waiting queue, with its salt and stop tokens. Refusal: a known id raises
    :class:`ConfigError` (field ``request_id``), nothing changes.
    """
    scheduler.add_request(
        Request(
            spec.request_id,
            spec.prompt,
            spec.max_tokens,
            cache_salt=spec.cache_salt,
            stop_token_ids=spec.stop_token_ids,
        )
    )


def failure_reports(
    scheduler: Scheduler, errors: Mapping[RequestId, frozenset[int]]
) -> tuple[FailureReport, ...]:
    """The block-level reports the scheduler gets for the worker's ``errors``.

    Shared truncation reads them (every group truncated at one point before the first invalid
    block). Under vLLM's recovery models none is passed: vLLM 0.33 raises ``RuntimeError`` on a
    block-level report with several KV cache groups (``scheduler.py:3712-3721``), so a
    connector reports failed requests through ``failed_recving`` only (its plug-in checklist),
    and the failed request restarts from 0 or fails. Pure.
    """
    if scheduler.config.recovery is not RecoveryMode.SHARED_TRUNCATION:
        return ()
    return tuple(
        FailureReport(rid, frozenset(BlockId(b) for b in blocks))
        for rid, blocks in sorted(errors.items())
    )


def freeze(scheduler: Scheduler, worker: ReferenceWorker) -> Hashable:
    """The canonical key of the scheduler (connector and store included) and the worker.

    Frame: nothing changes. Pre: the scheduler drives a :class:`ReferenceConnector`
    (:class:`ConfigError` otherwise).
    """
    return (scheduler.freeze(), connector_of(scheduler).freeze(), worker.freeze())


def ref_counts(scheduler: Scheduler) -> tuple[int, ...]:
    """The block pool's reference count per block id.

    Pure: the null block (0) included.
    """
    pool = scheduler.kv.pool
    return tuple(pool.ref_count(BlockId(b)) for b in range(pool.num_blocks))


def tables(scheduler: Scheduler) -> tuple[tuple[int, str, tuple[int, ...]], ...]:
    """Every request's block table per group: ``(group_idx, request_id, blocks)``.

    Pure: rows by group, then by request id.
    """
    rows = []
    for group_idx, manager in enumerate(scheduler.kv.managers):
        for rid, table in sorted(manager.req_to_blocks.items()):
            rows.append((group_idx, rid, tuple(int(b) for b in table)))
    return tuple(rows)


def statuses(scheduler: Scheduler, arrived: tuple[RequestId, ...]) -> Mapping[RequestId, str]:
    """The status name of each arrived request.

    Pure. Pre: every id of ``arrived`` was added to the scheduler (``KeyError`` otherwise).
    """
    return {rid: scheduler.requests[rid].status.name for rid in arrived}


def has_work(scheduler: Scheduler) -> bool:
    """Does a step still matter: an unfinished request, a load or a held block?

    Pure: a load in flight or parked counts as a load.
    """
    unfinished = any(not r.status.is_finished for r in scheduler.requests.values())
    return unfinished or bool(scheduler.loads or scheduler.parked or scheduler.holds)


def subject_snapshots(scheduler: Scheduler) -> list[tuple[str, Mapping[str, Any]]]:
    """The snapshots of the parts, each with the invariant subject that reads it.

    Frame: nothing changes. Pre: the scheduler drives a :class:`ReferenceConnector`
    (:class:`ConfigError` otherwise). Post: ``scheduler``, ``kv_cache_groups``,
    ``block_pool``, ``planner`` (the connector's offload geometry), ``connector`` and
    ``store``, in that order.
    """
    snap = scheduler.snapshot()
    kv = snap["kv_cache_groups"]
    found: list[tuple[str, Mapping[str, Any]]] = [
        ("scheduler", snap),
        ("kv_cache_groups", kv),
        ("block_pool", kv["block_pool"]),
    ]
    connector = connector_of(scheduler)
    # The planner never changes after construction, but it is checked in every state all the
    # same: a state is judged on its own, and PL-* costs little next to the other families.
    found.append(("planner", connector.geometry.planner.snapshot()))
    found.append(("connector", connector.snapshot()))
    found.append(("store", connector.store.snapshot()))
    return found


def seed_store(scheduler: Scheduler, keys: list[bytes]) -> None:
    """Make ``keys`` READY in the connector's host store (a seeded start).

    Pre: the store has room for them. Post: each key is READY with no pins.
    """
    store: HostStore = connector_of(scheduler).store
    prepared = store.prepare_store(keys)
    if not isinstance(prepared, PrepareStoreOutput):
        raise ConfigError("store_capacity", store.capacity, "too small to seed", "raise it")
    store.complete_store(prepared.keys_to_store, success=True)


def seed_host(
    scheduler: Scheduler,
    spec: RequestSpec,
    num_tokens: int,
    groups: tuple[int, ...] = (),
) -> tuple[tuple[int, bytes, int], ...]:
    """Make the host hold READY the units of ``spec``'s first ``num_tokens`` tokens.

    What an earlier request with the same tokens and salt left in the host tier. ``groups``
    limits the groups stored (empty: all). Post: the absent keys are READY with the salt
    recorded (a key already present is left as it is); returns ``(group_idx, key, end_token)``
    per unit, present ones included, for the caller's content map. Refusal: a store too small
    raises :class:`ConfigError` (field ``store_capacity``), nothing changes.
    """
    connector = connector_of(scheduler)
    view = Request(spec.request_id, spec.prompt, spec.max_tokens, cache_salt=spec.cache_salt).view()
    connector.seed(view, num_tokens, groups)
    geometry = connector.geometry
    hashes = request_block_hashes(
        view.token_ids, geometry.planner.hash_block_size, cache_salt=view.cache_salt
    )
    return tuple(
        (g, geometry.key(hashes, ref), ref.end)
        for g in (sorted(groups) or range(geometry.num_groups))
        for ref in geometry.units_ending_in(g, 0, num_tokens)
    )


def reset_prefix_cache(scheduler: Scheduler) -> bool:
    """vLLM ``reset_prefix_cache``: drop every GPU cache entry, refused while a block is in use.

    As vLLM's ``BlockPool.reset_prefix_cache``: False (and nothing changes) when a block other
    than the null block is referenced; otherwise every hash goes, the host tier is untouched.
    """
    pool = scheduler.kv.pool
    blocks = [BlockId(b) for b in range(1, pool.num_blocks)]
    if any(pool.ref_count(b) for b in blocks):
        return False
    pool.evict_blocks(blocks)
    return True


def step_labels(before: Engine, after: Engine) -> list[str]:
    """Coverage labels of what a step caused (preemptions, finishes, timeouts, recoveries).

    Pure. Pre: ``after`` is ``before`` after one step (its ``last_output`` is set). Post: the
    labels, then ``claim:<kind>`` per connector answer of the step.
    """
    output = after.last_output
    labels = []
    for rid in sorted(output.preempted_ids):
        labels.append("event:preempt")
        if before.jobs_of(rid) or after.jobs_of(rid):
            labels.append("event:preempt_during_transfer")
    if output.finished_ids:
        labels.append("event:finish")
    for rid in sorted(output.abandoned_ids):
        labels.append("event:load_timeout")
        if after.jobs_of(rid):
            labels.append("event:timeout_during_transfer")
    if after.last_kv_output.failed_recving:
        labels.append(f"recovery:{after.config.scheduler.recovery.value}")
    for claim in output.claims:
        labels.append(f"claim:{claim.kind.value}")
    return labels
