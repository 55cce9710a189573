"""Mutation evidence for every SC-* id: a deliberately broken scheduler that the id catches.

Each broken variant is a subclass (or a config switch) that reintroduces one known bug; the test
drives it with the scripted connector and asserts the predicate reports exactly that id, while
the same drive on the correct model reports nothing.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from _scheduler_fakes import (
    FULL4,
    NOTHING,
    ScriptedConnector,
    broken,
    config,
    done,
    failed,
    request,
)

from spec.connector_api import Claim, ClaimKind, RequestId
from spec.invariants import ALL_INVARIANTS
from spec.scheduler import RecoveryMode, RecoveryRecord, RequestStatus, Scheduler
from spec.scheduler.recovery import FailureReport, shared_truncation

ASYNC8 = Claim(ClaimKind.ASYNC, 8)


class _WedgeOnEmptyChunk(Scheduler):
    """The field's wedge: the async path's 0-token chunk breaks out before WFR."""

    def _stops_on_empty_chunk(self, plan: object) -> bool:
        return True


class _SingleGroupTruncation(Scheduler):
    """Truncates at group 0's point only, ignoring the other groups (the #50687 class)."""

    def _recover_load(self, rid: RequestId, report: FailureReport | None) -> RecoveryRecord:
        record = super()._recover_load(rid, report)
        tables = self.kv.get_blocks(rid)
        invalid = report.invalid_blocks if report else frozenset()
        unit = self.kv.scheduler_block_size
        point = shared_truncation(
            self.config.groups[:1], tables[:1], invalid, record.computed_before, unit
        ).point
        self.requests[rid] = self.requests[rid].evolve(num_computed_tokens=point)
        return replace(record, truncated_to=point)


class _LostPreempted(Scheduler):
    """Preemption forgets to put the victim back in the waiting queue."""

    def _preempt(self, rid: RequestId) -> None:
        super()._preempt(rid)
        self.waiting.remove(rid)


class _UncountedStatus(Scheduler):
    """Status changes that forget the hand-kept WAITING_FOR_REMOTE_KVS count."""

    def _set_status(self, rid: RequestId, status: RequestStatus, **changes: int) -> None:
        self.requests[rid] = self.requests[rid].evolve(status=status, **changes)


class _ForgottenLoad(Scheduler):
    """Enters WAITING_FOR_REMOTE_KVS without recording the load it waits for."""

    def _start_load(self, rid: RequestId, *args: object) -> None:
        super()._start_load(rid, *args)  # type: ignore[arg-type]
        del self.loads[rid]


class _LeakOnRelease(Scheduler):
    """Drops the delayed-free reason but never frees the blocks."""

    def _release(self, rid: RequestId, hold: object) -> None:
        del self.holds[rid]


class _DeadlineIgnored(Scheduler):
    """Never abandons a load, whatever its age (vLLM #49829)."""

    def _expire_loads(self) -> frozenset[RequestId]:
        return frozenset()


def _drive(s: Scheduler, steps: int, reports: dict[int, object] | None = None) -> set[str]:
    """Run ``steps`` schedule/update rounds; collect every invariant id broken on the way."""
    found: set[str] = set()
    for step in range(1, steps + 1):
        out = s.schedule()
        found |= set(broken(s))
        sampled = {
            x.request.request_id: 1
            for x in out.scheduled
            if s.requests[x.request.request_id].num_computed_tokens
            >= s.requests[x.request.request_id].num_tokens
        }
        s.update_from_output(out, sampled, (reports or {}).get(step, NOTHING))  # type: ignore[arg-type]
        found |= set(broken(s))
    return found


def _one(cls: type[Scheduler], *claims: Claim, steps: int = 3, reports=None, **kw: object):
    s = cls(config(**kw), ScriptedConnector(*claims))
    s.add_request(request("a"))
    return _drive(s, steps, reports)


def test_sc1_unaligned_claim_allowed() -> None:
    assert _one(Scheduler, Claim(ClaimKind.ASYNC, 6)) == set()  # floored to 4 (D2)
    assert "SC-1" in _one(Scheduler, Claim(ClaimKind.ASYNC, 6), vllm_exact=True)


def test_sc2_async_claim_that_breaks_out_on_its_empty_chunk() -> None:
    assert _one(Scheduler, ASYNC8, ASYNC8) == set()
    s = _WedgeOnEmptyChunk(config(), ScriptedConnector(ASYNC8, ASYNC8, ASYNC8))
    s.add_request(request("a"))
    assert "SC-2" in _drive(s, 2)
    assert s.connector.asked == [("a", 0), ("a", 0)]  # type: ignore[union-attr]  # re-claims


def test_sc3_load_that_never_reports_without_deadline() -> None:
    # With a deadline the load is abandoned at step 4; its late report (step 5) frees the
    # parked blocks and the request finishes by step 6.
    late = {5: done("a")}
    kw = {"steps": 8, "liveness_bound_steps": 6, "reports": late}
    assert _one(Scheduler, ASYNC8, load_deadline_steps=2, **kw) == set()
    # Without one (vLLM 0.33) a load that never reports leaves the request waiting forever.
    assert "SC-3" in _one(Scheduler, ASYNC8, steps=8, liveness_bound_steps=6)


def test_sc4_single_group_truncation_on_two_groups() -> None:
    # Invalid mamba state (block 3): full alone would keep 8, mamba can resume only at 0.
    reports = {1: failed("a")}
    mode = RecoveryMode.SHARED_TRUNCATION
    for cls, expect in ((Scheduler, False), (_SingleGroupTruncation, True)):
        s = cls(config(recovery=mode), ScriptedConnector(ASYNC8))
        s.add_request(request("a"))
        out = s.schedule()
        s.update_from_output(out, {}, reports[1], (FailureReport("a", frozenset({3})),))
        assert ("SC-4" in broken(s)) is expect


def test_sc5_preempted_request_lost_from_the_queues() -> None:
    def two(cls: type[Scheduler]) -> set[str]:
        s = cls(config(FULL4, num_blocks=5), None)
        s.add_request(request("a", 8, max_tokens=3))
        s.add_request(request("b", 8, max_tokens=3, cache_salt="b"))
        return _drive(s, 2)

    assert two(Scheduler) == set()
    assert "SC-5" in two(_LostPreempted)


def test_sc6_hand_kept_count_not_updated() -> None:
    assert "SC-6" in _one(_UncountedStatus, ASYNC8, steps=1)


def test_sc7_waiting_for_remote_kvs_without_a_load() -> None:
    assert "SC-7" in _one(_ForgottenLoad, ASYNC8, steps=1)


def test_sc8_finished_request_keeps_blocks_without_reason() -> None:
    conn = ScriptedConnector(ASYNC8)
    s = _LeakOnRelease(config(), conn)
    s.add_request(request("a"))
    out = s.schedule()
    s.abort_request("a")
    s.update_from_output(out, {}, done("a"))
    assert "SC-8" in broken(s)


def test_sc9_deadline_ignored() -> None:
    found = _one(_DeadlineIgnored, ASYNC8, steps=5, load_deadline_steps=2)
    assert "SC-9" in found


@pytest.mark.parametrize("inv_id", sorted(i for i in ALL_INVARIANTS if i.startswith("SC-")))
def test_every_sc_id_has_a_mutation_test(inv_id: str) -> None:
    """Here, or for the pool's liveness (SC-10..12: the scheduler model has no pool to fill)
    in the pool model's mutations of ``test_explorer_mutations``."""
    import test_explorer_mutations

    number = inv_id.split("-")[1]
    names = (*globals(), *vars(test_explorer_mutations))
    assert any(name.startswith(f"test_sc{number}_") for name in names)
