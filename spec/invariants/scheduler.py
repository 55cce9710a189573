"""SC-*: invariants of the scheduler model (subject ``"scheduler"``).

Each predicate reads the plain mapping :meth:`spec.scheduler.Scheduler.snapshot` returns:
``config`` (``claim_unit``, ``max_num_running``, ``load_deadline_steps``,
``liveness_bound_steps``, ``groups`` as ``(kind, block_size)``), ``requests`` (``id``,
``status``, ``num_computed_tokens``, ``num_tokens``, ``age``), the queues ``waiting``,
``kv_holding`` and ``running``, ``loads`` (``(id, age, claim_end, reported)``), ``parked``
(``(id, blocks)``), ``holds``, ``tables`` (``(id, (blocks per group))``), ``claims`` and
``recoveries`` of the last step, ``last_step`` and ``num_waiting_for_remote_kvs``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from spec.invariants._registry import invariant

__all__ = [
    "async_claim_reaches_waiting_for_remote_kvs",
    "blocks_held_by_live_requests",
    "bounded_liveness",
    "claims_aligned",
    "counters_recount",
    "groups_agree_after_recovery",
    "loads_within_deadline",
    "queues_partition_requests",
    "waiting_for_remote_kvs_holds_blocks",
]

Snapshot = Mapping[str, Any]
_WFR = "waiting_for_remote_kvs"
_QUEUED = {"waiting": {"waiting", "preempted", _WFR}, "kv_holding": {"waiting", "preempted", _WFR}}


def _finished(status: str) -> bool:
    return status.startswith("finished")


def _requests(snapshot: Snapshot) -> dict[str, Mapping[str, Any]]:
    return {r["id"]: r for r in snapshot["requests"]}


@invariant("scheduler")
def claims_aligned(snapshot: Snapshot) -> list[str]:
    """SC-1: every claim starts and ends on a multiple of the claim unit (the scheduler block)."""
    bad = []
    for c in snapshot["claims"]:
        unit = c["unit"]
        if c["num_computed_tokens"] % unit:
            bad.append(f"{c['request_id']}: asked at {c['num_computed_tokens']}, unit {unit}")
        end = c["num_computed_tokens"] + c["accepted"]
        if c["accepted"] and end % unit:
            bad.append(f"{c['request_id']}: claim ends at {end}, not a multiple of {unit}")
    return bad


@invariant("scheduler")
def async_claim_reaches_waiting_for_remote_kvs(snapshot: Snapshot) -> list[str]:
    """SC-2: an accepted async claim reaches WAITING_FOR_REMOTE_KVS in its step or finds no room."""
    requests = _requests(snapshot)
    bad = []
    for c in snapshot["claims"]:
        if c["kind"] != "async" or not c["accepted"]:
            continue
        if c["outcome"] not in (_WFR, "no_space"):
            bad.append(f"{c['request_id']}: async claim of {c['accepted']} ended {c['outcome']}")
        status = requests[c["request_id"]]["status"]
        if c["outcome"] == _WFR and status != _WFR and not _finished(status):
            bad.append(f"{c['request_id']}: async claim left it {status}")
    return bad


@invariant("scheduler")
def bounded_liveness(snapshot: Snapshot) -> list[str]:
    """SC-3: every request finishes within the liveness bound (no wedge, no endless wait)."""
    bound = snapshot["config"]["liveness_bound_steps"]
    if bound is None:
        return []
    return [
        f"{r['id']}: {r['status']} after {r['age']} steps (bound {bound})"
        for r in snapshot["requests"]
        if not _finished(r["status"]) and r["age"] > bound
    ]


@invariant("scheduler")
def groups_agree_after_recovery(snapshot: Snapshot) -> list[str]:
    """SC-4: every group can resume at a request's computed prefix (after recovery too)."""
    bad = [
        f"{rec['request_id']}: truncated to {rec['truncated_to']}, group {g} valid only at {pts}"
        for rec in snapshot["recoveries"]
        for g, pts in enumerate(rec["valid_points"])
        if rec["truncated_to"] not in pts
    ]
    requests = _requests(snapshot)
    groups = snapshot["config"]["groups"]
    for rid, tables in snapshot["tables"]:
        r = requests[rid]
        computed = r["num_computed_tokens"]
        if _finished(r["status"]) or r["status"] == _WFR or computed == 0:
            continue
        for g, (kind, block_size) in enumerate(groups):
            index = -(-computed // block_size) - 1
            if kind == "mamba" and (index >= len(tables[g]) or tables[g][index] == 0):
                bad.append(f"{rid}: computed {computed} but group {g} holds no state there")
    return bad


@invariant("scheduler")
def queues_partition_requests(snapshot: Snapshot) -> list[str]:
    """SC-5: each unfinished request sits in one queue matching its status; a finished in none."""
    seen = Counter(rid for q in ("waiting", "kv_holding", "running") for rid in snapshot[q])
    bad = [f"{rid} queued {n} times" for rid, n in seen.items() if n > 1]
    requests = _requests(snapshot)
    for queue in ("waiting", "kv_holding", "running"):
        allowed = _QUEUED.get(queue, {"running"})
        bad += [
            f"{rid} in {queue} is {requests[rid]['status']}"
            for rid in snapshot[queue]
            if requests[rid]["status"] not in allowed
        ]
    bad += [
        f"{rid} ({r['status']}) is in no queue"
        for rid, r in requests.items()
        if not _finished(r["status"]) and rid not in seen
    ]
    return bad


@invariant("scheduler")
def counters_recount(snapshot: Snapshot) -> list[str]:
    """SC-6: hand-kept counts recount: remote waits, running cap, the last step's token budget."""
    bad = []
    wfr = sum(1 for r in snapshot["requests"] if r["status"] == _WFR)
    if wfr != snapshot["num_waiting_for_remote_kvs"]:
        bad.append(f"num_waiting_for_remote_kvs {snapshot['num_waiting_for_remote_kvs']} != {wfr}")
    if len(snapshot["running"]) > snapshot["config"]["max_num_running"]:
        bad.append(f"{len(snapshot['running'])} running > {snapshot['config']['max_num_running']}")
    last = snapshot["last_step"]
    used = sum(n for _rid, n in last["scheduled"])
    if last["budget_left"] != last["budget"] - used or last["budget_left"] < 0:
        bad.append(f"budget left {last['budget_left']} != {last['budget']} - {used}")
    return bad


@invariant("scheduler")
def waiting_for_remote_kvs_holds_blocks(snapshot: Snapshot) -> list[str]:
    """SC-7: a WAITING_FOR_REMOTE_KVS request is not running, holds blocks and has one load."""
    requests = _requests(snapshot)
    holding = {rid for rid, _t in snapshot["tables"]}
    loads = {entry[0] for entry in snapshot["loads"]}
    parked = {rid for rid, _b in snapshot["parked"]}
    bad = []
    for rid, r in requests.items():
        if r["status"] != _WFR:
            continue
        if rid in snapshot["running"]:
            bad.append(f"{rid} waits for remote KV but is running")
        if rid not in holding:
            bad.append(f"{rid} waits for remote KV but holds no block")
        if rid not in loads:
            bad.append(f"{rid} waits for remote KV without a load")
    bad += [
        f"{rid} has a load but is {requests[rid]['status']}"
        for rid in loads
        if requests[rid]["status"] != _WFR
    ]
    bad += [f"{rid} has an active and a parked load" for rid in loads & parked]
    return bad


@invariant("scheduler")
def blocks_held_by_live_requests(snapshot: Snapshot) -> list[str]:
    """SC-8: a finished request holds blocks only while a load or a store still needs them."""
    requests = _requests(snapshot)
    held = {rid for rid, _reasons in snapshot["holds"]}
    bad = [
        f"{rid} is finished and holds blocks with no reason"
        for rid, _t in snapshot["tables"]
        if _finished(requests[rid]["status"]) and rid not in held
    ]
    bad += [
        f"{rid} has a hold but is {requests[rid]['status']}"
        for rid in held
        if not _finished(requests[rid]["status"])
    ]
    return bad


@invariant("scheduler")
def loads_within_deadline(snapshot: Snapshot) -> list[str]:
    """SC-9: no load stays unreported past the load deadline (it is abandoned instead)."""
    deadline = snapshot["config"]["load_deadline_steps"]
    if deadline is None:
        return []
    return [
        f"{rid}: load pending for {age} steps (deadline {deadline})"
        for rid, age, _end, reported in snapshot["loads"]
        if not reported and age > deadline
    ]
