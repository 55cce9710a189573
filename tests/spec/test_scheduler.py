"""Hand-computed scenarios of the scheduler model (spec.scheduler) with a scripted connector.

Layout unless said otherwise: full attention + mamba, block 4 (claim unit 4), 8 usable blocks
(ids 1..8, handed out in id order), budget 16, 2 running. Prompts are 12 tokens.
"""

from __future__ import annotations

import pytest
from _scheduler_fakes import (
    FULL4,
    NOTHING,
    SLIDING4,
    ScriptedConnector,
    broken,
    config,
    done,
    failed,
    request,
)

from spec.connector_api import Claim, ClaimKind, KVConnectorOutput
from spec.errors import ConfigError
from spec.scheduler import (
    BlockLevelReportError,
    ClaimOutcome,
    FailureReport,
    Hold,
    RecoveryMode,
    RequestStatus,
    Scheduler,
    mamba_block_aligned_split,
)

ASYNC8 = Claim(ClaimKind.ASYNC, 8)
WFR = RequestStatus.WAITING_FOR_REMOTE_KVS


def sound(s: Scheduler) -> None:
    assert broken(s) == {}


def test_sync_claim_loads_then_computes_the_rest() -> None:
    conn = ScriptedConnector(Claim(ClaimKind.SYNC, 8))
    s = Scheduler(config(), conn)
    s.add_request(request("a"))
    out = s.schedule()
    # 8 tokens claimed at 0; the remaining 4 are the prompt's last chunk (no split needed).
    assert [(x.num_computed_tokens, x.num_scheduled_tokens) for x in out.scheduled] == [(8, 4)]
    # full: 2 external blocks then 1 new; mamba: one external state at index 1, new state at 2.
    assert out.scheduled[0].block_ids == ((1, 2, 4), (0, 3, 5))
    assert conn.allocs == [("a", ((1, 2, 4), (0, 3, 5)), 8)]
    assert s.requests["a"].status is RequestStatus.RUNNING
    assert out.claims[0].outcome is ClaimOutcome.SCHEDULED
    sound(s)


def test_async_claim_waits_then_runs_and_sees_update_state_twice() -> None:
    conn = ScriptedConnector(ASYNC8)
    s = Scheduler(config(), conn)
    s.add_request(request("a"))
    out = s.schedule()
    assert out.scheduled == ()
    assert s.requests["a"].status is WFR
    assert s.kv_holding == ["a"]
    assert s.running == []
    assert out.claims[0].outcome is ClaimOutcome.WAITING_FOR_REMOTE_KVS
    sound(s)
    s.update_from_output(out, {}, NOTHING)
    out = s.schedule()  # not reported yet: skipped, not asked again
    assert out.scheduled == ()
    assert conn.asked == [("a", 0)]
    s.update_from_output(out, {}, done("a"))
    out = s.schedule()
    assert [(x.num_computed_tokens, x.num_scheduled_tokens) for x in out.scheduled] == [(8, 4)]
    assert [n for _r, _b, n in conn.allocs] == [8, 0]
    s.update_from_output(out, {"a": 7}, NOTHING)
    assert s.requests["a"].output_token_ids == (7,)
    sound(s)


def test_defer_skips_then_claims_next_step() -> None:
    conn = ScriptedConnector(Claim(ClaimKind.DEFER), ASYNC8)
    s = Scheduler(config(), conn)
    s.add_request(request("a"))
    out = s.schedule()
    assert out.scheduled == ()
    assert out.claims[0].outcome is ClaimOutcome.DEFERRED
    assert s.waiting == ["a"]
    assert s.kv.get_blocks("a") == ((), ())
    s.update_from_output(out, {}, NOTHING)
    s.schedule()
    assert conn.asked == [("a", 0), ("a", 0)]
    assert s.requests["a"].status is WFR
    sound(s)


def test_abort_during_load_frees_blocks_only_after_the_report() -> None:
    s = Scheduler(config(), ScriptedConnector(ASYNC8))
    s.add_request(request("a"))
    out = s.schedule()
    s.abort_request("a")
    assert s.requests["a"].status is RequestStatus.FINISHED_ABORTED
    assert s.kv.get_blocks("a") == ((1, 2), (0, 3))  # the load may still write them
    sound(s)
    s.update_from_output(out, {}, done("a"))
    assert s.kv.get_blocks("a") == ((), ())
    assert s.kv.pool.get_num_free_blocks() == 8
    sound(s)


def test_preemption_frees_the_last_running_request() -> None:
    # Full attention only, 4 usable blocks: two 8-token prompts take 2 blocks each.
    s = Scheduler(config(FULL4, num_blocks=5), None)
    s.add_request(request("a", 8, max_tokens=3))
    s.add_request(request("b", 8, max_tokens=3, cache_salt="b"))  # no prefix hit on a
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 8, "b": 8}
    s.update_from_output(out, {"a": 1, "b": 2}, NOTHING)
    out = s.schedule()  # a's 9th token needs a 3rd block: b is preempted to make room
    assert out.preempted_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    b = s.requests["b"]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert s.waiting == ["b"]
    assert s.kv.get_blocks("b") == ((),)
    sound(s)


def test_delayed_free_waits_for_finished_sending() -> None:
    conn = ScriptedConnector(delay_free=True)
    s = Scheduler(config(), conn)
    s.add_request(request("a", 8, max_tokens=1))
    out = s.schedule()
    # The split stops the 8-token prompt at the last cacheable boundary 4, then 4 more.
    assert out.num_scheduled_tokens == {"a": 4}
    s.update_from_output(out, {}, NOTHING)
    out = s.schedule()
    s.update_from_output(out, {"a": 9}, NOTHING)
    assert s.requests["a"].status is RequestStatus.FINISHED_LENGTH
    # full (1, 3); mamba dropped its first state (block 2) before the connector saw the table.
    assert conn.finished == [("a", ((1, 3), (0, 4)))]
    assert s.holds == {"a": frozenset({Hold.STORE})}
    assert s.kv.get_blocks("a") != ((), ())
    sound(s)
    out = s.schedule()
    s.update_from_output(out, {}, KVConnectorOutput(finished_sending=frozenset({"a"})))
    assert s.kv.get_blocks("a") == ((), ())
    assert not s.holds
    sound(s)


def test_deadline_abandons_the_load_and_parks_its_blocks() -> None:
    conn = ScriptedConnector(ASYNC8)
    s = Scheduler(config(load_deadline_steps=2), conn)
    s.add_request(request("a"))
    for _ in range(3):  # steps 1..3: the load is at most 2 steps old
        out = s.schedule()
        s.update_from_output(out, {}, NOTHING)
        assert s.requests["a"].status is WFR
    out = s.schedule()  # step 4: 3 steps old -> abandoned, recomputed without asking again
    assert out.abandoned_ids == {"a"}
    assert conn.asked == [("a", 0)]
    assert s.parked["a"].blocks == (1, 2, 3)
    # Recompute from 0: the split stops at the last cacheable boundary 8.
    assert out.num_scheduled_tokens == {"a": 8}
    assert s.counters["tokens_discarded_by_deadline"] == 8
    sound(s)
    s.update_from_output(out, {}, done("a"))  # the late report matches the parked load
    assert "a" not in s.parked
    assert s.requests["a"].status is RequestStatus.RUNNING
    assert all(s.kv.pool.ref_count(b) == 0 for b in (1, 2, 3))
    sound(s)


def _failed_load(
    mode: RecoveryMode, groups: tuple = (), report: frozenset | None = None
) -> Scheduler:
    conn = ScriptedConnector(ASYNC8)
    s = Scheduler(config(*groups, recovery=mode), conn)
    s.add_request(request("a"))
    out = s.schedule()
    failures = (FailureReport("a", report),) if report is not None else ()
    s.update_from_output(out, {}, failed("a"), failures)
    return s


def test_vllm_recompute_restarts_from_zero_and_asks_again() -> None:
    s = _failed_load(RecoveryMode.VLLM_RECOMPUTE)
    assert s.recoveries[0].discarded == 8  # all 8 claimed tokens
    out = s.schedule()
    assert s.connector.asked == [("a", 0), ("a", 0)]  # type: ignore[union-attr]
    assert out.num_scheduled_tokens == {"a": 8}  # recomputed from 0 (split at 8)
    sound(s)


def test_vllm_fail_finishes_with_error_and_frees() -> None:
    s = _failed_load(RecoveryMode.VLLM_FAIL)
    assert s.requests["a"].status is RequestStatus.FINISHED_ERROR
    assert s.kv.pool.get_num_free_blocks() == 8
    sound(s)


def test_shared_truncation_on_full_mamba_falls_back_to_zero() -> None:
    # Tables: full (1, 2), mamba (0, 3). A bad second attention block bounds the prefix at 4;
    # mamba holds a state only at 8 (null at index 0), so the only point both accept is 0:
    # 8 tokens discarded, as many as vLLM's recompute. One state per request leaves no middle.
    s = _failed_load(RecoveryMode.SHARED_TRUNCATION, report=frozenset({2}))
    rec = s.recoveries[0]
    assert (rec.truncated_to, rec.discarded) == (0, 8)
    assert rec.valid_points == ((0, 4), (0,))
    sound(s)


def test_shared_truncation_on_full_sliding_keeps_the_valid_prefix() -> None:
    # full (1, 2), sliding window 8 (2, 3 -> ids 3, 4). Bad full block 2: bound 4; the window
    # ending at 4 is block 3 (valid): truncate to 4, discard 4 (vLLM's recompute discards 8).
    s = _failed_load(RecoveryMode.SHARED_TRUNCATION, (FULL4, SLIDING4), frozenset({2}))
    rec = s.recoveries[0]
    assert (rec.truncated_to, rec.discarded) == (4, 4)
    out = s.schedule()
    assert [(x.num_computed_tokens, x.num_scheduled_tokens) for x in out.scheduled] == [(4, 8)]
    sound(s)
    vllm = _failed_load(RecoveryMode.VLLM_RECOMPUTE, (FULL4, SLIDING4))
    assert vllm.recoveries[0].discarded == 8


def test_block_level_report_on_two_groups_is_refused_like_vllm() -> None:
    conn = ScriptedConnector(ASYNC8)
    s = Scheduler(config(recovery=RecoveryMode.VLLM_RECOMPUTE), conn)
    s.add_request(request("a"))
    out = s.schedule()
    before = s.freeze()
    with pytest.raises(BlockLevelReportError):
        s.update_from_output(out, {}, failed("a"), (FailureReport("a", frozenset({2})),))
    assert s.freeze() == before  # the refusal changes nothing


def test_full_prompt_async_hit_recomputes_the_last_token() -> None:
    s = Scheduler(config(), ScriptedConnector(Claim(ClaimKind.ASYNC, 12)))
    s.add_request(request("a"))
    out = s.schedule()
    s.update_from_output(out, {}, done("a"))
    out = s.schedule()
    assert [(x.num_computed_tokens, x.num_scheduled_tokens) for x in out.scheduled] == [(11, 1)]
    sound(s)


def test_unaligned_claim_is_floored_to_the_unit() -> None:
    s = Scheduler(config(), ScriptedConnector(Claim(ClaimKind.ASYNC, 6)))
    s.add_request(request("a"))
    out = s.schedule()
    assert (out.claims[0].claimed, out.claims[0].accepted) == (6, 4)
    sound(s)


def test_mamba_split_ends_prefill_chunks_on_block_boundaries() -> None:
    kw = {"num_prompt_tokens": 12, "num_tokens": 12, "block_size": 4, "max_prefill_tokens": 16}
    assert mamba_block_aligned_split(start=0, num_new_tokens=7, **kw) == 4  # floor 7 -> 4
    assert mamba_block_aligned_split(start=0, num_new_tokens=12, **kw) == 8  # stop at 8
    assert mamba_block_aligned_split(start=8, num_new_tokens=4, **kw) == 4  # last chunk
    assert mamba_block_aligned_split(start=2, num_new_tokens=9, **kw) == 2  # to boundary 4
    assert mamba_block_aligned_split(start=12, num_new_tokens=1, **kw) == 1  # decode


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ConfigError):
        config(load_deadline_steps=2, vllm_exact=True)
    with pytest.raises(ConfigError):
        config(recovery=RecoveryMode.SHARED_TRUNCATION, vllm_exact=True)
    with pytest.raises(ConfigError):
        config(hash_block_size=3)
    s = Scheduler(config(), None)
    s.add_request(request("a"))
    with pytest.raises(ConfigError):
        s.add_request(request("a"))
    out = s.schedule()
    s.update_from_output(out, {}, NOTHING)
    with pytest.raises(ConfigError):
        s.update_from_output(out, {}, done("a"))  # stale output, no load


def test_clone_is_independent_and_freeze_is_stable() -> None:
    s = Scheduler(config(), ScriptedConnector(ASYNC8))
    s.add_request(request("a"))
    twin = s.clone(ScriptedConnector())
    assert twin.freeze() == s.freeze()
    s.schedule()
    assert twin.requests["a"].status is RequestStatus.WAITING
    assert twin.freeze() != s.freeze()
    hash(s.freeze())
