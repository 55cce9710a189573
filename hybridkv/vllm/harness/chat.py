"""A multi-turn chat workload (:class:`ChatTrace`) and its closed-loop driver
(:func:`run_trace`) on the in-process engine: the trace the benchmarks and most tests play.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hybridkv.vllm.harness.engine_config import WedgedError
from hybridkv.vllm.harness.inprocess import InProcessEngine
from hybridkv.vllm.harness.report import InProcessReport

__all__ = ["ChatTrace", "run_trace"]


@dataclass(frozen=True, slots=True)
class ChatTrace:
    """Multi-turn chat: ``convs`` conversations of ``turns`` turns sharing a system prompt.

    Turn ``t + 1``'s prompt is turn ``t``'s prompt, its output and new user tokens; it arrives
    ``think`` steps after turn ``t`` finished (closed loop); conversation ``c`` starts at step
    ``c * stagger``. Tokens come from ``random.Random(seed)``.
    """

    convs: int = 4
    turns: int = 3
    system_len: int = 128
    user_min: int = 40
    user_max: int = 80
    output_len: int = 4
    think: int = 2
    stagger: int = 2
    seed: int = 1234

    def system(self) -> list[int]:
        rng = random.Random(self.seed)
        return [rng.randint(3, 999) for _ in range(self.system_len)]

    def user(self, conv: int, turn: int) -> list[int]:
        rng = random.Random(self.seed * 7919 + conv * 101 + turn + 1)
        return [rng.randint(3, 999) for _ in range(rng.randint(self.user_min, self.user_max))]


def run_trace(engine: InProcessEngine, trace: ChatTrace) -> InProcessReport:
    """Play ``trace`` closed-loop on ``engine`` until every turn finished and the connector has
    nothing in flight; :class:`~.engine_config.WedgedError` after ``settings.max_steps`` steps."""
    system = trace.system()
    arrive: dict[int, int] = {c: c * trace.stagger for c in range(trace.convs)}
    turn = dict.fromkeys(range(trace.convs), 0)
    history: dict[int, list[int]] = {c: [] for c in range(trace.convs)}
    owner: dict[str, int] = {}
    finished = 0
    clock = 0
    while True:
        for conv, at in list(arrive.items()):
            if at <= clock:
                del arrive[conv]
                t = turn[conv]
                prompt = (history[conv] or system) + trace.user(conv, t)
                rid = f"c{conv}-t{t}"
                owner[rid] = conv
                history[conv] = prompt
                engine.add(rid, prompt, trace.output_len)
        clock += 1
        if not engine.busy():
            if not arrive:
                break
            continue
        if engine.tally.steps >= engine.settings.max_steps:
            raise WedgedError(
                f"max_steps={engine.settings.max_steps}: {finished} of "
                f"{len(engine.requests)} requests finished; raise max_steps or look for a "
                "request that never leaves WAITING_FOR_REMOTE_KVS"
            )
        for out in engine.step():
            if out.finish_reason is None:
                continue
            finished += 1
            conv = owner[out.request_id]
            history[conv] = list(engine.requests[out.request_id].all_token_ids)
            turn[conv] += 1
            if turn[conv] < trace.turns:
                arrive[conv] = clock + trace.think
    if engine.pending():
        raise WedgedError(f"{engine.pending()} transfer jobs still in flight at the end")
    return engine.report(finished)
