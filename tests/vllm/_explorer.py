"""The configuration explorer's runner (issue 28, item 2): play one drawn :class:`Config`
(:mod:`_explorer_config`) through the in-process vLLM 0.33 engine, every KV slot and mamba
state read content-checked and the spec's invariants evaluated after every step
(:class:`_invariants_on_vllm.InvariantChecker`), and say what went wrong, if anything.

:func:`explore` returns an :class:`Explored`: its counts and at most one :class:`Failure`, whose
kind is one of :data:`FAILURE_KINDS`:

- ``wrong_reads``: a slot or state read held other content than its tokens imply;
- ``wedge``: the engine made no progress for SC-12's window (:data:`_invariants_on_vllm.
  PROGRESS_WINDOW` steps with work left, no transfer in flight, and no request's status,
  computed or output tokens changing: issue 29's spin), or was still busy after ``max_steps``,
  or left a request unfinished;
- ``leak``: transfers, jobs, pins, held blocks, core requests or GPU blocks left at the end
  (:func:`_random_traces.residue`);
- ``violation``: a step broke another spec invariant (:class:`spec.errors.InvariantViolation`);
- ``crash``: any other exception, inside vLLM or hybridkv, at any step or event.

A configuration vLLM or hybridkv refuses while the engine is built (vLLM's "To serve at least one
request", a ``SpeculativeConfig`` it rejects, a ``HybridKVConfigError``) raises :class:`Refused`
instead: the draw is rejected, not failed. Only refusals raised from vLLM's own code or as
``HybridKVConfigError`` count; anything else raised while building is a crash.

The events of a configuration run between steps as a client's utility calls reach vLLM's engine
core (:mod:`hybridkv.vllm.harness.engine_loop` binds vLLM's own ``pause_scheduler``,
``reset_prefix_cache``, ``sleep`` and ``wake_up``); :data:`_EVENTS` says what each does. A
refusal vLLM documents (a reset while requests hold blocks, the in-process pause with a load
in flight) is counted (``events_refused``), and the run goes on.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _explorer_config import Config
from _invariants_on_vllm import InvariantChecker
from _random_traces import Arrival, Shape, random_trace, residue, shared_prefix_trace
from diffharness.layouts import RECIPES, Layout
from vllm.config import KVTransferConfig

from hybridkv.errors import HybridKVConfigError
from hybridkv.vllm.harness.cpu_worker import FaultPlan, HybridKVOnCPU
from hybridkv.vllm.harness.engine_config import EngineSettings, WedgedError
from hybridkv.vllm.harness.inprocess import InProcessEngine
from hybridkv.vllm.layout import read_layout
from spec.errors import InvariantViolation
from spec.presets import tiny_config

__all__ = [
    "FAILURE_KINDS",
    "LIVENESS_IDS",
    "Explored",
    "Failure",
    "Refused",
    "explore",
    "pool_blocks",
    "require_clean",
    "whole_request_blocks",
]

FAILURE_KINDS = ("wrong_reads", "wedge", "leak", "violation", "crash")
LIVENESS_IDS = ("SC-10", "SC-11", "SC-12")
"""The invariants whose violation is a wedge (:mod:`spec.invariants.liveness`)."""
MAX_STEPS = 800


class Refused(Exception):
    """vLLM or hybridkv refused the configuration while the engine was built (a rejected draw)."""

    def __init__(self, who: str, message: str) -> None:
        super().__init__(f"{who}: {message}")
        self.who = who


@dataclass(frozen=True, slots=True)
class Failure:
    """What went wrong (``kind`` one of :data:`FAILURE_KINDS`) and the evidence."""

    kind: str
    detail: str


@dataclass(slots=True)
class Explored:
    """One configuration's run: what it observed, and its failure (None: it ran clean)."""

    config: Config
    counts: Counter[str] = field(default_factory=Counter)
    failure: Failure | None = None


# ------------------------------------------------------------------ building


def _nemotron() -> dict[str, Any]:
    """Nemotron-H cut to ``M*M*`` (tests/vllm/test_hybridkv_checkpoints.py's model)."""
    cfg = tiny_config("nemotron-h-8b", 4)
    cfg["hybrid_override_pattern"] = "M*M*"
    cfg["num_nextn_predict_layers"] = 1
    return cfg


_RECIPE_OF = {
    "sliding+full": Layout.SLIDING_FULL,
    "2sliding+full": Layout.THREE_GROUPS,
    "mamba+full": Layout.MAMBA_FULL,
}


def _model(config: Config) -> dict[str, Any]:
    if config.layout == "mamba2+full":
        return _nemotron()
    cfg = RECIPES[_RECIPE_OF[config.layout]].config_json()
    if config.speculative == "mtp":
        cfg["num_nextn_predict_layers"] = 1  # SpeculativeConfig(method="mtp") reads it
    return cfg


def _batches(config: Config) -> int:
    return 2 if config.async_scheduling else 1


def smallest_pool(config: Config) -> int:
    """vLLM's smallest pool for the configuration's loop and budget (a sliding window reserves
    for every batch in flight: ``LayoutRecipe.min_blocks``). Nemotron-H ``M*M*``: one full
    group of ``max_model_len``, two mamba states and the prefill checkpoint block, plus the null
    block (8, measured against vLLM's start-up check). Under speculative decoding a mamba group
    keeps a state per speculative token besides (vLLM's speculative mamba blocks)."""
    spec = 0 if config.speculative == "none" else config.num_speculative_tokens
    if config.layout == "mamba2+full":
        return 8 + spec
    recipe = RECIPES[_RECIPE_OF[config.layout]]
    mamba_groups = 3 if config.layout == "mamba+full" else 0
    return recipe.min_blocks(config.max_num_batched_tokens * _batches(config)) + mamba_groups * spec


def whole_request_blocks(config: Config, num_tokens: int) -> int:
    """The blocks one request of ``num_tokens`` holds at its end, with vLLM's reservation for a
    step in flight: :func:`smallest_pool`'s count for a ``max_model_len`` of ``num_tokens``,
    less the null block."""
    spec = 0 if config.speculative == "none" else config.num_speculative_tokens
    if config.layout == "mamba2+full":
        return -(-num_tokens // config.geometry.block) + 3 + spec  # two states, the checkpoint
    recipe = RECIPES[_RECIPE_OF[config.layout]]
    mamba_groups = 3 if config.layout == "mamba+full" else 0
    budget = config.max_num_batched_tokens * _batches(config)
    return recipe.min_blocks(budget, num_tokens) - 1 + mamba_groups * spec


def pool_blocks(config: Config, arrivals: list[Arrival]) -> int:
    """The GPU pool: vLLM's smallest plus ``pool_extra``; under ``pool_fit``, ``pool_fit``
    whole requests of the workload's longest (never below vLLM's smallest)."""
    if config.pool_fit is None:
        return smallest_pool(config) + config.pool_extra
    longest = max(len(a.prompt) + a.max_tokens for a in arrivals)
    fit = 1 + config.pool_fit * whole_request_blocks(config, longest)
    return max(smallest_pool(config), fit)


@functools.cache
def _draft_dir(hidden_size: int, heads: int, kv_heads: int, head_dim: int, vocab: int) -> str:
    """A one-layer Llama config for EAGLE's draft (never built: only its config is read)."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": 256,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
    }
    text = json.dumps(cfg, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    directory = Path(tempfile.gettempdir()) / f"hybridkv-explorer-{os.getuid()}" / digest
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "config.json"
    if not target.exists():
        partial = directory / f"config.{os.getpid()}.tmp"
        partial.write_text(text)
        os.replace(partial, target)  # whole or absent: a parallel worker never reads half
    return str(directory)


def _speculative(config: Config, model: dict[str, Any]) -> dict[str, Any] | None:
    k = config.num_speculative_tokens
    if config.speculative == "none":
        return None
    if config.speculative == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
    if config.speculative == "mtp":
        return {"method": "mtp", "num_speculative_tokens": k}
    return eagle_speculative(model, config.speculative, k)


def eagle_speculative(model: dict[str, Any], method: str, k: int) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for EAGLE or EAGLE-3 (``method``) with ``k`` drafts over
    a one-layer Llama draft config sized from the target's ``model`` config (never built)."""
    text = model.get("text_config", model)
    heads = int(text.get("num_attention_heads", 4))
    draft = _draft_dir(
        int(text["hidden_size"]),
        heads,
        int(text.get("num_key_value_heads", heads)),
        int(text.get("head_dim") or text["hidden_size"] // heads),
        int(text.get("vocab_size", 32000)),
    )
    return {"method": method, "model": draft, "num_speculative_tokens": k}


def _transfer(config: Config) -> KVTransferConfig:
    g = config.geometry
    chunk = None if config.chunk_units is None else config.chunk_units * g.block
    return KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy=config.failure_policy,
        kv_connector_extra_config={
            "host_memory_bytes": 1,  # sized by _SizedHost once vLLM planned the caches
            "chunk_size": chunk,
            "eviction_policy": config.eviction_policy,
            "load_deadline_steps": config.deadline,
            "offload_decode_state": config.offload_decode_state,
        },
    )


class _SizedHost(HybridKVOnCPU):
    """The adapter whose host tier is ``ratio`` times the working set, in slots of the planned
    layout (``working_blocks`` distinct block-aligned prefixes, one slot per block and group)."""

    def __init__(self, ratio: float, working_blocks: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ratio, self.working_blocks = ratio, working_blocks

    def configure(self, vllm_config: Any, kv_cache_config: Any) -> None:
        layout = read_layout(vllm_config, kv_cache_config)
        ranks = int(vllm_config.parallel_config.world_size)
        groups = len(kv_cache_config.kv_cache_groups)
        slots = max(1, round(self.ratio * self.working_blocks * groups))
        self.host_bytes = slots * layout.slot_bytes * ranks
        super().configure(vllm_config, kv_cache_config)


def _two_waves(first: list[Arrival], config: Config) -> list[Arrival]:
    """The trace, then its prompts again once the last event has run (so a reset, a pause or a
    sleep is followed by requests that could hit what it should have dropped, or kept)."""
    start = max([12, *(step for step, _kind in config.events)]) + 1
    again = [Arrival(start + a.step, f"w{a.request_id}", a.prompt, a.max_tokens) for a in first]
    return first + again


def _working_blocks(prompts: list[tuple[int, ...]], block: int) -> int:
    return len({p[:n] for p in prompts for n in range(block, len(p) + 1, block)})


_VLLM_ROOT = str(Path(__import__("vllm").__file__).parent)


def _raised_in_vllm(error: BaseException) -> bool:
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_VLLM_ROOT)


def _build(config: Config, adapters: list[HybridKVOnCPU], pool: int) -> InProcessEngine:
    g = config.geometry
    model = _model(config)
    settings = EngineSettings(
        num_gpu_blocks=pool,
        max_model_len=g.max_model_len,
        block_size=g.block if g.block < 640 else None,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_steps=MAX_STEPS,
        tensor_parallel_size=config.tensor_parallel,
        replicated_kv=config.replicated_kv,
        speculative=_speculative(config, model),
        prefix_match_unit=config.prefix_match_unit,
        speculative_hooks=config.speculative_hooks,
        hash_algo=config.hash_algo,
        async_scheduling=config.async_scheduling,
    )
    adapter: Any = adapters[0] if len(adapters) == 1 else adapters
    try:
        return InProcessEngine(model, settings, _transfer(config), adapter)
    except HybridKVConfigError as refused:
        raise Refused("hybridkv", str(refused)) from refused
    except Exception as error:
        # pydantic's ValidationError of vLLM's config classes, vLLM's ValueError (its smallest
        # pool, a prefix_match_unit), NotImplementedError (a method a model lacks).
        if type(error).__name__ == "ValidationError" or _raised_in_vllm(error):
            raise Refused("vllm", f"{type(error).__name__}: {error}") from error
        raise


# ------------------------------------------------------------------ playing


def explore(
    config: Config,
    corrupt: Callable[[HybridKVOnCPU], None] | None = None,
) -> Explored:
    """Play ``config`` (module docstring), every invariant checked after every step.
    ``corrupt``: called on each rank's adapter before the engine is built (the negative
    controls). Raises :class:`Refused` only."""
    g = config.geometry
    rng = random.Random(config.seed)
    shape = Shape(Layout.SLIDING_FULL, 0, g.block, g.max_prompt, 4, g.max_tokens)
    draw = random_trace if config.pool_fit is None else shared_prefix_trace
    arrivals = _two_waves(draw(shape, rng), config)
    working = _working_blocks([a.prompt for a in arrivals], g.block)
    adapters: list[HybridKVOnCPU] = [
        _SizedHost(
            config.host_ratio,
            working,
            faults=FaultPlan(config.seed + rank, config.load_rate, config.store_rate),
            delay=config.delay,
        )
        for rank in range(config.tensor_parallel)
    ]
    for adapter in adapters:
        if corrupt is not None:
            corrupt(adapter)
    engine = _build(config, adapters, pool_blocks(config, arrivals))
    explored = Explored(config)
    try:
        _play(engine, config, arrivals, explored)
    except WedgedError as wedged:
        explored.failure = Failure("wedge", str(wedged))
    except InvariantViolation as violation:
        kind = "wedge" if violation.invariant_id in LIVENESS_IDS else "violation"
        explored.failure = Failure(kind, str(violation))
    except Exception as error:  # anything else inside vLLM or hybridkv
        detail = "".join(traceback.format_exception(error)[-12:]).strip()
        explored.failure = Failure("crash", detail)
    finally:
        engine.close()  # the worker's copy thread would keep the engine's memory
    return explored


class _Run:
    """One play's engine, checker and counts (the steps, aborts and events below)."""

    def __init__(self, engine: InProcessEngine, config: Config, explored: Explored) -> None:
        self.engine, self.counts = engine, explored.counts
        self.rng = random.Random(config.seed ^ 0xE7)  # the aborts' own stream
        self.checker = InvariantChecker(engine)
        self.core = engine.loop.core

    def step(self) -> None:
        if self.engine.tally.steps >= MAX_STEPS:
            live = {
                rid: (self.engine.status(rid), r.num_computed_tokens)
                for rid, r in self.engine.requests.items()
                if not r.is_finished()
            }
            raise WedgedError(f"busy after max_steps={MAX_STEPS}: {live}")
        self.engine.step()
        self.checker.after_step()

    def drain(self) -> None:
        """Step until the engine is idle (nothing scheduled, in the queue or in flight)."""
        while self.engine.busy():
            self.step()

    def abort_all(self) -> None:
        for rid, request in self.engine.requests.items():
            if not request.is_finished() and self.engine.abort(rid):
                self.counts["aborted"] += 1


def _play(
    engine: InProcessEngine,
    config: Config,
    arrivals: list[Arrival],
    explored: Explored,
) -> None:
    run = _Run(engine, config, explored)
    events = sorted(config.events)
    step = 0
    while arrivals or events or engine.busy():
        while arrivals and arrivals[0].step <= step:
            a = arrivals.pop(0)
            engine.add(a.request_id, list(a.prompt), a.max_tokens)
        while events and events[0][0] <= step:
            _event(run, events.pop(0)[1], config)
        step += 1
        if not engine.busy():
            continue
        _abort(run, config)
        run.step()
    _judge(engine, run, explored)


def _abort(run: _Run, config: Config) -> None:
    """Aborts before a step: of a request waiting for its load, with a store in flight, any."""
    core = run.engine.scheduler.connector.core
    loading = core.loading_requests()
    for rid, request in run.engine.requests.items():
        if request.is_finished():
            continue
        if rid in loading:
            rate, kind = config.abort_loading, "aborted_loading"
        elif core.has_transfers(rid):
            rate, kind = config.abort_storing, "aborted_storing"
        else:
            rate, kind = config.abort_random, "aborted"
        if rate and run.rng.random() < rate and run.engine.abort(rid):
            run.counts[kind] += 1


def _reset_running(run: _Run, config: Config) -> bool:
    """``reset_prefix_cache(reset_running_requests=True, reset_connector=True)``; under async
    scheduling during a ``pause(mode="keep")`` once the batch queue's steps landed
    (tests/vllm/test_hybridkv_reset.py: vLLM defers a preempted request's frees while its step
    is in the queue, and refuses the reset before)."""
    from vllm.v1.core.sched.interface import PauseState

    scheduler = run.engine.scheduler
    if config.async_scheduling:
        scheduler.set_pause_state(PauseState.PAUSED_ALL)
        while scheduler.processed_step_seq < scheduler.sched_step_seq:
            run.step()
    try:
        return bool(run.core.reset_prefix_cache(True, True))
    except RuntimeError as refused:
        # vLLM's own: "Failed to reset KV cache even when all the running requests are
        # preempted ... running requests waiting for remote KV transfer ... not supported yet".
        if "waiting for remote KV transfer" not in str(refused):
            raise
        return False
    finally:
        scheduler.set_pause_state(PauseState.UNPAUSED)


def _pause_inproc(run: _Run) -> bool:
    """``pause_generation(clear_cache=True)`` as the in-process engine core runs it: vLLM raises
    ``RuntimeError`` while an aborted request's load is in flight (its reset fails first)."""
    run.abort_all()
    try:
        run.core.pause_scheduler(mode="abort", clear_cache=True)
        return True
    except RuntimeError as refused:
        if "Failed to reset" not in str(refused):
            raise
        return False
    finally:
        run.core.resume_scheduler()


def _quiesce(run: _Run) -> None:
    """A server's pause (``EngineCoreProc.pause_scheduler``): abort everything, then finish the
    pause only once the engine has no work (its idle-state callback)."""
    run.abort_all()
    run.core.pause_scheduler(mode="abort", clear_cache=False)
    run.drain()


def _event(run: _Run, kind: str, config: Config) -> None:
    run.counts[f"event_{kind}"] += 1
    if not _EVENTS[kind](run, config):
        run.counts["events_refused"] += 1


def _sleep(level: int) -> Callable[[_Run, Config], bool]:
    def sleep(run: _Run, config: Config) -> bool:
        _quiesce(run)
        run.core.sleep(level)  # idle now: vLLM's pause and cache reset, then the executor's
        return bool(run.core.wake_up())

    return sleep


def _pause_server(run: _Run, config: Config) -> bool:
    _quiesce(run)
    run.core.pause_scheduler(mode="abort", clear_cache=True)  # idle: must succeed
    run.core.resume_scheduler()
    return True


_EVENTS: dict[str, Callable[[_Run, Config], bool]] = {
    "reset_cache": lambda run, config: bool(run.core.reset_prefix_cache()),
    "reset_connector": lambda run, config: bool(run.core.reset_prefix_cache(False, True)),
    "reset_running": _reset_running,
    "pause_inproc": lambda run, config: _pause_inproc(run),
    "pause_server": _pause_server,
    "sleep1": _sleep(1),
    "sleep2": _sleep(2),
}
"""Each event, returning False where vLLM refused it (module docstring)."""


def _judge(engine: InProcessEngine, run: _Run, explored: Explored) -> None:
    t = engine.tally
    core = engine.scheduler.connector.core.stats()
    explored.counts.update(
        steps=t.steps,
        slots_checked=t.checked,
        wrong_reads=t.wrong,
        preemptions=t.preemptions,
        external_hits=t.external_hits,
        failed_loads=t.failed_loads,
        load_jobs=core.load_jobs,
        failed_jobs=core.load_jobs_failed + core.store_jobs_failed,
        steps_checked=run.checker.situations["steps_checked"],
        finished_error=sum(r.status.name == "FINISHED_ERROR" for r in engine.requests.values()),
    )
    unfinished = [rid for rid, r in engine.requests.items() if not r.is_finished()]
    left = residue(engine)
    if t.wrong:
        explored.failure = Failure("wrong_reads", f"{t.wrong} of {t.checked} slots read wrong")
    elif unfinished:
        explored.failure = Failure("wedge", f"idle with requests unfinished: {unfinished}")
    elif left:
        explored.failure = Failure("leak", f"left at the end: {dict(left)}")


def require_clean(explored: Explored) -> None:
    """Raise ``AssertionError`` naming the failure and the one-line replay, if there is one."""
    failure = explored.failure
    if failure is not None:
        raise AssertionError(
            f"{failure.kind}: {failure.detail}\n  replay: {explored.config.replay}"
        )
