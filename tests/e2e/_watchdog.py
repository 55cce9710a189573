"""vLLM's engine stepped by the test, with a progress watchdog: a wedge fails, never hangs.

``LLM.generate`` steps the engine until every request finishes, so an engine that wedges
(issue 29: nothing running, nothing that frees a block) spins forever. Here the test adds the
requests and steps ``LLMEngine`` itself, in a loop that never sleeps, as vLLM's own engine
loop spins. Progress is read from vLLM's scheduler after every step: the tokens its requests
have computed and how many requests it still holds. If neither moves for ``stall_s`` seconds,
the run raises :class:`Wedged`, which names the state: waiting and running requests, free
blocks, and each waiting request's status and computed tokens.

It also times each async load as vLLM sees it: from the end of the step that admitted it (the
request became ``WAITING_FOR_REMOTE_KVS``; the connector's worker submits the copy in that
step) to the end of the first step after which vLLM no longer waits for it (the worker
reported it done and the scheduler took it). The figure includes at most one step beyond the
copy itself, and that step is short while the engine loop spins on loads.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from _llm import reply
from _workload import Reply

STALL_S = 120.0
"""Seconds without progress that count as a wedge. A load on the busy 2-core CI machine takes
well under a second; the issue's wedge made no progress for 10 minutes."""


class Wedged(AssertionError):
    """The engine made no progress for ``STALL_S`` seconds (the message names its state)."""


def _scheduler(llm: Any) -> Any:
    """vLLM's scheduler, reachable because the engine core runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the conftest)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def describe(scheduler: Any) -> str:
    """The scheduler's state in words: what a wedge report names."""
    pool = scheduler.kv_cache_manager.block_pool
    held = sorted(
        (r.status.name, r.num_computed_tokens)
        for r in scheduler.requests.values()
        if r not in scheduler.running
    )
    statuses = Counter(status for status, _ in held)
    return (
        f"{len(scheduler.waiting) + len(scheduler.kv_holding_waiting)} waiting, "
        f"{len(scheduler.running)} running, {pool.get_num_free_blocks()} of "
        f"{pool.num_gpu_blocks} blocks free; waiting requests by status {dict(statuses)}, "
        f"their computed tokens {[tokens for _, tokens in held]}"
    )


def _progress(scheduler: Any) -> tuple[int, int]:
    requests = scheduler.requests.values()
    return (sum(r.num_computed_tokens for r in requests), len(scheduler.requests))


@dataclass
class Stepper:
    """Generates through ``llm`` step by step (module docstring); keeps the load times."""

    llm: Any
    params: Any
    stall_s: float = STALL_S
    load_seconds: list[float] = field(default_factory=list)
    load_steps: list[int] = field(default_factory=list)  # engine steps each load spanned
    steps: int = 0
    _added: int = 0
    _loading: dict[str, tuple[float, int]] = field(default_factory=dict)

    def generate(self, prompts: list[list[int]]) -> list[Reply]:
        """One greedy answer per prompt, in order; raises :class:`Wedged` on a stall."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self.params.output_kind = RequestOutputKind.FINAL_ONLY
        engine = self.llm.llm_engine
        ids = []
        for prompt in prompts:
            ids.append(f"r{self._added}")
            self._added += 1
            engine.add_request(ids[-1], TokensPrompt(prompt_token_ids=prompt), self.params)
        done: dict[str, Reply] = {}
        scheduler = _scheduler(self.llm)
        last, moved = _progress(scheduler), time.monotonic()
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = reply(output.outputs[0])
            self.steps += 1
            now = time.monotonic()
            self._time_loads(scheduler, now)
            state = _progress(scheduler)
            if state != last:
                last, moved = state, now
            elif now - moved > self.stall_s:
                raise Wedged(
                    f"no progress for {self.stall_s:.0f} s (step {self.steps}, "
                    f"{len(done)} of {len(prompts)} requests of this batch finished): "
                    f"{describe(scheduler)}"
                )
        return [done[i] for i in ids]

    def _time_loads(self, scheduler: Any, now: float) -> None:
        from vllm.v1.request import RequestStatus

        loading = {
            rid
            for rid, r in scheduler.requests.items()
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        }
        for rid in loading - self._loading.keys():
            self._loading[rid] = (now, self.steps)
        for rid in self._loading.keys() - loading:
            started, step = self._loading.pop(rid)
            self.load_seconds.append(now - started)
            self.load_steps.append(self.steps - step)
