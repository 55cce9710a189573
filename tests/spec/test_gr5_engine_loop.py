"""GR-5's bound on a mamba table depends on the engine loop (``concurrent_batches`` in the
``kv_cache_groups`` snapshot): vLLM trims mamba states at the processed prefix, so under async
scheduling (2 batches) the state of the step before the previous one is still in the table
after a loop turn; under the synchronous loop it is not. Tables worked out by hand: 4-token
blocks, 4 tokens processed, so the latest state is at index 0."""

from __future__ import annotations

from typing import Any

from spec.block_pool import BlockPool
from spec.invariants import ALL_INVARIANTS

GR5 = ALL_INVARIANTS["GR-5"]


def _snapshot(blocks: tuple[int, ...], **loop: int) -> dict[str, Any]:
    group = {
        "kv_cache_group_id": 0,
        "kind": "mamba",
        "block_size": 4,
        "sliding_window": None,
        "extra_retained_tokens": 0,
        "num_speculative_blocks": 0,
        "num_prefill_checkpoint_blocks": 0,
        "reserved": 0,
        "taken": 0,
        "tables": (("r", 4, blocks),),
    }
    return {"block_pool": BlockPool(8).snapshot(), "groups": (group,), **loop}


def test_three_states_break_the_sync_bound() -> None:
    """The processed prefix's state, the in-flight step's and the new one: one too many for the
    synchronous loop (the default when the snapshot names no loop)."""
    assert GR5.violations(_snapshot((1, 2, 3))) == ["r: 3 real blocks, at most 2"]
    assert GR5.violations(_snapshot((1, 2, 3), concurrent_batches=1)) != []


def test_three_states_hold_under_async_scheduling_and_four_do_not() -> None:
    assert GR5.violations(_snapshot((1, 2, 3), concurrent_batches=2)) == []
    assert GR5.violations(_snapshot((1, 2, 3, 4), concurrent_batches=2)) == [
        "r: 4 real blocks, at most 3"
    ]


def test_a_block_before_the_latest_state_breaks_it_whatever_the_loop() -> None:
    """The extra state is the processed prefix's (index 0 here), never one before it."""
    snap = _snapshot((1, 2, 3), concurrent_batches=2)
    snap["groups"][0]["tables"] = (("r", 8, (1, 2, 3)),)
    assert GR5.violations(snap) == ["r: real blocks at [0] before the state at 1"]
