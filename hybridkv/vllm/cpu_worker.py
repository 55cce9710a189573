"""The in-process engine's worker adapter for :class:`~hybridkv.vllm.connector.HybridKVConnector`,
with seeded fault injection (:class:`FaultPlan`).

The connector's worker side runs unchanged on the CPU caches vLLM's ``allocate_kv_cache`` built
(canonical caches, the CPU transfer engine on its copy thread, the core's transfer worker). A
:class:`FaultPlan` fails jobs in two places, both seeded so a run is reproducible:

- before submission (the transfer worker's job hook): the job reports failed and no byte moves;
- inside the copy (the CPU engine's per-run hook, on the copy thread): the job's first run has
  moved when the second raises, so a failed load leaves its blocks half written, which vLLM's
  recompute must overwrite before anything reads them.

Timing: a job is reported on its ``delay``-th poll of ``get_transfer_results`` (one a step) and
waited for then, whatever the copy thread's timing (as :mod:`hybridkv.vllm.native_cpu` does).

Only failures that actually fired are counted (a mid-copy fault planned for a one-run job does
not fire). Nothing here is reachable from ``kv_connector_extra_config``.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.connector.api import TransferJob, TransferKind
from hybridkv.transfer.api import Direction, JobId

__all__ = ["FaultPlan", "HybridKVOnCPU", "InjectedFault"]


class InjectedFault(RuntimeError):
    """A copy failure raised on purpose by :class:`FaultPlan`."""


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """Which jobs fail: each load (store) job fails with ``load_rate`` (``store_rate``); of
    those, the share ``mid_copy`` fails inside the copy, the rest before submission."""

    seed: int
    load_rate: float = 0.0
    store_rate: float = 0.0
    mid_copy: float = 0.5

    def __post_init__(self) -> None:
        for name in ("load_rate", "store_rate", "mid_copy"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"FaultPlan.{name}={value}: a probability in [0, 1]")


class _Injector:
    """Draws the plan's faults (main thread: job hook; copy thread: copy hook)."""

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self._job_rng = random.Random(plan.seed)
        self._copy_rng = random.Random(plan.seed ^ 0x5EED)
        self._doomed: dict[JobId, bool] = {}
        self._lock = threading.Lock()
        self.counts = {"load_faults": 0, "store_faults": 0}

    def _rate(self, load: bool) -> float:
        return self.plan.load_rate if load else self.plan.store_rate

    def job_hook(self, job: TransferJob) -> bool:
        """Fail ``job`` before submission?"""
        load = job.kind is TransferKind.LOAD
        if self._job_rng.random() >= self._rate(load) * (1.0 - self.plan.mid_copy):
            return False
        with self._lock:
            self.counts["load_faults" if load else "store_faults"] += 1
        return True

    def copy_hook(self, job: JobId, direction: Direction, run: int) -> None:
        """Raise inside run 1 of a job drawn to fail mid-copy (run 0 has moved by then)."""
        if run == 0:
            load = direction is Direction.LOAD
            rate = self._rate(load) * self.plan.mid_copy
            self._doomed[job] = self._copy_rng.random() < rate
            return
        if run == 1 and self._doomed.pop(job, False):
            with self._lock:
                key = "load_faults" if direction is Direction.LOAD else "store_faults"
                self.counts[key] += 1
            raise InjectedFault(f"injected copy fault in engine job {job} ({direction.value})")


class HybridKVOnCPU:
    """The :class:`~hybridkv.vllm.inprocess.WorkerAdapter` of ``HybridKVConnector``: its own
    registration on the CPU caches, with ``faults`` injected (None: none)."""

    def __init__(self, faults: FaultPlan | None = None, delay: int = 1) -> None:
        if delay < 1:
            raise ValueError(f"delay={delay}: a job is reported at the earliest on its 1st poll")
        self._injector = None if faults is None else _Injector(faults)
        self.delay = delay
        self.connector: Any = None
        self._age: dict[int, int] = {}

    def configure(self, vllm_config: Any, kv_cache_config: Any) -> None:
        """Nothing to size: the extra config's ``host_memory_bytes`` sizes the host tier."""

    def attach(self, connector: Any, kv_caches: dict[str, torch.Tensor]) -> None:
        self.connector = connector
        injector = self._injector
        if injector is None:
            connector.register_kv_caches(kv_caches)
        else:
            connector._register(kv_caches, injector.job_hook, injector.copy_hook)
        worker = connector.worker
        real = worker.get_transfer_results

        def after_delay(*, wait: bool = False, hold: Any = ()) -> Any:
            # Step-counted timing, not the copy thread's: a job is reported on its
            # ``delay``-th poll (one poll a step), waited for then, so a run does not depend
            # on how the OS schedules the copy thread (a starved thread would otherwise look
            # like a wedge to the step-counting guard).
            flight = worker.in_flight()
            for job in flight:
                self._age[job] = self._age.get(job, 0) + 1
            young = {job for job in flight if self._age[job] < self.delay}
            self._age = {job: self._age[job] for job in young}
            return real(wait=True, hold=young | set(hold))

        worker.get_transfer_results = after_delay

    def pending(self) -> int:
        """Connector jobs bound on the worker and not reported yet."""
        worker = None if self.connector is None else self.connector.worker
        return 0 if worker is None else len(worker.in_flight())

    def stats(self) -> dict[str, int]:
        """The transfer worker's counters and the faults that fired."""
        worker = None if self.connector is None else self.connector.worker
        found = {} if worker is None else dict(worker.stats()._asdict())
        if self._injector is not None:
            found.update(self._injector.counts)
        return found
