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
from spec.planner import HybridOffloadPlanner
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
    "freeze",
    "has_work",
    "ref_counts",
    "seed_store",
    "statuses",
    "step_labels",
    "subject_snapshots",
    "tables",
]


def build(config: EngineConfig) -> tuple[Scheduler, ReferenceWorker]:
    """A fresh scheduler (with its connector and an empty store) and a fresh worker."""
    groups = config.groups
    planner = HybridOffloadPlanner(
        tuple((g.kind, g.block_size) for g in groups),
        config.scheduler.hash_block_size,
        config.chunk_size,
        config.max_model_len,
    )
    connector = ReferenceConnector(
        planner,
        HostStore(config.store_capacity),
        tuple(g.kind for g in groups),
        config.scheduler.hash_block_size,
        config.chunk_size,
    )
    return Scheduler(config.scheduler, connector), ReferenceWorker()


def connector_of(scheduler: Scheduler) -> ReferenceConnector:
    """The reference connector :func:`build` gave the scheduler.

    Refusal: a scheduler driving another connector (or none) raises :class:`ConfigError`.
    """
    connector = scheduler.connector
    if not isinstance(connector, ReferenceConnector):
        raise ConfigError("connector", connector, "is not a ReferenceConnector", "use build()")
    return connector


def clone(scheduler: Scheduler, worker: ReferenceWorker) -> tuple[Scheduler, ReferenceWorker]:
    """Independent copies of the scheduler, its connector (and store) and the worker."""
    connector = connector_of(scheduler).clone()
    twin: Scheduler = scheduler.clone(connector)
    return twin, worker.clone()


def add_request(scheduler: Scheduler, spec: RequestSpec) -> None:
    """Hand ``spec`` to the scheduler as a new request."""
    scheduler.add_request(
        Request(
            spec.request_id,
            spec.prompt,
            spec.max_tokens,
            cache_salt=spec.cache_salt,
            stop_token_ids=spec.stop_token_ids,
        )
    )


def freeze(scheduler: Scheduler, worker: ReferenceWorker) -> Hashable:
    """The canonical key of the scheduler (connector and store included) and the worker."""
    return (scheduler.freeze(), connector_of(scheduler).freeze(), worker.freeze())


def ref_counts(scheduler: Scheduler) -> tuple[int, ...]:
    """The block pool's reference count per block id."""
    pool = scheduler.kv.pool
    return tuple(pool.ref_count(BlockId(b)) for b in range(pool.num_blocks))


def tables(scheduler: Scheduler) -> tuple[tuple[int, str, tuple[int, ...]], ...]:
    """Every request's block table per group: ``(group_idx, request_id, blocks)``."""
    rows = []
    for group_idx, manager in enumerate(scheduler.kv.managers):
        for rid, table in sorted(manager.req_to_blocks.items()):
            rows.append((group_idx, rid, tuple(int(b) for b in table)))
    return tuple(rows)


def statuses(scheduler: Scheduler, arrived: tuple[RequestId, ...]) -> Mapping[RequestId, str]:
    """The status name of each arrived request."""
    return {rid: scheduler.requests[rid].status.name for rid in arrived}


def has_work(scheduler: Scheduler) -> bool:
    """Does a step still matter: an unfinished request, a load or a held block?"""
    unfinished = any(not r.status.is_finished for r in scheduler.requests.values())
    return unfinished or bool(scheduler.loads or scheduler.parked or scheduler.holds)


def subject_snapshots(scheduler: Scheduler) -> list[tuple[str, Mapping[str, Any]]]:
    """The snapshots of the parts, each with the invariant subject that reads it."""
    snap = scheduler.snapshot()
    kv = snap["kv_cache_groups"]
    found: list[tuple[str, Mapping[str, Any]]] = [
        ("scheduler", snap),
        ("kv_cache_groups", kv),
        ("block_pool", kv["block_pool"]),
    ]
    connector = connector_of(scheduler)
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


def step_labels(before: Engine, after: Engine) -> list[str]:
    """Coverage labels of what a step caused (preemptions, finishes, timeouts, recoveries)."""
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
