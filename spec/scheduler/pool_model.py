"""Async loads against the block pool, as a small model the bounded explorer searches (issue 29).

The abstraction keeps only what issue 29's wedge is made of. ``requests`` requests share one
long prefix that the host tier holds; each is ``prefix_blocks`` of that prefix plus
``tail_blocks`` of its own. The pool holds ``fits`` whole requests. The GPU prefix cache never
serves the prefix (the issue's case: vLLM frees a request's out-of-window sliding blocks
last-first, so a sliding group's hit fails where the full group's holds), so every request
loads its own copy of the prefix.

One :class:`Step` is one ``schedule()`` with its forward: the requests scheduled last step
compute their tails and finish (freeing their blocks); then the waiting queues, FCFS, those
holding KV first (``kv_holding_waiting``). A loaded request allocates its tail or, refused,
stops the step (vLLM ``break``s at a refused allocation, ``scheduler.py:1454``). A waiting
request asks the connector: the claim rule (:class:`ClaimRule`) answers DEFER (skipped, it
keeps its place) or an async claim of the prefix, which vLLM admits when the free blocks, less
its reservation for the other in-flight prefills, hold the prefix (``scheduler.py:1420-1430``),
else stops. vLLM 0.33 reserves nothing for a loaded sliding-window request's tail (its count
subtracts the null blocks padding the skipped prefix,
``single_type_kv_cache_manager.py:225-228``): ``reserve_tails=False``, the default, models that;
``True`` models a reservation that counts them. :class:`Lands` reports one load.

A request whose load landed is not running, so vLLM cannot preempt it: once the loaded
requests hold so much that none fits its tail and nothing runs, nothing ever frees a block
(SC-10; the pool snapshot). The claim rule's capacity condition (SC-11) excludes it. SC-12
reads the run's idle steps: a step is idle when work is left, no load is in flight, and the
step changed nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from spec.connector.admission import AsyncClaim, HeldLoad, admit
from spec.errors import ConfigError
from spec.invariants import check_all

__all__ = ["ClaimRule", "Lands", "Phase", "PoolAction", "PoolModel", "PoolScenario", "PoolState"]


class ClaimRule(Enum):
    """How the connector answers a waiting request whose prefix the host holds."""

    EVERY = "every"  # before issue 29's fix: an async claim for every request
    ADMISSION = "admission"  # spec.connector.admission: defer a shared load or one with no room


class Phase(Enum):
    """A request's lifecycle in the model."""

    WAITING = "waiting"  # holds nothing
    LOADING = "loading"  # its async load in flight; holds the prefix's blocks
    LOADED = "loaded"  # landed, waiting to run; holds the prefix's blocks
    RUNNING = "running"  # scheduled: holds the whole request, finishes at the next step
    FINISHED = "finished"


_HOLDS_LOAD = (Phase.LOADING, Phase.LOADED)


@dataclass(frozen=True, slots=True)
class PoolScenario:
    """The model's parameters (module docstring). ``window``: SC-12's progress window."""

    requests: int = 4
    prefix_blocks: int = 3
    tail_blocks: int = 1
    fits: int = 3
    rule: ClaimRule = ClaimRule.ADMISSION
    reserve_tails: bool = False
    window: int = 2

    def __post_init__(self) -> None:
        for name in ("requests", "prefix_blocks", "tail_blocks", "fits", "window"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be >= 1", "give a count")

    @property
    def whole(self) -> int:
        """Blocks one request holds to run: its prefix and its tail."""
        return self.prefix_blocks + self.tail_blocks

    @property
    def capacity(self) -> int:
        """The pool's usable blocks: ``fits`` whole requests."""
        return self.fits * self.whole


@dataclass(frozen=True, slots=True)
class PoolState:
    """Each request's phase (by index, FCFS order) and the idle steps so far (capped just
    past the window, so the state space stays finite)."""

    phases: tuple[Phase, ...]
    idle: int = 0


@dataclass(frozen=True, slots=True)
class Step:
    """One ``schedule()`` with its forward."""

    def __str__(self) -> str:
        return "step"


@dataclass(frozen=True, slots=True)
class Lands:
    """Request ``index``'s load reports."""

    index: int

    def __str__(self) -> str:
        return f"r{self.index} lands"


PoolAction = Step | Lands


class PoolModel:
    """The :class:`spec.explorer.Model` over :class:`PoolState` (module docstring)."""

    stuck_invariant_id = "SC-10"

    def __init__(self, scenario: PoolScenario) -> None:
        self.scenario = scenario
        self._prefix = tuple(f"prefix-{i}".encode() for i in range(scenario.prefix_blocks))

    def initial_states(self) -> Iterable[PoolState]:
        """Every request waiting, the host holding the prefix. Frame: nothing changes."""
        return (PoolState((Phase.WAITING,) * self.scenario.requests),)

    def enabled(self, state: PoolState) -> Iterable[PoolAction]:
        """A step while work is left; each in-flight load's report. Pure."""
        actions: list[PoolAction] = [Step()] if not self.is_final(state) else []
        actions += [Lands(i) for i, p in enumerate(state.phases) if p is Phase.LOADING]
        return actions

    def step(self, state: PoolState, action: PoolAction) -> PoolState:
        """The successor; ``state`` is unchanged. Pre: ``action`` is enabled."""
        if isinstance(action, Lands):
            landed = list(state.phases)
            landed[action.index] = Phase.LOADED
            return PoolState(tuple(landed), 0)
        phases = self._schedule(state.phases)
        busy = phases != state.phases or Phase.LOADING in phases
        idle = 0 if busy else min(state.idle + 1, self.scenario.window + 1)
        return PoolState(phases, idle)

    def key(self, state: PoolState) -> Hashable:
        """The state itself (a frozen value). Pure."""
        return state

    def violations(self, state: PoolState) -> Mapping[str, list[str]]:
        """SC-10, SC-11 on :meth:`pool_snapshot`; SC-12 on :meth:`progress_snapshot`. Pure."""
        found = dict(check_all("pool", self.pool_snapshot(state)))
        found.update(check_all("progress", self.progress_snapshot(state)))
        return found

    def is_final(self, state: PoolState) -> bool:
        """Every request finished. Pure."""
        return all(p is Phase.FINISHED for p in state.phases)

    def labels(self, state: PoolState, action: PoolAction) -> Iterable[str]:
        """``event:step`` or ``event:lands``. Frame: nothing changes."""
        return ("event:step",) if isinstance(action, Step) else ("event:lands",)

    # ------------------------------------------------------------ snapshots
    def pool_snapshot(self, state: PoolState) -> dict[str, Any]:
        """The ``pool`` schema of :mod:`spec.invariants.liveness`. Pure."""
        return {
            "capacity": self.scenario.capacity,
            "requests": tuple(
                {
                    "id": f"r{i}",
                    "phase": p.value,
                    "held": self._held(p),
                    "next_blocks": self._next_blocks(p),
                }
                for i, p in enumerate(state.phases)
            ),
        }

    def progress_snapshot(self, state: PoolState) -> dict[str, Any]:
        """The ``progress`` schema of :mod:`spec.invariants.liveness`. Pure."""
        return {
            "window": self.scenario.window,
            "idle": state.idle,
            "unfinished": tuple(
                f"r{i}" for i, p in enumerate(state.phases) if p is not Phase.FINISHED
            ),
        }

    def _held(self, phase: Phase) -> int:
        s = self.scenario
        if phase in _HOLDS_LOAD:
            return s.prefix_blocks
        return s.whole if phase is Phase.RUNNING else 0

    def _next_blocks(self, phase: Phase) -> int:
        s = self.scenario
        if phase is Phase.WAITING:
            return s.prefix_blocks
        return s.tail_blocks if phase in _HOLDS_LOAD else 0

    # ------------------------------------------------------------ schedule()
    def _schedule(self, before: tuple[Phase, ...]) -> tuple[Phase, ...]:
        s = self.scenario
        phases: list[Phase] = [Phase.FINISHED if p is Phase.RUNNING else p for p in before]
        free = s.capacity - sum(self._held(p) for p in phases)
        loaded = [i for i, p in enumerate(phases) if p is Phase.LOADED]
        waiting = [i for i, p in enumerate(phases) if p is Phase.WAITING]
        for i in loaded:  # kv_holding_waiting first
            if free < s.tail_blocks:
                return tuple(phases)  # a refused allocation ends the step
            phases[i] = Phase.RUNNING
            free -= s.tail_blocks
        for i in waiting:
            if self._defers(i, phases):
                continue  # skipped; keeps its place
            if free - self._reserved(phases) < s.prefix_blocks:
                break
            phases[i] = Phase.LOADING
            free -= s.prefix_blocks
        return tuple(phases)

    def _reserved(self, phases: list[Phase]) -> int:
        """vLLM's reservation for the other in-flight prefills (module docstring)."""
        if not self.scenario.reserve_tails:
            return 0
        return sum(self.scenario.tail_blocks for p in phases if p in _HOLDS_LOAD)

    def _defers(self, index: int, phases: list[Phase]) -> bool:
        if self.scenario.rule is ClaimRule.EVERY:
            return False
        s = self.scenario
        end = s.prefix_blocks
        held = [
            HeldLoad(f"r{i}", p is Phase.LOADING, 0, end, s.whole, self._prefix)
            for i, p in enumerate(phases)
            if p in _HOLDS_LOAD
        ]
        claim = AsyncClaim(f"r{index}", 0, end, s.whole, self._prefix)
        return admit(claim, held, s.capacity, 1).defers
