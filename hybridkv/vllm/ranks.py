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
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hybridkv.connector import JobResult
from hybridkv.errors import HybridKVConfigError

__all__ = ["JobQuorum", "RankReport", "merge_reports", "refuse_unsupported_parallelism"]


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
