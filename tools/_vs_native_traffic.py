"""bench_vs_native's traffic like a server's: random arrivals, several system prompts,
aborts (:class:`TrafficTrace`), played on an engine with a per-request ledger, its floor and
where the tokens above the floor go.

A module of ``tools/bench_vs_native.py`` (its module docstring says what the bench measures);
imported after that tool has put this checkout and ``tools/`` on ``sys.path`` and loaded its
torchvision shim.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hybridkv.vllm.harness.engine_config import WedgedError
from hybridkv.vllm.harness.inprocess import InProcessEngine
from hybridkv.vllm.harness.report import InProcessReport


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
