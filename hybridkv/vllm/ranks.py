"""Tensor parallel: one scheduler-side decision, one worker per rank, job results in quorum.

Under tensor parallelism vLLM 0.33 runs one scheduler and ``world_size`` workers; each worker
holds its rank's shard of every layer (a slice of the KV heads, of the mamba heads) in a
``KVCacheConfig`` with the same groups, block ids and page size on every rank
(``generate_scheduler_kv_cache_config`` hands the scheduler rank 0's). So one host slot per rank
holds one rank's shard of a block, every rank moves the same (block, slot) pairs over its own
caches and host memory, and the scheduler side, which chose the jobs, must hear from every rank
before it trusts a job.

vLLM's ``KVOutputAggregator`` (``distributed/kv_transfer/kv_connector/utils.py``) folds the
workers' outputs of one step: a request is in ``finished_recving`` / ``finished_sending`` once
all ``world_size`` workers named it, in that step or earlier ones; ``failed_recving`` is the
union over workers, emitted with that ``finished_recving``; ``kv_connector_worker_meta`` is folded
with ``aggregate`` over the workers that reported this step only. Ranks finish a job in
different steps (their copies run apart), so a job result cannot be decided per step: each
worker reports ``(job, 1 worker, success)``, ``aggregate`` adds the workers and ANDs the
success, and :class:`JobQuorum` on the scheduler side holds a job until ``world_size`` workers
reported it, then releases it, failed if any rank failed it. A load that failed on one rank
thereby fails for all: the core forgets or remembers its keys as a failed load, and vLLM, which
got the request in ``failed_recving`` from that rank in the same step the last rank finished,
recomputes it.

Replicated KV (:class:`HostSharding`): where consecutive ranks hold identical KV for every
layer (vLLM's ``KVCacheConfig.kv_tp_replicas``: an MLA model's latent cache is not split over
TP ranks, so ``kv_tp_replicas == tensor_parallel_size``), a host copy per rank would hold the
same bytes ``kv_tp_replicas`` times. Instead each group of replicas shares one host region (a
file mapped by all of them, :class:`hybridkv.hostmem.HostMemory` ``shared_path``), the group's
first rank is its only writer, and the others run their store jobs as empty copies
(:class:`ReplicaEngine`) but still report them, so the quorum still waits for ``world_size``
reports per job. ``host_memory_bytes`` is divided by the number of distinct shards, not by the
ranks. Why the reads are safe: a slot becomes loadable only once its store job is released,
which needs the writer's report, so its copy ended first; a slot is rewritten only after its
entry was evicted, and an entry being loaded is pinned until every rank reported the load.
vLLM's native connector does the same for MLA (one writer, one shared region).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.connector import JobResult
from hybridkv.errors import HybridKVConfigError
from hybridkv.transfer import Direction, JobId, TransferPair
from hybridkv.transfer.api import EngineWrapper

__all__ = [
    "HostSharding",
    "JobQuorum",
    "RankReport",
    "ReplicaEngine",
    "host_sharding",
    "merge_reports",
    "refuse_unsupported_parallelism",
]


@dataclass(frozen=True, slots=True)
class RankReport:
    """``workers`` workers reported connector job ``job_id``; ``success``: all of them did so
    successfully."""

    job_id: int
    workers: int
    success: bool


def merge_reports(*groups: Iterable[RankReport]) -> tuple[RankReport, ...]:
    """The reports of several workers as one: per job, workers added, success ANDed; ascending
    job id."""
    merged: dict[int, tuple[int, bool]] = {}
    for group in groups:
        for r in group:
            workers, ok = merged.get(r.job_id, (0, True))
            merged[r.job_id] = (workers + r.workers, ok and r.success)
    return tuple(RankReport(j, w, ok) for j, (w, ok) in sorted(merged.items()))


class JobQuorum:
    """Holds each job's reports until all ``world_size`` workers reported it."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: at least one worker")
        self.world_size = world_size
        self._pending: dict[int, tuple[int, bool]] = {}

    def fold(self, reports: Iterable[RankReport]) -> tuple[JobResult, ...]:
        """The jobs that reached ``world_size`` workers with these reports, ascending.

        Refusal: a job reported by more workers than exist (a worker reported it twice).
        """
        released = []
        for r in reports:
            workers, ok = self._pending.pop(r.job_id, (0, True))
            workers, ok = workers + r.workers, ok and r.success
            if workers > self.world_size:
                raise HybridKVConfigError(
                    "kv_connector_worker_meta",
                    r.job_id,
                    f"job reported by {workers} workers of {self.world_size}",
                    "each worker reports a job once",
                )
            if workers == self.world_size:
                released.append(JobResult(r.job_id, ok))
            else:
                self._pending[r.job_id] = (workers, ok)
        return tuple(sorted(released))

    def pending(self) -> int:
        """Jobs some but not all workers reported."""
        return len(self._pending)


def refuse_unsupported_parallelism(parallel_config: object) -> None:
    """Pipeline and context parallelism are refused at start-up, naming the setting.

    Pipeline parallel splits the layers over ranks, so a rank's ``KVCacheConfig`` does not name
    every group's layers and the host slot of one rank is not one rank's shard of a block;
    prefill/decode context parallel interleave a block's tokens over ranks. Neither is built
    nor tested in hybridkv.vllm.
    """
    for name, what in (
        ("pipeline_parallel_size", "pipeline parallel"),
        ("prefill_context_parallel_size", "prefill context parallel"),
        ("decode_context_parallel_size", "decode context parallel"),
    ):
        value = getattr(parallel_config, name, 1)
        if value != 1:
            raise HybridKVConfigError(
                f"parallel_config.{name}",
                value,
                f"{what} is not supported by hybridkv.vllm (tensor parallel is)",
                f"set --{name.replace('_', '-')} 1",
            )


@dataclass(frozen=True, slots=True)
class HostSharding:
    """How ``world_size`` ranks map onto host copies: ``replicas`` consecutive ranks hold
    identical KV (vLLM's ``kv_tp_replicas``; 1: every rank its own shard)."""

    world_size: int
    replicas: int

    @property
    def copies(self) -> int:
        """Distinct host copies of a chunk: one per shard (``host_memory_bytes`` is split over
        these, not over the ranks)."""
        return self.world_size // self.replicas

    def shard(self, rank: int) -> int:
        """The shard ``rank`` holds (the index of its replica group)."""
        return rank // self.replicas

    def writes(self, rank: int) -> bool:
        """Whether ``rank`` writes its shard's host slots: the first rank of each group."""
        return rank % self.replicas == 0

    def shared_path(self, engine_id: str, rank: int) -> str | None:
        """The file ``rank``'s group maps as host memory (None: unreplicated, private memory).
        Named by vLLM's ``engine_id`` (a fresh uuid per engine unless set), so two engines on
        one machine never share a region."""
        if self.replicas == 1:
            return None
        return f"/dev/shm/hybridkv-{engine_id}-shard{self.shard(rank)}.kv"


def host_sharding(parallel_config: Any, kv_cache_config: Any) -> HostSharding:
    """The sharding of vLLM's configs; refuses a replica count that does not divide the ranks.

    With pipeline and context parallel refused, the ranks are the tensor-parallel ranks. The
    shared region is a file on one machine, so replicas share it only when every rank runs
    there as a process of vLLM's ``mp`` executor (vLLM's native connector draws the same
    line); otherwise each rank keeps its own copy, as if unreplicated (correct, not deduped).
    """
    world = int(parallel_config.world_size)
    replicas = getattr(kv_cache_config, "kv_tp_replicas", 1)
    is_int = isinstance(replicas, int) and not isinstance(replicas, bool)
    if not is_int or replicas < 1 or world % replicas:
        raise HybridKVConfigError(
            "kv_cache_config.kv_tp_replicas",
            replicas,
            f"does not divide the {world} tensor-parallel ranks into groups of identical KV",
            "report it: vLLM plans kv_tp_replicas as a divisor of tensor_parallel_size",
        )
    one_machine = (
        getattr(parallel_config, "distributed_executor_backend", None) == "mp"
        and getattr(parallel_config, "nnodes_within_dp", 1) == 1
    )
    return HostSharding(world, replicas if one_machine else 1)


class ReplicaEngine(EngineWrapper):
    """A replica rank's engine: loads copy, stores move nothing (its group's writer stores the
    same bytes into the shared slots) yet are real jobs of ``inner``, reported once like any
    other, so the worker's bookkeeping and the quorum see every job."""

    def submit(self, direction: Direction, pairs: Sequence[TransferPair]) -> JobId:
        if direction is Direction.STORE:
            return self.inner.submit(direction, [])  # an empty job finishes successfully
        return self.inner.submit(direction, pairs)
