"""What an in-process run observed (:class:`InProcessReport`), the running tally it is built
from (:class:`Tally`), and the clock on the scheduler-side connector calls
(:class:`ConnectorClock`): what the benchmarks compare between connectors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ConnectorClock", "InProcessReport", "Tally"]

_SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "get_external_cache_hit_sources",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "on_new_request",
    "take_events",
    "has_pending_push_work",
    "has_pending_block_frees",
    "get_kv_connector_stats",
    "get_loaded_kv_cache_group_ids",
    "register_finished_partial_tail",
)


@dataclass(frozen=True, slots=True)
class InProcessReport:
    """What a run observed. Token figures count prompt positions only.

    Attributes:
        connector: the connector class name (``""`` without one).
        requests / finished: requests added and finished.
        steps: engine steps executed (idle think-time ticks not counted).
        prompt_tokens: prompt tokens of all requests.
        prefill_computed: prompt positions the scheduler scheduled (recompute included).
        external_loaded: the ``num_external_tokens > 0`` vLLM handed ``update_state_after_alloc``.
        gpu_prefix_hits / external_hits: vLLM's ``PrefillStats`` (local / external cached).
        preemptions: requests preempted.
        slots_checked / wrong_reads: KV slots and mamba states the forward checked, and those
            holding other content (a wrong load or a wrong reuse).
        schedule_us / connector_us: mean per step of ``schedule() + update_from_output()`` and of
            the scheduler-side connector calls inside them (wall clock).
        schedule_cpu_us / connector_cpu_us: the same spans in the calling thread's CPU time
            (``time.thread_time``): what the calls cost, without the time the thread waited
            for a core. On a shared machine the wall clock charges a call for every other job
            that held the core meanwhile, so the two connectors' wall figures are compared
            under whatever load each run met; their CPU figures are not.
        leaked_blocks: GPU blocks not back in vLLM's free pool after everything finished.
        transfers: the worker adapters' counters (e.g. jobs and bytes moved), summed over ranks.
        failed_loads: requests vLLM got in ``failed_recving`` (after aggregation over ranks).

    The engine also keeps every ``SchedulerStats.kv_connector_stats`` payload vLLM produced
    (``InProcessEngine.connector_stats``: the workers' stats aggregated, then the scheduler's).
    """

    connector: str
    requests: int
    finished: int
    steps: int
    prompt_tokens: int
    prefill_computed: int
    external_loaded: int
    gpu_prefix_hits: int
    external_hits: int
    preemptions: int
    slots_checked: int
    wrong_reads: int
    schedule_us: float
    connector_us: float
    leaked_blocks: int
    schedule_cpu_us: float = 0.0
    connector_cpu_us: float = 0.0
    transfers: dict[str, int] = field(default_factory=dict)
    failed_loads: int = 0

    @property
    def connector_share(self) -> float:
        """The scheduler-side connector's share of the scheduler's time."""
        return self.connector_us / self.schedule_us if self.schedule_us else 0.0

    @property
    def connector_cpu_share(self) -> float:
        """The same share in CPU time (see ``connector_cpu_us``)."""
        return self.connector_cpu_us / self.schedule_cpu_us if self.schedule_cpu_us else 0.0


class ConnectorClock:
    """Times the scheduler-side connector calls (outermost call only) and sums the external
    tokens vLLM hands ``update_state_after_alloc``."""

    def __init__(self, connector: Any):
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.external = 0
        self._depth = 0
        for name in _SCHEDULER_HOOKS:
            method = getattr(connector, name, None)
            if callable(method):
                setattr(connector, name, self._wrap(name, method))

    def _wrap(self, name: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if name == "update_state_after_alloc":
                external = args[2] if len(args) > 2 else kwargs["num_external_tokens"]
                self.external += max(0, external)
            if self._depth:
                return method(*args, **kwargs)
            self._depth += 1
            # The CPU span nests inside the wall span, so CPU time <= wall time per call.
            start = time.perf_counter()
            start_cpu = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.cpu_seconds += time.thread_time() - start_cpu
                self.seconds += time.perf_counter() - start
                self._depth -= 1

        return timed


@dataclass(slots=True)
class Tally:
    steps: int = 0  # turns of vLLM's engine loop
    schedules: int = 0  # schedule() calls: under async a turn may only apply a step's output
    prompt_tokens: int = 0
    prefill_computed: int = 0
    gpu_hits: int = 0
    external_hits: int = 0
    preemptions: int = 0
    checked: int = 0
    wrong: int = 0
    wrong_by: dict[str, int] = field(default_factory=dict)  # per request, where any
    schedule_s: float = 0.0
    connector_s: float = 0.0
    schedule_cpu_s: float = 0.0
    connector_cpu_s: float = 0.0
    failed_loads: int = 0
