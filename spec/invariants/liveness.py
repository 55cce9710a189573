"""SC-10..SC-12: liveness of async loads against the block pool (issue 29).

Issue 29's wedge: requests whose async loads landed hold most of the pool, none can allocate
the blocks for its next chunk, nothing runs that vLLM could preempt, and the engine spins for
ever. SC-3 catches it only as an age bound on a run; these three name it where it happens.

Subject ``"pool"`` (SC-10, SC-11) reads a plain mapping of the pool and the requests:
``capacity`` (the pool's usable blocks) and ``requests``, each ``id``, ``phase`` (``waiting``:
holds nothing; ``loading``: its async load in flight; ``loaded``: landed, waiting to run;
``running``; ``finished``), ``held`` (the real blocks it holds now) and ``next_blocks`` (the
further blocks its next step needs: a loaded request's rest of its chunk, a waiting one's
first allocation). :class:`spec.system.pool_model.PoolModel` exports it.

Subject ``"progress"`` (SC-12) reads a run's progress record: ``window`` (steps), ``idle``
(consecutive steps so far with work unfinished, no transfer in flight, and nothing
computed, landed or finished) and ``unfinished`` (request ids). The pool model exports it, and
tests/vllm's checker builds it from vLLM's real scheduler after every step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from spec.invariants._registry import invariant

__all__ = ["loads_leave_room_to_run", "no_wedge", "progress_within_window"]

Snapshot = Mapping[str, Any]
_HOLDS_LOAD = ("loading", "loaded")


def _free(snapshot: Snapshot) -> int:
    return int(snapshot["capacity"]) - sum(int(r["held"]) for r in snapshot["requests"])


@invariant("pool")
def no_wedge(snapshot: Snapshot) -> list[str]:
    """SC-10: with a request unfinished, one runs, one loads, or one's next blocks fit the pool."""
    live = [r for r in snapshot["requests"] if r["phase"] != "finished"]
    if not live or any(r["phase"] in ("running", "loading") for r in live):
        return []
    free = _free(snapshot)
    if any(int(r["next_blocks"]) <= free for r in live):
        return []
    loaded = sum(int(r["held"]) for r in live if r["phase"] == "loaded")
    needs = ", ".join(f"{r['id']} {r['next_blocks']}" for r in live)
    return [
        f"wedge: nothing runs or loads, {free} of {snapshot['capacity']} blocks free, "
        f"{loaded} held by loaded requests; next blocks needed: {needs}"
    ]


@invariant("pool")
def loads_leave_room_to_run(snapshot: Snapshot) -> list[str]:
    """SC-11: blocks held by admitted loads, plus the next blocks of one of them, fit the pool."""
    held = [r for r in snapshot["requests"] if r["phase"] in _HOLDS_LOAD]
    if not held:
        return []
    holding = sum(int(r["held"]) for r in held)
    least = min(int(r["next_blocks"]) for r in held)
    if holding + least <= int(snapshot["capacity"]):
        return []
    ids = ", ".join(f"{r['id']} {r['held']}" for r in held)
    return [
        f"loads hold {holding} blocks ({ids}); the least next chunk needs {least} more; "
        f"the pool has {snapshot['capacity']}"
    ]


@invariant("progress")
def progress_within_window(snapshot: Snapshot) -> list[str]:
    """SC-12: with work left and no transfer in flight, a step makes progress within the window."""
    idle, window = int(snapshot["idle"]), int(snapshot["window"])
    if idle <= window or not snapshot["unfinished"]:
        return []
    return [
        f"{idle} steps without progress (window {window}); unfinished: "
        + ", ".join(str(rid) for rid in snapshot["unfinished"])
    ]
