"""GR-*: invariants of the per-group managers over the shared pool (subject ``"kv_cache_groups"``).

Each predicate reads the plain mapping :meth:`spec.managers.KVCacheCoordinator.snapshot` returns:
``block_pool`` (the pool's snapshot) and ``groups``, one mapping per group with its geometry
(``kind``, ``block_size``, ``sliding_window``, ``extra_retained_tokens``,
``num_speculative_blocks``, ``num_prefill_checkpoint_blocks``), the last allocation's
``reserved`` and ``taken`` counts and its ``tables``: ``(request_id, processed_tokens,
(block ids...))``. An optional ``held_outside``
(block ids, one entry per reference) lists references held by something other than a table.
An optional ``concurrent_batches`` (vLLM's ``VllmConfig.max_concurrent_batches``: 1 for the
synchronous engine loop, the default; 2 under async scheduling) sets the mamba bound of GR-5.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

from spec.invariants._registry import invariant

__all__ = [
    "cache_keys_match_owner_group",
    "full_tables_hold_no_null",
    "mamba_holds_latest_state_only",
    "one_group_owns_each_block",
    "ref_counts_recount_tables",
    "reservations_cover_allocations",
    "reservations_non_negative",
    "sliding_window_only",
]

Snapshot = Mapping[str, Any]
NULL = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tables(snapshot: Snapshot, kind: str | None = None) -> Iterator[tuple[Any, str, int, Any]]:
    """``(group, request_id, processed_tokens, blocks)`` for every table (of ``kind``)."""
    for group in snapshot["groups"]:
        if kind is None or group["kind"] == kind:
            for request_id, processed, blocks in group["tables"]:
                yield group, request_id, processed, blocks


@invariant("kv_cache_groups")
def ref_counts_recount_tables(snapshot: Snapshot) -> list[str]:
    """GR-1: each block's reference count equals the table entries (and outside holds) naming it."""
    named = Counter(b for _g, _r, _p, blocks in _tables(snapshot) for b in blocks if b != NULL)
    named.update(snapshot.get("held_outside", ()))
    refs = snapshot["block_pool"]["ref_counts"]
    return [
        f"block {b} has ref_count {refs[b]} but {named.get(b, 0)} references"
        for b in range(1, len(refs))
        if refs[b] != named.get(b, 0)
    ]


@invariant("kv_cache_groups")
def one_group_owns_each_block(snapshot: Snapshot) -> list[str]:
    """GR-2: a real block appears in the tables of one KV cache group at most."""
    owners: dict[int, set[int]] = {}
    for group, _r, _p, blocks in _tables(snapshot):
        for b in blocks:
            if b != NULL:
                owners.setdefault(b, set()).add(group["kv_cache_group_id"])
    return [f"block {b} is in groups {sorted(g)}" for b, g in sorted(owners.items()) if len(g) > 1]


@invariant("kv_cache_groups")
def cache_keys_match_owner_group(snapshot: Snapshot) -> list[str]:
    """GR-3: a block in group g's table that carries a hash carries a key of group g."""
    key_group = {b: g for b, _h, g in snapshot["block_pool"]["block_hashes"]}
    return [
        f"block {b} in group {group['kv_cache_group_id']} carries a key of group {key_group[b]}"
        for group, _r, _p, blocks in _tables(snapshot)
        for b in sorted(set(blocks))
        if b in key_group and key_group[b] != group["kv_cache_group_id"]
    ]


@invariant("kv_cache_groups")
def sliding_window_only(snapshot: Snapshot) -> list[str]:
    """GR-4: a sliding-window table holds nulls before the window of its processed tokens."""
    messages = []
    for group, request_id, processed, blocks in _tables(snapshot, "sliding"):
        skipped = processed - group["sliding_window"] + 1 - group["extra_retained_tokens"]
        below = max(0, skipped) // group["block_size"]
        real = [i for i in range(min(below, len(blocks))) if blocks[i] != NULL]
        if real:
            messages.append(f"{request_id}: real blocks at {real}, window starts at {below}")
    return messages


@invariant("kv_cache_groups")
def mamba_holds_latest_state_only(snapshot: Snapshot) -> list[str]:
    """GR-5: a mamba table holds no real block before its latest state, at most 2 (async: 3) + spec.

    The bound is ``1 + concurrent_batches`` states, ``concurrent_batches`` being the snapshot's
    (the engine loop's: vLLM's ``VllmConfig.max_concurrent_batches``, 1 when absent): 1 under
    ``EngineCore.step``, 2 under async scheduling's ``step_with_batch_queue``. vLLM frees mamba
    blocks on the processed-token basis only: ``allocate_slots`` trims at ``num_computed_tokens
    - num_in_flight_tokens`` (``v1/core/kv_cache_manager.py:564-568``), keeping the block of
    the last processed token (``MambaManager.get_num_skipped_tokens``), and it trims before
    allocating the new step's state while ``concurrent_batches - 1`` steps are still in flight.
    So the table holds the processed prefix's state, each in-flight step's and the new one.
    Under sync: the previous state and the running one. Under async the state of the step
    before the previous one stays too, until the next allocation trims at the then-processed
    prefix; the checks after a loop turn see it (a chunked prefill of 640-token blocks:
    states at 640, 1280 and 1609 after the step computing 1280-1609 was scheduled while the one
    computing 640-1280 was in flight).

    Plus vLLM's speculative blocks and prefill checkpoint blocks: the block a final chunk
    exports its checkpoint into stays beside the running state and the previous one until the
    next step frees it, as ``MambaSpec.max_memory_usage_bytes`` counts (``2 +
    num_speculative_blocks + num_prefill_checkpoint_blocks``, whatever the engine loop: unlike
    a sliding window's, vLLM's start-up reservation for mamba does not grow with the batches
    in flight).
    """
    messages = []
    states = 1 + snapshot.get("concurrent_batches", 1)
    for group, request_id, processed, blocks in _tables(snapshot, "mamba"):
        state = _cdiv(processed, group["block_size"]) - 1
        early = [i for i in range(min(max(state, 0), len(blocks))) if blocks[i] != NULL]
        if early:
            messages.append(f"{request_id}: real blocks at {early} before the state at {state}")
        real = sum(1 for b in blocks if b != NULL)
        bound = states + group["num_speculative_blocks"] + group["num_prefill_checkpoint_blocks"]
        if real > bound:
            messages.append(f"{request_id}: {real} real blocks, at most {bound}")
    return messages


@invariant("kv_cache_groups")
def reservations_non_negative(snapshot: Snapshot) -> list[str]:
    """GR-6: no group's reserved block count for an allocation is negative."""
    return [
        f"group {g['kv_cache_group_id']} reserved {g['reserved']} blocks"
        for g in snapshot["groups"]
        if g["reserved"] < 0
    ]


@invariant("kv_cache_groups")
def reservations_cover_allocations(snapshot: Snapshot) -> list[str]:
    """GR-7: no group takes more blocks off the free queue than it reserved for that allocation."""
    return [
        f"group {g['kv_cache_group_id']} took {g['taken']} blocks, reserved {g['reserved']}"
        for g in snapshot["groups"]
        if g["taken"] > g["reserved"]
    ]


@invariant("kv_cache_groups")
def full_tables_hold_no_null(snapshot: Snapshot) -> list[str]:
    """GR-8: a full-attention table never holds the null block (full attention skips nothing)."""
    return [
        f"{request_id}: null block in a full-attention table at {blocks.index(NULL)}"
        for _g, request_id, _p, blocks in _tables(snapshot, "full")
        if NULL in blocks
    ]
