"""TR-* and DATA-*: invariants of the whole engine (snapshot subject ``"system"``).

They read the plain snapshot of :meth:`spec.system.engine.Engine.snapshot`::

    ref_counts: tuple[int, ...]      the block pool's reference count per block id
    tables:     tuple[(group_idx, request_id, (block ids...)), ...]  every request's table
    in_flight:  tuple[(job_id, kind, request_id, items), ...]  jobs started, not completed;
                kind "load" | "store"; items: tuple[(group_idx, block_id, end_token, source)]
                where source is the block's value when the store started (None for a load)
    gpu:        tuple[(block_id, value), ...]  what each written block holds now
    reads:      tuple[(request_id, group_idx, block_id, what, block_index, block_size,
                       need_end, tokens, value), ...]  the reads of the last forward plus every
                earlier read that was wrong (kept, so a merged state cannot hide one);
                what is "attention" | "state"

A value is tagged plain data: ``("computed", group_idx, prefix tuple)`` or
``("garbage", reason)`` (:func:`spec.system.content.encode`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from spec.invariants._registry import invariant
from spec.system.content import attention_holds, decode, describe, state_holds

__all__: list[str] = []

_SUBJECT = "system"


def _items(snap: Mapping[str, Any]) -> Iterator[tuple[int, str, str, int, int, int, Any]]:
    for job_id, kind, rid, items in snap["in_flight"]:
        for group_idx, block_id, end_token, source in items:
            yield job_id, kind, rid, group_idx, block_id, end_token, source


def _holders(snap: Mapping[str, Any]) -> dict[int, set[tuple[int, str]]]:
    holders: dict[int, set[tuple[int, str]]] = {}
    for group_idx, rid, blocks in snap["tables"]:
        for block in blocks:
            if block:
                holders.setdefault(block, set()).add((group_idx, rid))
    return holders


@invariant(_SUBJECT)
def tr1_in_flight_blocks_held(snap: Mapping[str, Any]) -> list[str]:
    """TR-1: no block with an in-flight transfer is free or reallocated to another request/group.

    A job's block keeps a reference (not free), no other group's table lists it, and a block a
    load writes is listed by no other request (a store's source may be shared by a prefix hit).
    """
    ref_counts = snap["ref_counts"]
    holders = _holders(snap)
    messages = []
    for job_id, kind, rid, group_idx, block, _, _ in _items(snap):
        where = f"{kind} job {job_id} of {rid}: block {block} (group {group_idx})"
        if block == 0 or not 0 < block < len(ref_counts) or ref_counts[block] == 0:
            messages.append(f"{where} is free or the null block")
        others = {g for g, _ in holders.get(block, set())} - {group_idx}
        if others:
            messages.append(f"{where} is now in group(s) {sorted(others)}")
        strangers = {r for _, r in holders.get(block, set())} - {rid}
        if kind == "load" and strangers:
            messages.append(f"{where} is now held by {sorted(strangers)}")
    return messages


def _same_up_to(current: Any, source: Any, end_token: int) -> bool:
    if current == source:
        return True
    if current[0] != "computed" or source[0] != "computed" or current[1] != source[1]:
        return False
    upto = min(end_token, len(source[2]))
    return len(current[2]) >= upto and current[2][:upto] == source[2][:upto]


@invariant(_SUBJECT)
def tr2_store_source_stable(snap: Mapping[str, Any]) -> list[str]:
    """TR-2: a store's source blocks are not rewritten before the store completes."""
    gpu = dict(snap["gpu"])
    messages = []
    for job_id, kind, rid, _, block, end_token, source in _items(snap):
        if kind != "store":
            continue
        current = gpu.get(block, ("garbage", "unwritten"))
        if not _same_up_to(current, source, end_token):
            messages.append(
                f"store job {job_id} of {rid}: block {block} held {describe(decode(source))} at "
                f"the start, now {describe(decode(current))}"
            )
    return messages


@invariant(_SUBJECT)
def data1_reads_true_content(snap: Mapping[str, Any]) -> list[str]:
    """DATA-1: every block a request reads holds the true content for its tokens."""
    messages = []
    for rid, group_idx, block, what, index, size, need_end, tokens, raw in snap["reads"]:
        value = decode(raw)
        if what == "state":
            ok = state_holds(value, group_idx, tokens, need_end)
            expected = f"the state after {need_end} tokens"
        else:
            ok = attention_holds(
                value, group_idx, tokens, block_index=index, block_size=size, need_end=need_end
            )
            expected = f"positions {index * size}..{need_end - 1}"
        if not ok:
            messages.append(
                f"{rid} read block {block} (group {group_idx}, {expected} of "
                f"{list(tokens[:need_end])}) holding {describe(value)}"
            )
    return messages
