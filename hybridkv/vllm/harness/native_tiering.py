"""vLLM 0.33's native ``OffloadingConnector`` with ``TieringOffloadingSpec`` and its ``fs`` tier,
its worker on CPU tensors.

The scheduler side is vLLM's own, unchanged: ``TieringOffloadingManager`` over a CPU primary tier
(LRU or ARC) and ``FileSystemTierManager`` (``v1/kv_offload/tiering/fs/``) writing every chunk
the primary tier completes to ``root_dir`` (temp file, rename; O_DIRECT where the filesystem
takes it) and promoting a primary miss it finds there back into the primary tier. Both read and
write the primary tier's bytes through the spec's ``SharedOffloadRegion``, a ``/dev/shm`` file
named by the engine id that the scheduler side maps.

The worker side differs from a GPU server's only where :mod:`.native_cpu` does:
``CPUOffloadingSpec.get_worker`` refuses a CPU platform, so :class:`NativeTieringOnCPU` gives the
connector's own ``register_kv_caches`` a :class:`~.native_cpu.HostCopyWorker` whose host chunks
are this rank's views of that same region (``create_next_worker_view``, as
``CPUOffloadingWorker`` takes them), so the bytes the worker stores are the bytes the fs tier
writes, and the bytes the fs tier promotes are the bytes the worker loads.

What the tier did is read from vLLM's own objects: :meth:`NativeTieringOnCPU.fs_counts` sums
the ``transfer_bytes`` of the tier's finished jobs (``JobResult``, what vLLM's write and read
byte metrics count), split by direction and outcome.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridkv.vllm.harness.native_cpu import HostCopyWorker, NativeOffloadOnCPU

__all__ = ["FsCounts", "NativeTieringOnCPU"]


@dataclass(frozen=True, slots=True)
class FsCounts:
    """What the fs tier's finished jobs reported (``JobResult``), by direction and outcome.

    ``stored``/``loaded``: bytes of successful store (cascade) and load (promotion) jobs;
    ``store_jobs_failed``/``load_jobs_failed``: jobs that reported ``success=False`` (a full
    directory fails a store: the tier never evicts).
    """

    stored: int = 0
    loaded: int = 0
    store_jobs: int = 0
    load_jobs: int = 0
    store_jobs_failed: int = 0
    load_jobs_failed: int = 0


class _FsTally:
    """Counts the fs tier's finished jobs as the manager collects them (pass-through)."""

    def __init__(self, tier: Any) -> None:
        self.counts = FsCounts()
        directions: dict[int, bool] = {}  # job id -> is a promotion (load)
        submit_store, submit_load = tier.submit_store, tier.submit_load
        finished = tier.get_finished_jobs

        def stored(job: Any) -> None:
            directions[job.job_id] = False
            submit_store(job)

        def loaded(job: Any) -> None:
            directions[job.job_id] = True
            submit_load(job)

        def collected() -> Any:
            results = list(finished())
            for result in results:
                self._count(directions.pop(result.job_id), result)
            return results

        tier.submit_store, tier.submit_load = stored, loaded
        tier.get_finished_jobs = collected

    def _count(self, load: bool, result: Any) -> None:
        c, nbytes = self.counts, result.transfer_bytes or 0
        if load:
            self.counts = FsCounts(
                c.stored,
                c.loaded + (nbytes if result.success else 0),
                c.store_jobs,
                c.load_jobs + 1,
                c.store_jobs_failed,
                c.load_jobs_failed + (not result.success),
            )
        else:
            self.counts = FsCounts(
                c.stored + (nbytes if result.success else 0),
                c.loaded,
                c.store_jobs + 1,
                c.load_jobs,
                c.store_jobs_failed + (not result.success),
                c.load_jobs_failed,
            )


class NativeTieringOnCPU(NativeOffloadOnCPU):
    """The worker adapter for ``OffloadingConnector`` with ``TieringOffloadingSpec``.

    ``host_chunks``: the CPU primary tier in chunks (as :class:`~.native_cpu.NativeOffloadOnCPU`);
    ``root_dir``: the fs tier's directory; ``threads``: its read and its write threads each;
    ``delay``: the steps a GPU <-> host copy takes. :meth:`configure` writes
    ``spec_name``, ``cpu_bytes_to_use`` and ``secondary_tiers`` into the connector's extra
    config before vLLM builds the connector.
    """

    def __init__(self, host_chunks: int, root_dir: Path, *, threads: int = 4, delay: int = 1):
        super().__init__(host_chunks, delay)
        if threads < 1:
            raise ValueError(f"threads={threads}: the fs tier needs at least 1 read and 1 write")
        self.root_dir = Path(root_dir)
        self.threads = threads
        self._tally: _FsTally | None = None
        self._region: Any = None

    def configure(self, vllm_config: Any, kv_cache_config: Any) -> None:
        super().configure(vllm_config, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        extra["spec_name"] = "TieringOffloadingSpec"
        extra["secondary_tiers"] = [
            {
                "type": "fs",
                "root_dir": str(self.root_dir),
                "n_read_threads": self.threads,
                "n_write_threads": self.threads,
            }
        ]

    def watch(self, scheduler_connector: Any) -> None:
        """Count the fs tier's jobs on the scheduler side's manager (call before the run)."""
        manager = scheduler_connector.connector_scheduler.manager
        (tier,) = manager.secondary_tiers
        self._tally = _FsTally(tier)

    def fs_counts(self) -> FsCounts:
        return FsCounts() if self._tally is None else self._tally.counts

    def attach(self, connector: Any, kv_caches: dict[str, torch.Tensor]) -> None:
        """The connector's own ``register_kv_caches``, the host chunks in the shared region."""
        from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

        inner = connector.connector_worker
        spec = inner.spec
        if spec.num_chunks != self.host_chunks:
            raise AssertionError(
                f"the tiering spec sized the tier at {spec.num_chunks} chunks, "
                f"not {self.host_chunks}"
            )

        def init_worker(canonical: Any) -> None:
            worker = HostCopyWorker(canonical, spec.blocks_per_chunk, 1, self.delay)
            self._region = SharedOffloadRegion(
                engine_id=spec.config.engine_id,
                num_chunks=spec.num_chunks,
                rank=0,
                kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
                cpu_page_size=spec.cpu_page_size_per_worker,
            )
            # The views CPUOffloadingWorker takes, one per canonical tensor, in order.
            worker.host = [
                self._region.create_next_worker_view(page * spec.blocks_per_chunk)
                for page in worker.pages
            ]
            self.worker = worker
            inner.worker = worker

        inner._init_worker = init_worker
        connector.register_kv_caches(kv_caches)

    def close(self) -> None:
        """Unmap this rank's view of the region (the scheduler side unmaps its own)."""
        if self._region is not None:
            if self.worker is not None:
                self.worker.host = []
            self._region.cleanup()
            self._region = None
