"""bench_vs_native's layouts and what a chat trace itself says: the cases, their GPU pools
under each engine loop, and a chat trace's working set and floor.

A module of ``tools/bench_vs_native.py`` (its module docstring says what the bench measures);
imported after that tool has put this checkout and ``tools/`` on ``sys.path`` and loaded its
torchvision shim.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from _vs_native_traffic import TrafficTrace

from hybridkv.vllm.harness.chat import ChatTrace
from hybridkv.vllm.harness.engine_config import EngineSettings
from spec.presets import tiny_config


@dataclass(frozen=True, slots=True)
class Case:
    """One layout: its config.json, the engine's knobs and the short-answer trace."""

    name: str
    config_json: dict[str, Any]
    settings: EngineSettings
    trace: ChatTrace
    traffic: TrafficTrace
    traffic_settings: EngineSettings


# The smallest GPU pool vLLM 0.33 accepts for mamba + full at max_model_len 2560: its planner
# (``_check_enough_kv_cache_memory``) refuses a pool that cannot hold one request of
# max_model_len, the full group's cdiv(2560, 640) = 4 blocks on top of the mamba groups' blocks
# per request (measured: 10 blocks reach 1,920 tokens, 11 reach 2,560). The 8 x 4 trace's
# working set (9 token blocks, each a block of all 4 groups: 36 pool blocks, 36 native host
# chunks) is 3x this pool.
TIGHT_POOL = 11
# The traffic traces' pools (TrafficTrace): four mamba + full sequences of up to four full
# blocks each need more than this, six sliding + full ones decoding at once more than that,
# so both preempt.
TRAFFIC_POOL = 14
SLIDING_TRAFFIC_POOL = 36
# Under async scheduling vLLM sizes a sliding window's reservation for two batches in flight, so
# the smallest sliding pool it accepts is 2 blocks more at this budget (128 tokens a step,
# window reach 127 + 256 tokens): the traffic trace's sliding pool grows by those 2. Full
# attention and mamba groups reserve the same under both loops.
ASYNC_SLIDING_EXTRA = 2


def for_loop(case: Case, async_scheduling: bool) -> Case:
    """``case`` under vLLM's async-scheduling loop or the synchronous one."""
    settings = replace(case.settings, async_scheduling=async_scheduling)
    traffic = replace(case.traffic_settings, async_scheduling=async_scheduling)
    if async_scheduling and traffic.num_gpu_blocks == SLIDING_TRAFFIC_POOL:
        traffic = replace(traffic, num_gpu_blocks=SLIDING_TRAFFIC_POOL + ASYNC_SLIDING_EXTRA)
    return replace(case, settings=settings, traffic_settings=traffic)


def _cases(quick: bool) -> list[Case]:
    mamba_trace = ChatTrace(
        convs=3 if quick else 4,
        turns=3,
        system_len=700,
        user_min=150,
        user_max=300,
        think=2,
        stagger=2,
    )
    sliding_trace = ChatTrace(convs=4 if quick else 8, turns=3 if quick else 4, system_len=128)
    mamba_settings = EngineSettings(
        num_gpu_blocks=16, max_model_len=2560, max_num_seqs=2, max_num_batched_tokens=1280
    )
    # Traffic (TrafficTrace): 16 conversations x 6 turns (quick: 6 x 3) on a pool that
    # preempts: more sequences at once than the pool holds at their longest.
    mamba_traffic = TrafficTrace(
        convs=6 if quick else 16, turns=3 if quick else 6, systems=(700, 900)
    )
    mamba_traffic_settings = replace(mamba_settings, num_gpu_blocks=TRAFFIC_POOL, max_num_seqs=4)
    sliding_settings = EngineSettings(
        num_gpu_blocks=40,
        max_model_len=768,
        block_size=32,
        max_num_seqs=3,
        max_num_batched_tokens=128,
    )
    sliding_traffic = TrafficTrace(
        convs=6 if quick else 16,
        turns=3 if quick else 6,
        systems=(128, 96),
        user_min=20,
        user_max=60,
        start_gap=4,
        think_max=10,
    )
    return [
        Case(
            "mamba+full",
            tiny_config("qwen3-next-80b-a3b", 4),
            mamba_settings,
            mamba_trace,
            mamba_traffic,
            mamba_traffic_settings,
        ),
        # The GPU pool well below the working set (TIGHT_POOL): the host tier carries the hits.
        Case(
            "mamba+full-tight",
            tiny_config("qwen3-next-80b-a3b", 4),
            replace(mamba_settings, num_gpu_blocks=TIGHT_POOL),
            replace(mamba_trace, convs=4 if quick else 8, turns=3 if quick else 4),
            mamba_traffic,
            replace(mamba_traffic_settings, num_gpu_blocks=TIGHT_POOL),
        ),
        Case(
            "sliding+full",
            tiny_config("gpt-oss-20b", 2),
            sliding_settings,
            sliding_trace,
            sliding_traffic,
            replace(
                sliding_settings,
                num_gpu_blocks=SLIDING_TRAFFIC_POOL,
                max_model_len=512,
                max_num_seqs=6,
            ),
        ),
    ]


# ------------------------------------------------------------------ the trace's own figures


def _contexts(trace: ChatTrace) -> list[list[tuple[int, ...]]]:
    """Per conversation, per turn: the prompt as tokens, outputs as distinct placeholders."""
    system = [(t,) for t in trace.system()]
    out = []
    for conv in range(trace.convs):
        turns, context = [], list(system)
        for turn in range(trace.turns):
            if turn:
                context += [(-1, conv, turn, i) for i in range(trace.output_len)]
            context = context + [(t,) for t in trace.user(conv, turn)]
            turns.append(tuple(context))
        out.append(turns)
    return out


def working_set_blocks(trace: ChatTrace, block: int) -> int:
    """Distinct full blocks of every conversation's final context (prompt and answer)."""
    keys = set()
    for turns in _contexts(trace):
        final = turns[-1] + tuple((-1, -1, i) for i in range(trace.output_len))
        keys.update(final[: k * block] for k in range(1, len(final) // block + 1))
    return len(keys)


def floor_tokens(trace: ChatTrace, block: int) -> int:
    """Prompt tokens no cache can supply (module docstring)."""
    total, first = 0, True
    for turns in _contexts(trace):
        previous = 0  # tokens whose KV the previous turn computed
        for turn, prompt in enumerate(turns):
            reach = trace.system_len if turn == 0 and not first else previous
            supplied = min(reach, len(prompt) - 1) // block * block
            total += len(prompt) - supplied
            previous = len(prompt) + trace.output_len - 1
        first = False
    return total
