"""The in-process engine's worker adapter for :class:`~hybridkv.vllm.connector.HybridKVConnector`,
with seeded fault injection (:class:`FaultPlan`), a simulated copy delay and an optional host size.

The connector's worker side runs unchanged on the CPU caches vLLM's ``allocate_kv_cache`` built
(canonical caches, the CPU transfer engine on its copy thread, the core's transfer worker). A
:class:`FaultPlan` fails each job with its direction's rate, in one of two places, both seeded so
a run is reproducible:

- before submission (the transfer worker's job hook): the job reports failed and no byte moves;
- inside the copy (:class:`_CopyFaults`, between the delay and the CPU engine, and the engine's
  per-run hook on the copy thread): a job of two or more copy runs raises at its second run, so
  its first has moved (a failed load leaves its blocks half written, which vLLM's recompute must
  overwrite before anything reads them); a job of one run moves its bytes and reports failed.

The first draw is made per job at the job hook, the second per submitted copy at the conditional
rate that makes the two together fail the plan's rate of the jobs: most loads of a mamba + full
layout are one run (a chunk's full-attention block alone), and a fault that only fired at a
second run used to miss them (``hybridkv simulate --engine vllm --requests 32 --faults 0.1``
injected 4 of 124 jobs; now 8 of 126).

Timing: the engine sits under :class:`~hybridkv.vllm.harness.delayed.DelayedCompletion`, the report
rule of :class:`hybridkv.vllm.harness.native_cpu.HostCopyWorker`: a job reports once it has been
polled ``delay`` times (one poll a step; 0 and 1 both mean the first poll after submission), in
submission order per direction, and is waited for then, whatever the copy thread's timing. So
``HybridKVOnCPU(delay=d)`` and ``NativeOffloadOnCPU(host_chunks, d)`` simulate the same copy
latency. A job failed before submission never reaches the engine: it reports at the next poll.
A load lands when it is due, so with a ``load_deadline_steps`` below ``delay`` the connector
abandons it first and it is cancelled, no byte moved (``loads_cancelled`` in :meth:`stats`).

Only failures that fired are counted (a copy drawn to fail that was cancelled first is not).
Faults and delay are not reachable from ``kv_connector_extra_config``;
``host_bytes`` only writes its ``host_memory_bytes`` (the benchmark sizes both connectors' host
tiers alike this way).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.connector.api import TransferJob, TransferKind
from hybridkv.transfer.api import (
    Direction,
    EngineWrapper,
    FinishedJob,
    JobId,
    TransferEngine,
    TransferPair,
)
from hybridkv.vllm.harness.delayed import DelayedCompletion
from hybridkv.vllm.layout import read_layout

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
    """Draws the plan's faults, all on the main thread in submission order (so a seed fixes
    them); the copy thread only raises where a draw said so."""

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self._job_rng = random.Random(plan.seed)
        self._copy_rng = random.Random(plan.seed ^ 0x5EED)
        self._doomed: set[JobId] = set()  # engine jobs to fail inside the copy
        self._lock = threading.Lock()
        self.counts = {"load_faults": 0, "store_faults": 0}

    def _rate(self, load: bool) -> float:
        return self.plan.load_rate if load else self.plan.store_rate

    def _fired(self, load: bool) -> None:
        with self._lock:
            self.counts["load_faults" if load else "store_faults"] += 1

    def job_hook(self, job: TransferJob) -> bool:
        """Fail ``job`` before submission? (the plan's rate times ``1 - mid_copy``)"""
        load = job.kind is TransferKind.LOAD
        if self._job_rng.random() >= self._rate(load) * (1.0 - self.plan.mid_copy):
            return False
        self._fired(load)
        return True

    def copy_rate(self, load: bool) -> float:
        """The rate at which a job that passed :meth:`job_hook` fails inside its copy, so that
        ``before + (1 - before) * inside`` is the plan's rate."""
        rate = self._rate(load)
        before = rate * (1.0 - self.plan.mid_copy)
        return 0.0 if before >= 1.0 else rate * self.plan.mid_copy / (1.0 - before)

    def submitted(self, submit: Callable[[], JobId], load: bool) -> JobId:
        """Run ``submit`` (the engine's) and draw whether that copy fails; under the lock, so
        the copy thread cannot reach the job's second run before the draw is recorded."""
        with self._lock:
            job = submit()
            if self._copy_rng.random() < self.copy_rate(load):
                self._doomed.add(job)
        return job

    def copy_hook(self, job: JobId, direction: Direction, run: int) -> None:
        """Raise inside run 1 of a job drawn to fail in its copy (run 0 has moved by then)."""
        if run != 1:
            return
        with self._lock:
            doomed = job in self._doomed
            self._doomed.discard(job)
        if doomed:
            self._fired(direction is Direction.LOAD)
            raise InjectedFault(f"injected copy fault in engine job {job} ({direction.value})")

    def finished(self, done: FinishedJob, direction: Direction) -> FinishedJob:
        """A doomed job that finished without a run 1 (one run: its bytes moved) fails now;
        one that failed anyway (cancelled before it started) is not counted."""
        with self._lock:
            doomed = done.job_id in self._doomed
            self._doomed.discard(done.job_id)
        if not doomed or not done.success:
            return done
        self._fired(direction is Direction.LOAD)
        return FinishedJob(done.job_id, False)


class _CopyFaults(EngineWrapper):
    """The CPU engine with :class:`_Injector`'s copy faults: draws at each submission, and
    reports a one-run job drawn to fail as failed (module docstring)."""

    def __init__(self, inner: TransferEngine, injector: _Injector) -> None:
        super().__init__(inner)
        self._injector = injector
        self._direction: dict[JobId, Direction] = {}

    def submit(self, direction: Direction, pairs: Sequence[TransferPair]) -> JobId:
        if not pairs:
            # No copy, nothing to fail inside it: a replica rank's store moves no byte
            # (hybridkv.vllm.ranks.ReplicaEngine), its group's writer copies the shared slots.
            job = self.inner.submit(direction, pairs)
        else:
            load = direction is Direction.LOAD
            job = self._injector.submitted(lambda: self.inner.submit(direction, pairs), load)
        self._direction[job] = direction
        return job

    def poll(self) -> list[FinishedJob]:
        return [
            self._injector.finished(done, self._direction.pop(done.job_id))
            for done in self.inner.poll()
        ]


class HybridKVOnCPU:
    """The :class:`~hybridkv.vllm.harness.inprocess.WorkerAdapter` of ``HybridKVConnector``: its own
    registration on the CPU caches, reports ``delay`` polls late (:class:`DelayedCompletion`,
    the rule of the native adapter's ``HostCopyWorker``), ``faults`` injected (None: none).

    ``host_bytes``: written to ``host_memory_bytes`` before vLLM builds the connector (at least
    one slot, so it can be built); None keeps the extra config's own.
    """

    def __init__(
        self, *, host_bytes: int | None = None, faults: FaultPlan | None = None, delay: int = 1
    ) -> None:
        if host_bytes is not None and host_bytes < 1:
            raise ValueError(f"host_bytes={host_bytes}: the host tier needs at least 1 byte")
        if delay < 0:
            raise ValueError(f"delay={delay}: a transfer takes 0 or more steps")
        self.host_bytes = host_bytes
        self._injector = None if faults is None else _Injector(faults)
        self.delay = delay
        self.connector: Any = None
        self.engine: DelayedCompletion | None = None

    def configure(self, vllm_config: Any, kv_cache_config: Any) -> None:
        if self.host_bytes is None:
            return
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        # One slot on each tensor-parallel rank (host_memory_bytes is split over the ranks).
        ranks = int(vllm_config.parallel_config.world_size)
        slot = read_layout(vllm_config, kv_cache_config).slot_bytes * ranks
        extra["host_memory_bytes"] = max(self.host_bytes, slot)

    def attach(self, connector: Any, kv_caches: dict[str, torch.Tensor]) -> None:
        injector = self._injector
        connector._register(
            kv_caches,
            None if injector is None else injector.job_hook,
            None if injector is None else injector.copy_hook,
            self._delayed,
        )
        self.connector = connector

    def _delayed(self, engine: Any) -> DelayedCompletion:
        if self._injector is not None:
            engine = _CopyFaults(engine, self._injector)
        self.engine = DelayedCompletion(engine, self.delay)
        return self.engine

    def pending(self) -> int:
        """Connector jobs bound on the worker and not reported yet (a job failed before
        submission counts too: it never reaches the engine)."""
        worker = None if self.connector is None else self.connector.worker
        return 0 if worker is None else len(worker.in_flight())

    def stats(self) -> dict[str, int]:
        """The transfer worker's counters, the faults that fired and the loads cancelled."""
        worker = None if self.connector is None else self.connector.worker
        found = {} if worker is None else dict(worker.stats()._asdict())
        if self.engine is not None:
            found["loads_cancelled"] = self.engine.cancelled
        if self._injector is not None:
            found.update(self._injector.counts)
        return found
