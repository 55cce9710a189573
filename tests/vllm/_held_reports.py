"""A transfer engine whose chosen jobs report only when the test releases them (a slow copy,
made exact), and the in-process adapter that puts it under ``HybridKVConnector``'s worker.

The adapter's ``job_hook`` (``TransferJob -> Direction | bool | None``) decides per job: True
fails it before submission, a :class:`Direction` holds its report until
:meth:`HeldReports.release`, None lets it run as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hybridkv.connector.api import TransferJob
from hybridkv.transfer import Direction, TransferEngine, TransferPair
from hybridkv.transfer.api import EngineWrapper, FinishedJob, JobId
from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU

JobHook = Callable[[TransferJob], "Direction | bool | None"]


class HeldReports(EngineWrapper):
    """Holds back the reports of chosen jobs until released."""

    def __init__(self, inner: TransferEngine) -> None:
        super().__init__(inner)
        self.hold_next: Direction | None = None
        self.held: dict[JobId, Direction] = {}
        self._kept: list[FinishedJob] = []

    def submit(self, direction: Direction, pairs: Sequence[TransferPair]) -> JobId:
        job = self.inner.submit(direction, pairs)
        if self.hold_next is direction:
            self.held[job] = direction
            self.hold_next = None
        return job

    def release(self, direction: Direction | None = None) -> None:
        """Let the held jobs of ``direction`` (None: all) report at the next poll."""
        self.held = {j: d for j, d in self.held.items() if direction not in (None, d)}

    def poll(self) -> list[FinishedJob]:
        found, self._kept = self._kept + self.inner.poll(), []
        self._kept = [f for f in found if f.job_id in self.held]
        return [f for f in found if f.job_id not in self.held]


class HoldingAdapter(HybridKVOnCPU):
    """:class:`HybridKVOnCPU` (reports one poll late) over :class:`HeldReports`."""

    def __init__(self, job_hook: JobHook) -> None:
        super().__init__(delay=1)
        self._decide = job_hook
        self.hold: HeldReports | None = None

    def attach(self, connector: Any, kv_caches: Any) -> None:
        connector._register(kv_caches, self._job_hook, None, self._wrap)
        self.connector = connector

    def _wrap(self, engine: Any) -> HeldReports:
        self.hold = HeldReports(self._delayed(engine))
        return self.hold

    def _job_hook(self, job: TransferJob) -> bool:
        assert self.hold is not None
        verdict = self._decide(job)
        if isinstance(verdict, Direction):
            self.hold.hold_next = verdict
            return False
        return bool(verdict)
