"""The field's bugs (``tests/regressions``) replayed on vLLM 0.33's own Scheduler.

Each scenario of ``tests/regressions`` that vLLM 0.33's interfaces can express (the scheduler,
its KV cache manager, and a connector plugged into ``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``build_connector_meta``, ``update_connector_output`` and
``request_finished_all_groups``) runs here against the real scheduler, in lock step with the
spec in its vLLM-exact mode, and the test asserts what vLLM 0.33 does: the bug reproduces
(STILL HAS) or the correct outcome of the regression test comes out (FIXED). Two scenarios have
no scheduler trace in vLLM 0.33 and are measured on the part of vLLM they concern instead: the
"39 < 40" allocation on vLLM's KVCacheManager, and #41830's connector without ``SupportsHMA``
on vLLM's configuration and KV cache specs.

How a scenario gets here: the regression test's own script runs on the spec engine (its helper
function, imported from ``tests/regressions``), and :func:`diffharness.replay.translate` turns
what it did into a trace: the same arrivals, connector answers, load reports and failures,
aborts, store holds, pool, running cap and policy, on the vLLM layout with the same group
structure, one regression block (2 tokens) becoming one claim unit ``u`` (640 tokens for
``1mamba+full``, 64 for ``sliding64+full``, 32 for ``sliding+full``). So a regression count
``t`` reads ``rep.tokens(t)`` here and a regression chunk ``(a, n)`` of a request reads
``rep.chunks(rid, ...)`` (decode positions are not scaled); the numbers asserted below are the
regression test's own, scaled that way. One scenario is
re-expressed (#45406: its decode steps must cross a block), and says how.

Every regression scenario, in ``tests/regressions`` order:

1. ``test_wrong_output::test_attention_kv_is_never_restored_without_its_mamba_state``
   (LMCache #2863, #2845)
   expressible: the claim yes; restoring the state happens inside the connector
   here: test_attention_only_claim_is_accepted_the_state_is_the_connectors
   vLLM 0.33: the scheduler accepts the attention-only claim: no guard (a connector bug)
2. ``test_wrong_output::test_full_prompt_hit_on_a_chunk_boundary_leaves_the_last_token_to_compute``
   (#51094)
   expressible: yes
   here: test_whole_prompt_claim_resumes_one_token_before_its_state
   vLLM 0.33: STILL HAS (scheduler)
3. ``test_wrong_output::test_mamba_state_is_stored_from_the_block_of_its_own_position`` (#49964)
   expressible: no: the block a store copies is chosen inside the connector; no DCP here
   here: none
   vLLM 0.33: not measured
4. ``test_wrong_output::test_speculative_scratch_block_is_never_stored_as_a_state``
   (LMCache #4984, #5004)
   expressible: no: the store source is chosen inside the connector; no speculative decoding here
   here: none
   vLLM 0.33: not measured
5. ``test_wrong_output::test_host_hit_reads_what_the_store_copied_before_its_block_was_reused``
   (SGLang #39830)
   expressible: the block reuse yes (donor half); the store's copy happens inside the connector
   here: test_state_block_of_a_running_request_is_reused_without_a_hook
   vLLM 0.33: the scheduler frees and reuses the block: no guard (a connector bug)
6. ``test_wrong_output::test_prefill_chunks_end_where_a_state_can_be_stored`` (LMCache align rule)
   expressible: the prefill yes; the host half is content (cut at reset_prefix_cache)
   here: test_prefill_chunks_end_on_state_boundaries
   vLLM 0.33: FIXED
7. ``test_lost_hits::test_decode_phase_states_are_stored_so_the_next_turn_hits`` (#56972)
   expressible: no: the store policy is inside the connector
   here: none
   vLLM 0.33: not measured
8. ``test_crashes::test_external_claim_on_a_mamba_layout_is_allowed_when_aligned`` (#45268, #45407)
   expressible: yes
   here: test_external_claim_on_a_mamba_layout_is_admitted
   vLLM 0.33: FIXED
9. ``test_crashes::test_sc1_unaligned_external_claim_is_floored_to_the_claim_unit`` (#42554)
   expressible: yes
   here: test_unaligned_external_claim_is_taken_as_is
   vLLM 0.33: STILL HAS
10. ``test_crashes::test_block_level_failure_truncates_every_group_at_one_point`` (#50687)
   expressible: the report yes; shared truncation is spec only (the translator refuses it)
   here: test_block_level_report_on_two_groups_raises
   vLLM 0.33: the unpack is FIXED, a RuntimeError instead
11. ``test_crashes::test_vllm_033_refuses_block_level_reports_on_two_groups``
   (#50687, #50388, #56855)
   expressible: yes
   here: test_block_level_report_on_two_groups_raises,
     test_request_level_failure_recomputes_from_zero
   vLLM 0.33: STILL HAS the refusal (RuntimeError); request-level reports recompute from 0
12. ``test_crashes::test_sc4_per_group_truncation_must_agree_on_the_state``
   (#50742, #54733, RFC #47812)
   expressible: no per-group recovery exists in vLLM; its two recovery paths are replayed on full +
     mamba
   here: the two tests above, full+mamba
   vLLM 0.33: FIXED (absent)
13. ``test_crashes::test_mamba_allocates_nothing_after_a_truncation`` (field note ("39 < 40"))
   expressible: no: vLLM never truncates a multi-group request; replayed on vLLM's KVCacheManager
   here: test_mamba_allocation_after_a_rollback_takes_nothing
   vLLM 0.33: FIXED
14. ``test_wedges::test_sc2_async_claim_waits_for_remote_kvs_in_its_step`` (field note)
   expressible: yes
   here: test_async_claim_waits_for_remote_kvs_in_its_step
   vLLM 0.33: FIXED
15. ``test_wedges::test_sc3_async_loads_reserve_what_in_flight_prefills_still_need``
   (#45387, #45388, #44560)
   expressible: yes (vLLM cannot switch its reserve off: the broken variant is refused)
   here: test_async_loads_reserve_what_in_flight_prefills_need
   vLLM 0.33: FIXED
16. ``test_wedges::test_two_admitted_async_loads_finish_under_vllm_033_rules`` and
   ``test_wedges::test_sc3_two_admitted_async_loads_do_not_wait_for_each_others_reserve``
   (D4's first cut, found here)
   expressible: yes
   here: test_two_admitted_async_loads_both_finish
   vLLM 0.33: not affected
17. ``test_wedges::test_plain_admission_leaves_the_async_reserve_alone`` (#48433)
   expressible: yes
   here: test_plain_admission_eats_the_async_reserve
   vLLM 0.33: STILL HAS
18. ``test_wedges::test_sc3_requests_holding_kv_are_scheduled_before_the_waiting_head`` (#45406)
   expressible: yes, re-expressed (r0's prompt, see the test)
   here: test_requests_holding_kv_are_scheduled_before_the_waiting_head
   vLLM 0.33: FIXED
19. ``test_wedges::test_sc3_a_pending_load_is_abandoned_at_its_deadline`` (#49829)
   expressible: the wait yes; the deadline is spec only (the translator refuses it)
   here: test_a_pending_load_has_no_deadline
   vLLM 0.33: STILL HAS
20. ``test_memory::test_gr4_external_claim_allocates_the_sliding_window_only`` and
   ``test_memory::test_sliding_window_claim_loads_and_holds_the_window`` (#30166)
   expressible: yes
   here: test_external_claim_allocates_the_sliding_window_only
   vLLM 0.33: FIXED
21. ``test_memory::test_gr4_sliding_window_layers_are_not_managed_as_full_attention`` (#41830)
   expressible: yes (with a SupportsHMA connector; without one, vLLM's configuration is inspected)
   here: test_sliding_window_keeps_its_window_with_a_supports_hma_connector,
     test_connector_without_supports_hma_turns_the_hybrid_manager_off
   vLLM 0.33: FIXED for SupportsHMA connectors; STILL HAS for the others
22. ``test_memory::test_gpt_oss_sliding_layers_as_full_attention_double_the_kv_a_request_needs``
   (#41830, #36463)
   expressible: start-up sizing: vLLM's own KV cache specs, no scheduler run
   here: test_connector_without_supports_hma_turns_the_hybrid_manager_off
   vLLM 0.33: STILL HAS without SupportsHMA
23. ``test_geometry::test_pl8_no_common_offload_block_of_every_group`` (#38230)
   expressible: no: offload planner geometry, no vLLM scheduler or connector interface
   here: none
   vLLM 0.33: not measured
24. ``test_geometry::test_pl1_hash_unit_divides_every_group_block`` (#54413)
   expressible: no: offload planner geometry
   here: none
   vLLM 0.33: not measured
25. ``test_geometry::test_pl2_no_hit_shorter_than_one_mamba_block`` (#40696)
   expressible: no: offload planner geometry
   here: none
   vLLM 0.33: not measured
26. ``test_geometry::test_pl7_chunk_need_not_be_a_multiple_of_the_unified_block``
   (LMCache hybrid mode)
   expressible: no: LMCache's chunking rule
   here: none
   vLLM 0.33: not measured

"Not measured" rows keep the code-reading verdict of ``docs/explanation/regressions.md``. The
translator refuses what a trace cannot say, and two tests pin those refusals (shared truncation,
a load deadline), so an inexpressible scenario is never replayed silently as something else.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vLLM 0.33 (run `nox -s vllm`)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "regressions"))

import test_crashes as crashes
import test_memory as memory
import test_wedges as wedges
import test_wrong_output as wrong_output
from diffharness.layouts import RECIPES, Layout
from diffharness.lockstep import RunResult, run_lockstep
from diffharness.observe import Hook, Phase, StepObservation
from diffharness.replay import Replay, translate
from diffharness.spec_side import SpecSide
from diffharness.trace import (
    ClaimMode,
    EngineSettings,
    LoadScript,
    RequestScript,
    Trace,
    TraceError,
)
from diffharness.vllm_side import BuiltEngine, VllmSide
from regression_script import full, mamba, sliding

from spec.invariants import check_all
from spec.kinds import GroupKind
from spec.scheduler import RecoveryMode

pytestmark = pytest.mark.vllm

RECOMPUTE = RecoveryMode.VLLM_RECOMPUTE


# --------------------------------------------------------------------------------------------
# helpers: run a replay in lock step and read its observations the way the regression tests
# read a Script


def _lockstep(rep: Replay | Trace, **spec_changes: Any) -> RunResult:
    """vLLM's Scheduler and the vLLM-exact spec in lock step (raises on any difference)."""
    trace = rep.trace if isinstance(rep, Replay) else rep
    changes = dict(rep.spec_changes) if isinstance(rep, Replay) else {}
    changes.update(spec_changes)
    return run_lockstep(trace, SpecSide(trace, **changes), VllmSide(trace))


def _agreed(rep: Replay | Trace, **spec_changes: Any) -> RunResult:
    result = _lockstep(rep, **spec_changes)
    assert result.crash is None, result.crash
    return result


def _obs(result: RunResult, step: int, phase: Phase = Phase.SCHEDULE) -> StepObservation:
    return next(o for o in result.history if (o.step, o.phase) == (step, phase))


def _status(obs: StepObservation, rid: str) -> str:
    return next(r.status for r in obs.requests if r.request_id == rid)


def _final(result: RunResult, rid: str) -> tuple[str, int]:
    """``rid``'s last status and output token count."""
    r = next(r for r in result.history[-1].requests if r.request_id == rid)
    return r.status, r.num_output_tokens


def _scheduled(result: RunResult, rid: str) -> list[tuple[int, int]]:
    """``(computed before, tokens)`` of every step that ran ``rid`` (``Script.scheduled``);
    both sides advance ``num_computed_tokens`` inside ``schedule()``."""
    found = []
    for obs in result.history:
        if obs.phase is not Phase.SCHEDULE:
            continue
        for scheduled, n in obs.scheduled:
            if scheduled == rid:
                after = next(r.num_computed_tokens for r in obs.requests if r.request_id == rid)
                found.append((after - n, n))
    return found


def _accepted(result: RunResult, rid: str) -> list[tuple[int, int]]:
    """``(claimed, accepted)`` of every admission after a connector answer for ``rid``."""
    return [
        (c.claimed, c.accepted) for o in result.history for c in o.claims if c.request_id == rid
    ]


def _asks(result: RunResult, rid: str) -> list[int]:
    """The local hit of every ``get_num_new_matched_tokens`` call for ``rid``."""
    return [
        int(c.args[0])  # type: ignore[call-overload]
        for o in result.history
        for c in o.hooks
        if c.hook is Hook.GET_NUM_NEW_MATCHED_TOKENS and c.request_id == rid
    ]


def _table(obs: StepObservation, rid: str, layout: Layout, kind: GroupKind) -> tuple[int, ...]:
    """``rid``'s block table of the (one) group of ``kind`` (0 is the null block)."""
    index = next(i for i, g in enumerate(RECIPES[layout].spec_groups()) if g.kind is kind)
    return next(tables for r, tables in obs.tables if r == rid)[index]


def _steps_before(result: RunResult, rid: str) -> set[int]:
    """The steps whose schedule() ran ``rid``."""
    return {
        o.step for o in result.history if o.phase is Phase.SCHEDULE and rid in dict(o.scheduled)
    }


# --------------------------------------------------------------------------------------------
# The layouts and the translation itself


@pytest.mark.parametrize("layout", [Layout.ONE_MAMBA_FULL, Layout.SHORT_SLIDING_FULL])
def test_regression_layouts_are_vllms_groups(layout: Layout) -> None:
    """The two replay layouts: vLLM derives the groups the spec side runs with (kind, block,
    window, in vLLM's group order), and the pool minimum the translator checks is vLLM's."""
    recipe = RECIPES[layout]
    built = BuiltEngine(recipe, EngineSettings(recipe.min_num_blocks, 4 * recipe.unit, 2))
    kinds = {"MambaSpec": "mamba", "SlidingWindowSpec": "sliding", "FullAttentionSpec": "full"}
    ours = [(g.kind.value, g.block_size, g.sliding_window) for g in recipe.spec_groups()]
    assert [(kinds[name], block, window) for name, block, window in built.groups()] == ours
    assert built.block_size == recipe.unit
    with pytest.raises(ValueError, match="serve at least one request"):
        BuiltEngine(recipe, EngineSettings(recipe.min_num_blocks - 1, 4 * recipe.unit, 2))


def test_translation_keeps_the_scenarios_numbers() -> None:
    """#45387's script (``_two_async_loads(11)``: full + mamba, blocks of 2, 11 blocks, budget
    16, 4 running; r0 and r1 with 9-token prompts and 8 host tokens each; every job completes
    before the next step) becomes: the one-mamba-group layout, u = 640; the same pool and
    running cap, a budget of 8u; prompts of 4u + 1 tokens sharing nothing; each first answer an
    async claim of 4 units, each load reporting one step after it started, each finished
    request held one step for its last store."""
    rep = translate(wedges._two_async_loads(11))
    assert (rep.trace.layout, rep.block, rep.unit) == (Layout.ONE_MAMBA_FULL, 2, 640)
    settings = rep.trace.settings
    assert (settings.num_blocks, settings.max_num_batched_tokens, settings.max_num_seqs) == (
        11,
        8 * 640,
        4,
    )
    assert settings.max_model_len == 5 * 640  # 4u + 1 prompt tokens + 2 outputs, rounded up
    r0, r1 = rep.trace.requests
    assert (r0.arrival_step, r1.arrival_step) == (1, 1)
    assert len(r0.prompt) == len(r1.prompt) == rep.tokens(9) == 4 * 640 + 1
    assert (r0.prompt[:2], r0.prompt[-1], r1.prompt[:2], r1.prompt[-1]) == ((1, 2), 9, (21, 22), 29)
    assert r0.prompt[640:642] == (3, 4)  # block 1 starts with the regression's block 1
    for r in (r0, r1):
        assert {(c.mode, c.num_units, c.offset_tokens) for c in r.claims} == {
            (ClaimMode.ASYNC, 4, 0)
        }
        assert r.loads == (LoadScript(1),)
        assert r.store_hold == 1
    assert rep.cut == ()
    assert rep.chunks("r0", [(8, 1), (9, 1)]) == [(4 * 640, 1), (4 * 640 + 1, 1)]


# --------------------------------------------------------------------------------------------
# Wrong output


def test_attention_only_claim_is_accepted_the_state_is_the_connectors() -> None:
    """LMCache #2863/#2845 (``test_attention_kv_is_never_restored_without_its_mamba_state``):
    the host holds r0's attention to token 8 and its state at 4 only. The correct connector
    claims 4: vLLM runs ``[4, 8)``, ``[8, 9)`` and a decode step, as the regression does. The
    attention-only connector claims 8: vLLM takes 8 just the same and hands the connector one
    mamba block, at the slot of the state after 8 tokens, which that connector never fills.
    vLLM's scheduler has no way to tell: the guard must be in the connector (MB-1)."""
    good = translate(wrong_output._attention_without_state(None))
    result = _agreed(good)
    assert _accepted(result, "r0") == [(good.tokens(4), good.tokens(4))]
    assert _scheduled(result, "r0") == good.chunks("r0", [(4, 4), (8, 1), (9, 1)])
    assert _final(result, "r0") == ("finished_length", 2)

    bad = translate(wrong_output._attention_without_state(wrong_output.AttentionOnlyConnector))
    result = _agreed(bad)
    assert _accepted(result, "r0") == [(bad.tokens(8), bad.tokens(8))]  # STILL accepted
    # 8 claimed tokens = 4 mamba slots; the only real one is slot 3, the state after 8 tokens.
    state = _table(_obs(result, 1), "r0", bad.trace.layout, GroupKind.MAMBA)
    assert [slot for slot, b in enumerate(state) if b] == [3]
    assert _scheduled(result, "r0")[0] == bad.chunks("r0", [(8, 1)])[0]  # resumes on that slot


def test_whole_prompt_claim_resumes_one_token_before_its_state() -> None:
    """#51094 (``test_full_prompt_hit_on_a_chunk_boundary_leaves_the_last_token_to_compute``):
    an 8-token prompt ends on a block boundary and the host holds all of it. The correct claim
    (6) runs ``[6, 8)`` and a decode. A claim of the whole prompt is taken by vLLM 0.33: at the
    load's end it sets ``num_computed_tokens = num_tokens - 1`` (``scheduler.py:3513-3516``)
    and recomputes token 7 with the mamba slot holding the state after 8: the regression's
    broken run, ``(7, 1)``, STILL HAS at the scheduler (the native connector claims one token
    less, ``max_hit -= 1``, from code reading)."""
    good = translate(wrong_output._prompt_on_a_boundary(None))
    result = _agreed(good)
    assert _accepted(result, "r0") == [(good.tokens(6), good.tokens(6))]
    assert _scheduled(result, "r0") == good.chunks("r0", [(6, 2), (8, 1)])

    bad = translate(wrong_output._prompt_on_a_boundary(wrong_output.WholePromptClaim))
    result = _agreed(bad)
    assert _accepted(result, "r0") == [(bad.tokens(8), bad.tokens(8))]
    assert _scheduled(result, "r0")[0] == (bad.tokens(8) - 1, 1)
    # The forward of token 8u-1 reads the mamba slot the load wrote: slot 3, the state after
    # all 8u tokens (nothing is allocated in between: the table is the one of step 1).
    layout = bad.trace.layout
    loaded = _table(_obs(result, 1), "r0", layout, GroupKind.MAMBA)
    resumed = _table(_obs(result, 3), "r0", layout, GroupKind.MAMBA)
    assert resumed == loaded
    assert [slot for slot, b in enumerate(resumed) if b] == [3]


def test_state_block_of_a_running_request_is_reused_without_a_hook() -> None:
    """SGLang #39830 (``test_host_hit_reads_what_the_store_copied_before_its_block_was_reused``,
    the donor half; the reader half needs the host's content, cut at ``reset_prefix_cache``):
    r0 (7 tokens, budget 2, 8 blocks) stores the state after 2 from mamba slot 0 in step 1.
    vLLM drops that block from r0's table at step 3 and hands the same block to r0's full
    attention at step 4, while r0 runs: no connector hook is called in between, so a store still
    copying it reads r0's later KV. The scheduler gives no guard; the connector must keep its
    sources (the regression's TR-1; native: fenced, from code reading). Store holds are left
    out: the regression completes r0's later stores outside its event log."""
    rep = translate(wrong_output._slow_store(None), stores=False)
    assert rep.cut[:2] == ("reset_prefix_cache", "arrive r1")
    result = _agreed(rep)
    layout = rep.trace.layout
    assert _scheduled(result, "r0") == rep.chunks("r0", [(0, 2), (2, 2), (4, 2), (6, 1)])
    first_state = _table(_obs(result, 1), "r0", layout, GroupKind.MAMBA)[0]
    assert first_state != 0
    assert _table(_obs(result, 3), "r0", layout, GroupKind.MAMBA)[0] == 0  # dropped at step 3
    assert _table(_obs(result, 4), "r0", layout, GroupKind.FULL)[-1] == first_state  # reused
    until_reuse = result.history[: result.history.index(_obs(result, 4)) + 1]
    hooks = {c.hook for o in until_reuse for c in o.hooks}
    assert Hook.REQUEST_FINISHED_ALL_GROUPS not in hooks  # the only hook that could hold it


def test_prefill_chunks_end_on_state_boundaries() -> None:
    """LMCache's align rule (``test_prefill_chunks_end_where_a_state_can_be_stored``, r0's
    prefill; r1's claim depends on what the host stored, cut at ``reset_prefix_cache``): a
    9-token prompt with a budget of 5 runs as ``[0, 4)``, ``[4, 8)``, ``[8, 9)`` so the states
    after 4 and 8 exist. vLLM's ``_mamba_block_aligned_split`` does the same: FIXED."""
    rep = translate(wrong_output._unaligned_prefill(None)[0])
    assert rep.cut[:2] == ("reset_prefix_cache", "arrive r1")
    assert rep.trace.settings.max_num_batched_tokens == rep.tokens(5)  # 2u + 1
    result = _agreed(rep)
    assert _scheduled(result, "r0") == rep.chunks("r0", [(0, 4), (4, 4), (8, 1)])


# --------------------------------------------------------------------------------------------
# Crashes


@pytest.mark.parametrize("mode", [ClaimMode.ASYNC, ClaimMode.SYNC], ids=lambda m: m.value)
def test_external_claim_on_a_mamba_layout_is_admitted(mode: ClaimMode) -> None:
    """#45268/#45407 (``test_external_claim_on_a_mamba_layout_is_allowed_when_aligned``): r0
    claims the 8 host tokens of its 9-token prompt on full attention + mamba. vLLM asserted
    "External KV connector is not verified yet" in ``_mamba_block_aligned_split``; 0.33 takes
    the claim (FIXED). The regression's claim is async (the split is skipped for async loads);
    the same claim answered sync runs through the split with 8 external tokens."""
    rep = translate(crashes._host_hit())
    r0 = rep.trace.requests[0]
    if mode is ClaimMode.SYNC:
        claims = tuple(replace(c, mode=ClaimMode.SYNC) for c in r0.claims)
        rep = replace(rep, trace=replace(rep.trace, requests=(replace(r0, claims=claims),)))
    result = _agreed(rep)
    assert _accepted(result, "r0") == [(rep.tokens(8), rep.tokens(8))]
    ran = rep.chunks("r0", [(8, 1), (9, 1)])
    assert _scheduled(result, "r0") == ran
    first = 1 if mode is ClaimMode.SYNC else 3  # an async load reports in step 2's output
    assert min(_steps_before(result, "r0")) == first
    assert _final(result, "r0") == ("finished_length", 2)


def test_unaligned_external_claim_is_taken_as_is() -> None:
    """#42554 (``test_sc1_unaligned_external_claim_is_floored_to_the_claim_unit``): the
    connector answers 5 where the host's state exists only at 4. The regression's vLLM-exact
    run accepts 5; so does vLLM 0.33 (STILL HAS: nothing checks an external claim's alignment,
    D2). Its mamba table gets one state block, in the slot of position 5 (cdiv(5, 2) = 3
    slots, the last real), a state that align mode never takes; the next chunk runs to the next
    block boundary, ``[5, 6)`` (the ``start % block_size`` stop of the split)."""
    rep = translate(crashes._unaligned(vllm_exact=True))
    result = _agreed(rep)
    assert _accepted(result, "r0") == [(rep.tokens(5), rep.tokens(5))]
    state = _table(_obs(result, 1), "r0", rep.trace.layout, GroupKind.MAMBA)
    assert [slot for slot, b in enumerate(state) if b] == [2]
    assert _scheduled(result, "r0") == rep.chunks("r0", [(5, 1), (6, 2), (8, 1), (9, 1)])


_TWO_GROUP_SETS = pytest.mark.parametrize(
    "groups",
    [(full(), sliding(window=8)), (full(), mamba())],
    ids=["full+sliding8", "full+mamba"],
)


@_TWO_GROUP_SETS
def test_block_level_report_on_two_groups_raises(groups: tuple[Any, ...]) -> None:
    """#50687 (``test_block_level_failure_truncates_every_group_at_one_point``,
    ``test_vllm_033_refuses_block_level_reports_on_two_groups``,
    ``test_sc4_per_group_truncation_must_agree_on_the_state``): r0's load of 8 claimed tokens
    fails in its third segment ``[4, 6)``. Reported per block (the first two units arrived
    intact), vLLM 0.33 raises ``RuntimeError`` from ``update_from_output`` in the step of the
    report, on both layouts; the exact spec raises ``BlockLevelReportError`` at the same call.
    The old ``ValueError: too many values to unpack`` is gone (FIXED), replaced by a refusal
    (STILL no block-level recovery on a hybrid layout). Shared truncation, the regression's
    correct recovery, is spec only: the translator refuses it."""
    with pytest.raises(TraceError, match="recovery"):
        translate(crashes._third_segment_fails(groups))
    script = crashes._third_segment_fails(groups, recovery=RECOMPUTE)
    rep = translate(script, r0=LoadScript(1, block_level=True, valid_units=2))
    result = _lockstep(rep)
    assert result.crash is not None
    assert (result.crash.step, result.crash.call) == (2, "update_from_output")
    assert type(result.crash.right) is RuntimeError
    assert "block-level load failures" in str(result.crash.right)
    assert type(result.crash.left).__name__ == "BlockLevelReportError"


@_TWO_GROUP_SETS
def test_request_level_failure_recomputes_from_zero(groups: tuple[Any, ...]) -> None:
    """#50687/#50388/#56855 and #50742 (``test_vllm_033_refuses_block_level_reports_on_two_groups``
    and ``test_sc4_per_group_truncation_must_agree_on_the_state``): the same failure reported
    per request (``failed_recving``), as vLLM 0.33 requires. vLLM discards all 8 claimed tokens
    (no per-group truncation exists to get wrong: the #50742 bug is absent), asks the connector
    again from 0 and takes 4; then it computes what the regression computes: ``[4, 9)`` with the
    sliding window, ``[4, 8)``, ``[8, 9)`` with the mamba split, and a decode."""
    rep = translate(crashes._third_segment_fails(groups, recovery=RECOMPUTE))
    result = _agreed(rep)
    (recovery,) = _obs(result, 2, Phase.UPDATE).recoveries
    assert (recovery.computed_before, recovery.outcome, recovery.resume_at) == (
        rep.tokens(8),
        "recompute",
        0,
    )
    assert _asks(result, "r0") == [0, 0]
    assert [accepted for _, accepted in _accepted(result, "r0")] == [rep.tokens(8), rep.tokens(4)]
    expected = [(4, 5), (9, 1)] if groups[1].kind is GroupKind.SLIDING else [(4, 4), (8, 1), (9, 1)]
    assert _scheduled(result, "r0") == rep.chunks("r0", expected)
    assert _final(result, "r0") == ("finished_length", 2)


def test_mamba_allocation_after_a_rollback_takes_nothing() -> None:
    """ "39 < 40" (``test_mamba_allocates_nothing_after_a_truncation``). vLLM 0.33 never
    truncates a running request on a multi-group layout (block-level reports raise, above), so
    no scheduler trace reaches this; vLLM's own KVCacheManager is driven here the way the
    regression's scheduler drives its managers: r0 (10 tokens) is allocated ``[0, 4)``,
    ``[4, 8)``, ``[8, 10)``, put back to 8, and asks for ``[8, 10)`` again. The mamba table
    already has cdiv(10, 2) = 5 slots: vLLM allocates nothing and does not assert
    (``num_required_blocks <= len(req_blocks)`` returns no blocks): FIXED."""
    layout = Layout.ONE_MAMBA_FULL
    u = RECIPES[layout].unit
    side = VllmSide(Trace(layout, EngineSettings(32, 2 * u, 2), ()))
    side.add(RequestScript("r0", 1, tuple(range(1, 5 * u + 1)), 3))
    request, manager = side.requests["r0"], side.scheduler.kv_cache_manager
    for chunk in (2 * u, 2 * u, u):  # [0, 4), [4, 8), [8, 10) in regression tokens
        assert manager.allocate_slots(request, chunk) is not None
        request.num_computed_tokens += chunk
    mamba_index = next(
        i for i, g in enumerate(RECIPES[layout].spec_groups()) if g.kind is GroupKind.MAMBA
    )
    tables = manager.get_block_ids("r0")
    # mamba: null x3, the state at 8, the state at 10 (the regression's tables, scaled).
    assert [bool(b) for b in tables[mamba_index]] == [False, False, False, True, True]
    free = manager.block_pool.get_num_free_blocks()
    request.num_computed_tokens = 4 * u  # truncated to 8
    again = manager.allocate_slots(request, u)
    assert again is not None
    assert again.get_block_ids() == ([], [])
    assert manager.get_block_ids("r0") == tables
    assert manager.block_pool.get_num_free_blocks() == free


# --------------------------------------------------------------------------------------------
# Wedges


def test_async_claim_waits_for_remote_kvs_in_its_step() -> None:
    """The field's async-claim wedge (``test_sc2_async_claim_waits_for_remote_kvs_in_its_step``):
    r0's 8 host tokens are claimed asynchronously, so its step schedules 0 new tokens. The
    broken scheduler floored the 0 and broke out before WAITING_FOR_REMOTE_KVS, asking again
    every step. vLLM 0.33 asks once, parks r0 in WAITING_FOR_REMOTE_KVS in step 1, and runs
    ``[8, 9)`` and a decode after the load: FIXED (the split is skipped for async loads)."""
    rep = translate(wedges._async_claim(None))
    spec = SpecSide(rep.trace, **rep.spec_changes)  # the regression's bound: 6 steps
    result = run_lockstep(rep.trace, spec, VllmSide(rep.trace))
    assert result.crash is None
    assert _asks(result, "r0") == [0]
    assert _status(_obs(result, 1), "r0") == "waiting_for_remote_kvs"
    assert _scheduled(result, "r0") == rep.chunks("r0", [(8, 1), (9, 1)])
    assert _final(result, "r0") == ("finished_length", 2)
    assert check_all("scheduler", spec.scheduler.snapshot()) == {}


def test_async_loads_reserve_what_in_flight_prefills_need() -> None:
    """#45387/#45388 (``test_sc3_async_loads_reserve_what_in_flight_prefills_still_need``): 10
    usable blocks; r0 and r1 each claim 8 host tokens (4 attention blocks and 1 state block;
    after the load each needs 2 more). Admitting both leaves 0 free and deadlocks. vLLM 0.33
    reserves for in-flight prefills (#44560): r1 stays WAITING while r0's load and prefill run
    (5 free, 2 reserved for r0, 5 needed), is admitted once r0's blocks are back, and both
    finish: FIXED. The regression's broken variant (no reserve) has no vLLM switch: refused."""
    with pytest.raises(TraceError, match="reserve_for_async_loads"):
        translate(wedges._two_async_loads(11, reserve_for_async_loads=False))
    rep = translate(wedges._two_async_loads(11))
    result = _agreed(rep)
    assert _status(_obs(result, 1), "r0") == "waiting_for_remote_kvs"
    assert _obs(result, 1).num_free_blocks == 10 - 5  # r0's 4 attention blocks + 1 state
    first_r1 = min(o.step for o in result.history if any(c.request_id == "r1" for c in o.claims))
    for step in range(1, first_r1):
        assert _status(_obs(result, step), "r1") == "waiting"
    assert first_r1 > max(_steps_before(result, "r0"))  # after r0 ran to the end
    for rid in ("r0", "r1"):
        assert _final(result, rid) == ("finished_length", 2)


def test_two_admitted_async_loads_both_finish() -> None:
    """D4's first cut (``test_two_admitted_async_loads_finish_under_vllm_033_rules`` and
    ``test_sc3_two_admitted_async_loads_do_not_wait_for_each_others_reserve``): 12 usable
    blocks; both loads are admitted (r1's 5 blocks fit 7 free minus r0's reserve of 2). vLLM
    0.33 does not gate r0's resumption on r1's reserve: r0 takes the last 2 blocks, finishes,
    and r1 follows. Both regression runs translate to this one trace."""
    rep = translate(wedges._two_async_loads(13, vllm_exact=True))
    assert translate(wedges._two_resuming_loads()).trace == rep.trace
    result = _agreed(rep)
    assert [c.request_id for c in _obs(result, 1).claims] == ["r0", "r1"]
    # 12 usable - 5 (r0) - 5 (r1) - 2 (r0's next attention block and state): 0 left.
    assert _obs(result, 3).num_free_blocks == 0
    for rid in ("r0", "r1"):
        assert _final(result, rid) == ("finished_length", 2)


def test_plain_admission_eats_the_async_reserve() -> None:
    """#48433 (``test_plain_admission_leaves_the_async_reserve_alone``): r0's async load of 8
    tokens is in flight (it will need 2 more blocks); r1 has no host hit. vLLM 0.33 reserves
    only against other async admissions, so r1 is scheduled in step 1 into r0's reserve (0
    blocks left), is preempted in step 2 when its chunk needs another block, and its work is
    lost: STILL HAS (the regression's vLLM-exact run: one preemption)."""
    rep = translate(wedges._load_then_plain(vllm_exact=True))
    result = _agreed(rep)
    step1 = _obs(result, 1)
    assert _status(step1, "r0") == "waiting_for_remote_kvs"
    assert step1.scheduled == (("r1", rep.tokens(8)),)
    assert step1.num_free_blocks == 10 - 5 - 5  # r0's load; r1's 4 attention blocks + 1 state
    assert _obs(result, 2).preempted == ("r1",)
    assert result.counts["preemptions"] == 1
    for rid in ("r0", "r1"):
        assert _final(result, rid) == ("finished_length", 2)


def test_requests_holding_kv_are_scheduled_before_the_waiting_head() -> None:
    """#45406 (``test_sc3_requests_holding_kv_are_scheduled_before_the_waiting_head``),
    re-expressed: 10 usable blocks; r0 decodes and is preempted when r1's 8-token load holds the
    blocks its next token needs; r0 then heads the waiting queue and r1's landed load must not
    wait behind it. The regression's r0 (5 prompt tokens) needs a new block at its second
    decode step; scaled, 5 tokens would need 639 decode steps to cross a block, so r0's prompt
    here is ``3u - 1`` tokens: the same 3 blocks after its prefill, the same new block at its
    second decode. Everything else is the regression's. vLLM 0.33 schedules r1 from its
    ``kv_holding_waiting`` queue ahead of r0: FIXED."""
    rep = translate(wedges._preempted_head(None))
    r0, r1 = rep.trace.requests
    r0 = replace(r0, prompt=tuple(range(1, 3 * rep.unit)))
    trace = replace(rep.trace, requests=(r0, r1))
    result = _agreed(trace, **rep.spec_changes)
    assert result.counts["preemptions"] == 1
    preempted = next(o.step for o in result.history if o.preempted == ("r0",))
    (r1_step,) = _steps_before(result, "r1")
    assert r1_step > preempted
    assert _obs(result, r1_step).waiting == ("r0",)  # r0 still heads the waiting queue
    assert _scheduled(result, "r1") == rep.chunks("r1", [(8, 1)])
    assert _final(result, "r1") == ("finished_length", 1)
    assert _final(result, "r0") == ("finished_length", 8)


def test_a_pending_load_has_no_deadline() -> None:
    """#49829 (``test_sc3_a_pending_load_is_abandoned_at_its_deadline``): r0's load never
    reports. vLLM 0.33 keeps r0 in WAITING_FOR_REMOTE_KVS for all 10 steps of the regression's
    stuck run, its blocks held (STILL HAS, D3); the exact spec agrees and its liveness check
    (the regression's bound, 8 steps) names SC-3. The deadline is spec only: refused."""
    with pytest.raises(TraceError, match="load_deadline_steps"):
        translate(wedges._load_never_reports(load_deadline_steps=2))
    stuck = wedges._load_never_reports()
    stuck.step(4)
    rep = translate(stuck)
    assert rep.trace.max_steps == 10
    spec = SpecSide(rep.trace, **rep.spec_changes)
    result = run_lockstep(rep.trace, spec, VllmSide(rep.trace))
    assert result.crash is None
    assert result.steps == 10
    assert {_status(o, "r0") for o in result.history} == {"waiting_for_remote_kvs"}
    assert _scheduled(result, "r0") == []
    assert result.history[-1].tables != ()
    assert "SC-3" in check_all("scheduler", spec.scheduler.snapshot())


# --------------------------------------------------------------------------------------------
# Memory


def test_external_claim_allocates_the_sliding_window_only() -> None:
    """#30166 (``test_gr4_external_claim_allocates_the_sliding_window_only`` and
    ``test_sliding_window_claim_loads_and_holds_the_window``): r0 claims 8 host tokens on full
    attention + a window of 2 blocks, is aborted while its load copies, and r1 is admitted.
    vLLM 0.33 gives the sliding table the null block before the window from the start
    (``(0, 0, b, b)``: 6 blocks taken, not 8), keeps r0's blocks until its load reports (step
    3), and hands r1 none of them meanwhile: no allocate-then-free, FIXED."""
    rep = translate(memory._claim_then_abort(None))
    layout = rep.trace.layout
    assert layout is Layout.SHORT_SLIDING_FULL
    result = _agreed(rep)
    step1 = _obs(result, 1)
    assert step1.scheduled == ()
    window = _table(step1, "r0", layout, GroupKind.SLIDING)
    assert window[:2] == (0, 0)
    assert all(window[2:])
    assert len(window) == 4
    usable = rep.trace.settings.num_blocks - 1
    assert step1.num_free_blocks == usable - 4 - 2  # 4 attention blocks + the 2 in the window
    r0_blocks = {b for t in dict(step1.tables)["r0"] for b in t if b}
    for step in (2, 3):
        obs = _obs(result, step)
        assert _status(obs, "r0") == "finished_aborted"
        assert {b for t in dict(obs.tables)["r0"] for b in t if b} == r0_blocks  # still held
        assert not r0_blocks & {b for t in dict(obs.tables)["r1"] for b in t if b}
    assert "r0" not in dict(_obs(result, 3, Phase.UPDATE).tables)  # freed at the load's report
    assert _final(result, "r1") == ("finished_length", 2)


def test_sliding_window_keeps_its_window_with_a_supports_hma_connector() -> None:
    """#41830 (``test_gr4_sliding_window_layers_are_not_managed_as_full_attention``): a 12-token
    prompt in chunks of 4 on full attention + a window of 2 blocks. With a ``SupportsHMA``
    connector vLLM 0.33 keeps the hybrid manager on and the sliding table holds at most 4 real
    blocks (the window and the chunk), null before the window, as the regression's correct run
    (its broken run peaks at 7): FIXED for such connectors."""
    rep = translate(memory._long_prefill(None)[0])
    layout = rep.trace.layout
    result = _agreed(rep)
    assert _scheduled(result, "r0") == rep.chunks("r0", [(0, 4), (4, 4), (8, 4), (12, 1)])
    held = [
        sum(1 for b in _table(o, "r0", layout, GroupKind.SLIDING) if b)
        for o in result.history
        if o.phase is Phase.SCHEDULE and "r0" in dict(o.tables)
    ]
    assert max(held) == 4
    assert _table(_obs(result, 3), "r0", layout, GroupKind.SLIDING)[:2] == (0, 0)


def test_connector_without_supports_hma_turns_the_hybrid_manager_off() -> None:
    """#41830/#36463 (the same scenario, and
    ``test_gpt_oss_sliding_layers_as_full_attention_double_the_kv_a_request_needs``): the same
    engine with a connector that is not ``SupportsHMA`` (vLLM's in-tree ``ExampleConnector``).
    vLLM 0.33 switches the hybrid manager off (``config/vllm.py:2257-2278``): one KV cache group
    holds both layers as ``FullAttentionSpec``, served by ``FullAttentionManager``, so the
    sliding layer keeps every block. Start-up sizing per layer, for one request of the
    trace's ``max_model_len`` (7u) with its budget (2u): the sliding layer needs cdiv(7u, u) = 7
    pages like the full one instead of its window's cdiv(min(2u - 1 + 2u, 7u), u) + 1 = 5:
    STILL HAS for connectors without ``SupportsHMA``."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    rep = translate(memory._long_prefill(None)[0])
    recipe = RECIPES[rep.trace.layout]
    assert rep.trace.max_model_len == 7 * rep.unit
    assert rep.trace.settings.max_num_batched_tokens == 2 * rep.unit
    pages: dict[str, dict[str, int]] = {}
    for name in ("TraceHMAConnector", "ExampleConnector"):
        in_tree = None if name == "TraceHMAConnector" else name
        built = BuiltEngine(recipe, rep.trace.settings, kv_connector=in_tree)
        config = built.vllm_config
        hma_off = config.scheduler_config.disable_hybrid_kv_cache_manager
        assert hma_off is (name == "ExampleConnector")
        assert KVConnectorFactory.supports_hma_config(config.kv_transfer_config) is not hma_off
        groups = built.kv_cache_config.kv_cache_groups
        pages[name] = {
            layer: g.kv_cache_spec.max_memory_usage_bytes(config) // g.kv_cache_spec.page_size_bytes
            for g in groups
            for layer in g.layer_names
        }
        if hma_off:
            (group,) = groups
            assert type(group.kv_cache_spec).__name__ == "FullAttentionSpec"
            manager = KVCacheSpecRegistry.get_manager_class(group.kv_cache_spec, None)
            assert manager is FullAttentionManager
    sliding_layer, full_layer = "model.layers.0.attn.attn", "model.layers.1.attn.attn"
    assert pages["TraceHMAConnector"] == {sliding_layer: 5, full_layer: 7}
    assert pages["ExampleConnector"] == {sliding_layer: 7, full_layer: 7}
