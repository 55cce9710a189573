"""Steps whose stores wait for their block hashes: vLLM's async scheduling (the GPU default).

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

A step is dropped instead (counted) when its request was preempted in between (its blocks went
back to the pool), finished (no request), or its hashes are still missing; a connector reset
drops every waiting step (KV computed before a reset is not stored after it).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DeferredStores", "WaitingStep", "keyable"]


def keyable(end: int, hash_block: int, num_hashes: int) -> bool:
    """Whether every unit ending at or before token ``end`` has its block hash."""
    return end // hash_block <= num_hashes


@dataclass(frozen=True, slots=True)
class WaitingStep:
    """One step held for its hashes: the range it computed and its store limit."""

    start: int
    num_tokens: int
    store_limit: int | None


class DeferredStores:
    """The steps held for their block hashes, at most one per request (module docstring)."""

    __slots__ = ("_waiting", "dropped", "replayed")

    def __init__(self) -> None:
        self._waiting: dict[str, WaitingStep] = {}
        self.replayed = 0  # steps stored one metadata late
        self.dropped = 0  # steps whose units were never stored (preempted, finished, reset)

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def hold(self, request_id: str, step: WaitingStep) -> None:
        """Hold ``step`` of ``request_id`` until the next :meth:`due`."""
        self._waiting[request_id] = step

    def due(
        self, requests: Mapping[str, Any], preempted: Collection[str], hash_block: int
    ) -> list[tuple[Any, WaitingStep]]:
        """Every held step whose request is live, not in ``preempted`` and now keyable, with
        its request; every other held step is dropped. Post: nothing is held."""
        found = []
        for rid, step in self._waiting.items():
            request = requests.get(rid)
            if (
                request is None
                or rid in preempted
                or not keyable(step.start + step.num_tokens, hash_block, len(request.block_hashes))
            ):
                self.dropped += 1
                continue
            found.append((request, step))
        self._waiting.clear()
        self.replayed += len(found)
        return found

    def clear(self) -> None:
        """A connector reset: every held step is dropped."""
        self.dropped += len(self._waiting)
        self._waiting.clear()
