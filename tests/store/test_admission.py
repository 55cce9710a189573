"""Admission under host pressure (issue 18 item 2): a LOW store takes free slots only.

The connector stores a prompt's units NORMAL and the units a decode step completes (a
continuation, past the prompt) LOW, like the sliding-window units no claim of the prompt reads.
On a small trace: when the host is full, the reusable prompt prefix stays and the continuation
is refused; when there is room, the continuation is stored and a follow-up turn loads it.
Both host stores (the reference ``spec.store`` and the library's) keep the same rule.
"""

from __future__ import annotations

from typing import Any

import pytest

import spec.store
from hybridkv.connector import (
    ClaimKind,
    ConnectorCore,
    JobId,
    JobResult,
    KVConnectorOutput,
    RequestId,
    RequestView,
    ScheduledRequest,
    StepView,
)
from hybridkv.connector.api import TransferItem
from hybridkv.connector.geometry import ConnectorGeometry
from hybridkv.connector.stores import low_priority
from hybridkv.kinds import GroupKind
from hybridkv.planner import HybridOffloadPlanner
from hybridkv.store import HostStore, Refusal, StorePriority

FULL, SLIDING = GroupKind.FULL, GroupKind.SLIDING
PROMPT = tuple(range(1, 10))  # 9 tokens: units ending at 4 and 8 are the prompt's
ANSWER = (50, 51, 52)  # decode tokens 9-11: the unit ending at 12 is a continuation
TABLE = ((11, 12, 13, 14),)


def _core(capacity: int) -> ConnectorCore:
    planner = HybridOffloadPlanner(((FULL, 4),), 4, 4, 1 << 10)
    return ConnectorCore(planner, HostStore(capacity), (FULL,), 4, 4)


def _run(core: ConnectorCore, scheduled: ScheduledRequest) -> int:
    """One step storing what ``scheduled`` completes; every job reports success. Returns the
    number of keys stored."""
    meta = core.build_connector_meta(StepView(1, (scheduled,)))
    results = tuple(JobResult(JobId(job.job_id), True) for job in meta.store_jobs)
    core.update_connector_output(KVConnectorOutput(completed_jobs=results))
    return sum(len(job.items) for job in meta.store_jobs)


def _chat(capacity: int) -> tuple[ConnectorCore, int, int]:
    """Turn 1 of a conversation (prefill, then the decode step completing a unit), then turn 2
    (the prompt grown by the answer) asking the host. Returns the core, the keys turn 1's
    decode step stored and the tokens turn 2 claims."""
    core = _core(capacity)
    prefill = RequestView(RequestId("t1"), PROMPT, len(PROMPT))
    assert _run(core, ScheduledRequest(prefill, TABLE, 0, len(PROMPT))) == 2
    decoded = RequestView(RequestId("t1"), PROMPT + ANSWER, len(PROMPT))
    stored = _run(core, ScheduledRequest(decoded, TABLE, len(PROMPT), len(ANSWER)))
    core.request_finished_all_groups(decoded, TABLE)
    follow_up = PROMPT + ANSWER + (60, 61)
    claim = core.get_num_new_matched_tokens(
        RequestView(RequestId("t2"), follow_up, len(follow_up)), 0
    )
    assert claim.kind in (ClaimKind.ASYNC, ClaimKind.NONE)
    return core, stored, claim.num_tokens


def test_a_full_host_keeps_the_prompt_prefix_over_the_continuation() -> None:
    # Two entries hold the prompt's two units; the continuation may not displace them.
    core, stored, claimed = _chat(2)
    assert stored == 0
    assert claimed == 8  # the whole prompt prefix is still there to load
    assert core.stats().stores_refused == 1


def test_with_room_the_continuation_is_stored_and_claimed() -> None:
    core, stored, claimed = _chat(3)
    assert stored == 1
    assert claimed == 12  # prompt and the previous answer's unit
    assert core.stats().stores_refused == 0


def test_a_full_host_keeps_an_earlier_continuation_over_a_later_one() -> None:
    # Conversations A and B take turns; the host holds A's prompt (2 units) and continuation
    # (1 unit) and B's prompt (2 units): 5 of 5 slots. A's answer came first, so A's next turn
    # comes first too. B's continuation, a LOW unit, may not displace A's: on bb61df5 it
    # evicted it (a LOW store could take a LOW entry's place), and A's second turn then
    # claimed only its prompt.
    core = _core(5)
    a_prompt, b_prompt = PROMPT, tuple(range(101, 110))
    for rid, prompt in (("a1", a_prompt), ("b1", b_prompt)):
        prefill = RequestView(RequestId(rid), prompt, len(prompt))
        assert _run(core, ScheduledRequest(prefill, TABLE, 0, len(prompt))) == 2
        decoded = RequestView(RequestId(rid), prompt + ANSWER, len(prompt))
        stored = _run(core, ScheduledRequest(decoded, TABLE, len(prompt), len(ANSWER)))
        core.request_finished_all_groups(decoded, TABLE)
        assert stored == (1 if rid == "a1" else 0)  # B's continuation finds no free slot
    assert core.stats().stores_refused == 1
    follow_up = a_prompt + ANSWER + (60, 61)
    claim = core.get_num_new_matched_tokens(
        RequestView(RequestId("a2"), follow_up, len(follow_up)), 0
    )
    assert (claim.kind, claim.num_tokens) == (ClaimKind.ASYNC, 12)  # prompt and A's answer


def test_low_priority_marks_continuations_and_far_sliding_units() -> None:
    planner = HybridOffloadPlanner(((FULL, 4), (SLIDING, 4)), 4, 4, 1 << 10)
    geometry = ConnectorGeometry.build(planner, (FULL, SLIDING), (0, 7))
    # A 21-token prompt: its claims end at 20 at the furthest; a 7-token window there reads
    # the sliding units ending at 16 and 20, so those ending at 12 or before are far.
    far = {end for end in range(4, 29, 4) if low_priority(geometry, _item(1, end), 21)}
    assert far == {4, 8, 12, 24, 28}
    assert {end for end in range(4, 29, 4) if low_priority(geometry, _item(0, end), 21)} == {
        24,
        28,
    }


def _item(group: int, end: int) -> TransferItem:
    return TransferItem(group, 1, b"k%d-%d" % (group, end), end)


STORES: list[tuple[Any, Any]] = [
    (HostStore, StorePriority),
    (spec.store.HostStore, spec.store.StorePriority),
]


@pytest.mark.parametrize(("store_type", "priorities"), STORES)
def test_a_low_store_takes_free_slots_only(store_type: Any, priorities: Any) -> None:
    store = store_type(3, "lru")
    for key, priority in ((b"p", priorities.NORMAL), (b"c", priorities.LOW)):
        store.prepare_store([key], priority)
        store.complete_store([key], success=True)
    # One free slot: a LOW store takes it.
    assert store.prepare_store([b"d"], priorities.LOW).evicted_keys == ()
    store.complete_store([b"d"], success=True)
    assert store.snapshot()["low"] == tuple(sorted((b"c".hex(), b"d".hex())))
    # Full: a LOW store displaces nothing, not even the older LOW entry c, and is refused.
    full = store.snapshot()
    assert store.prepare_store([b"e"], priorities.LOW).value == Refusal.NO_SPACE.value
    assert store.snapshot() == full
    # A NORMAL store evicts by the policy's order, whatever the class.
    assert store.prepare_store([b"e"]).evicted_keys == (b"p",)


@pytest.mark.parametrize(("store_type", "priorities"), STORES)
def test_priority_must_be_a_store_priority(store_type: Any, priorities: Any) -> None:
    store = store_type(2)
    with pytest.raises(ValueError, match="StorePriority") as bad:
        store.prepare_store([b"a"], "low")
    assert bad.value.field == "priority"  # type: ignore[attr-defined]
    assert store.snapshot()["used"] == 0
