"""vLLM 0.33's own engine loop over the in-process engine: ``EngineCore.step`` (synchronous
scheduling) or ``EngineCore.step_with_batch_queue`` (async scheduling, vLLM's default on a GPU).

Under async scheduling the engine core schedules step N+1 before step N's sampled token is
applied to the request (``engine/core.py:708-799``): a decode step computes a token the request
does not hold yet (an output placeholder), so the block that ends at it has no block hash when
the connector's ``build_connector_meta`` runs. vLLM's CPU build turns async scheduling off even
when asked (``platforms/cpu.py:348``), so only a harness that runs vLLM's own loop code sees it.

What is vLLM's here and what is not:

- vLLM's: the loop functions themselves (``EngineCore.step``, ``step_with_batch_queue`` and
  ``post_step``, run unmodified on :class:`_EngineCore`), and the utility calls a client makes
  between turns of the loop (``pause_scheduler`` as ``pause_generation`` reaches it, ``sleep``,
  ``wake_up``, ``reset_prefix_cache``), the ``Scheduler`` or ``AsyncScheduler``
  that ``SchedulerConfig.get_scheduler_cls`` picks, the batch queue of
  ``max_concurrent_batches`` (2 under async scheduling), and ``update_from_output``.
- Not vLLM's: ``EngineCore.__init__`` (it starts a real executor, profiles memory and plans the
  caches; the in-process engine did the planning with vLLM's own functions), and the executor:
  :class:`StandInExecutor` runs the stand-in runner (the connector's worker hooks in the GPU
  runner's order, the forward that writes and checks every cache slot) when
  ``execute_model`` is called and hands the sampled tokens back from ``sample_tokens``, as the
  GPU runner does when sampling is a separate call. The runner keeps the tokens it sampled
  until the scheduler applies them (the GPU runner keeps them on the device), so under async
  scheduling it computes a step whose input token the request does not hold yet. Futures are
  resolved when created: the runner has no device stream to overlap with.
"""

from __future__ import annotations

import queue
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from enum import Enum
from typing import Any

__all__ = ["EngineLoop", "LoopKind", "StandInExecutor", "build_engine_core"]


class LoopKind(Enum):
    """Which of vLLM's loop functions steps the engine."""

    SYNC = "step"  # EngineCore.step: schedule, run, apply, one step at a time
    BATCH_QUEUE = "step_with_batch_queue"  # async scheduling: N+1 scheduled before N applied


def _resolved(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class StandInExecutor:
    """The executor ``EngineCore`` calls, over a ``run`` function (scheduler output to a
    ``ModelRunnerOutput``): ``execute_model`` runs the step at once and, when the model ran,
    keeps its output for ``sample_tokens``, as vLLM's GPU runner does."""

    def __init__(self, run: Callable[[Any], Any]) -> None:
        self._run = run
        self._sampled: deque[Any] = deque()
        self.calls: list[str] = []  # the calls below that stand for device work
        self.is_sleeping = False

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        output = self._run(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens > 0:
            # The GPU runner returns None here and the sampled tokens from sample_tokens.
            self._sampled.append(output)
            output = None
        return _resolved(output) if non_block else output

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        if not self._sampled:
            raise RuntimeError("sample_tokens called with no executed step waiting for it")
        output = self._sampled.popleft()
        return _resolved(output) if non_block else output

    def take_draft_token_ids(self) -> Any:
        return None  # the stand-in runner proposes no draft tokens

    # What vLLM's pause, sleep and cache resets ask the executor: the stand-in runner has no
    # device to synchronize, no multimodal or encoder cache and no weights to offload, so
    # each is a call that changes nothing (counted, so a test can see it was made).
    def collective_rpc(self, method: Any, *args: Any, **kwargs: Any) -> list[Any]:
        self.calls.append(str(method))
        return []

    def reset_mm_cache(self) -> None:
        self.calls.append("reset_mm_cache")

    def reset_encoder_cache(self) -> None:
        self.calls.append("reset_encoder_cache")

    def sleep(self, level: int = 1) -> None:
        self.calls.append(f"sleep({level})")
        self.is_sleeping = True

    def wake_up(self, tags: Any = None) -> None:
        self.calls.append("wake_up")
        self.is_sleeping = False

    def get_kv_connector_handshake_metadata(self) -> list[Any]:
        return []  # no peer to hand shake with


class _EngineCore:
    """Holds what vLLM's loop functions read of an ``EngineCore`` (set as its ``__init__`` sets
    them, from the config); those functions are bound to it from ``EngineCore`` itself."""


def build_engine_core(vllm_config: Any, scheduler: Any, executor: StandInExecutor) -> Any:
    """An object on which vLLM's ``EngineCore.step``, ``step_with_batch_queue`` and
    ``post_step`` run unmodified, over ``scheduler`` and ``executor``."""
    from vllm.v1.engine.core import EngineCore

    core = _EngineCore()
    attrs: dict[str, Any] = {
        "vllm_config": vllm_config,
        "log_stats": True,
        "_weight_version": "default",
        "model_executor": executor,
        "scheduler": scheduler,
        "structured_output_manager": scheduler.structured_output_manager,
        "use_spec_decode": vllm_config.speculative_config is not None,
        "is_mm_encoder_only": vllm_config.is_mm_encoder_only,
        "is_pooling_model": vllm_config.model_config.runner_type == "pooling",
        "async_scheduling": bool(vllm_config.scheduler_config.async_scheduling),
        "aborts_queue": queue.Queue(),
        "batch_queue_size": vllm_config.max_concurrent_batches,
        "mm_receiver_cache": None,
    }
    attrs["check_for_draft_tokens"] = (
        attrs["use_spec_decode"] or vllm_config.model_config.is_diffusion
    )
    size = attrs["batch_queue_size"]
    attrs["batch_queue"] = deque(maxlen=size) if size > 1 else None
    core.__dict__.update(attrs)
    for name in (
        "step",
        "step_with_batch_queue",
        "post_step",
        "_process_aborts_queue",
        "_attach_iteration_details",
        "_attach_weight_version",
        "capture_iteration_details",
        "log_error_detail",
        "_should_throttle_prefills",
        "_make_iteration_details_stats",
        # pause_generation, sleep and the cache resets, as a client's utility calls run them
        "pause_scheduler",
        "resume_scheduler",
        "is_scheduler_paused",
        "_finish_pause",
        "_reset_caches",
        "reset_prefix_cache",
        "reset_mm_cache",
        "reset_encoder_cache",
        "sleep",
        "wake_up",
        "_set_kv_connector_handshake_metadata",
    ):
        setattr(core, name, getattr(EngineCore, name).__get__(core))
    core.step_fn = core.step if core.batch_queue is None else core.step_with_batch_queue
    return core


class EngineLoop:
    """Steps an engine core built by :func:`build_engine_core` as ``EngineCore``'s busy loop
    does (``_process_engine_step``: ``step_fn`` then ``post_step``), minus its 1 ms sleep."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.kind = LoopKind.SYNC if core.batch_queue is None else LoopKind.BATCH_QUEUE

    def step(self) -> tuple[list[Any], bool]:
        """One turn of the loop: the request outputs it produced and whether the model ran."""
        outputs, model_executed = self.core.step_fn()
        self.core.post_step(model_executed)
        found = []
        for engine_outputs in (outputs or {}).values():
            found.append(engine_outputs)
        return found, bool(model_executed)

    def in_flight(self) -> int:
        """Scheduled steps whose output is not applied yet (the batch queue's length)."""
        return 0 if self.core.batch_queue is None else len(self.core.batch_queue)

    def busy(self) -> bool:
        """Whether the loop has work: requests in the scheduler or a step in the queue."""
        return bool(self.core.scheduler.has_requests()) or self.in_flight() > 0
