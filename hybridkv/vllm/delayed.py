"""HybridKVConnector's worker side on CPU tensors with copies reported ``delay`` steps late.

The benchmark against vLLM's native connector (``tools/bench_vs_native.py``) gives both
connectors the same simulated copy latency. :class:`hybridkv.vllm.native_cpu.HostCopyWorker`
reports a native job once it has been polled ``delay`` times (one poll a step), in submission
order per direction; :class:`DelayedCompletion` applies that rule to hybridkv's real CPU transfer
engine, and :class:`HybridKVOnCPU` is the in-process engine's worker adapter that puts it under
the connector's :class:`~hybridkv.connector.worker.TransferWorker`.

The bytes move when the inner engine moves them (at once, on its copy thread); only the report
is held back, and a held job is waited for before it is reported, so a reported job's bytes
have landed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from hybridkv.transfer import Direction, TransferEngine, TransferPair
from hybridkv.transfer.api import FinishedJob, JobId
from hybridkv.vllm.layout import read_layout

__all__ = ["DelayedCompletion", "HybridKVOnCPU"]


class DelayedCompletion(TransferEngine):
    """A transfer engine whose jobs report after ``delay`` polls (module docstring)."""

    def __init__(self, inner: TransferEngine, delay: int) -> None:
        if delay < 0:
            raise ValueError(f"delay={delay}: a transfer takes 0 or more steps")
        self.inner = inner
        self.delay = delay
        self._queues: dict[Direction, deque[list[int]]] = {d: deque() for d in Direction}
        self._released: list[JobId] = []  # completed by wait(), reported at the next poll
        self._results: dict[JobId, bool] = {}

    def submit(self, direction: Direction, pairs: Sequence[TransferPair]) -> JobId:
        job = self.inner.submit(direction, pairs)
        self._queues[direction].append([job, 0])
        return job

    def poll(self) -> list[FinishedJob]:
        ready, self._released = self._released, []
        for queue in self._queues.values():
            for entry in queue:
                entry[1] += 1
            while queue and queue[0][1] >= self.delay:
                ready.append(JobId(queue.popleft()[0]))
        return self._report(ready)

    def wait(self, job_ids: Iterable[JobId]) -> None:
        wanted = set(job_ids)
        for queue in self._queues.values():
            last = max((i for i, e in enumerate(queue) if e[0] in wanted), default=-1)
            for _ in range(last + 1):
                self._released.append(JobId(queue.popleft()[0]))
        self.inner.wait(self._released)

    def close(self) -> None:
        self.inner.close()

    def pending(self) -> int:
        """Jobs submitted and not yet reported."""
        return sum(len(q) for q in self._queues.values()) + len(self._released)

    def _report(self, ready: list[JobId]) -> list[FinishedJob]:
        if not ready:
            return []
        self.inner.wait(ready)
        for finished in self.inner.poll():
            self._results[finished.job_id] = finished.success
        return [FinishedJob(job, self._results.pop(job)) for job in ready]


class HybridKVOnCPU:
    """The in-process engine's worker adapter for ``HybridKVConnector``.

    ``host_bytes`` sets ``host_memory_bytes`` (before vLLM builds the connector); ``delay`` is
    the steps a copy takes to report (:class:`DelayedCompletion`).
    """

    def __init__(self, host_bytes: int, delay: int = 1) -> None:
        if host_bytes < 1:
            raise ValueError(f"host_bytes={host_bytes}: the host tier needs at least 1 byte")
        self.host_bytes = host_bytes
        self.delay = delay
        self.engine: DelayedCompletion | None = None
        self.connector: Any = None

    def configure(self, vllm_config: Any, kv_cache_config: Any) -> None:
        """Write ``host_memory_bytes`` (at least one slot, so the connector can be built)."""
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        slot = read_layout(vllm_config, kv_cache_config).slot_bytes
        extra["host_memory_bytes"] = max(self.host_bytes, slot)

    def attach(self, connector: Any, kv_caches: dict[str, torch.Tensor]) -> None:
        """The connector's own ``register_kv_caches``, then the delay around its engine."""
        connector.register_kv_caches(kv_caches)
        self.engine = DelayedCompletion(connector.worker.engine, self.delay)
        connector.worker.engine = self.engine
        connector._engine = self.engine
        self.connector = connector

    def pending(self) -> int:
        return 0 if self.engine is None else self.engine.pending()

    def stats(self) -> dict[str, int]:
        if self.connector is None or self.connector.worker is None:
            return {}
        return dict(self.connector.worker.stats()._asdict())
