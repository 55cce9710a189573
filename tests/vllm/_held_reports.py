"""A transfer engine whose chosen jobs report only when the test releases them (a slow copy,
made exact), and the in-process adapter that puts it under ``HybridKVConnector``'s worker.

The adapter's ``job_hook`` (``TransferJob -> Direction | bool | None``) decides per job: True
fails it before submission, a :class:`Direction` holds its report until
:meth:`HeldReports.release`, None lets it run as usual.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from hybridkv.connector.api import TransferJob, TransferKind
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


def hold_loads_of(request_id: str) -> JobHook:
    """A job hook that holds every load of ``request_id`` and lets every other job run."""

    def hook(job: TransferJob) -> Direction | None:
        return (
            Direction.LOAD
            if job.kind is TransferKind.LOAD and job.request_id == request_id
            else None
        )

    return hook


def held_load_engine(adapter: HybridKVOnCPU) -> Any:
    """Sliding window + full attention in vLLM's scheduler, a 64 MiB host tier, 48 GPU blocks of
    32 tokens, 128 tokens a step, ``adapter`` under the connector's worker."""
    from diffharness.layouts import RECIPES, Layout
    from vllm.config import KVTransferConfig

    from hybridkv.vllm.harness.engine_config import EngineSettings
    from hybridkv.vllm.harness.inprocess import InProcessEngine

    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"host_memory_bytes": 64 << 20, "chunk_size": 32},
    )
    settings = EngineSettings(
        num_gpu_blocks=48, max_model_len=512, block_size=32, max_num_batched_tokens=128
    )
    return InProcessEngine(RECIPES[Layout.SLIDING_FULL].config_json(), settings, transfer, adapter)


def start_a_held_load(engine: Any, adapter: HoldingAdapter, steps: int) -> None:
    """Request a runs to the end and is stored; vLLM's GPU cache is cleared, so b (a's prompt
    and 3 more tokens) claims a's prefix from the host; within ``steps`` engine steps b waits
    for that load, which :func:`hold_loads_of` ("b") holds (asserted)."""
    rng = random.Random(1)
    prompt = [rng.randint(3, 999) for _ in range(200)]
    engine.add("a", prompt, 2)
    while engine.busy():
        engine.step()
    assert engine.scheduler.reset_prefix_cache()  # vLLM's GPU cache only: b loads
    engine.add("b", [*prompt, 5, 6, 7], 3)
    for _ in range(steps):
        engine.step()
        if engine.status("b") == "WAITING_FOR_REMOTE_KVS":
            break
    assert engine.status("b") == "WAITING_FOR_REMOTE_KVS"
    assert adapter.hold is not None
    assert adapter.hold.held
