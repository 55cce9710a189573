"""Hypothesis strategies for random traces over one layout.

A trace draws the engine settings: a token budget from under one block to a few blocks (so
prefills are chunked), a pool at most 8 blocks above the smallest vLLM accepts for that budget
(so requests preempt each other), the running cap, the failure policy, dense or sparse
retention, and whether an admission must fit the whole sequence. Then one to six requests.
Prompts are cut around block boundaries (k blocks, minus one, plus one, or a random tail) from
a few shared prefixes, with or without a cache salt, so local prefix hits, full-prompt hits and
salted misses all occur. Each request scripts up to three connector answers (defer, none, sync
or async claims of a few units), how each async load ends (after 0-3 steps, failing or not), an
optional store hold and, one request in four, an abort between or during steps.
"""

from __future__ import annotations

from hypothesis import strategies as st

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
)

__all__ = ["BUDGETS", "traces"]

BUDGETS: dict[Layout, tuple[int, ...]] = {
    # Mamba blocks are 640 tokens: 320 forces sub-block chunks, 2048 several blocks per step.
    Layout.MAMBA_FULL: (320, 640, 1280, 2048),
    Layout.SLIDING_FULL: (16, 32, 64, 96, 128),
    Layout.THREE_GROUPS: (16, 32, 64, 96, 128),
    Layout.FULL_ONLY: (16, 32, 64, 96, 128),
}
MAX_BLOCKS_PER_PROMPT: dict[Layout, int] = {
    Layout.MAMBA_FULL: 3,
    Layout.SLIDING_FULL: 12,
    Layout.THREE_GROUPS: 12,
    Layout.FULL_ONLY: 12,
}
MAX_TOKENS = 4
NUM_PREFIXES = 2


def _prompt_length(draw: st.DrawFn, unit: int, max_blocks: int, limit: int) -> int:
    blocks = draw(st.integers(1, max_blocks))
    shape = draw(st.sampled_from(("exact", "minus", "plus", "tail")))
    offset = {"exact": 0, "minus": -1, "plus": 1}.get(shape)
    if offset is None:
        offset = draw(st.integers(1, unit - 1))
    return max(1, min(blocks * unit + offset, limit))


_CLAIMS = st.one_of(
    st.just(ClaimScript(ClaimMode.NONE)),
    st.just(ClaimScript(ClaimMode.DEFER)),
    st.builds(ClaimScript, st.just(ClaimMode.SYNC), st.integers(1, 4)),
    st.builds(ClaimScript, st.just(ClaimMode.ASYNC), st.integers(1, 4)),
    st.builds(ClaimScript, st.just(ClaimMode.ASYNC), st.integers(1, 4)),
)
_LOADS = st.builds(LoadScript, st.integers(0, 3), st.booleans())


@st.composite
def _request(
    draw: st.DrawFn, index: int, layout: Layout, prefixes: tuple[tuple[int, ...], ...]
) -> RequestScript:
    recipe = RECIPES[layout]
    unit = recipe.unit
    limit = recipe.max_model_len - MAX_TOKENS
    length = _prompt_length(draw, unit, MAX_BLOCKS_PER_PROMPT[layout], limit)
    prefix = prefixes[draw(st.integers(0, len(prefixes) - 1))]
    shared_blocks = draw(st.integers(0, length // unit + 1))
    shared = min(length, max(0, shared_blocks * unit + draw(st.sampled_from((0, 0, 1, -1)))))
    own = tuple(200_000 + 10_000 * index + j for j in range(length - shared))
    arrival = draw(st.integers(1, 4))
    # One request in four is aborted, between steps or while its step runs.
    aborted = draw(st.integers(0, 3)) == 0
    abort_step = draw(st.integers(arrival, arrival + 10)) if aborted else None
    return RequestScript(
        request_id=f"r{index}",
        arrival_step=arrival,
        prompt=prefix[:shared] + own,
        max_tokens=draw(st.integers(1, MAX_TOKENS)),
        cache_salt=draw(st.sampled_from((None, None, None, "s1", "s2"))),
        claims=tuple(draw(st.lists(_CLAIMS, max_size=3))),
        loads=tuple(draw(st.lists(_LOADS, max_size=3))),
        store_hold=draw(st.none() | st.integers(1, 3)),
        abort_step=abort_step,
        abort_phase=draw(st.sampled_from(AbortPhase)),
    )


@st.composite
def traces(draw: st.DrawFn, layout: Layout) -> Trace:
    """A random trace over ``layout`` (see the module docstring)."""
    recipe = RECIPES[layout]
    budget = draw(st.sampled_from(BUDGETS[layout]))
    smallest = recipe.min_blocks(budget)
    settings = EngineSettings(
        num_blocks=draw(st.integers(smallest, smallest + 8)),
        max_num_batched_tokens=budget,
        max_num_seqs=draw(st.integers(1, 4)),
        failure_policy=draw(st.sampled_from(FailurePolicy)),
        retention_interval=draw(st.sampled_from((0, None))),
        reserve_full_sequence=draw(st.booleans()),
    )
    longest = recipe.max_model_len
    prefixes = tuple(tuple(1000 * (p + 1) + j for j in range(longest)) for p in range(NUM_PREFIXES))
    count = draw(st.integers(1, 6))
    requests = tuple(draw(_request(i, layout, prefixes)) for i in range(count))
    return Trace(layout, settings, requests, max_steps=120)
