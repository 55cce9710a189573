"""The connector core as the spec's scheduler and engine see it: values converted both ways.

``spec.scheduler.Scheduler`` drives any :class:`spec.connector_api.SchedulerConnector` and
``spec.system.engine.Engine`` any :class:`spec.connector_api.WorkerConnector`. This module (the
one place that imports both ``spec`` and ``hybridkv.connector``) wraps the optimized core so
they drive it exactly as they drive ``spec.connector.ReferenceConnector`` and
``ReferenceWorker``:

- :class:`CoreConnector` over :class:`~hybridkv.connector.ConnectorCore` (scheduler side),
  including ``bind_gpu_block_pool`` (the spec pool wrapped as a
  :class:`~hybridkv.connector.GpuBlockPool`) and ``held_blocks``;
- :class:`TrackerWorker` over :class:`~hybridkv.connector.JobTracker` (worker side);
- :func:`build_core`, :func:`build_engine`: the core for a spec engine configuration, and a
  spec engine whose scheduler drives it;
- the conversions themselves (``to_core_*``, ``to_spec_*``), for a loop that drives the spec
  scheduler with a :class:`~hybridkv.connector.worker.TransferWorker` (real bytes): bind
  ``to_core_meta(output.meta)``, hand ``to_spec_output(worker.get_transfer_results())`` to
  ``update_from_output``.

Conversions are per call and proportional to the values passed (the core itself never
converts). The spec's ``ConfigError`` and hybridkv's ``HybridKVConfigError`` are both
``ValueError`` subclasses with the same ``field``; errors pass through unconverted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import hybridkv.connector as core_api
from hybridkv.connector import ConnectorCore, JobTracker, LoadMode
from hybridkv.kinds import GroupKind as CoreGroupKind
from hybridkv.planner import HybridOffloadPlanner
from hybridkv.store import HostStore
from spec import connector_api as spec_api
from spec.block_pool import BlockId, BlockPool
from spec.kinds import GroupKind
from spec.managers.group_spec import GroupSpec

__all__ = [
    "CoreConnector",
    "SpecBlockPool",
    "TrackerWorker",
    "build_core",
    "build_engine",
    "to_core_meta",
    "to_core_output",
    "to_core_step",
    "to_core_view",
    "to_spec_meta",
    "to_spec_output",
    "window_reaches",
]


class SpecBlockPool:
    """A ``spec.block_pool.BlockPool`` seen as the core's :class:`GpuBlockPool`."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    def touch(self, blocks: Iterable[int]) -> None:
        """One more reference on each block."""
        self.pool.touch(BlockId(b) for b in blocks)

    def free_blocks(self, ordered_blocks: Iterable[int]) -> None:
        """One reference fewer on each block, in the given order."""
        self.pool.free_blocks(BlockId(b) for b in ordered_blocks)


class CoreConnector:
    """``spec.connector_api.SchedulerConnector`` over a :class:`ConnectorCore`."""

    def __init__(self, core: ConnectorCore) -> None:
        self.core = core

    @property
    def store(self) -> HostStore:
        """The core's host store."""
        return self.core.store

    def get_num_new_matched_tokens(
        self, request: spec_api.RequestView, num_computed_tokens: int
    ) -> spec_api.Claim:
        """The core's claim, as the spec's value."""
        claim = self.core.get_num_new_matched_tokens(to_core_view(request), num_computed_tokens)
        return spec_api.Claim(spec_api.ClaimKind(claim.kind.value), claim.num_tokens)

    def update_state_after_alloc(
        self, request: spec_api.RequestView, block_ids: spec_api.BlockTable, n: int
    ) -> None:
        """Pass the allocation on."""
        self.core.update_state_after_alloc(to_core_view(request), block_ids, n)

    def build_connector_meta(self, step: spec_api.StepView) -> spec_api.ConnectorMeta:
        """The core's metadata for the step, as the spec's value."""
        meta = self.core.build_connector_meta(to_core_step(step))
        return to_spec_meta(meta)

    def update_connector_output(self, output: spec_api.KVConnectorOutput) -> None:
        """Pass the worker's output on."""
        self.core.update_connector_output(to_core_output(output))

    def request_finished_all_groups(
        self, request: spec_api.RequestView, block_ids: spec_api.BlockTable
    ) -> bool:
        """Whether the core delays the free."""
        return self.core.request_finished_all_groups(to_core_view(request), block_ids)

    def bind_gpu_block_pool(self, pool: BlockPool) -> None:
        """Pin store sources in the spec's pool."""
        self.core.bind_gpu_block_pool(SpecBlockPool(pool))

    def held_blocks(self) -> tuple[BlockId, ...]:
        """The core's pins, as spec block ids."""
        return tuple(BlockId(b) for b in self.core.held_blocks())

    def snapshot(self) -> dict[str, Any]:
        """The core's snapshot (the reference connector's schema)."""
        return self.core.snapshot()

    # The reference connector's queries and seeding, for tests and the simulator.

    def seed(
        self, request: spec_api.RequestView, num_tokens: int, groups: Iterable[int] = ()
    ) -> int:
        """Seed the host with the request's first ``num_tokens`` tokens (``ConnectorCore.seed``)."""
        return self.core.seed(to_core_view(request), num_tokens, groups)

    def failed_keys(self) -> frozenset[bytes]:
        """The failure memory's keys."""
        return self.core.failed_keys()

    def has_transfers(self, request_id: spec_api.RequestId) -> bool:
        """Whether a job of the request is in flight."""
        return self.core.has_transfers(core_api.RequestId(request_id))

    def busy_blocks(self) -> frozenset[int]:
        """Blocks an in-flight job reads or writes."""
        return self.core.busy_blocks()

    def invalid_blocks(self, request_id: spec_api.RequestId) -> frozenset[int]:
        """Destination blocks of the failed jobs of the request's latest load."""
        return self.core.invalid_blocks(core_api.RequestId(request_id))

    def first_invalid_token(self, request: spec_api.RequestView) -> int:
        """Where the request's latest load leaves every group valid."""
        return self.core.first_invalid_token(to_core_view(request))


class TrackerWorker:
    """``spec.connector_api.WorkerConnector`` over a :class:`JobTracker`."""

    def __init__(self, tracker: JobTracker | None = None) -> None:
        self.tracker = tracker if tracker is not None else JobTracker()

    def bind_connector_metadata(self, meta: spec_api.ConnectorMeta) -> None:
        """Pass the step's jobs on."""
        self.tracker.bind_connector_metadata(to_core_meta(meta))

    def get_transfer_results(
        self, results: tuple[spec_api.JobResult, ...]
    ) -> spec_api.KVConnectorOutput:
        """Fold the results; the tracker's output as the spec's value."""
        out = self.tracker.get_transfer_results(
            tuple(core_api.JobResult(core_api.JobId(r.job_id), r.success) for r in results)
        )
        return to_spec_output(out)

    def get_block_ids_with_load_errors(self) -> dict[spec_api.RequestId, frozenset[int]]:
        """The tracker's block-level load errors, per request (handed out once)."""
        return {
            spec_api.RequestId(rid): blocks
            for rid, blocks in self.tracker.get_block_ids_with_load_errors().items()
        }

    def snapshot(self) -> dict[str, Any]:
        """The tracker's snapshot (the reference worker's schema)."""
        return self.tracker.snapshot()


# --------------------------------------------------------------------- builders


def window_reaches(groups: Sequence[GroupSpec]) -> tuple[int, ...]:
    """Each group's window reach: ``sliding_window - 1 + extra_retained_tokens`` for SLIDING,
    0 otherwise (``spec.connector.geometry.Geometry.from_groups``)."""
    return tuple(
        g.sliding_window - 1 + g.extra_retained_tokens if g.kind is GroupKind.SLIDING else 0
        for g in groups
    )


def build_core(
    groups: Sequence[GroupSpec],
    *,
    hash_block_size: int,
    chunk_size: int,
    max_model_len: int,
    store_capacity: int,
    policy: str = "lru",
    load_mode: LoadMode = LoadMode.ASYNC,
    windows: bool = False,
    eagle_groups: Sequence[int] = (),
) -> CoreConnector:
    """A core (and its empty host store) for spec group specs, wrapped for the spec scheduler.

    ``windows``: pass each sliding group's window reach (else a SLIDING group needs every unit,
    as ``spec.system.parts.build`` builds the reference connector). ``eagle_groups``: the
    groups vLLM drops EAGLE's block from (:class:`~hybridkv.connector.ConnectorCore`).
    """
    kinds = tuple(CoreGroupKind(g.kind.value) for g in groups)
    planner = HybridOffloadPlanner(
        tuple((kind, g.block_size) for kind, g in zip(kinds, groups, strict=True)),
        hash_block_size,
        chunk_size,
        max_model_len,
    )
    core = ConnectorCore(
        planner,
        HostStore(store_capacity, policy),
        kinds,
        hash_block_size,
        chunk_size,
        sliding_windows=window_reaches(groups) if windows else (),
        load_mode=load_mode,
        eagle_groups=eagle_groups,
    )
    return CoreConnector(core)


def build_engine(
    config: Any,
    *,
    policy: str = "lru",
    load_mode: LoadMode = LoadMode.ASYNC,
    windows: bool = False,
) -> Any:
    """A ``spec.system.engine.Engine`` for ``config`` (an ``EngineConfig``) whose scheduler
    drives the core and whose worker is a :class:`TrackerWorker`.

    The engine's events (arrive, step, complete, abort) and ``snapshot()`` work as with the
    reference; ``clone()`` and ``freeze()`` do not (they are the explorer's, built for the
    reference connector).
    """
    from spec.scheduler.scheduler import Scheduler
    from spec.system.engine import Engine

    connector = build_core(
        config.groups,
        hash_block_size=config.scheduler.hash_block_size,
        chunk_size=config.chunk_size,
        max_model_len=config.max_model_len,
        store_capacity=config.store_capacity,
        policy=policy,
        load_mode=load_mode,
        windows=windows,
    )
    return Engine(config, Scheduler(config.scheduler, connector), TrackerWorker())


# --------------------------------------------------------------------- conversions


def to_core_view(view: spec_api.RequestView) -> core_api.RequestView:
    """A spec request view as the core's."""
    return core_api.RequestView(
        core_api.RequestId(view.request_id), view.token_ids, view.num_prompt_tokens, view.cache_salt
    )


def to_core_step(step: spec_api.StepView) -> core_api.StepView:
    """A spec step view as the core's."""
    return core_api.StepView(
        step.step,
        tuple(
            core_api.ScheduledRequest(
                to_core_view(s.request),
                s.block_ids,
                s.num_computed_tokens,
                s.num_scheduled_tokens,
            )
            for s in step.scheduled
        ),
        frozenset(core_api.RequestId(r) for r in step.finished_ids),
        frozenset(core_api.RequestId(r) for r in step.preempted_ids),
    )


def to_spec_meta(meta: core_api.ConnectorMeta) -> spec_api.ConnectorMeta:
    """The core's metadata as the spec's."""
    return spec_api.ConnectorMeta(
        tuple(_spec_job(job) for job in meta.load_jobs),
        tuple(_spec_job(job) for job in meta.store_jobs),
        _spec_ids(meta.delayed_free_ids),
    )


def to_core_meta(meta: spec_api.ConnectorMeta) -> core_api.ConnectorMeta:
    """Spec metadata as the core's."""
    return core_api.ConnectorMeta(
        tuple(_core_job(job) for job in meta.load_jobs),
        tuple(_core_job(job) for job in meta.store_jobs),
        frozenset(core_api.RequestId(r) for r in meta.delayed_free_ids),
    )


def to_core_output(output: spec_api.KVConnectorOutput) -> core_api.KVConnectorOutput:
    """A spec connector output as the core's."""
    return core_api.KVConnectorOutput(
        frozenset(core_api.RequestId(r) for r in output.finished_recving),
        frozenset(core_api.RequestId(r) for r in output.failed_recving),
        frozenset(core_api.RequestId(r) for r in output.finished_sending),
        tuple(
            core_api.JobResult(core_api.JobId(r.job_id), r.success) for r in output.completed_jobs
        ),
    )


def to_spec_output(output: core_api.KVConnectorOutput) -> spec_api.KVConnectorOutput:
    """The core's (or a :class:`~hybridkv.connector.worker.TransferWorker`'s) output as the
    spec's, for ``spec.scheduler.Scheduler.update_from_output``."""
    return spec_api.KVConnectorOutput(
        _spec_ids(output.finished_recving),
        _spec_ids(output.failed_recving),
        _spec_ids(output.finished_sending),
        tuple(
            spec_api.JobResult(spec_api.JobId(r.job_id), r.success) for r in output.completed_jobs
        ),
    )


def _spec_ids(ids: frozenset[core_api.RequestId]) -> frozenset[spec_api.RequestId]:
    return frozenset(spec_api.RequestId(r) for r in ids)


def _spec_job(job: core_api.TransferJob) -> spec_api.TransferJob:
    return spec_api.TransferJob(
        spec_api.JobId(job.job_id),
        spec_api.TransferKind(job.kind.value),
        spec_api.RequestId(job.request_id),
        tuple(spec_api.TransferItem(*item) for item in job.items),
        job.sync,
    )


def _core_job(job: spec_api.TransferJob) -> core_api.TransferJob:
    return core_api.TransferJob(
        core_api.JobId(job.job_id),
        core_api.TransferKind(job.kind.value),
        core_api.RequestId(job.request_id),
        tuple(
            core_api.TransferItem(i.group_idx, i.block_id, i.key, i.end_token) for i in job.items
        ),
        job.sync,
    )
