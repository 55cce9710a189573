"""Steps whose stores wait: for their block hashes (vLLM's async scheduling, the GPU default) or
for their draft tokens' verdict (speculative decoding).

Under async scheduling vLLM's engine loop schedules step N+1 before step N's sampled token is
applied to the request (``EngineCore.step_with_batch_queue``, ``v1/engine/core.py:708-799``). A
decode step of N+1 therefore computes a token the request does not hold yet (an output
placeholder), and a unit that ends at that token has no block hash, so no offload key, when
``build_connector_meta`` runs. Every unit end is a hash-block boundary, so a step of
``[start, start + num)`` can be keyed exactly when ``(start + num) // hash_block`` is at most
the number of the request's block hashes (:func:`keyable`).

Such a step is held here and replayed, as the same step (its start, length and store limit,
over the request's block table at replay time), at the next ``build_connector_meta``. Why that
is soon enough, and what it reads is still in place:

- the batch queue holds two steps, so when step N+2 is scheduled step N's output has been
  applied: the placeholder token and its block hash exist;
- a running request's attention blocks stay in its table, and vLLM's align-mode mamba manager
  frees the block of step N+1's running state only two steps after allocating it
  (``MambaManager.remove_skipped_blocks``, ``v1/core/single_type_kv_cache_manager.py:1629-1657``);
  a store pins what it reads from its emission on.

A speculative step (MTP, EAGLE: the step carries draft tokens, ``scheduled_spec_decode_tokens``)
computes KV at draft positions the target may reject: a rejected draft's slot holds the KV of a
token the request never gets, and vLLM rolls ``num_computed_tokens`` back and recomputes it
(``Scheduler.update_from_output``, ``v1/core/sched/scheduler.py:2346-2364``). Such a step is
held until its output is applied, then stored up to the request's materialized frontier,
``num_computed_tokens - num_output_placeholders`` (:func:`frontier`, vLLM's own "safe
frontier", ``scheduler.py:2724``): every token below it is computed, applied and accepted, so
no rejection can roll back into it. Its output is applied by the next metadata under
synchronous scheduling and by the one after under async scheduling (step N is applied after
N+1 is scheduled), so a speculative step waits at most two metadata (:data:`SPECULATIVE_WAITS`).
Stored over ``[start, min(end, frontier))``: the mamba state at that end is the one vLLM's
runner leaves in the block at a block end after acceptance (``postprocess_mamba``); a state at a
draft position past the frontier is never stored.

A step is dropped instead (counted) when its request was preempted in between (its blocks went
back to the pool), finished (no request), its hashes are still missing, or its output was not
applied in time; a connector reset drops every waiting step (KV computed before a reset is not
stored after it).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["SPECULATIVE_WAITS", "DeferredStores", "WaitingStep", "frontier", "keyable"]

SPECULATIVE_WAITS = 2
"""Metadata calls a speculative step waits for its output at most (async scheduling: two)."""


def keyable(end: int, hash_block: int, num_hashes: int) -> bool:
    """Whether every unit ending at or before token ``end`` has its block hash."""
    return end // hash_block <= num_hashes


def frontier(request: Any) -> int:
    """Tokens of ``request`` computed and applied, with no draft left to reject: vLLM's safe
    frontier (module docstring). Under synchronous scheduling no placeholder is counted."""
    return int(request.num_computed_tokens) - int(getattr(request, "num_output_placeholders", 0))


@dataclass(frozen=True, slots=True)
class WaitingStep:
    """One step held for its hashes or its drafts' verdict: the range it computed, its store
    limit, whether it carried draft tokens and how many metadata calls it has waited."""

    start: int
    num_tokens: int
    store_limit: int | None
    speculative: bool = False
    waited: int = 0


class DeferredStores:
    """The steps held for their block hashes or their drafts' verdict (module docstring)."""

    __slots__ = ("_waiting", "dropped", "replayed", "speculative_stored")

    def __init__(self) -> None:
        self._waiting: dict[str, list[WaitingStep]] = {}
        self.replayed = 0  # steps stored one or more metadata late
        self.dropped = 0  # steps whose units were never stored (preempted, finished, reset)
        self.speculative_stored = 0  # speculative steps stored once their drafts were verified

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def hold(self, request_id: str, step: WaitingStep) -> None:
        """Hold ``step`` of ``request_id`` until a later :meth:`due`."""
        self._waiting.setdefault(request_id, []).append(step)

    def due(
        self, requests: Mapping[str, Any], preempted: Collection[str], hash_block: int
    ) -> list[tuple[Any, WaitingStep]]:
        """The held steps to store now, at most one per request, with its request.

        A step of a finished or preempted request is dropped. A speculative step whose output
        is not applied yet (the frontier has not passed its start) waits again, up to
        :data:`SPECULATIVE_WAITS` calls, then is dropped; one that is applied is cut at the
        frontier. Steps of one request due together are stored as one range (every token
        below the frontier is final, whichever step computed it). A step still not
        :func:`keyable` is dropped. Post: only the steps that wait again are held."""
        found = []
        waiting, self._waiting = self._waiting, {}
        for rid, steps in waiting.items():
            request = requests.get(rid)
            if request is None or rid in preempted:
                self.dropped += len(steps)
                continue
            ready = []
            for step in steps:
                if not step.speculative:
                    ready.append(step)
                    continue
                front = frontier(request)
                if front > step.start:
                    end = min(step.start + step.num_tokens, front)
                    ready.append(WaitingStep(step.start, end - step.start, step.store_limit, True))
                elif step.waited + 1 < SPECULATIVE_WAITS:
                    self.hold(rid, WaitingStep(*_fields(step), True, step.waited + 1))
                else:
                    self.dropped += 1
            if not ready:
                continue
            step = _union(ready)
            if not keyable(step.start + step.num_tokens, hash_block, len(request.block_hashes)):
                self.dropped += len(ready)
                continue
            self.replayed += len(ready)
            self.speculative_stored += sum(s.speculative for s in ready)
            found.append((request, step))
        return found

    def clear(self) -> None:
        """A connector reset: every held step is dropped."""
        self.dropped += sum(len(steps) for steps in self._waiting.values())
        self._waiting.clear()


def _fields(step: WaitingStep) -> tuple[int, int, int | None]:
    return step.start, step.num_tokens, step.store_limit


def _union(steps: list[WaitingStep]) -> WaitingStep:
    """One range over ``steps`` of one request (their store limits: the tightest)."""
    if len(steps) == 1:
        return steps[0]
    start = min(s.start for s in steps)
    end = max(s.start + s.num_tokens for s in steps)
    limits = [s.store_limit for s in steps if s.store_limit is not None]
    return WaitingStep(
        start, end - start, min(limits) if limits else None, any(s.speculative for s in steps)
    )
