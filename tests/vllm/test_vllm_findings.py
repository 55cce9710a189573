"""Findings: traces on which vLLM 0.33 itself breaks one of our invariants.

Each test keeps a shrunk trace (:mod:`diffharness.findings`) and pins what vLLM 0.33 does on
it, marked ``known_vllm_behaviour``: if a vLLM release changes the behaviour, the test fails and
the finding is re-examined (``docs/explanation/vllm-differential.md`` describes each). On every
one the spec in its vLLM-exact mode agrees with vLLM step by step, and names the invariant.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vLLM 0.33 (run `nox -s vllm`)")

from diffharness.findings import (
    FINDINGS,
    abort_during_load_with_store_hold,
    classify,
    failed_load_reclaimed,
    mamba_sync_claims,
)
from diffharness.lockstep import run_lockstep
from diffharness.observe import Phase
from diffharness.spec_side import SpecSide
from diffharness.vllm_side import VllmSide

from spec.errors import ConfigError, InvariantViolation
from spec.invariants import check_all

pytestmark = [pytest.mark.vllm, pytest.mark.known_vllm_behaviour]


def test_findings_are_catalogued_once() -> None:
    ids = [f.finding_id for f in FINDINGS]
    assert ids == [f"F{i}" for i in range(1, len(ids) + 1)]


def test_f1_mamba_sync_claim_under_reserves_and_crashes_schedule() -> None:
    """F1 (GR-7): vLLM's ``get_new_blocks`` raises ``ValueError`` inside ``schedule()``; the
    exact spec stops at the same call naming GR-7 (a group took more blocks than it reserved)."""
    trace = mamba_sync_claims()
    result = run_lockstep(trace, SpecSide(trace), VllmSide(trace))
    assert result.crash is not None
    assert (result.crash.step, result.crash.call) == (1, "schedule")
    assert isinstance(result.crash.right, ValueError)
    assert "Cannot get 1 free blocks from the pool" in str(result.crash.right)
    assert isinstance(result.crash.left, InvariantViolation)
    assert result.crash.left.invariant_id == "GR-7"
    finding = classify(result.crash)
    assert finding is not None
    assert finding.finding_id == "F1"


def test_f2_failed_load_reclaimed_waits_forever() -> None:
    """F2 (SC-3): after its failed load the request is refused at every step for 28 steps while
    the pool is otherwise empty; both sides agree on every step, and the exact spec's liveness
    check (bound 20 steps) names SC-3."""
    trace = failed_load_reclaimed(steps=30)
    spec = SpecSide(trace, liveness_bound_steps=20)
    result = run_lockstep(trace, spec, VllmSide(trace))
    assert result.crash is None
    assert result.steps == 30
    statuses = [
        (obs.step, obs.requests[0].status)
        for obs in result.history
        if obs.phase is Phase.SCHEDULE and obs.step >= 3
    ]
    assert {status for _, status in statuses} == {"waiting"}
    assert all(obs.scheduled == () for obs in result.history if obs.step >= 3)
    last = result.history[-1]
    assert last.num_free_blocks == 16  # the whole pool is free, and still nothing is admitted
    assert "SC-3" in check_all("scheduler", spec.scheduler.snapshot())


def test_f3_early_free_then_assert_on_the_late_report() -> None:
    """F3 (TR-1): both holders of the aborted request's blocks (its load and a store) exist;
    vLLM frees the blocks at the first report (step 3, the load still writes them) and fails
    ``assert req_id in self.requests`` when the load reports (step 5). The exact spec frees at
    the same step and refuses the late report as unmatched."""
    trace = abort_during_load_with_store_hold()
    result = run_lockstep(trace, SpecSide(trace), VllmSide(trace))
    assert result.crash is not None
    assert (result.crash.step, result.crash.call) == (5, "update_from_output")
    assert type(result.crash.right) is AssertionError
    assert isinstance(result.crash.left, ConfigError)
    assert result.crash.left.field == "finished_recving"
    step3 = next(o for o in result.history if (o.step, o.phase) == (3, Phase.UPDATE))
    assert step3.tables == ()  # freed while the load (due at step 5) may still write them
    assert step3.requests[0].status == "finished_aborted"
    finding = classify(result.crash)
    assert finding is not None
    assert finding.finding_id == "F3"
