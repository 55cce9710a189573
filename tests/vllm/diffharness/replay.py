"""A ``tests/regressions`` scenario, as its script ran on the spec engine, made into a trace.

A regression scenario is a script of engine events (``regression_script.Script``) on a tiny
geometry: every group has blocks of 2 tokens, the hash block is 2, a sliding window is a few
tokens. :func:`translate` reads what that script did (its event log and its scheduler outputs,
both public on the ``Script``), and writes the same run as a :class:`~diffharness.trace.Trace`
on the vLLM layout with the same group structure (:func:`layout_for`), scaled so that one
regression block is one claim unit of the layout:

- a token count ``t`` becomes ``(t // b) * u + t % b`` (``b`` the regression block, ``u`` the
  layout's scheduler block): block boundaries stay block boundaries and the tokens past the
  last boundary stay single tokens (the last prompt token, a decode step);
- a prompt becomes, block by block, the block's own ``b`` tokens followed by ``u - b`` filler
  tokens, so prompts share exactly the blocks they shared;
- the connector's answers are the reference connector's claims as the script recorded them
  (``ClaimRecord``: kind, tokens claimed beyond the local hit), the last one repeated for any
  later ask (the host still holds what it held);
- each async load reports at the step after its last job completed in the script (the engine
  folds a job's result in the next step) and fails if any of its jobs failed; a request the
  connector kept for a store (``ConnectorMeta.delayed_free_ids``) is held until the step its
  last store job was folded;
- arrivals and aborts happen before the ``schedule()`` of the step that followed them;
- the pool (block count), the running cap, the failure policy, the retention and the
  whole-sequence gate are the scenario's own; the token budget is scaled;
  ``max_model_len`` is the smallest multiple of ``u`` that holds every request (the spec
  engine has none), and the pool must pass vLLM's start-up check with it.

What a trace cannot say is refused with :class:`~diffharness.trace.TraceError` (a spec-only
switch: shared truncation, a load deadline, no async reserve) or cut and listed in
:attr:`Replay.cut` (``reset_prefix_cache`` and everything after it). ``seed`` events need no
translation: the claims they produced are in the log.

Imports neither vLLM nor ``tests/regressions``: the ``Script`` is read through its attributes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from diffharness.layouts import RECIPES, Layout
from diffharness.trace import (
    AbortPhase,
    ClaimMode,
    ClaimScript,
    EngineSettings,
    FailurePolicy,
    LoadScript,
    RequestScript,
    Trace,
    TraceError,
)
from spec.kinds import GroupKind
from spec.scheduler import RecoveryMode

__all__ = ["FILLER", "Replay", "layout_for", "scale_prompt", "translate"]

FILLER = 1_000
"""The first filler token; regression prompts use tokens below it."""

_MODES = {mode.value: mode for mode in ClaimMode}
_POLICIES = {
    RecoveryMode.VLLM_RECOMPUTE: FailurePolicy.RECOMPUTE,
    RecoveryMode.VLLM_FAIL: FailurePolicy.FAIL,
}


@dataclass(frozen=True, slots=True)
class Replay:
    """A translated scenario.

    Attributes:
        trace: the trace both sides run.
        block: the regression's block size in tokens.
        unit: the layout's claim unit (scheduler block) in tokens.
        spec_changes: spec-only ``SchedulerConfig`` fields of the scenario worth keeping on the
            spec side (``liveness_bound_steps``: the spec names SC-3 on a wedge).
        cut: the events not translated, in script order (empty when all were).
        prompt_lengths: each translated request's prompt length in the regression.
    """

    trace: Trace
    block: int
    unit: int
    spec_changes: Mapping[str, Any]
    cut: tuple[str, ...]
    prompt_lengths: Mapping[str, int]

    def tokens(self, regression_tokens: int) -> int:
        """A regression token count (or position) on the layout (module docstring)."""
        return (regression_tokens // self.block) * self.unit + regression_tokens % self.block

    def position(self, request_id: str, regression_position: int) -> int:
        """A position of ``request_id``'s sequence on the layout: inside the prompt as
        :meth:`tokens`; past it, one token per token (decode steps are not scaled)."""
        prompt = self.prompt_lengths[request_id]
        past = max(regression_position - prompt, 0)
        return self.tokens(regression_position - past) + past

    def chunks(self, request_id: str, pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Regression ``(computed before, tokens)`` chunks of ``request_id`` on the layout: the
        chunk ``[a, a + n)`` becomes ``[position(a), position(a + n))``."""
        found = []
        for a, n in pairs:
            start = self.position(request_id, a)
            found.append((start, self.position(request_id, a + n) - start))
        return found


def layout_for(groups: Sequence[Any], block: int) -> Layout:
    """The layout whose groups are ``groups`` (regression ``GroupSpec`` values, blocks of
    ``block`` tokens) with one regression block made one claim unit: the same kinds, as many
    groups, windows of the same number of blocks, no speculative blocks."""

    def shape(kinds: Sequence[tuple[GroupKind, int, int]]) -> list[tuple[str, int]]:
        return sorted((kind.value, window // size if window else 0) for kind, size, window in kinds)

    wanted = shape([(g.kind, g.block_size, g.sliding_window) for g in groups])
    for layout, recipe in RECIPES.items():
        ours = recipe.spec_groups()
        if any(g.num_speculative_blocks for g in (*groups, *ours)):
            continue
        if shape([(g.kind, g.block_size, g.sliding_window) for g in ours]) == wanted:
            return layout
    raise TraceError("groups", groups, "no layout has this group structure", "add a recipe")


def scale_prompt(prompt: Sequence[int], block: int, unit: int) -> tuple[int, ...]:
    """``prompt`` with each whole block of ``block`` tokens followed by ``unit - block`` filler
    tokens; the tokens past the last whole block are kept as they are."""
    if any(t >= FILLER for t in prompt):
        raise TraceError("prompt", tuple(prompt), f"tokens must be below {FILLER}", "renumber")
    filler = tuple(range(FILLER, FILLER + unit - block))
    out: list[int] = []
    whole = len(prompt) - len(prompt) % block
    for start in range(0, whole, block):
        out.extend((*prompt[start : start + block], *filler))
    out.extend(prompt[whole:])
    return tuple(out)


@dataclass
class _Log:
    """The script's events by step: what happened before each step's ``schedule()``."""

    steps: int = 0
    arrivals: dict[str, int] = field(default_factory=dict)
    aborts: dict[str, int] = field(default_factory=dict)
    done: dict[int, tuple[int, bool]] = field(default_factory=dict)  # job -> (steps done, ok)
    cut: tuple[str, ...] = ()


def _read_events(events: Sequence[str]) -> _Log:
    log = _Log()
    for index, label in enumerate(events):
        words = label.split()
        if label == "reset_prefix_cache":
            log.cut = tuple(events[index:])
            break
        if words[0] == "step":
            log.steps += 1
        elif words[0] == "arrive":
            log.arrivals[words[1]] = log.steps + 1
        elif words[0] == "abort":
            log.aborts[words[1]] = log.steps + 1
        elif words[0] in ("load", "store") and words[1] == "job":
            log.done[int(words[2])] = (log.steps, words[-1] == "completes")
        elif words[0] != "seed":
            raise TraceError("events", label, "not a Script event", "extend translate()")
    return log


def _claims(outputs: Sequence[Any], rid: str, block: int, steps: int) -> tuple[ClaimScript, ...]:
    found = []
    for out in outputs:
        for claim in out.claims:
            if claim.request_id == rid:
                mode = _MODES[claim.kind.value]
                units, offset = divmod(claim.claimed, block)
                if mode in (ClaimMode.SYNC, ClaimMode.ASYNC):
                    found.append(ClaimScript(mode, units, offset))
                else:
                    found.append(ClaimScript(mode))
    return tuple(found) + tuple(found[-1:]) * steps  # the host keeps answering the same


def _loads(outputs: Sequence[Any], rid: str, log: _Log) -> tuple[LoadScript, ...]:
    loads = []
    for step, out in enumerate(outputs, start=1):
        jobs = [int(j.job_id) for j in out.meta.load_jobs if j.request_id == rid and not j.sync]
        if not jobs:
            continue
        ends = [log.done[job] for job in jobs if job in log.done]
        if len(ends) < len(jobs):
            loads.append(LoadScript(None))  # a job never reports: neither does the load
            continue
        report = max(done for done, _ in ends) + 1  # folded in the step after the last one
        loads.append(LoadScript(report - step, fails=not all(ok for _, ok in ends)))
    return tuple(loads)


def _hold(outputs: Sequence[Any], rid: str, log: _Log) -> int | None:
    announced = next(
        (step for step, out in enumerate(outputs, start=1) if rid in out.meta.delayed_free_ids),
        None,
    )
    if announced is None:
        return None
    stores = [int(j.job_id) for out in outputs for j in out.meta.store_jobs if j.request_id == rid]
    if any(job not in log.done for job in stores):
        raise TraceError("store", rid, "a store job never reports", "complete it in the script")
    folded = max([announced, *(log.done[job][0] + 1 for job in stores)])
    # Finished by length in the update of the step before the announcement; by an abort before
    # the announcing step's schedule() (the player's step is then the announcing one).
    finished = announced if log.aborts.get(rid) == announced else announced - 1
    if folded - finished < 1:
        raise TraceError("store", rid, "released in the step it finished", "not expressible")
    return folded - finished


def _settings(config: Any, scale: Any, longest: int) -> EngineSettings:
    sched = config.scheduler
    if sched.recovery not in _POLICIES:
        raise TraceError("recovery", sched.recovery, "spec only", "use a vLLM recovery mode")
    if sched.load_deadline_steps is not None:
        raise TraceError("load_deadline_steps", sched.load_deadline_steps, "spec only", "drop it")
    if not sched.reserve_for_async_loads:
        raise TraceError("reserve_for_async_loads", False, "vLLM always reserves", "drop it")
    return EngineSettings(
        num_blocks=sched.num_blocks,
        max_num_batched_tokens=scale(sched.max_num_batched_tokens),
        max_num_seqs=sched.max_num_running,
        failure_policy=_POLICIES[sched.recovery],
        retention_interval=sched.retention_interval,
        reserve_full_sequence=sched.full_sequence_must_fit,
        max_model_len=longest,
    )


def translate(
    script: Any, *, max_steps: int | None = None, stores: bool = True, **loads: LoadScript
) -> Replay:
    """The scenario ``script`` ran (a finished ``regression_script.Script``) as a trace.

    ``max_steps``: the trace's step cap (default: the steps the script took before any cut).
    ``stores=False`` leaves the connector's store holds out. ``loads``: per request id, a
    :class:`LoadScript` replacing its first load's (a block-level report of the same failure,
    which the script's recovery mode decides and a trace states). Refusals: module docstring.
    """
    config = script.engine.config
    groups = config.groups
    block = groups[0].block_size
    if any(g.block_size != block for g in groups) or config.scheduler.hash_block_size != block:
        raise TraceError("groups", groups, "needs one block size, the hash block", "use one")
    layout = layout_for(groups, block)
    recipe = RECIPES[layout]
    unit = recipe.unit
    log = _read_events(script.events)
    outputs = script.outputs[: log.steps]

    def scale(t: int) -> int:
        return (t // block) * unit + t % block

    requests = []
    for spec in config.requests:
        rid = str(spec.request_id)
        if rid not in log.arrivals:
            continue
        own = _loads(outputs, rid, log)
        if rid in loads:
            own = (loads[rid], *own[1:])
        requests.append(
            RequestScript(
                rid,
                log.arrivals[rid],
                scale_prompt(spec.prompt, block, unit),
                spec.max_tokens,
                cache_salt=spec.cache_salt,
                claims=_claims(outputs, rid, block, log.steps),
                loads=own,
                store_hold=_hold(outputs, rid, log) if stores else None,
                abort_step=log.aborts.get(rid),
                abort_phase=AbortPhase.BEFORE_SCHEDULE,
            )
        )
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    longest = -(-longest // unit) * unit
    settings = _settings(config, scale, longest)
    smallest = recipe.min_blocks(settings.max_num_batched_tokens, longest)
    if settings.num_blocks < smallest:
        raise TraceError(
            "num_blocks", settings.num_blocks, f"vLLM needs {smallest} at start-up", "raise it"
        )
    trace = Trace(layout, settings, tuple(requests), max_steps or log.steps)
    bound = config.scheduler.liveness_bound_steps
    changes = {} if bound is None else {"liveness_bound_steps": bound}
    lengths = {str(r.request_id): len(r.prompt) for r in config.requests}
    return Replay(
        trace,
        block,
        unit,
        changes,
        log.cut,
        {r.request_id: lengths[r.request_id] for r in requests},
    )
