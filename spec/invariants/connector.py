"""MB-* and SEC-*: invariants of the reference connector (snapshot subject ``"connector"``).

Each predicate reads the plain snapshot documented in :mod:`spec.connector.scheduler_side`
(the host store's snapshot is nested under ``store``). MB-1..MB-3 are the mamba-boundary and
alignment rules of loads and stores, MB-8 the position a stored mamba state holds (read off
each store job's step and the group's checkpoint rule, :mod:`spec.connector.checkpoints`);
MB-4..MB-7 recount the connector's hand-kept bookkeeping against the host store (pins,
reservations, failure memory, delayed frees); SEC-1 is ``cache_salt`` isolation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

from spec.connector.checkpoints import CheckpointRule, states_written
from spec.invariants._registry import invariant
from spec.kinds import GroupKind

__all__: list[str] = []

_SUBJECT = "connector"
_MAMBA = GroupKind.MAMBA.value
_LOAD = "load"
_STORE = "store"


def _loads(snap: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    names = (
        "request_id",
        "start",
        "end",
        "num_tokens",
        "sync",
        "cache_salt",
        "jobs",
        "reported",
        "failed",
        "items",
    )
    for row in snap["loads"]:
        yield dict(zip(names, row, strict=True))


def _jobs(snap: Mapping[str, Any], kind: str) -> Iterator[dict[str, Any]]:
    names = ("job_id", "kind", "request_id", "cache_salt", "sync", "items")
    for row in snap["jobs"]:
        job = dict(zip(names, row, strict=True))
        if job["kind"] == kind:
            yield job


def _mamba_groups(snap: Mapping[str, Any]) -> list[int]:
    return [g for g, kind in enumerate(snap["kinds"]) if kind == _MAMBA]


@invariant(_SUBJECT)
def mb1_mamba_state_with_attention(snap: Mapping[str, Any]) -> list[str]:
    """MB-1: a load that restores KV up to token t restores each mamba state at exactly t only."""
    messages = []
    mamba = _mamba_groups(snap)
    for load in _loads(snap):
        if not load["items"] or not mamba:
            continue
        for g in mamba:
            ends = sorted(end for group, _, _, end in load["items"] if group == g)
            if ends != [load["end"]]:
                messages.append(
                    f"load of {load['request_id']} ends at {load['end']} but restores mamba "
                    f"group {g} at {ends}"
                )
        reach = max(end for _, _, _, end in load["items"])
        if reach > load["end"]:
            messages.append(f"load of {load['request_id']} writes past its end to {reach}")
    return messages


@invariant(_SUBJECT)
def mb2_mamba_store_on_boundary(snap: Mapping[str, Any]) -> list[str]:
    """MB-2: a store takes a mamba state only at its unit end, once per group and position."""
    messages = []
    mamba = set(_mamba_groups(snap))
    for job in _jobs(snap, _STORE):
        seen = Counter((g, end) for g, _, _, end in job["items"] if g in mamba)
        for (g, end), count in sorted(seen.items()):
            if end % snap["units"][g] or count > 1:
                messages.append(
                    f"store job {job['job_id']} takes mamba group {g} at {end} ({count}x, unit "
                    f"{snap['units'][g]})"
                )
    return messages


@invariant(_SUBJECT)
def mb3_load_aligned(snap: Mapping[str, Any]) -> list[str]:
    """MB-3: a load ends on the claim alignment, after its start, before the last token."""
    messages = []
    for load in _loads(snap):
        start, end = load["start"], load["end"]
        if end % snap["align"] or not start < end < load["num_tokens"]:
            messages.append(
                f"load of {load['request_id']} spans [{start}, {end}) of {load['num_tokens']} "
                f"tokens, alignment {snap['align']}"
            )
    return messages


@invariant(_SUBJECT)
def mb4_pins_recount_loads(snap: Mapping[str, Any]) -> list[str]:
    """MB-4: each host entry's pins equal the in-flight load jobs that carry its key."""
    held = Counter(key for job in _jobs(snap, _LOAD) for _, _, key, _ in job["items"])
    pins = {key: count for key, _, count in snap["store"]["entries"]}
    messages = [
        f"key {key} has {pins.get(key, 0)} pins, {held.get(key, 0)} loads in flight"
        for key in sorted(set(held) | set(pins))
        if pins.get(key, 0) != held.get(key, 0)
    ]
    return messages


@invariant(_SUBJECT)
def mb5_no_load_of_failed_key(snap: Mapping[str, Any]) -> list[str]:
    """MB-5: no load built after a key's failure was learned carries that key again."""
    since = dict(snap["failed_keys"])
    messages = []
    for load in _loads(snap):
        first_job = min(load["jobs"], default=0)
        for _, _, key, _ in load["items"]:
            if key in since and first_job >= since[key]:
                messages.append(
                    f"load of {load['request_id']} (job {first_job}) carries key {key} that "
                    f"failed before job {since[key]}"
                )
    return messages


@invariant(_SUBJECT)
def mb6_store_jobs_hold_storing_keys(snap: Mapping[str, Any]) -> list[str]:
    """MB-6: each in-flight store job's keys are STORING in the host, each in that job alone."""
    states = {key: state for key, state, _ in snap["store"]["entries"]}
    count = Counter(key for job in _jobs(snap, _STORE) for _, _, key, _ in job["items"])
    messages = [f"key {key} is written by {n} store jobs" for key, n in count.items() if n > 1]
    messages += [
        f"store key {key} is {states.get(key, 'absent')}, not storing"
        for key in sorted(count)
        if states.get(key) != "storing"
    ]
    return messages


@invariant(_SUBJECT)
def mb7_delayed_free_has_store(snap: Mapping[str, Any]) -> list[str]:
    """MB-7: a request's block free is delayed only while one of its store jobs is in flight."""
    storing = {job["request_id"] for job in _jobs(snap, _STORE)}
    return [
        f"{rid} is delayed with no store in flight" for rid in snap["delayed"] if rid not in storing
    ]


@invariant(_SUBJECT)
def sec1_no_hit_across_salts(snap: Mapping[str, Any]) -> list[str]:
    """SEC-1: a request loads only keys stored by a request with the same cache_salt."""
    salts = dict(snap["key_salts"])
    messages = []
    for load in _loads(snap):
        for _, _, key, _ in load["items"]:
            if key in salts and salts[key] != load["cache_salt"]:
                messages.append(
                    f"{load['request_id']} (salt {load['cache_salt']!r}) loads key {key} stored "
                    f"under salt {salts[key]!r}"
                )
    return messages


@invariant(_SUBJECT)
def mb8_mamba_state_keyed_by_its_position(snap: Mapping[str, Any]) -> list[str]:
    """MB-8: a stored mamba state is keyed by the position its step wrote it at."""
    messages = []
    mamba = set(_mamba_groups(snap))
    spans = {job_id: (start, end) for job_id, start, end in snap["store_spans"]}
    for job in _jobs(snap, _STORE):
        if job["job_id"] not in spans:
            messages.append(f"store job {job['job_id']} has no recorded step")
            continue
        start, end = spans[job["job_id"]]
        for g, block_id, _, at in job["items"]:
            if g not in mamba:
                continue
            rule = CheckpointRule(*snap["checkpoints"][g])
            written = {s.position for s in states_written(rule, start, end, snap["units"][g])}
            if at not in written:
                messages.append(
                    f"store job {job['job_id']} of step [{start}, {end}) keys block {block_id} "
                    f"of mamba group {g} at {at}; the step wrote states at {sorted(written)}"
                )
    return messages
