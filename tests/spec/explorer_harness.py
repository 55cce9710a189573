"""Scenarios and the search of tests/spec/test_explorer_mutations.py.

Not a test module (no ``test_`` prefix); the mutation tests import it by name.

Each builder returns the initial engines of one small scenario (those of ``hybridkv check``,
or a variant a mutation needs) and takes the broken classes as
:func:`spec.system.scenarios.build_engines` does (``connector_cls``, ``scheduler_cls``).
:func:`caught` runs the explorer and returns the shortest counterexample naming one id.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, NamedTuple
from unittest import mock

from spec.connector_api import RequestId
from spec.explorer import explore
from spec.kinds import GroupKind
from spec.managers.group_spec import GroupSpec
from spec.scheduler.config import SchedulerConfig
from spec.store import HostStore
from spec.system import parts
from spec.system.engine import Engine, EngineConfig, RequestSpec
from spec.system.model import Action, Complete, EngineModel
from spec.system.scenarios import Recovery, Scenario, Start, build_engines

FULL, SLIDING, MAMBA = GroupKind.FULL, GroupKind.SLIDING, GroupKind.MAMBA

# ----------------------------------------------------------------- scenarios


def seeded(requests: int = 2, **broken: Any) -> list[Engine]:
    """``hybridkv check --start seeded``: full + mamba, the shared prefix in the host."""
    return build_engines(Scenario(num_requests=requests), **broken)


def empty(**broken: Any) -> list[Engine]:
    """``hybridkv check --start empty``: full + mamba, nothing arrived, an empty host."""
    return build_engines(Scenario(start=Start.EMPTY), **broken)


def sliding(**broken: Any) -> list[Engine]:
    """``hybridkv check --groups full,sliding --start seeded``."""
    return build_engines(Scenario(groups=(FULL, SLIDING)), **broken)


def whole_prefix(recovery: Recovery, **broken: Any) -> list[Engine]:
    """Seeded, one request, the host holding r0's first two tokens in EVERY group (the seeded
    start lacks the second mamba state): a claim of two tokens, one load job per token."""
    found = build_engines(Scenario(num_requests=1, recovery=recovery), **broken)
    for engine in found:
        engine.seed_host(RequestId("r0"), 2)
    return found


def small_store(start: Start, capacity: int, **broken: Any) -> list[Engine]:
    """A scenario with a host store of ``capacity`` entries (``hybridkv check`` has 8)."""
    return build_engines(
        Scenario(start=start), configure=lambda c: replace(c, store_capacity=capacity), **broken
    )


class ArcStore(HostStore):
    """The host store evicting by ARC (the engine's default is LRU)."""

    def __init__(self, capacity: int, policy: str = "arc") -> None:
        super().__init__(capacity, policy)


def arc_store(**broken: Any) -> list[Engine]:
    """Seeded, with an ARC host store of 2 entries: keys are evicted and come back."""
    with mock.patch.object(parts, "HostStore", ArcStore):
        return small_store(Start.SEEDED, 2, **broken)


def salted(**broken: Any) -> list[Engine]:
    """Empty start, r0 salted ``tenant-a`` and r1 ``tenant-b``; the host holds r0's first two
    tokens, stored under its salt (no scenario of ``hybridkv check`` has a salt)."""

    def tenants(config: EngineConfig) -> EngineConfig:
        salts = ("tenant-a", "tenant-b")[: len(config.requests)]
        requests = tuple(
            replace(r, cache_salt=s) for r, s in zip(config.requests, salts, strict=True)
        )
        return replace(config, requests=requests)

    found = build_engines(Scenario(start=Start.EMPTY), configure=tenants, **broken)
    for engine in found:
        engine.seed_host(RequestId("r0"), 2)
    return found


def wedge(**broken: Any) -> list[Engine]:
    """Seeded, a pool of five usable blocks, one output token, a liveness bound of 6 steps:
    two admitted one-token loads would leave one free block, too few for either to resume."""
    return build_engines(
        Scenario(num_blocks=6, max_tokens=1),
        configure=lambda c: replace(c, scheduler=replace(c.scheduler, liveness_bound_steps=6)),
        **broken,
    )


def two_token_blocks(
    *, host: int = 0, hash_block: int = 2, chunk: int = 2, store: int = 8, **broken: Any
) -> list[Engine]:
    """Full + mamba with 2-token blocks, r0 = (1, 2, 3, 4, 5), one output token: a claim or a
    step can end off a block boundary (every position is one with the scenarios' 1-token
    blocks). ``host`` > 0: r0 arrived and the host holds its first ``host`` tokens."""
    config = EngineConfig(
        SchedulerConfig(
            groups=(GroupSpec(FULL, 2), GroupSpec(MAMBA, 2)),
            num_blocks=9,
            max_num_batched_tokens=4,
            max_num_running=1,
            hash_block_size=hash_block,
            load_deadline_steps=1,
        ),
        (RequestSpec(RequestId("r0"), (1, 2, 3, 4, 5), 1),),
        chunk_size=chunk,
        store_capacity=store,
        max_model_len=16,
    )
    engine = Engine.create(config, **broken)
    if host:
        engine.seed_host(RequestId("r0"), host)
        engine.arrive(RequestId("r0"))
    return [engine]


class FairEngineModel(EngineModel):
    """Every job in flight reports before the next step (and no aborts): liveness needs
    fairness, and the plain model may withhold a load's report for ever."""

    def __init__(self, engines: Iterable[Engine]) -> None:
        super().__init__(engines, aborts=False)

    def enabled(self, state: Engine) -> Iterable[Action]:
        actions = list(super().enabled(state))
        if state.in_flight:
            return [a for a in actions if isinstance(a, Complete)]
        return actions


# ----------------------------------------------------------------- the search


class Found(NamedTuple):
    """The shortest counterexample naming one id, as the explorer reported it."""

    trace: str
    messages: tuple[str, ...]
    ids: tuple[str, ...]
    states: int


def caught(
    inv_id: str,
    engines: Iterable[Engine],
    depth: int,
    *,
    model: Callable[[Iterable[Engine]], EngineModel] = EngineModel,
    every_level: bool = False,
) -> Found:
    """Explore to ``depth`` and return the counterexample naming ``inv_id`` (asserted found).

    ``every_level``: go on past the first violating level (the broken part's own invariant
    may break a level before the end-to-end one).
    """
    return shortest(explore(model(engines), depth, stop_at_first=not every_level), inv_id, depth)


def shortest(result: Any, inv_id: str, depth: int) -> Found:
    """The shortest of ``result``'s counterexamples naming ``inv_id`` (asserted found), with
    every id it found; ``result`` is what :func:`spec.explorer.explore` returned (any model)."""
    ids = tuple(sorted({v.invariant_id for v in result.violations}))
    hits = [v for v in result.violations if v.invariant_id == inv_id]
    assert hits, f"{result.states} states to depth {depth}: found {ids or 'nothing'}"
    first = min(hits, key=lambda v: len(v.trace))
    trace = " | ".join(str(action) for action in first.trace) or "(initial state)"
    return Found(trace, first.messages, ids, result.states)
