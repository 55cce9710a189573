"""vLLM 0.33's native ``OffloadingConnector`` (CPU offloading spec) with its worker on CPU tensors.

The connector's own ``register_kv_caches`` runs unchanged on the CPU caches: it derives vLLM's
canonical tensors and per-group refs. Only its last step differs: ``CPUOffloadingSpec.get_worker``
refuses a platform that is neither CUDA nor XPU (``v1/kv_offload/cpu/spec.py``), so
:class:`NativeOffloadOnCPU` hands the canonical caches to :class:`HostCopyWorker`, an
``OffloadingWorker`` that really moves the bytes between those tensors and host chunks, with the
direct layout's addressing of ``SingleDirectionOffloadingHandler`` (``cpu/gpu_worker.py``): a
group's GPU blocks map to consecutive sub-blocks of its host chunks, skipping
``block_index % blocks_per_chunk`` in the first.

Timing: a job's bytes move when the job completes, ``delay`` polls of ``get_finished`` after its
submission (one poll a step), in submission order per direction; ``wait(job_ids)`` completes
those jobs and the ones before them at once. Moving bytes at completion, the latest moment the
real engine may, means a connector that lets vLLM reuse a block before its job is reported reads
or writes the wrong bytes, and the content check sees it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["HostCopyWorker", "NativeOffloadOnCPU"]

_ALIGN = 4096  # CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT: chunk bytes are rounded to it


@dataclass(slots=True)
class _Job:
    job_id: int
    store: bool
    gpu_spec: Any
    cpu_spec: Any
    polls: int = 0


class HostCopyWorker:
    """An ``OffloadingWorker`` for CPU tensors (see the module docstring)."""

    def __init__(self, canonical: Any, blocks_per_chunk: int, num_chunks: int, delay: int):
        self.gpu = [t.tensor for t in canonical.tensors]
        self.pages = [t.page_size_bytes for t in canonical.tensors]
        self.refs = canonical.group_data_refs
        self.per_chunk = blocks_per_chunk
        self.host = [
            torch.zeros((num_chunks, page * blocks_per_chunk), dtype=torch.int8)
            for page in self.pages
        ]
        self.delay = delay
        self.queues: dict[bool, deque[_Job]] = {True: deque(), False: deque()}
        self.done: list[Any] = []
        self.jobs = {"store": 0, "load": 0, "bytes_stored": 0, "bytes_loaded": 0}

    # ------------------------------------------------------------ OffloadingWorker
    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        self.queues[True].append(_Job(job_id, True, src_spec, dst_spec))
        self.jobs["store"] += 1
        return True

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False):
        self.queues[False].append(_Job(job_id, False, dst_spec, src_spec))
        self.jobs["load"] += 1
        return True

    def get_finished(self) -> list[Any]:
        out, self.done = self.done, []
        for queue in self.queues.values():
            for job in queue:
                job.polls += 1
            while queue and queue[0].polls >= self.delay:
                out.append(self._complete(queue.popleft()))
        return out

    def wait(self, job_ids: set[int]) -> None:
        for queue in self.queues.values():
            last = max((i for i, j in enumerate(queue) if j.job_id in job_ids), default=-1)
            for _ in range(last + 1):
                self.done.append(self._complete(queue.popleft()))

    def shutdown(self) -> None:
        self.queues = {True: deque(), False: deque()}

    def pending(self) -> int:
        """Jobs submitted and not yet reported."""
        return sum(len(q) for q in self.queues.values()) + len(self.done)

    # ------------------------------------------------------------ copying
    def _complete(self, job: _Job) -> Any:
        from vllm.v1.kv_offload.base import TransferResult

        moved = self._copy(job)
        self.jobs["bytes_stored" if job.store else "bytes_loaded"] += moved
        return TransferResult(job_id=job.job_id, success=True)

    def _copy(self, job: _Job) -> int:
        gpu_ids = [int(b) for b in job.gpu_spec.block_ids]
        chunk_ids = [int(c) for c in job.cpu_spec.block_ids]
        moved = 0
        g_off = c_off = 0
        for group, (size, index) in enumerate(
            zip(job.gpu_spec.group_sizes, job.gpu_spec.block_indices, strict=True)
        ):
            if size == 0:
                continue
            skip = index % self.per_chunk
            n_chunks = -(-(size + skip) // self.per_chunk)
            blocks = gpu_ids[g_off : g_off + size]
            chunks = chunk_ids[c_off : c_off + n_chunks]
            for ref in self.refs[group]:
                moved += self._copy_ref(ref, blocks, chunks, skip, job.store)
            g_off += size
            c_off += n_chunks
        if g_off != len(gpu_ids) or c_off != len(chunk_ids):
            raise AssertionError(
                f"job {job.job_id}: group sizes {list(job.gpu_spec.group_sizes)} cover "
                f"{g_off}/{len(gpu_ids)} GPU blocks and {c_off}/{len(chunk_ids)} host chunks"
            )
        return moved

    def _copy_ref(self, ref: Any, blocks: list[int], chunks: list[int], skip: int, store: bool):
        gpu, host = self.gpu[ref.tensor_idx], self.host[ref.tensor_idx]
        page, nbytes = self.pages[ref.tensor_idx], ref.page_size_bytes
        for k, block in enumerate(blocks):
            sub = skip + k
            row, col = chunks[sub // self.per_chunk], (sub % self.per_chunk) * page
            if store:
                host[row, col : col + nbytes] = gpu[block, :nbytes]
            else:
                gpu[block, :nbytes] = host[row, col : col + nbytes]
        return nbytes * len(blocks)


class NativeOffloadOnCPU:
    """The worker adapter for vLLM's ``OffloadingConnector`` with the CPU offloading spec.

    ``host_chunks`` sizes the host tier in chunks (``cpu_bytes_to_use`` is derived from the
    planned KV-cache config before vLLM builds the connector); ``delay`` is the steps a
    transfer takes (see :class:`HostCopyWorker`).
    """

    def __init__(self, host_chunks: int, delay: int = 1):
        if host_chunks < 1:
            raise ValueError(f"host_chunks={host_chunks}: the host tier needs at least 1 chunk")
        if delay < 0:
            raise ValueError(f"delay={delay}: a transfer takes 0 or more steps")
        self.host_chunks = host_chunks
        self.delay = delay
        self.worker: HostCopyWorker | None = None

    def configure(self, vllm_config: Any, kv_cache_config: Any) -> None:
        """Size the host tier: ``host_chunks`` chunks of one block each."""
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        per_block = kv_cache_config.kv_cache_tensors[0].size // kv_cache_config.num_blocks
        extra["cpu_bytes_to_use"] = self.host_chunks * (-(-per_block // _ALIGN) * _ALIGN)

    def attach(self, connector: Any, kv_caches: dict[str, torch.Tensor]) -> None:
        """Run the connector's own ``register_kv_caches`` with a :class:`HostCopyWorker`."""
        inner = connector.connector_worker
        spec = inner.spec
        if spec.num_chunks != self.host_chunks:
            raise AssertionError(
                f"the CPU spec sized the tier at {spec.num_chunks} chunks, not {self.host_chunks}"
            )

        def init_worker(canonical: Any) -> None:
            self.worker = HostCopyWorker(
                canonical, spec.blocks_per_chunk, spec.num_chunks, self.delay
            )
            inner.worker = self.worker

        inner._init_worker = init_worker
        connector.register_kv_caches(kv_caches)

    def pending(self) -> int:
        return 0 if self.worker is None else self.worker.pending()

    def stats(self) -> dict[str, int]:
        return {} if self.worker is None else dict(self.worker.jobs)
