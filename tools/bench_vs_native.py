"""hybridkv's HybridKVConnector beside vLLM 0.33's native OffloadingConnector, in one process.

Every variant plays the same multi-turn chat trace on vLLM 0.33's real ``Scheduler`` through
:class:`hybridkv.vllm.harness.inprocess.InProcessEngine` (both connector roles in-process on CPU
tensors, content-checked): (a) no connector; (b) the native ``OffloadingConnector`` (CPU
offloading spec, LRU and ARC, both built into vLLM 0.33's ``CachePolicyFactory``) with its
worker on :class:`hybridkv.vllm.harness.native_cpu.NativeOffloadOnCPU`; (c) ``HybridKVConnector``
(``eviction_policy`` lru and arc; ``chunk_size`` left to its default, which on every layout
here is one scheduler block, native's chunk) with its real CPU transfer engine under
:class:`hybridkv.vllm.harness.cpu_worker.HybridKVOnCPU`. Both connectors' copies report ``delay``
steps after submission by the same rule (0, 1, 4).

Layouts: mamba align + full (Qwen3-Next cut to 4 layers, the platform's block) and sliding +
full (gpt-oss cut to 2 layers, block 32); ``mamba+full-tight`` is mamba + full with more
conversations on the smallest GPU pool vLLM accepts (``TIGHT_POOL``), a third of the working
set, so the host tier carries the hits. Traces: multi-turn chat over a shared system prompt
with 4-token and 40-token answers. A host-tier sweep (delay 1, 4-token answers) gives each
connector 0.5x, 1x and 2x the trace's working set: the distinct full blocks of every
conversation's final context (system prompt once), each a block of every group
(:func:`block_bytes`), in bytes. Native sizes its tier in chunks of one GPU block
(``kv_cache_tensors[0].size // num_blocks``, 4 KiB aligned: :func:`native_chunk_bytes`), and
the KV cache groups overlay one allocation, so a chunk holds one group's block and a token
block of every group takes one chunk per group; hybridkv gets the same bytes
(``host_memory_bytes`` = chunks x chunk bytes, one slot per group block on these layouts).

Printed per variant: prefill tokens computed and their ratio to the floor, tokens loaded by the
connector, GPU prefix hits, continuation hits (cached prompt tokens at positions of an earlier
turn's answer: loaded by the connector, the part of those in the previous turn's answer, and
GPU prefix hits; :class:`Continuation`), engine steps, scheduler-side connector µs per step and
its share of the scheduler's time, wall clock, then the same calls' CPU time per step (``cpu
us``: the calling thread's CPU time, which a shared machine's other jobs do not inflate; the
wall figure charges a call for every moment another job held the core) (medians over repeats,
which run in rounds over a trace's variants so that native and hybridkv meet the same load;
every repeat's counters must agree),
evictions and dropped stores (counted at the host store's ``prepare_store``), and hybridkv /
native ratios at the same policy and delay. The floor is what no cache can supply, from the
trace: the system prompt once, each turn's new user tokens, what claim alignment rounds off
(hits come in whole scheduler blocks of what the previous turn computed), and the one token
every prompt computes.
Each trace also names the variants where computed + loaded + GPU prefix hits differ from the
prompt tokens (a preempted request is admitted again, a failed load recomputed:
:func:`identity_breaks`).

Traffic traces (:class:`TrafficTrace`, every layout; ``--no-traffic`` skips them): 16
conversations x 6 turns over two system prompts, seeded random gaps between conversation starts
and between turns, 10% of the requests aborted (half of them while a connector load is in
flight where the variant loads one), on a GPU pool small enough to preempt
(``TRAFFIC_POOL``, ``SLIDING_TRAFFIC_POOL``); the seed is printed in the header. Their floor
(:func:`traffic_floor`) leaves aborted requests out, as does their ``computed`` column: an
aborted request's tokens are what its abort left it (printed apart per variant), and the turn
after it may find its prompt computed (the floor assumes so: a lower bound). Per variant the
bench prints the aborts (with a load in flight), preemptions, the per-request identity
(computed + loaded + GPU hit = prompt, except for requests preempted or aborted) and, above the
floor, where the tokens above it go by cause (:func:`over_floor`: preempted, after an abort,
a partial hit, no hit), with the requests themselves past 1.05x.

Every trace runs under each of vLLM's engine loops named by ``--loops`` (default both, async
first): async scheduling (``EngineCore.step_with_batch_queue`` with the ``AsyncScheduler``,
vLLM's default on a GPU server) and the synchronous ``EngineCore.step``
(:mod:`hybridkv.vllm.harness.engine_loop`); the sliding traffic pool is 2 blocks larger under
async scheduling, the smallest vLLM accepts there (:func:`for_loop`).

The traffic rows' counts depend on Python's string hashing: under a random ``PYTHONHASHSEED``
native's own sliding + full traffic at 0.5x computed 7,675 to 8,091 tokens from one run to the
next (the order vLLM's engine walks some sets of request ids follows str hashes), so the bench
runs under ``--hash-seed`` (default 0), starting itself again when the environment names
another seed, and prints it; within one run every repeat agrees.

Usage: ``python tools/bench_vs_native.py [--quick] [--no-traffic] [--repeats N]
[--layouts sliding+full] [--loops async,sync] [--plot PATH]``; needs vLLM 0.33 (``nox -s vllm``
or ``nox -s bench`` install it) and, for ``--plot`` (per trace: prefill computed with the floor,
connector µs per step), matplotlib (the ``plot`` extra). Exit 1 when a run leaks blocks or reads
wrong KV; a failed HybridKVConnector variant is printed as failed with its
reason.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's hybridkv and spec, not another install's

from spec.presets import tiny_config  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/_vllm_tool.py
from _vllm_tool import require_vllm, torchvision_shim  # noqa: E402

_SHIM = torchvision_shim("bench_vs_native")  # kept alive (tools/_vllm_tool.py)
require_vllm("bench_vs_native")

from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.vllm.harness.chat import ChatTrace, run_trace  # noqa: E402
from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.engine_config import EngineSettings, WedgedError  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402
from hybridkv.vllm.harness.native_cpu import NativeOffloadOnCPU  # noqa: E402
from hybridkv.vllm.harness.report import InProcessReport  # noqa: E402
from hybridkv.vllm.layout import read_layout, recommended_chunk_size  # noqa: E402


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


# ------------------------------------------------------------------ traffic like a server's


class Abort(Enum):
    """When a request of :class:`TrafficTrace` is aborted (a client going away).

    LOAD: at the first step it waits for a connector load (``WAITING_FOR_REMOTE_KVS``), or,
    where it never waits for one (no connector, nothing claimed, a GPU hit), when its prefill
    ends; PREFILL: once it has been scheduled and before its prefill ends (else when it ends);
    DECODE: after its first answer token.
    """

    LOAD = "load"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class TrafficTrace:
    """Conversations as a server sees them: random arrivals, several system prompts, aborts.

    ``convs`` conversations of ``turns`` turns; conversation ``c`` opens with system prompt
    ``c % len(systems)`` (``systems``: their lengths) and starts a seeded gap of 0 to
    ``2 * start_gap`` steps after the one before it; each next turn arrives a seeded 0 to
    ``think_max`` steps after the previous one ended (finished or aborted). ``abort_rate`` of
    the requests (rounded, drawn from ``seed``) are aborted (:class:`Abort`: half of them LOAD,
    a quarter each PREFILL and DECODE); the turn after an aborted one repeats its prompt
    without an answer, then the new user tokens. Every draw comes from ``seed``: every variant
    plays the same conversations, gaps and abort choices; when an abort fires depends on what
    the variant does (a LOAD abort needs a load in flight).
    """

    convs: int = 16
    turns: int = 6
    systems: tuple[int, ...] = (700, 900)
    user_min: int = 100
    user_max: int = 220
    output_len: int = 4
    start_gap: int = 3
    think_max: int = 8
    abort_rate: float = 0.1
    seed: int = 2026

    def system(self, conv: int) -> list[int]:
        which = conv % len(self.systems)
        rng = random.Random(self.seed * 31 + which)
        return [rng.randint(3, 999) for _ in range(self.systems[which])]

    def user(self, conv: int, turn: int) -> list[int]:
        rng = random.Random(self.seed * 7919 + conv * 101 + turn + 1)
        return [rng.randint(3, 999) for _ in range(rng.randint(self.user_min, self.user_max))]

    def starts(self) -> list[int]:
        """Each conversation's first arrival step."""
        rng = random.Random(self.seed * 13 + 1)
        at, out = 0, []
        for _ in range(self.convs):
            out.append(at)
            at += rng.randint(0, 2 * self.start_gap)
        return out

    def think(self, conv: int, turn: int) -> int:
        """Steps between turn ``turn``'s end and turn ``turn + 1``'s arrival."""
        return random.Random(self.seed * 104729 + conv * 211 + turn).randint(0, self.think_max)

    def aborts(self) -> dict[tuple[int, int], Abort]:
        """The aborted requests, by (conversation, turn), and when each is aborted."""
        rng = random.Random(self.seed * 17 + 3)
        pairs = [(c, t) for c in range(self.convs) for t in range(self.turns)]
        chosen = rng.sample(pairs, round(self.abort_rate * len(pairs)))
        half, quarter = -(-len(chosen) // 2), len(chosen) // 4
        modes = [Abort.LOAD] * half + [Abort.PREFILL] * quarter
        modes += [Abort.DECODE] * (len(chosen) - len(modes))
        return dict(zip(chosen, modes, strict=True))

    def prompts(self) -> list[list[tuple[tuple[int, ...], ...]]]:
        """Per conversation, per turn: the prompt, answers as distinct placeholders (what
        the floor and the working set read)."""
        aborts = self.aborts()
        out = []
        for conv in range(self.convs):
            turns: list[tuple[tuple[int, ...], ...]] = []
            context: list[tuple[int, ...]] = [(t,) for t in self.system(conv)]
            for turn in range(self.turns):
                if turn and (conv, turn - 1) not in aborts:
                    context += [(-1, conv, turn, i) for i in range(self.output_len)]
                context = context + [(t,) for t in self.user(conv, turn)]
                turns.append(tuple(context))
            out.append(turns)
        return out

    def describe(self) -> str:
        aborts = self.aborts()
        return (
            f"traffic: {self.convs} conversations x {self.turns} turns, systems "
            f"{'/'.join(map(str, self.systems))}, user {self.user_min}-{self.user_max}, "
            f"answers {self.output_len} tokens, start gaps 0-{2 * self.start_gap} and think "
            f"0-{self.think_max} steps (seed {self.seed}), {len(aborts)} aborted "
            f"({sum(m is Abort.LOAD for m in aborts.values())} of them LOAD: at a load in flight)"
        )


def traffic_floor(trace: TrafficTrace, block: int) -> dict[str, int]:
    """Per request kept (not aborted): the prompt tokens no cache can supply.

    The rule of :func:`floor_tokens`, with an aborted request's prompt taken as computed (a
    lower bound: the turn after it may find its prompt's KV, if its prefill got that far) and
    the first conversation of each system prompt computing that prompt. Aborted requests have
    no floor: their computed tokens are what their abort left them (printed apart).
    """
    aborts = trace.aborts()
    seen: set[int] = set()
    floors = {}
    order = sorted(range(trace.convs), key=lambda c: (trace.starts()[c], c))
    prompts = trace.prompts()
    for conv in order:
        system = trace.systems[conv % len(trace.systems)]
        previous = 0
        for turn, prompt in enumerate(prompts[conv]):
            if turn == 0:
                reach = system if conv % len(trace.systems) in seen else 0
                seen.add(conv % len(trace.systems))
            else:
                reach = previous
            supplied = min(reach, len(prompt) - 1) // block * block
            if (conv, turn) not in aborts:
                floors[f"c{conv}-t{turn}"] = len(prompt) - supplied
                previous = len(prompt) + trace.output_len - 1
            else:
                previous = len(prompt)
    return floors


def traffic_working_blocks(trace: TrafficTrace, block: int) -> int:
    """Distinct full blocks of every conversation's final context (prompt and answer)."""
    keys: set[tuple[tuple[int, ...], ...]] = set()
    aborts = trace.aborts()
    for conv, turns in enumerate(trace.prompts()):
        final = turns[-1]
        if (conv, trace.turns - 1) not in aborts:
            final += tuple((-1, conv, trace.turns, i) for i in range(trace.output_len))
        keys.update(final[: k * block] for k in range(1, len(final) // block + 1))
    return len(keys)


@dataclass(slots=True)
class Ledger:
    """Per request, what a run did: prompt positions computed (every admission), tokens the
    connector loaded, GPU prefix hits (first admission), preemptions, whether and when it was
    aborted (``loading``: with a connector load in flight)."""

    computed: dict[str, int] = field(default_factory=dict)
    loaded: dict[str, int] = field(default_factory=dict)
    gpu: dict[str, int] = field(default_factory=dict)
    preempted: dict[str, int] = field(default_factory=dict)
    aborted: dict[str, bool] = field(default_factory=dict)
    prompt: dict[str, int] = field(default_factory=dict)

    def watch(self, engine: InProcessEngine) -> None:
        """Wrap the engine's scheduler and connector calls (counting only)."""
        scheduler = engine.scheduler
        schedule, step = scheduler.schedule, engine.step

        def scheduled(*args: Any, **kwargs: Any) -> Any:
            output = schedule(*args, **kwargs)
            for rid, n in output.num_scheduled_tokens.items():
                request = engine.requests[rid]
                c1 = request.num_computed_tokens
                done = max(0, min(c1, request.num_prompt_tokens) - (c1 - n))
                self.computed[rid] = self.computed.get(rid, 0) + done
            for rid in output.preempted_req_ids or ():
                self.preempted[rid] = self.preempted.get(rid, 0) + 1
            return output

        def stepped() -> list[Any]:
            outputs = step()
            for out in outputs:
                if out.prefill_stats is not None:
                    rid = out.request_id
                    hits = out.prefill_stats.num_local_cached_tokens
                    self.gpu[rid] = self.gpu.get(rid, 0) + hits
            return outputs

        scheduler.schedule = scheduled  # type: ignore[method-assign,assignment]
        engine.step = stepped  # type: ignore[method-assign]
        connector = scheduler.connector
        if connector is None:
            return
        alloc = connector.update_state_after_alloc

        def allocated(request: Any, blocks: Any, num_external_tokens: int) -> Any:
            rid = request.request_id
            self.loaded[rid] = self.loaded.get(rid, 0) + max(0, num_external_tokens)
            return alloc(request, blocks, num_external_tokens)

        connector.update_state_after_alloc = allocated  # type: ignore[method-assign]


def _abort_due(engine: InProcessEngine, rid: str, mode: Abort) -> bool | None:
    """Whether to abort ``rid`` before this step (None: not yet); True: a load is in flight."""
    request = engine.requests[rid]
    if engine.status(rid) == "WAITING_FOR_REMOTE_KVS":
        return True if mode is Abort.LOAD else None
    prefilled = request.num_computed_tokens >= request.num_prompt_tokens
    if mode is Abort.DECODE:
        return False if request.num_output_tokens >= 1 else None
    if mode is Abort.PREFILL and request.num_computed_tokens > 0:
        return False
    return False if prefilled else None


def play_traffic(engine: InProcessEngine, trace: TrafficTrace) -> tuple[InProcessReport, Ledger]:
    """Play ``trace`` on ``engine`` until every turn finished or was aborted and the connector
    has nothing in flight; the report and the per-request ledger."""
    ledger = Ledger()
    ledger.watch(engine)
    aborts = trace.aborts()
    arrive = dict(enumerate(trace.starts()))
    turn = dict.fromkeys(range(trace.convs), 0)
    history: dict[int, list[int]] = {c: trace.system(c) for c in range(trace.convs)}
    live: dict[str, tuple[int, int]] = {}
    clock = finished = 0

    def ended(conv: int, t: int, context: list[int]) -> None:
        history[conv] = context
        turn[conv] = t + 1
        if t + 1 < trace.turns:
            arrive[conv] = clock + trace.think(conv, t)

    while True:
        for conv, at in list(arrive.items()):
            if at <= clock:
                del arrive[conv]
                t = turn[conv]
                prompt = history[conv] + trace.user(conv, t)
                rid = f"c{conv}-t{t}"
                live[rid] = (conv, t)
                ledger.prompt[rid] = len(prompt)
                engine.add(rid, prompt, trace.output_len)
        clock += 1
        if not engine.busy():
            if not arrive:
                break
            continue
        if engine.tally.steps >= engine.settings.max_steps:
            raise WedgedError(f"max_steps={engine.settings.max_steps}: {sorted(live)} live")
        for rid, (conv, t) in list(live.items()):
            mode = aborts.get((conv, t))
            loading = None if mode is None else _abort_due(engine, rid, mode)
            if loading is not None and engine.abort(rid):
                ledger.aborted[rid] = loading
                del live[rid]
                ended(conv, t, list(engine.requests[rid].prompt_token_ids or ()))
        for out in engine.step():
            if out.finish_reason is None or out.request_id not in live:
                continue
            finished += 1
            conv, t = live.pop(out.request_id)
            ended(conv, t, list(engine.requests[out.request_id].all_token_ids))
    if engine.pending():
        raise WedgedError(f"{engine.pending()} transfer jobs still in flight at the end")
    return engine.report(finished + len(ledger.aborted)), ledger


def over_floor(
    ledger: Ledger, floors: dict[str, int], trace: TrafficTrace, top: int = 6
) -> list[str]:
    """Where the computed tokens above the floor go: per cause, the kept requests over their
    floor and the tokens above it; then the requests over it, largest first.

    Causes, the first that applies: ``preempted`` (admitted again: its prompt computed again
    unless hit), ``after abort`` (the previous turn was aborted before its prefill ended, so
    its prompt's KV was never all computed), ``partial hit`` (the connector or the GPU cache
    supplied part of what the previous turns computed: the rest was evicted, not yet stored,
    or rounded to a claim boundary), ``no hit`` (nothing cached beyond the GPU's and the
    connector's zero).
    """
    aborts = trace.aborts()
    causes: dict[str, list[int]] = {}
    rows = []
    for rid, floor in floors.items():
        extra = ledger.computed.get(rid, 0) - floor
        if extra <= 0:
            continue
        conv, turn = (int(x) for x in rid[1:].split("-t"))
        hit = ledger.loaded.get(rid, 0) + ledger.gpu.get(rid, 0)
        if ledger.preempted.get(rid):
            cause = "preempted"
        elif turn and (conv, turn - 1) in aborts:
            cause = "after abort"
        elif hit:
            cause = "partial hit"
        else:
            cause = "no hit"
        tally = causes.setdefault(cause, [0, 0])
        tally[0] += 1
        tally[1] += extra
        rows.append((extra, rid, floor, cause, hit))
    rows.sort(reverse=True)
    summary = ", ".join(f"{c} {n} requests +{x}" for c, (n, x) in sorted(causes.items()))
    lines = [f"    over the floor: {summary or 'none'}"]
    for extra, rid, floor, cause, _ in rows[:top]:
        lines.append(
            f"      {rid}: prompt {ledger.prompt[rid]}, floor {floor}, computed "
            f"{ledger.computed.get(rid, 0)} (+{extra}), loaded {ledger.loaded.get(rid, 0)}, "
            f"gpu hit {ledger.gpu.get(rid, 0)}, preempted {ledger.preempted.get(rid, 0)}: {cause}"
        )
    return lines


def traffic_identity(ledger: Ledger) -> str:
    """Requests where computed + loaded + GPU hit != prompt tokens, by what re-counts or
    cuts short: preempted (admitted again), aborted (stopped mid-prefill or mid-load)."""
    broken: dict[str, int] = {}
    for rid, prompt in ledger.prompt.items():
        total = ledger.computed.get(rid, 0) + ledger.loaded.get(rid, 0) + ledger.gpu.get(rid, 0)
        if total == prompt:
            continue
        cause = (
            "aborted"
            if rid in ledger.aborted
            else "preempted"
            if ledger.preempted.get(rid)
            else "UNEXPLAINED"
        )
        broken[cause] = broken.get(cause, 0) + 1
    return ", ".join(f"{n} {cause}" for cause, n in sorted(broken.items())) or "none"


# ------------------------------------------------------------------ variants


@dataclass(frozen=True, slots=True)
class Variant:
    """A connector setting: ``kind`` none | native | hybridkv; host tier in native chunks.

    ``chunk_size``: hybridkv's ``chunk_size`` extra config in tokens (named ``chunk=N``);
    ``None``, what the bench runs, leaves it to the default
    (:func:`hybridkv.vllm.layout.recommended_chunk_size`: one scheduler block on every layout
    here, so claims round off nothing native's one-block chunks would not).
    """

    kind: str
    policy: str = "lru"
    delay: int = 1
    chunks: int = 0
    label: str = ""
    chunk_size: int | None = None

    def name(self) -> str:
        if self.kind == "none":
            return "no connector"
        chunk = f" chunk={self.chunk_size}" if self.chunk_size is not None else ""
        return f"{self.kind} {self.policy} d={self.delay}{self.label}{chunk}"


@dataclass(frozen=True, slots=True)
class Continuation:
    """Prompt tokens served from cache at positions that held an earlier turn's answer.

    ``loaded``: inside the range the connector supplied; ``gpu``: inside vLLM's local prefix
    hit; ``loaded_previous``: the part of ``loaded`` in the immediately previous turn's answer,
    whose KV only that turn's decode steps computed (an older answer was recomputed in the
    prefill after it, so any connector that stores prefills may hold it). Counted at each
    request's first admission (vLLM's ``PrefillStats``, :func:`continuation_hits`).
    """

    loaded: int = 0
    gpu: int = 0
    loaded_previous: int = 0

    @property
    def total(self) -> int:
        return self.loaded + self.gpu


@dataclass(frozen=True, slots=True)
class Result:
    report: InProcessReport | None
    connector_us: float = 0.0
    share: float = 0.0
    connector_cpu_us: float = 0.0
    evictions: int = 0
    dropped: int = 0
    error: str = ""
    continuation: Continuation = Continuation()
    ledger: Ledger | None = None

    def computed(self) -> int:
        """Prompt tokens computed, aborted requests left out (what the floor is for)."""
        if self.report is None:
            return 0
        if self.ledger is None:
            return self.report.prefill_computed
        aborted = self.ledger.aborted
        return sum(n for rid, n in self.ledger.computed.items() if rid not in aborted)


class _StoreCounter:
    """Counts evictions and refused stores at a host store's ``prepare_store``."""

    def __init__(self, store: Any) -> None:
        self.evictions = 0
        self.dropped = 0
        inner = store.prepare_store

        def counted(*args: Any, **kwargs: Any) -> Any:
            result = inner(*args, **kwargs)
            evicted = getattr(result, "evicted_keys", None)
            if evicted is None:
                self.dropped += 1
            else:
                self.evictions += len(evicted)
            return result

        store.prepare_store = counted


class _Admissions:
    """Per request, the cached tokens of its first admission, as vLLM reports them in the
    request's output (``PrefillStats``: local prefix hit, then the connector's external hit,
    which starts where the local one ends)."""

    def __init__(self, engine: InProcessEngine) -> None:
        self.cached: dict[str, tuple[int, int]] = {}
        inner = engine.step

        def observed() -> list[Any]:
            outputs = inner()
            for out in outputs:
                stats = out.prefill_stats
                if stats is not None:
                    local, external = (
                        stats.num_local_cached_tokens,
                        stats.num_external_cached_tokens,
                    )
                    self.cached[out.request_id] = (local, external)
            return outputs

        engine.step = observed  # type: ignore[method-assign]


def _overlap(lo: int, hi: int, spans: list[tuple[int, int]]) -> int:
    return sum(max(0, min(hi, b) - max(lo, a)) for a, b in spans)


def continuation_hits(
    engine: InProcessEngine,
    cached: dict[str, tuple[int, int]],
    skip: frozenset[str] | set[str] = frozenset(),
) -> Continuation:
    """Cached prompt tokens lying in an earlier turn's answer, from what the run observed.

    The answer of request ``c{conv}-t{k}`` (``run_trace``'s names) is the positions of its
    output tokens, ``[num_prompt_tokens, num_tokens)``, as vLLM's request holds them; every
    later turn of the conversation repeats them at the same positions. A request's hit ranges
    are ``[0, local)`` (GPU prefix cache) and ``[local, local + external)`` (the connector).
    ``skip``: aborted requests, whose answers no later prompt repeats.
    """
    turns: dict[str, list[tuple[int, Any]]] = {}
    for rid, request in engine.requests.items():
        if rid in skip:
            continue
        conv, _, turn = rid.partition("-t")
        turns.setdefault(conv, []).append((int(turn), request))
    loaded = gpu = previous = 0
    for rid, (local, external) in cached.items():
        conv, _, turn = rid.partition("-t")
        earlier = [
            (k, (r.num_prompt_tokens, r.num_tokens))
            for k, r in turns.get(conv, [])
            if k < int(turn)
        ]
        spans = [span for _, span in earlier]
        last = [span for k, span in earlier if k == int(turn) - 1]
        gpu += _overlap(0, local, spans)
        loaded += _overlap(local, local + external, spans)
        previous += _overlap(local, local + external, last)
    return Continuation(loaded, gpu, previous)


def _transfer(variant: Variant) -> Any:
    if variant.kind == "native":
        extra = {"eviction_policy": variant.policy}
        return KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
        )
    extra = {"eviction_policy": variant.policy}
    if variant.chunk_size is not None:
        extra["chunk_size"] = variant.chunk_size
    return KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )


def default_chunk(engine_probe: InProcessEngine) -> int:
    """hybridkv's default ``chunk_size`` on the probe's layout (what a variant without one gets)."""
    layout = read_layout(engine_probe.vllm_config, engine_probe.kv_cache_config)
    return recommended_chunk_size(layout)


def block_bytes(engine_probe: InProcessEngine) -> int:
    """Bytes of one block of every layer: one token block of every group (the tensors of the
    groups overlay one allocation, each tensor a layer)."""
    config = engine_probe.kv_cache_config
    return sum(t.size // config.num_blocks for t in config.kv_cache_tensors)


def native_chunk_bytes(engine_probe: InProcessEngine) -> int:
    """Bytes of one native host chunk, as vLLM 0.33 sizes it: one GPU block of the shared
    allocation (``OffloadingConfig.worker_kv_bytes_per_block``), rounded up to 4 KiB
    (``CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT``). On a hybrid layout that is one group's block."""
    config = engine_probe.kv_cache_config
    per_block = config.kv_cache_tensors[0].size // config.num_blocks
    return -(-per_block // 4096) * 4096


def working_set_chunks(trace: ChatTrace, engine_probe: InProcessEngine) -> int:
    """The trace's working set (:func:`working_set_blocks`, every group) in native chunks."""
    working = working_set_blocks(trace, engine_probe.block_size) * block_bytes(engine_probe)
    return -(-working // native_chunk_bytes(engine_probe))


def _engine(case: Case, variant: Variant, chunk_bytes: int) -> tuple[InProcessEngine, Any]:
    if variant.kind == "none":
        return InProcessEngine(case.config_json, case.settings), None
    adapter: Any
    if variant.kind == "native":
        adapter = NativeOffloadOnCPU(variant.chunks, variant.delay)
    else:
        adapter = HybridKVOnCPU(host_bytes=variant.chunks * chunk_bytes, delay=variant.delay)
    engine = InProcessEngine(case.config_json, case.settings, _transfer(variant), adapter)
    connector = engine.scheduler.connector
    store = (
        connector.connector_scheduler.manager if variant.kind == "native" else connector.core.store
    )
    return engine, _StoreCounter(store)


def _counters(report: InProcessReport) -> tuple[int, ...]:
    return (
        report.prefill_computed,
        report.external_loaded,
        report.gpu_prefix_hits,
        report.steps,
        report.preemptions,
        report.failed_loads,
    )


def _play(engine: InProcessEngine, trace: ChatTrace | TrafficTrace) -> tuple[Any, Ledger | None]:
    if isinstance(trace, TrafficTrace):
        return play_traffic(engine, trace)
    return run_trace(engine, trace), None


def run_variant(
    case: Case,
    trace: ChatTrace | TrafficTrace,
    variant: Variant,
    chunk_bytes: int,
    repeats: int,
) -> Result:
    """``repeats`` fresh runs; timing medians; counters must agree across repeats."""
    return run_variants(case, trace, [variant], chunk_bytes, repeats)[variant]


def run_variants(
    case: Case,
    trace: ChatTrace | TrafficTrace,
    variants: list[Variant],
    chunk_bytes: int,
    repeats: int,
) -> dict[Variant, Result]:
    """``repeats`` fresh runs of each variant, in rounds: every round runs each variant once,
    in order, so the repeats of native and hybridkv meet the same load on a shared machine
    (run one variant after the other, a load that changed between them moved their CPU
    ratio: docs/benchmarks, "Scheduler-side cost: round 3"). Timing medians; counters must
    agree across repeats."""
    settings = case.traffic_settings if isinstance(trace, TrafficTrace) else case.settings
    case = replace(case, settings=settings)
    runs: dict[Variant, list[tuple[InProcessReport, Any, tuple[Any, ...]]]] = {
        variant: [] for variant in variants
    }
    failed: dict[Variant, Result] = {}
    for _ in range(repeats):
        for variant in variants:
            if variant in failed:
                continue
            try:
                runs[variant].append(_one_run(case, trace, variant, chunk_bytes))
            except Exception as error:  # a failing connector is a result to print, not a crash
                if variant.kind != "hybridkv":
                    raise
                reason = f"{type(error).__name__}: {str(error).splitlines()[0][:90]}"
                failed[variant] = Result(None, error=reason)
    return {v: failed[v] if v in failed else _combined(runs[v]) for v in variants}


def _one_run(
    case: Case, trace: ChatTrace | TrafficTrace, variant: Variant, chunk_bytes: int
) -> tuple[InProcessReport, Any, tuple[Any, ...]]:
    """One fresh run: its report, its per-request ledger and its store and continuation counts."""
    engine, counter = _engine(case, variant, chunk_bytes)
    try:
        admissions = _Admissions(engine)
        report, ledger = _play(engine, trace)
        skip = set(ledger.aborted) if ledger else set()
        continuation = continuation_hits(engine, admissions.cached, skip)
    finally:
        engine.close()  # a worker's copy thread would keep its memory (inprocess)
    evicted = (counter.evictions, counter.dropped) if counter else (0, 0)
    return report, ledger, (*evicted, continuation)


def _combined(runs: list[tuple[InProcessReport, Any, tuple[Any, ...]]]) -> Result:
    """One variant's repeats as one result: timing medians, counters that must agree."""
    reports = [report for report, _, _ in runs]
    ledgers = [ledger for _, ledger, _ in runs]
    counts = [count for _, _, count in runs]
    first = reports[0]
    if any(_counters(r) != _counters(first) for r in reports) or len(set(counts)) > 1:
        return Result(first, error="counters differ between repeats")
    if any(ledger != ledgers[0] for ledger in ledgers):
        return Result(first, error="per-request counts differ between repeats")
    return Result(
        first,
        ledger=ledgers[0],
        connector_us=statistics.median(r.connector_us for r in reports),
        share=statistics.median(r.connector_share for r in reports),
        connector_cpu_us=statistics.median(r.connector_cpu_us for r in reports),
        evictions=counts[0][0],
        dropped=counts[0][1],
        continuation=counts[0][2],
    )


# ------------------------------------------------------------------ printing

HEADER = (
    f"{'variant':<30} {'computed':>8} {'/floor':>6} {'loaded':>7} {'gpu hit':>7} "
    f"{'cont ld':>7} {'ld prev':>7} {'cont gpu':>8} {'steps':>5} {'conn us/step':>12} "
    f"{'share':>6} {'cpu us':>6} "
    f"{'evict':>6} {'dropped':>7} {'wrong':>5}"
)


def _row(name: str, result: Result, floor: int) -> str:
    r = result.report
    if r is None:
        return f"{name:<30} failed: {result.error}"
    us = f"{result.connector_us:12.0f}" if r.connector else f"{'-':>12}"
    share = f"{result.share:6.0%}" if r.connector else f"{'-':>6}"
    cpu = f"{result.connector_cpu_us:6.0f}" if r.connector else f"{'-':>6}"
    cont = result.continuation
    line = (
        f"{name:<30} {result.computed():8d} {result.computed() / floor:6.2f} "
        f"{r.external_loaded:7d} {r.gpu_prefix_hits:7d} {cont.loaded:7d} {cont.loaded_previous:7d} "
        f"{cont.gpu:8d} "
        f"{r.steps:5d} {us} {share} {cpu} "
        f"{result.evictions:6d} {result.dropped:7d} {r.wrong_reads:5d}"
    )
    return line + (f"  ({result.error})" if result.error else "")


def _ratio(ours: Result, theirs: Result, field: Callable[[Result], float]) -> str:
    if ours.report is None or theirs.report is None:
        return "  n/a"
    if not field(theirs):  # the count itself: a ratio to zero says nothing
        return f"{field(ours):.0f} vs 0"
    return f"{field(ours) / field(theirs):5.2f}"


def _ratios(results: dict[Variant, Result]) -> list[str]:
    lines = []
    for variant, ours in results.items():
        if variant.kind != "hybridkv":
            continue
        peer = results.get(replace(variant, kind="native", chunk_size=None))
        if peer is None:
            continue
        cost = _ratio(ours, peer, lambda x: x.connector_us)
        cpu = _ratio(ours, peer, lambda x: x.connector_cpu_us)
        computed = _ratio(ours, peer, lambda x: x.computed())
        hits = _ratio(ours, peer, lambda x: x.report.gpu_prefix_hits if x.report else 0)
        cont = _ratio(ours, peer, lambda x: x.continuation.total)
        lines.append(
            f"  hybridkv/native {variant.name().removeprefix('hybridkv ')}: "
            f"connector us/step {cost} (cpu {cpu}), prefill computed {computed}, "
            f"GPU prefix hits {hits}, "
            f"continuation hits {cont}"
        )
    return lines


def identity_breaks(results: dict[Variant, Result]) -> list[str]:
    """Variants where computed + loaded + gpu hit != prompt tokens, with what re-counts.

    Each prompt position is computed, loaded by the connector or a GPU prefix hit, once per
    admission; a preempted request is admitted again and a failed load is recomputed, so
    those runs count some positions twice.
    """
    broken = []
    for variant, result in results.items():
        r = result.report
        if r is None:
            continue
        if r.prefill_computed + r.external_loaded + r.gpu_prefix_hits != r.prompt_tokens:
            broken.append(
                f"{variant.name()} (preemptions {r.preemptions}, failed loads {r.failed_loads})"
            )
    return broken


def _bad(results: dict[Variant, Result]) -> list[str]:
    bad = []
    for variant, result in results.items():
        r = result.report
        if r is not None and (r.wrong_reads or r.leaked_blocks or r.finished != r.requests):
            bad.append(f"{variant.name()}: {r.wrong_reads} wrong reads, {r.leaked_blocks} leaked")
    return bad


@dataclass(frozen=True, slots=True)
class TraceOutcome:
    """One trace's results, its floor and the lines printed for it."""

    title: str
    floor: int
    results: dict[Variant, Result]
    lines: list[str]
    problems: list[str]


def _variants(working: int, delays: list[int], sweep: bool) -> list[Variant]:
    big = 2 * working
    variants = [Variant("none")]
    for kind in ("native", "hybridkv"):  # hybridkv at its default chunk (Variant)
        for delay in delays:
            variants.append(Variant(kind, "lru", delay, big))
        variants.append(Variant(kind, "arc", 1, big))
    if sweep:
        for factor in (0.5, 1.0):
            for kind in ("native", "hybridkv"):
                for policy in ("lru", "arc"):
                    chunks = max(1, round(factor * working))
                    variants.append(Variant(kind, policy, 1, chunks, f" host={factor}x"))
    return variants


def _figures(trace: ChatTrace | TrafficTrace, probe: InProcessEngine) -> tuple[int, int, str]:
    """The trace's floor, its working set in native chunks and its header's words."""
    block = probe.block_size
    if isinstance(trace, TrafficTrace):
        floor = sum(traffic_floor(trace, block).values())
        blocks = traffic_working_blocks(trace, block)
        words = trace.describe()
    else:
        floor = floor_tokens(trace, block)
        blocks = working_set_blocks(trace, block)
        words = (
            f"{trace.convs} conversations x {trace.turns} turns, system {trace.system_len}, "
            f"user {trace.user_min}-{trace.user_max}, answers {trace.output_len} tokens"
        )
    working = -(-blocks * block_bytes(probe) // native_chunk_bytes(probe))
    return floor, working, words


def _traffic_lines(trace: TrafficTrace, results: dict[Variant, Result], block: int) -> list[str]:
    """Per variant: aborts, preemptions, the per-request identity and, past 1.05x the floor,
    where the rest goes (:func:`over_floor`)."""
    floors = traffic_floor(trace, block)
    floor = sum(floors.values())
    lines = []
    for variant, result in results.items():
        ledger, r = result.ledger, result.report
        if ledger is None or r is None:
            continue
        aborted = ledger.aborted
        spent = sum(ledger.computed.get(rid, 0) for rid in aborted)
        lines.append(
            f"  {variant.name()}: aborted {len(aborted)} ({sum(aborted.values())} with a load "
            f"in flight; they computed {spent} prompt tokens, left out of /floor), "
            f"preemptions {r.preemptions}, failed loads {r.failed_loads}; computed + loaded + "
            f"gpu hit != prompt: {traffic_identity(ledger)}"
        )
        if result.computed() > floor:  # the requests themselves only past 1.05x
            lines += over_floor(ledger, floors, trace, 6 if result.computed() > 1.05 * floor else 0)
    return lines


def bench_trace(
    case: Case, trace: ChatTrace | TrafficTrace, args: argparse.Namespace, sweep: bool
) -> TraceOutcome:
    traffic = isinstance(trace, TrafficTrace)
    settings = case.traffic_settings if traffic else case.settings
    probe = InProcessEngine(case.config_json, settings)
    probe.close()
    block = probe.block_size
    floor, working, words = _figures(trace, probe)
    chunk_bytes = native_chunk_bytes(probe)
    delays = [1] if traffic else args.delays
    variants = _variants(working, delays, sweep)
    results = run_variants(case, trace, variants, chunk_bytes, args.repeats)
    plain = results[Variant("none")].report
    assert plain is not None
    lines = [
        f"== {case.name}, {words}; GPU pool {settings.num_gpu_blocks} blocks, max_num_seqs "
        f"{settings.max_num_seqs}; block {block}; prompt {plain.prompt_tokens} tokens; floor "
        f"{floor}{' (aborted requests left out)' if traffic else ''}; working set {working} "
        f"native chunks of {chunk_bytes} B = {working * chunk_bytes} B; host tier 2x = "
        f"{2 * working} chunks (hybridkv: the same bytes) unless named; "
        f"hybridkv chunk_size the default ({default_chunk(probe)} tokens) unless named",
        HEADER,
    ]
    for variant, result in results.items():
        lines.append(_row(variant.name(), result, floor))
    lines += _ratios(results)
    lost = [
        v.name()
        for v, r in results.items()
        if r.report is not None and r.report.gpu_prefix_hits < plain.gpu_prefix_hits
    ]
    lines.append(f"  GPU prefix hits below the no-connector run: {', '.join(lost) or 'none'}")
    if isinstance(trace, TrafficTrace):
        lines += _traffic_lines(trace, results, block)
    else:
        broken = identity_breaks(results)
        lines.append(
            f"  computed + loaded + gpu hit != prompt tokens: {', '.join(broken) or 'none'}"
        )
    problems = _bad(results)
    lines += [f"  ERROR {p}" for p in problems]
    print("\n".join(lines), flush=True)
    kind = "traffic" if traffic else "chat"
    title = f"{case.name}, {kind}, answers {trace.output_len} tokens"
    return TraceOutcome(title, floor, results, lines, problems)


# ------------------------------------------------------------------ the figure

_COLOURS = {"none": "0.6", "native": "tab:orange", "hybridkv": "tab:blue"}


def plot(outcomes: list[TraceOutcome], path: Path) -> None:
    """Per trace, a panel pair: prefill tokens computed per variant beside the floor, and the
    scheduler-side connector µs per step (median of the repeats). Failed variants are left
    blank and named failed."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on the machines that run the bench
    import matplotlib.pyplot as plt

    rows = len(outcomes)
    height = max(len(o.results) for o in outcomes) * 0.22 + 1.2
    figure, axes = plt.subplots(rows, 2, figsize=(13, height * rows), squeeze=False)
    for (computed_ax, cost_ax), outcome in zip(axes, outcomes, strict=True):
        variants = list(outcome.results)
        names = [v.name() + ("" if outcome.results[v].report else " (failed)") for v in variants]
        colours = [_COLOURS[v.kind] for v in variants]
        places = range(len(variants))
        computed = [r.report.prefill_computed if r.report else 0 for r in outcome.results.values()]
        cost = [
            r.connector_cpu_us if r.report and r.report.connector else 0
            for r in outcome.results.values()
        ]
        computed_ax.barh(places, computed, color=colours)
        computed_ax.axvline(
            outcome.floor,
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"floor {outcome.floor}",
        )
        computed_ax.legend(fontsize=7, loc="lower right")
        computed_ax.set_title(f"{outcome.title}: prefill tokens computed", fontsize=9)
        cost_ax.barh(places, cost, color=colours)
        cost_ax.set_title(f"{outcome.title}: connector CPU µs per step", fontsize=9)
        for ax in (computed_ax, cost_ax):
            ax.set_yticks(list(places), names, fontsize=7)
            ax.invert_yaxis()
            ax.tick_params(axis="x", labelsize=7)
        cost_ax.set_yticklabels([])
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def disk_main(args: argparse.Namespace, layouts: list[str]) -> int:
    """``--disk``: the disk tier side by side (tools/_disk_vs_native.py), per engine loop."""
    import _disk_vs_native as disk

    print(f"PYTHONHASHSEED={os.environ.get('PYTHONHASHSEED', 'random')}")
    print(
        "tier wrote/read: each tier's own byte counters; dir bytes/files: left in its directory "
        "at the end; dev wrote/read: /proc/self/io write_bytes/read_bytes over the run"
    )
    problems = []
    for loop in args.loops.split(","):
        print(f"\n==== engine loop: {loop}")
        for base in _cases(args.quick):
            if base.name not in layouts:
                continue
            case = for_loop(base, loop == "async")
            lines, found = disk.bench_disk(case, args.disk_root, args.small, args.repeats)
            print("\n".join(lines), flush=True)
            problems += [f"{loop}: {p}" for p in found]
    for problem in problems:
        print(f"  ERROR {problem}")
    return 1 if problems else 0


def main(argv: list[str] | None = None, *, rerun: bool = False) -> int:
    """The bench (module docstring); ``rerun``: start again under ``--hash-seed`` when the
    environment's ``PYTHONHASHSEED`` differs (the command line does; a caller in-process
    keeps its own)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small traces, one repeat")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per variant")
    parser.add_argument("--delays", default="0,1,4", help="copy delays in steps")
    names = [case.name for case in _cases(False)]
    parser.add_argument(
        "--layouts", default=",".join(names), help=f"comma-separated, of {', '.join(names)}"
    )
    parser.add_argument(
        "--plot", type=Path, default=None, help="write the figure there (needs matplotlib)"
    )
    parser.add_argument(
        "--loops",
        default="async,sync",
        help="vLLM's engine loops to run, of async (async scheduling, vLLM's GPU default) and sync",
    )
    parser.add_argument(
        "--traffic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also play each layout's traffic trace (TrafficTrace)",
    )
    parser.add_argument(
        "--hash-seed",
        type=int,
        default=0,
        help="PYTHONHASHSEED the bench runs under (it starts itself again under it when the "
        "environment names another; module docstring)",
    )
    parser.add_argument(
        "--disk",
        action="store_true",
        help="instead: a disk tier under a host tier of 0.5x the working set, hybridkv beside "
        "native's fs tier (tools/_disk_vs_native.py)",
    )
    parser.add_argument(
        "--disk-root",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="with --disk: where the tiers' directories are made (a real filesystem)",
    )
    parser.add_argument(
        "--small",
        type=float,
        default=0.5,
        help="with --disk: the small directory's size, a multiple of the working set",
    )
    args = parser.parse_args(argv)
    if rerun and os.environ.get("PYTHONHASHSEED") != str(args.hash_seed):
        # The order vLLM's engine walks some sets of request ids follows str hashes, so under a
        # random seed the traffic rows move from one run to the next (module docstring).
        os.execve(
            sys.executable,
            [sys.executable, *sys.argv],
            {**os.environ, "PYTHONHASHSEED": str(args.hash_seed)},
        )
    layouts = args.layouts.split(",")
    unknown = sorted(set(layouts) - set(names))
    if unknown:
        parser.error(f"--layouts: unknown {', '.join(unknown)}; use some of {', '.join(names)}")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'hybridkv[plot]'")
    loops = args.loops.split(",")
    if not loops or set(loops) - {"async", "sync"}:
        parser.error(f"--loops: {args.loops!r}; use async, sync or async,sync")
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.disk:
        return disk_main(args, layouts)
    args.delays = [int(d) for d in args.delays.split(",")]
    print(f"PYTHONHASHSEED={os.environ.get('PYTHONHASHSEED', 'random')}")
    print(
        "copies: both connectors' jobs report `d` polls (steps) after submission, FIFO per "
        "direction; native's bytes move at completion, hybridkv's on its CPU engine's thread "
        "at submission (only the report waits)"
    )
    print(
        "cont ld / cont gpu: prompt tokens at positions of an earlier turn's answer that the "
        "connector loaded / the GPU prefix cache hit (each request's first admission); ld prev: "
        "the part of cont ld in the previous turn's answer (KV only its decode computed)"
    )
    outcomes = []
    for loop in loops:
        print(
            f"\n==== engine loop: {loop} ("
            + (
                "EngineCore.step_with_batch_queue, AsyncScheduler: step N+1 scheduled before "
                "step N's token is applied"
                if loop == "async"
                else "EngineCore.step, Scheduler"
            )
            + ")"
        )
        for base in _cases(args.quick):
            if base.name not in layouts:
                continue
            case = for_loop(base, loop == "async")
            long = replace(case.trace, output_len=40)
            outcomes.append(bench_trace(case, case.trace, args, sweep=True))
            outcomes.append(bench_trace(case, long, args, sweep=False))
            if args.traffic:
                outcomes.append(bench_trace(case, case.traffic, args, sweep=True))
    if args.plot is not None:
        plot(outcomes, args.plot)
        print(f"figure: {args.plot}")
    return 1 if any(o.problems for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main(rerun=True))
