"""The scheduler's state, and how it is copied, frozen and shown to the ``SC-*`` predicates.

Everything the scheduler knows lives here as plain containers of immutable values (requests are
frozen, records are frozen), so a copy is one shallow copy per container plus the coordinator's
own copy. The logic lives in :mod:`spec.scheduler.scheduler` and
:mod:`spec.scheduler.completion`.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Mapping
from typing import Any, ClassVar

from spec.block_pool import NULL_BLOCK, BlockId
from spec.connector_api import RequestId, SchedulerConnector
from spec.kinds import GroupKind
from spec.managers import KVCacheCoordinator, MambaManager, SingleTypeManager
from spec.scheduler.config import SchedulerConfig
from spec.scheduler.loads import Hold, LoadRecord, ParkedLoad
from spec.scheduler.output import ClaimRecord
from spec.scheduler.recovery import RecoveryRecord
from spec.scheduler.request import Request

__all__ = ["SchedulerState"]


class _UnclampedMamba(MambaManager):
    """vLLM 0.33's align-mode count: not clamped at 0 (D1 off), the external state block not
    reserved on its own (D8 off)."""

    def _clamp(self, num_new: int) -> int:
        return num_new

    def _adopts_external(self, request_id: str, total: int, num_local: int) -> bool:
        del request_id, total, num_local
        return False


class _ExactCoordinator(KVCacheCoordinator):
    manager_classes: ClassVar[Mapping[GroupKind, type[SingleTypeManager]]] = {
        **KVCacheCoordinator.manager_classes,
        GroupKind.MAMBA: _UnclampedMamba,
    }


_MANAGER_TYPES: dict[bool, type[KVCacheCoordinator]] = {
    False: KVCacheCoordinator,
    True: _ExactCoordinator,
}


class SchedulerState:
    """All the scheduler's state.

    Attributes:
        config: the configuration.
        connector: the scheduler-side connector (``None``: no external KV).
        kv: the KV cache coordinator over the shared pool.
        requests: every request ever added, finished ones included.
        waiting, kv_holding, running: the FCFS queues (vLLM's ``waiting``,
            ``kv_holding_waiting`` and ``running``), as request ids.
        step: ``schedule()`` calls so far.
        loads: the async loads in flight, by request (their requests wait for them).
        parked: abandoned loads whose transfer has not reported (D3).
        recv_done: requests whose async load reported and that await promotion.
        failed: requests whose load failed and whose recovery completes at promotion.
        holds: finished requests whose blocks are still held, and why.
        inflight: vLLM's ``_inflight_prefills`` (admitted, prefill not complete).
        finished_since: requests finished since the previous ``schedule()``.
        num_waiting_for_remote_kvs: hand-kept count (``SC-6`` recounts it).
        claims, recoveries: the last step's claim records and the last update's recoveries.
        last_scheduled, last_budget_left: the last step's schedule and unused budget.
        in_flight: the tokens scheduled by the last ``schedule()`` whose output has not been
            applied yet (vLLM's ``num_in_flight_tokens``; empty between steps).
        counters: cumulative observations (not part of :meth:`freeze`).
    """

    def __init__(self, config: SchedulerConfig, connector: SchedulerConnector | None) -> None:
        """Pre: a valid config. Post: empty queues, an empty pool, step 0."""
        self.config = config
        self.kv = _MANAGER_TYPES[config.vllm_exact](
            config.groups,
            config.num_blocks,
            config.retention_interval,
            hash_block_size=config.hash_block_size,
        )
        self.connector = connector
        _bind_pool(connector, self)
        self.requests: dict[RequestId, Request] = {}
        self.waiting: list[RequestId] = []
        self.kv_holding: list[RequestId] = []
        self.running: list[RequestId] = []
        self.step = 0
        self.loads: dict[RequestId, LoadRecord] = {}
        self.parked: dict[RequestId, ParkedLoad] = {}
        self.recv_done: set[RequestId] = set()
        self.failed: set[RequestId] = set()
        self.holds: dict[RequestId, frozenset[Hold]] = {}
        self.inflight: set[RequestId] = set()
        self.finished_since: set[RequestId] = set()
        self.num_waiting_for_remote_kvs = 0
        self.claims: tuple[ClaimRecord, ...] = ()
        self.recoveries: tuple[RecoveryRecord, ...] = ()
        self.last_scheduled: tuple[tuple[RequestId, int], ...] = ()
        self.in_flight: dict[RequestId, int] = {}
        self.last_budget_left = config.max_num_batched_tokens
        self.counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)

    # ------------------------------------------------------------ copies
    def clone(self, connector: SchedulerConnector | None = None) -> Any:
        """An independent copy, bound to ``connector`` (the caller clones the connector).

        Post: no container is shared with ``self``; requests and records are immutable values
        and are shared.
        """
        twin = copy.copy(self)
        twin.kv = self.kv.clone()
        twin.connector = connector
        _bind_pool(connector, twin)
        for name in _LISTS:
            setattr(twin, name, list(getattr(self, name)))
        for name in _DICTS:
            setattr(twin, name, dict(getattr(self, name)))
        for name in _SETS:
            setattr(twin, name, set(getattr(self, name)))
        return twin

    def bind_connector(self, connector: SchedulerConnector | None) -> None:
        """Drive ``connector`` from now on (bound to this pool, as vLLM's
        ``bind_kv_cache_manager``). Post: only the bindings change."""
        self.connector = connector
        _bind_pool(connector, self)

    # ------------------------------------------------------------ observations
    def held_outside(self) -> tuple[BlockId, ...]:
        """Block references not held by a table (``GR-1``'s outside holds): those of parked
        loads and those the connector holds (its pinned store sources).

        Frame: nothing changes."""
        parked = tuple(b for p in self.parked.values() for b in p.blocks)
        held = getattr(self.connector, "held_blocks", None)
        return parked + (tuple(held()) if held is not None else ())

    def age(self, request: Request) -> int:
        """Steps since the request arrived.

        Pure."""
        return self.step - request.arrival_step

    def freeze(self) -> Hashable:
        """A hashable state for deduplication.

        Absolute step numbers are left out: ages enter only where a rule reads them (load ages
        under a deadline, request ages under a liveness bound, each capped just past its
        limit), so states that differ only in elapsed time merge. Cumulative counters are left
        out; the last step's claim and recovery records are kept.

        Frame: nothing changes.
        """
        return (
            self.kv.freeze(),
            tuple(self._frozen_request(r) for r in self.requests.values()),
            tuple(self.waiting),
            tuple(self.kv_holding),
            tuple(self.running),
            tuple(sorted((rid, self._load_age(rec), rec) for rid, rec in self.loads.items())),
            tuple(sorted(self.parked.items())),
            tuple(sorted(self.recv_done)),
            tuple(sorted(self.failed)),
            tuple(sorted((rid, _hold_names(hs)) for rid, hs in self.holds.items())),
            tuple(sorted(self.inflight)),
            tuple(sorted(self.finished_since)),
            tuple(sorted(self.in_flight.items())),
            self.claims,
            self.recoveries,
        )

    def _frozen_request(self, r: Request) -> Hashable:
        age = 0
        bound = self.config.liveness_bound_steps
        if bound is not None and not r.status.is_finished:
            age = min(self.age(r), bound + 1)
        return (
            r.request_id,
            r.prompt_token_ids,
            r.max_tokens,
            r.cache_salt,
            r.stop_token_ids,
            r.status,
            r.output_token_ids,
            r.num_computed_tokens,
            r.num_preemptions,
            r.shared_prefix_boundary,
            age,
        )

    def _load_age(self, record: LoadRecord) -> int:
        deadline = self.config.load_deadline_steps
        if deadline is None:
            return 0
        return min(self.step - record.started_step, deadline + 1)

    def snapshot(self) -> dict[str, Any]:
        """The plain state the ``SC-*`` predicates read (subject ``"scheduler"``).

        Keys: ``config`` (budget, running cap, ``claim_unit``, deadline, liveness bound,
        ``groups``: kind and block size per group), ``step``, ``requests`` (one mapping per
        request: ``id``, ``status``, ``num_computed_tokens``, ``num_tokens``, ``age``),
        ``waiting``/``kv_holding``/``running``, ``loads`` (``(id, age, claim_end, reported)``),
        ``parked`` (``(id, blocks)``), ``holds`` (``(id, (reasons...))``), ``tables``
        (``(id, ((blocks of group 0), ...))`` for every request holding a block), ``claims``,
        ``recoveries``,
        ``last_step`` (``budget``, ``budget_left``, ``scheduled``: ``(id, tokens)``),
        ``num_waiting_for_remote_kvs``, ``counters`` and ``kv_cache_groups`` (the
        coordinator's snapshot with ``held_outside``, for the ``GR-*`` predicates).

        Frame: nothing changes.
        """
        kv_snap = self.kv.snapshot()
        kv_snap["held_outside"] = self.held_outside()
        return {
            "config": self._config_snapshot(),
            "step": self.step,
            "requests": tuple(self._request_snapshot(r) for r in self.requests.values()),
            "waiting": tuple(self.waiting),
            "kv_holding": tuple(self.kv_holding),
            "running": tuple(self.running),
            "loads": tuple(
                (rid, self.step - rec.started_step, rec.claim_end, rid in self.recv_done)
                for rid, rec in sorted(self.loads.items())
            ),
            "parked": tuple((rid, tuple(p.blocks)) for rid, p in sorted(self.parked.items())),
            "holds": tuple((rid, _hold_names(hs)) for rid, hs in sorted(self.holds.items())),
            "tables": self._tables(),
            "claims": tuple(_claim_snapshot(c) for c in self.claims),
            "recoveries": tuple(_recovery_snapshot(r) for r in self.recoveries),
            "last_step": {
                "budget": self.config.max_num_batched_tokens,
                "budget_left": self.last_budget_left,
                "scheduled": self.last_scheduled,
            },
            "num_waiting_for_remote_kvs": self.num_waiting_for_remote_kvs,
            "counters": dict(self.counters),
            "kv_cache_groups": kv_snap,
        }

    def _config_snapshot(self) -> dict[str, Any]:
        c = self.config
        return {
            "max_num_batched_tokens": c.max_num_batched_tokens,
            "max_num_running": c.max_num_running,
            "claim_unit": self.kv.scheduler_block_size,
            "load_deadline_steps": c.load_deadline_steps,
            "liveness_bound_steps": c.liveness_bound_steps,
            "groups": tuple((g.kind.value, g.block_size) for g in c.groups),
        }

    def _request_snapshot(self, r: Request) -> dict[str, Any]:
        return {
            "id": r.request_id,
            "status": r.status.value,
            "num_computed_tokens": r.num_computed_tokens,
            "num_tokens": r.num_tokens,
            "age": self.age(r),
        }

    def _tables(self) -> tuple[tuple[RequestId, tuple[tuple[int, ...], ...]], ...]:
        found = []
        for rid in self.requests:
            blocks = self.kv.get_blocks(rid)
            if any(b != NULL_BLOCK for table in blocks for b in table):
                found.append((rid, tuple(tuple(int(b) for b in t) for t in blocks)))
        return tuple(sorted(found))

    @property
    def managers(self) -> tuple[SingleTypeManager, ...]:
        """The coordinator's per-group managers."""
        return self.kv.managers


def _bind_pool(connector: SchedulerConnector | None, state: SchedulerState) -> None:
    """Hand the connector the GPU block pool if it asks for it (vLLM's optional
    ``bind_gpu_block_pool``, called from ``bind_kv_cache_manager``, ``scheduler.py:382-384``)."""
    bind = getattr(connector, "bind_gpu_block_pool", None)
    if bind is not None:
        bind(state.kv.pool)


_LISTS = ("waiting", "kv_holding", "running")
_DICTS = ("requests", "loads", "parked", "holds", "counters", "in_flight")
_SETS = ("recv_done", "failed", "inflight", "finished_since")
_COUNTERS = (
    "tokens_scheduled",
    "tokens_discarded_by_recovery",
    "tokens_discarded_by_deadline",
    "num_preemptions",
    "num_recoveries",
    "num_abandoned_loads",
)


def _claim_snapshot(c: ClaimRecord) -> dict[str, Any]:
    return {
        "request_id": c.request_id,
        "num_computed_tokens": c.num_computed_tokens,
        "kind": c.kind.value,
        "claimed": c.claimed,
        "accepted": c.accepted,
        "unit": c.unit,
        "outcome": c.outcome.value,
    }


def _recovery_snapshot(r: RecoveryRecord) -> dict[str, Any]:
    return {
        "request_id": r.request_id,
        "mode": r.mode.value,
        "computed_before": r.computed_before,
        "truncated_to": r.truncated_to,
        "valid_points": r.valid_points,
    }


def _hold_names(holds: frozenset[Hold]) -> tuple[str, ...]:
    return tuple(sorted(h.value for h in holds))
