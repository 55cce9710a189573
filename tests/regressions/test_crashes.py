"""Crashes: asserts and unpacks that killed the engine on hybrid layouts.

Scenario: each test replays one field crash as a script of engine (or scheduler) events. The
correct model runs the same script to the end with every invariant holding and the outcome
derived by hand; the broken variant either raises what vLLM raised (the crash itself is the
observation) or, where the crash was "fixed" by silently doing the wrong thing, breaks the
named invariant.

Geometry: block 2, hash block 2, chunk 2 (every claim and truncation point is even).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import ClassVar

import pytest
from regression_script import (
    Script,
    config,
    expected_token,
    full,
    mamba,
    request,
    sliding,
)

import spec.system.parts as parts_module
from spec.block_pool import BlockId
from spec.connector import ReferenceConnector
from spec.connector_api import Claim, ClaimKind, KVConnectorOutput, RequestId, RequestView
from spec.invariants import check_all
from spec.kinds import GroupKind
from spec.managers import KVCacheCoordinator, MambaManager, SingleTypeManager
from spec.managers.group_spec import cdiv
from spec.scheduler import (
    BlockLevelReportError,
    FailureReport,
    RecoveryMode,
    RecoveryRecord,
    Request,
    Scheduler,
    SchedulerConfig,
)
from spec.scheduler.recovery import shared_truncation
from spec.scheduler.request import RequestStatus

SHARED = RecoveryMode.SHARED_TRUNCATION
P9 = tuple(range(1, 10))


# --------------------------------------------------------------------------------------------
# #45268 / #45407: "External KV connector is not verified yet" -> the alignment contract #42554


class BannedExternalClaims(Scheduler):
    """Before #42554: the mamba-aligned split refused any external tokens (an assert)."""

    def _plan(self, r, claims):  # type: ignore[no-untyped-def]
        plan = super()._plan(r, claims)
        if plan is not None and plan.num_external and self.config.needs_mamba_split:
            raise AssertionError("External KV connector is not verified yet")
        return plan


def _host_hit(**kw: object) -> Script:
    s = Script(config((full(), mamba()), [request("r0", P9)]), **kw)  # type: ignore[arg-type]
    s.seed("r0", 8)  # every group's units up to 8: the state at 8 included
    s.arrive("r0")
    s.step()
    s.run()
    return s


def test_external_claim_on_a_mamba_layout_is_allowed_when_aligned() -> None:
    """Scenario (#45268/#45407): a hybrid model with a connector; the host holds the first 8
    tokens of r0's 9-token prompt in every group. vLLM asserted in ``_mamba_block_aligned_split``
    that no external token was claimed, killing the engine on the first host hit; the contract
    that replaced the ban (#42554) only asks the claim to end where a state exists."""
    s = _host_hit()
    assert s.broken() == set()
    [claim] = s.claims("r0")
    assert claim.accepted == 8  # every group restorable at 8, the last claimable position
    assert s.scheduled("r0") == [(8, 1), (9, 1)]
    assert s.tokens("r0") == (expected_token("r0", 9), expected_token("r0", 10))

    with pytest.raises(AssertionError, match="not verified yet"):
        _host_hit(scheduler_cls=BannedExternalClaims)


class OneTokenPastTheState(ReferenceConnector):
    """Claims one token more than the reference connector would: an end with no mamba state."""

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> Claim:
        claim = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if claim.kind in (ClaimKind.ASYNC, ClaimKind.SYNC):
            return replace(claim, num_tokens=claim.num_tokens + 1)
        return claim


def _unaligned(*, vllm_exact: bool) -> Script:
    cfg = config((full(), mamba()), [request("r0", P9)], vllm_exact=vllm_exact)
    s = Script(cfg, connector_cls=OneTokenPastTheState)
    s.seed("r0", 4)  # attention 2, 4 and the state at 4: the reference claims 4
    s.arrive("r0")
    s.step()
    s.run()
    return s


@pytest.mark.mutation("MB-3", "MB-1", "DATA-1")
def test_sc1_unaligned_external_claim_is_floored_to_the_claim_unit() -> None:
    """Scenario (#42554, the alignment contract): a connector answers 5 where the state exists
    only at 4. The scheduler must take only the aligned part (4, divergence D2); vLLM 0.33
    takes 5 as it is (it asserts nothing about external alignment), so the load ends at 5,
    restores no state there, and the request resumes on garbage."""
    s = _unaligned(vllm_exact=False)
    assert s.broken() == set()
    [claim] = s.claims("r0")
    assert (claim.claimed, claim.accepted) == (5, 4)
    assert s.scheduled("r0") == [(4, 4), (8, 1), (9, 1)]

    exact = _unaligned(vllm_exact=True)
    assert exact.claims("r0")[0].accepted == 5
    assert {"SC-1", "MB-3", "MB-1", "DATA-1"} <= exact.broken()
    assert "claim ends at 5, not a multiple of 2" in exact.first("SC-1").messages[0]


# --------------------------------------------------------------------------------------------
# #50687: `_update_requests_with_invalid_blocks` -> ValueError: too many values to unpack


class UnpackOneGroup(Scheduler):
    """The single-group recovery code run on a multi-group layout (``(blocks,) = ...``)."""

    def _recover_load(self, rid: RequestId, report: FailureReport | None) -> RecoveryRecord:
        (_blocks,) = self.kv.get_blocks(rid)  # the single-group unpack of vLLM 0.33
        return super()._recover_load(rid, report)


class TruncateGroupZeroOnly(Scheduler):
    """A per-group recovery that truncates at group 0's point and ignores the others."""

    def _recover_load(self, rid: RequestId, report: FailureReport | None) -> RecoveryRecord:
        record = super()._recover_load(rid, report)
        invalid = report.invalid_blocks if report else frozenset()
        point = shared_truncation(
            self.config.groups[:1],
            self.kv.get_blocks(rid)[:1],
            invalid,
            record.computed_before,
            self.kv.scheduler_block_size,
        ).point
        self.requests[rid] = self.requests[rid].evolve(num_computed_tokens=point)
        return replace(record, truncated_to=point)


def _third_segment_fails(groups: tuple, **kw: object) -> Script:
    recovery = kw.pop("recovery", SHARED)
    cfg = config(groups, [request("r0", P9)], recovery=recovery)  # type: ignore[arg-type]
    s = Script(cfg, **kw)  # type: ignore[arg-type]
    s.seed("r0", 8)
    s.arrive("r0")
    s.step()  # claims 8: four load jobs, one per 2-token segment
    s.complete("r0", index=0)  # [0, 2) lands
    s.complete("r0", index=0)  # [2, 4) lands
    s.complete("r0", index=0, ok=False)  # [4, 6) fails
    s.complete("r0")  # [6, 8) lands
    s.step()  # the report and the recovery
    s.run()
    return s


def test_block_level_failure_truncates_every_group_at_one_point() -> None:
    """Scenario (#50687): full attention + a sliding window of 8; the load of r0's 8 claimed
    tokens fails in its third segment [4, 6). The block-level report names that segment's
    blocks in BOTH groups; every group keeps [0, 4) and r0 computes from 4. vLLM's recovery
    code unpacks one group's blocks and dies with ``ValueError``; vLLM 0.33 refuses the report
    on a multi-group layout with ``RuntimeError``."""
    groups = (full(), sliding(window=8))
    s = _third_segment_fails(groups)
    assert s.broken() == set()
    assert s.counter("tokens_discarded_by_recovery") == 4  # 8 claimed, 4 kept
    assert s.counter("num_recoveries") == 1
    assert len(s.claims("r0")) == 1  # nothing is asked again: the prefix stays in place
    # From 4: [4, 9) in one step (no mamba split), then a decode step.
    assert s.scheduled("r0") == [(4, 5), (9, 1)]
    assert s.tokens("r0") == (expected_token("r0", 9), expected_token("r0", 10))

    with pytest.raises(ValueError, match="too many values to unpack"):
        _third_segment_fails(groups, scheduler_cls=UnpackOneGroup)


def test_vllm_033_refuses_block_level_reports_on_two_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Scenario (#50687, as vLLM 0.33 "fails closed"): the same failure reported per block under
    vLLM's recovery raises ``RuntimeError`` from ``update_from_output`` (an engine error), so a
    connector must report ``failed_recving`` only; the reference connector does, and the
    request is recomputed from 0 (asking the host again for the part before the bad segment)."""
    groups = (full(), sliding(window=8))
    s = _third_segment_fails(groups, recovery=RecoveryMode.VLLM_RECOMPUTE)
    assert s.broken() == set()
    assert s.counter("tokens_discarded_by_recovery") == 8
    # The re-ask avoids the failed segment's keys: 4 tokens load again, [4, 9) is computed.
    assert [c.accepted for c in s.claims("r0")] == [8, 4]
    assert s.scheduled("r0") == [(4, 5), (9, 1)]

    def every_report(scheduler: Scheduler, errors: dict) -> tuple:  # type: ignore[type-arg]
        return tuple(FailureReport(rid, frozenset(map(BlockId, b))) for rid, b in errors.items())

    monkeypatch.setattr(parts_module, "failure_reports", every_report)
    with pytest.raises(BlockLevelReportError, match="several KV cache groups"):
        _third_segment_fails(groups, recovery=RecoveryMode.VLLM_RECOMPUTE)


@pytest.mark.mutation("DATA-1")
def test_sc4_per_group_truncation_must_agree_on_the_state() -> None:
    """Scenario (#50687 class, the per-group proposal done wrong): full attention + mamba, the
    third segment fails. Full attention alone could keep [0, 4), but the only mamba state r0
    holds is the one at 8 (an external claim gets one state block, at its end), and attention
    is invalid from 4 on: no point above 0 has both, so every group truncates to 0. Truncating
    at group 0's point resumes at 4 on a mamba slot nothing wrote."""
    groups = (full(), mamba())
    s = _third_segment_fails(groups)
    assert s.broken() == set()
    assert s.counter("tokens_discarded_by_recovery") == 8
    # Truncated to 0, r0 asks again and gets the first two segments (state at 4 included).
    assert [c.accepted for c in s.claims("r0")] == [8, 4]
    assert s.scheduled("r0") == [(4, 4), (8, 1), (9, 1)]

    broken = _third_segment_fails(groups, scheduler_cls=TruncateGroupZeroOnly)
    assert {"SC-4", "DATA-1"} <= broken.broken()
    assert "truncated to 4, group 1 valid only at (0,)" in broken.first("SC-4").messages[0]


# --------------------------------------------------------------------------------------------
# After a truncation the mamba manager asserted `num_required_blocks > len(req_blocks)` ("39 < 40")


class AssertingMamba(MambaManager):
    """The align-mode allocation before the fix: a table must always grow."""

    def allocate_new_blocks(self, request_id, num_tokens, pool):  # type: ignore[no-untyped-def]
        required = cdiv(num_tokens, self.block_size) + self.spec.num_speculative_blocks
        held = len(self.req_to_blocks.get(request_id, ()))
        assert required > held, (
            f"{required} < {held}" if required < held else f"{required} = {held}"
        )
        return super().allocate_new_blocks(request_id, num_tokens, pool)


class _AssertingCoordinator(KVCacheCoordinator):
    manager_classes: ClassVar[Mapping[GroupKind, type[SingleTypeManager]]] = {
        **KVCacheCoordinator.manager_classes,
        GroupKind.MAMBA: AssertingMamba,
    }


class AssertingScheduler(Scheduler):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.kv = _AssertingCoordinator(self.config.groups, self.config.num_blocks)
        self.bind_connector(self.connector)


def _truncate_a_running_request(cls: type[Scheduler]) -> Scheduler:
    """Scheduler-level script (no connector): r0 (10 tokens) runs [0, 4), [4, 8), [8, 10);
    then a block-level report says the full-attention block of tokens 8..9 holds garbage."""
    cfg = SchedulerConfig(
        groups=(full(), mamba()),
        num_blocks=32,
        max_num_batched_tokens=4,
        max_num_running=2,
        hash_block_size=2,
        recovery=SHARED,
    )
    s = cls(cfg, None)
    s.add_request(Request(RequestId("r0"), tuple(range(1, 11)), 3))
    for _ in range(2):
        out = s.schedule()
        s.update_from_output(out, {}, KVConnectorOutput())
    out = s.schedule()  # [8, 10): the prefill completes, one token is sampled
    bad = s.kv.get_blocks(RequestId("r0"))[0][-1]
    report = FailureReport(RequestId("r0"), frozenset({bad}))
    s.update_from_output(out, {RequestId("r0"): 7}, KVConnectorOutput(), (report,))
    return s


def test_mamba_allocates_nothing_after_a_truncation() -> None:
    """Scenario ("39 < 40"): shared truncation puts a running request back to an earlier point.
    Its mamba table already has the positions the next chunk needs, so the next allocation must
    take nothing. A manager that asserts the table always grows kills the engine there."""
    s = _truncate_a_running_request(Scheduler)
    # Tables after [8, 10): full (5 blocks), mamba (null x3, state at 8, state at 10). Bad full
    # block of tokens 8..9: full bound 8; the state at 8 (slot 3) is real and valid: point 8.
    [record] = s.recoveries
    assert (record.computed_before, record.truncated_to) == (10, 8)
    assert s.requests[RequestId("r0")].status is RequestStatus.RUNNING
    mamba_table = s.kv.get_blocks(RequestId("r0"))[1]
    free_before = s.kv.pool.get_num_free_blocks()
    out = s.schedule()
    # From 8: the mamba split stops at the last boundary before the last token (11 tokens:
    # 10), so [8, 10) again; cdiv(10, 2) = 5 mamba positions = the table's 5: nothing taken.
    assert [(x.num_computed_tokens, x.num_scheduled_tokens) for x in out.scheduled] == [(8, 2)]
    assert s.kv.get_blocks(RequestId("r0"))[1] == mamba_table
    assert s.kv.pool.get_num_free_blocks() == free_before
    snap = s.snapshot()
    assert check_all("scheduler", snap) == {}
    assert check_all("kv_cache_groups", snap["kv_cache_groups"]) == {}

    broken = _truncate_a_running_request(AssertingScheduler)
    with pytest.raises(AssertionError, match="5 = 5"):
        broken.schedule()
