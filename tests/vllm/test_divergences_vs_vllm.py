"""The divergence catalogue (D1-D9), each shown on a concrete trace against vLLM 0.33.

For every entry of :mod:`spec.scheduler.config` (and ``docs/explanation/divergences.md``) the
same trace runs three ways: vLLM 0.33's real Scheduler, the spec in its vLLM-exact mode, and the
spec with that divergence switched on. Each test checks that the exact mode agrees with vLLM
step by step (the lock-step comparison, or the same crash) and that the divergence changes the
named observation at the named step. D1 is a manager-level trace: vLLM 0.33 reaches a negative
mamba count only with speculative decoding or block-level recovery, which the scheduler traces
do not run (see the test).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vLLM 0.33 (run `nox -s vllm`)")

from diffharness.findings import (
    abort_during_load_with_store_hold,
    classify,
    failed_load_reclaimed,
    mamba_sync_claims,
)
from diffharness.layouts import RECIPES, Layout
from diffharness.lockstep import SoloRun, run_alone, run_lockstep
from diffharness.observe import Hook, Phase
from diffharness.spec_side import SpecSide
from diffharness.trace import (
    ClaimMode,
    ClaimScript,
    EngineSettings,
    LoadScript,
    RequestScript,
    Trace,
)
from diffharness.vllm_side import VllmSide

from spec.managers import KVCacheCoordinator
from spec.scheduler import RecoveryMode
from spec.scheduler.state import _ExactCoordinator

pytestmark = pytest.mark.vllm

FULL = Layout.FULL_ONLY
U = RECIPES[FULL].unit  # 32 tokens


def _prompt(base: int, length: int) -> tuple[int, ...]:
    return tuple(range(base, base + length))


def _exact_agrees(trace: Trace) -> None:
    """The vLLM-exact spec agrees with vLLM on the whole trace (or crashes identically, as a
    catalogued finding)."""
    result = run_lockstep(trace, SpecSide(trace), VllmSide(trace))
    if result.crash is not None:
        assert classify(result.crash) is not None, result.crash


def _runs(trace: Trace, **divergence: object) -> tuple[SoloRun, SoloRun]:
    """vLLM's run and the run of the spec with the divergence switched on."""
    _exact_agrees(trace)
    vllm = run_alone(trace, VllmSide(trace))
    spec = run_alone(trace, SpecSide(trace, name="spec+divergence", **divergence))
    return vllm, spec


def _status(run: SoloRun, step: int, phase: Phase, rid: str) -> str:
    return next(r.status for r in run.at(step, phase).requests if r.request_id == rid)


# ------------------------------------------------------------------------------------- D1
def test_d1_mamba_count_is_clamped_where_vllm_goes_negative() -> None:
    """D1, manager level: a mamba table longer than the tokens asked for (after a truncation or
    a rejected speculative step) gets a NEGATIVE align-mode count from vLLM 0.33
    (``single_type_kv_cache_manager.py:1743-1795``); the coordinator adds it to the other
    groups', under-reserving them. The exact spec returns the same count, the spec clamps it.

    Trace: 1280 tokens allocated for a request (two mamba blocks per group), then the count for
    640 tokens, as a rolled-back request would ask."""
    trace = Trace(Layout.MAMBA_FULL, EngineSettings(16, 2048, 2), ())
    side = VllmSide(trace)  # vLLM's own KVCacheManager, built as the engine core builds it
    side.add(RequestScript("r", 1, _prompt(0, 1920), 1))
    request = side.requests["r"]
    manager = side.scheduler.kv_cache_manager
    assert manager.allocate_slots(request, 1280) is not None
    empty = manager.empty_kv_cache_blocks.blocks
    vllm_count = manager.coordinator.get_num_blocks_to_allocate(
        request_id="r",
        num_tokens=640,
        new_computed_blocks=empty,
        num_encoder_tokens=0,
        total_computed_tokens=640,
        num_local_computed_tokens=640,
        num_tokens_main_model=640,
    )
    groups = RECIPES[Layout.MAMBA_FULL].spec_groups()
    counts = {}
    for name, coordinator in (
        ("exact", _ExactCoordinator(groups, 16)),
        ("spec", KVCacheCoordinator(groups, 16)),
    ):
        coordinator.allocate_slots("r", 1280)
        counts[name] = sum(
            m.get_num_blocks_to_allocate(
                "r",
                640,
                (),
                total_computed_tokens=640,
                num_local_computed_tokens=640,
                pool=coordinator.pool,
            )
            for m in coordinator.managers
        )
    assert vllm_count == counts["exact"] == -3  # -1 per mamba group, 0 for full attention
    assert counts["spec"] == 0


# ------------------------------------------------------------------------------------- D2
def test_d2_unaligned_claim_is_floored() -> None:
    """D2: vLLM takes an async claim of 33 tokens as is (the load ends mid-block); the spec
    floors it to the 32-token claim unit. Observation: the tokens accepted and the count
    ``update_state_after_alloc`` is called with, step 1."""
    trace = Trace(
        FULL,
        EngineSettings(20, 128, 2),
        (
            RequestScript(
                "r0",
                1,
                _prompt(100, 100),
                1,
                claims=(ClaimScript(ClaimMode.ASYNC, 1, offset_tokens=1),),
            ),
        ),
    )
    vllm, spec = _runs(trace, vllm_exact=False)
    vllm_claims = vllm.at(1, Phase.SCHEDULE).claims
    spec_claims = spec.at(1, Phase.SCHEDULE).claims
    assert [(c.claimed, c.accepted) for c in vllm_claims] == [(33, 33)]
    assert [(c.claimed, c.accepted) for c in spec_claims] == [(33, 32)]


def test_d2_sync_claim_of_every_token_is_capped() -> None:
    """D2: a sync claim of all 64 tokens trips vLLM's ``assert num_new_tokens > 0``
    (``scheduler.py:1331``) inside ``schedule()`` (the exact spec raises
    ``ConnectorContractError`` at the same call); the spec caps it one unit lower and schedules
    the rest."""
    trace = Trace(
        FULL,
        EngineSettings(20, 128, 2),
        (
            RequestScript(
                "r0",
                1,
                _prompt(100, 2 * U),
                1,
                claims=(ClaimScript(ClaimMode.SYNC, 2, capped=False),),
            ),
        ),
    )
    exact = run_lockstep(trace, SpecSide(trace), VllmSide(trace))
    assert exact.crash is not None
    assert (exact.crash.step, exact.crash.call) == (1, "schedule")
    assert type(exact.crash.right) is AssertionError
    assert type(exact.crash.left).__name__ == "ConnectorContractError"
    spec = run_alone(trace, SpecSide(trace, vllm_exact=False))
    assert spec.error is None
    assert spec.at(1, Phase.SCHEDULE).scheduled == (("r0", U),)


# ------------------------------------------------------------------------------------- D3
def test_d3_load_that_never_reports_is_abandoned() -> None:
    """D3: a load whose report never comes keeps the request in WAITING_FOR_REMOTE_KVS forever
    in vLLM (#49829); with a 3-step deadline the spec abandons it at step 5, restarts the
    request from 0 and finishes it. Observation: the request's status."""
    trace = Trace(
        FULL,
        EngineSettings(20, 128, 2),
        (
            RequestScript(
                "r0",
                1,
                _prompt(100, 96),
                1,
                claims=(ClaimScript(ClaimMode.ASYNC, 1),),
                loads=(LoadScript(None),),
            ),
        ),
        max_steps=12,
    )
    vllm, spec = _runs(trace, vllm_exact=False, load_deadline_steps=3)
    assert _status(vllm, 12, Phase.UPDATE, "r0") == "waiting_for_remote_kvs"
    assert _status(spec, 4, Phase.SCHEDULE, "r0") == "waiting_for_remote_kvs"
    assert _status(spec, 5, Phase.SCHEDULE, "r0") == "running"
    assert spec.observations[-1].requests[0].status == "finished_length"


# ------------------------------------------------------------------------------------- D4
def test_d4_every_admission_leaves_the_async_reserve_alone() -> None:
    """D4: r0's async load is in flight and still needs 9 blocks; vLLM admits r1 (7 blocks,
    no claim) into the 15 free blocks, eating that reserve (#48433); the spec subtracts the
    reserve from every admission and keeps r1 waiting. Observation: step 2's schedule."""
    trace = Trace(
        FULL,
        EngineSettings(17, 256, 2),
        (
            RequestScript(
                "r0",
                1,
                _prompt(100, 10 * U),
                1,
                claims=(ClaimScript(ClaimMode.ASYNC, 1),),
                loads=(LoadScript(5),),
            ),
            RequestScript("r1", 2, _prompt(5000, 7 * U), 1),
        ),
    )
    vllm, spec = _runs(trace, vllm_exact=False)
    assert vllm.at(2, Phase.SCHEDULE).scheduled == (("r1", 7 * U),)
    assert spec.at(2, Phase.SCHEDULE).scheduled == ()
    assert _status(spec, 2, Phase.SCHEDULE, "r1") == "waiting"


# ------------------------------------------------------------------------------------- D5
def test_d5_delayed_free_waits_for_every_holder() -> None:
    """D5: r0 is aborted during its load (report due at step 5) and the connector also keeps its
    blocks for a store (``finished_sending`` at step 3). vLLM frees the blocks at the first
    report, while the load still writes them (finding F3); the spec frees them at the last.
    Observation: free blocks after step 3's update (and vLLM's assert at step 5, F3)."""
    trace = abort_during_load_with_store_hold()
    vllm, spec = _runs(trace, vllm_exact=False)
    held = 2  # the two blocks the load writes
    assert (
        vllm.at(3, Phase.UPDATE).num_free_blocks == spec.at(3, Phase.UPDATE).num_free_blocks + held
    )
    assert spec.at(3, Phase.UPDATE).tables == (("r0", ((1, 2),)),)
    assert vllm.error_at == (5, "update_from_output")
    assert spec.error is None
    assert spec.at(5, Phase.UPDATE).tables == ()


# ------------------------------------------------------------------------------------- D6
def test_d6_block_level_failure_truncates_every_group() -> None:
    """D6: a load reports its last claim unit invalid, block by block, on a three-group layout.
    vLLM 0.33 raises RuntimeError from ``update_from_output`` (``scheduler.py:3712-3721``; the
    exact spec raises ``BlockLevelReportError`` at the same call); shared truncation keeps the
    valid unit in every group and resumes there. Observation: step 2's update."""
    layout = Layout.THREE_GROUPS
    trace = Trace(
        layout,
        EngineSettings(40, 128, 2),
        (
            RequestScript(
                "r0",
                1,
                _prompt(100, 96),
                1,
                claims=(ClaimScript(ClaimMode.ASYNC, 2),),
                loads=(LoadScript(1, block_level=True, valid_units=1),),
            ),
        ),
    )
    exact = run_lockstep(trace, SpecSide(trace), VllmSide(trace))
    assert exact.crash is not None
    assert (exact.crash.step, exact.crash.call) == (2, "update_from_output")
    assert "block-level load failures" in str(exact.crash.right)
    assert type(exact.crash.left).__name__ == "BlockLevelReportError"
    spec = run_alone(
        trace, SpecSide(trace, vllm_exact=False, recovery=RecoveryMode.SHARED_TRUNCATION)
    )
    (recovery,) = spec.at(2, Phase.UPDATE).recoveries
    assert (recovery.computed_before, recovery.resume_at) == (2 * U, U)
    assert spec.observations[-1].requests[0].status == "finished_length"


# ------------------------------------------------------------------------------------- D7
def test_d7_no_new_claim_while_an_abandoned_load_is_outstanding() -> None:
    """D7: r0's load reports a failure only at step 7. vLLM waits, recomputes and asks the
    connector again (a second claim, a second load); the spec abandons the load at its 2-step
    deadline and restarts WITHOUT asking while the abandoned load is outstanding. Observation:
    the connector is asked twice by vLLM, once by the spec."""
    trace = Trace(
        FULL,
        EngineSettings(20, 128, 2),
        (
            RequestScript(
                "r0",
                1,
                _prompt(100, 96),
                1,
                claims=(ClaimScript(ClaimMode.ASYNC, 1), ClaimScript(ClaimMode.ASYNC, 1)),
                loads=(LoadScript(6, fails=True),),
            ),
        ),
    )
    vllm, spec = _runs(trace, vllm_exact=False, load_deadline_steps=2)

    def asks(run: SoloRun) -> int:
        return sum(
            1
            for obs in run.observations
            for call in obs.hooks
            if call.hook is Hook.GET_NUM_NEW_MATCHED_TOKENS
        )

    assert asks(vllm) == 2
    assert asks(spec) == 1


# ------------------------------------------------------------------------------------- D8
def test_d8_external_mamba_state_is_reserved() -> None:
    """D8: two sync claims on the mamba layout. vLLM reserves one mamba block per group for r1
    but takes two, and with no slack left ``get_new_blocks`` raises in step 1 (finding F1); the
    spec reserves both, finds no room for r1 and admits it once r0 is done. Observation: step
    1's schedule."""
    trace = mamba_sync_claims()
    vllm, spec = _runs(trace, vllm_exact=False)
    assert vllm.error_at == (1, "schedule")
    assert "free blocks" in str(vllm.error)
    assert spec.at(1, Phase.SCHEDULE).scheduled == (("r0", 640),)
    assert spec.error is None
    assert {r.status for r in spec.observations[-1].requests} == {"finished_length"}


# ------------------------------------------------------------------------------------- D9
def test_d9_admission_is_not_gated_by_its_own_reservation() -> None:
    """D9: after its failed load, r0 is still in vLLM's in-flight prefill set, so its new async
    claim is gated by its own 15-block reservation: 16 free - 15 < 2 blocks, refused every step
    (finding F2). The spec reserves for the other in-flight prefills only and admits it at
    step 3. Observation: r0's status from step 3 on."""
    trace = failed_load_reclaimed()
    vllm, spec = _runs(trace, vllm_exact=False)
    assert _status(vllm, 3, Phase.SCHEDULE, "r0") == "waiting"
    assert _status(vllm, 30, Phase.UPDATE, "r0") == "waiting"
    assert _status(spec, 3, Phase.SCHEDULE, "r0") == "waiting_for_remote_kvs"
    assert spec.observations[-1].requests[0].status == "finished_length"
