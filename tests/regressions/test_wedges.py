"""Wedges: requests that stop making progress while the engine keeps stepping.

Scenario: each test replays one liveness bug of the field as a script of engine events. The
scheduler's liveness bound (``liveness_bound_steps``, SC-3) turns "never finishes" into a
checked invariant: a request unfinished for more steps than the bound is a violation. The
correct model finishes every request (tokens and statuses derived by hand); the broken variant
is caught by SC-3, or by the id named in the test.

Geometry: full attention + mamba, block 2, hash block 2, chunk 2; every job the engine starts
completes before the next step unless the script says otherwise.
"""

from __future__ import annotations

import pytest
from regression_script import Script, config, expected_token, full, mamba, request

from spec.scheduler.scheduler import Scheduler

FULL_MAMBA = (full(), mamba())
P9 = tuple(range(1, 10))
Q9 = tuple(range(21, 30))


def _steps(s: Script, n: int) -> None:
    """``n`` times: every job in flight completes, then a step."""
    for _ in range(n):
        s.complete_all()
        s.step()


# --------------------------------------------------------------------------------------------
# The async-claim wedge: the mamba split floors an async claim's 0 new tokens and breaks out


class WedgeOnEmptyChunk(Scheduler):
    """An empty chunk ends admissions even for an async load (which by design schedules 0 new
    tokens): the request never reaches WAITING_FOR_REMOTE_KVS and claims again next step."""

    def _stops_on_empty_chunk(self, plan: object) -> bool:
        return True


def _async_claim(scheduler: type[Scheduler] | None) -> Script:
    cfg = config(FULL_MAMBA, [request("r0", P9)], liveness_bound_steps=6)
    s = Script(cfg, scheduler_cls=scheduler)
    s.seed("r0", 8)
    s.arrive("r0")
    _steps(s, 8)
    return s


@pytest.mark.mutation("SC-3")
def test_sc2_async_claim_waits_for_remote_kvs_in_its_step() -> None:
    """Scenario (the field's async-claim wedge): r0's 8 host tokens are claimed asynchronously,
    so the step schedules 0 new tokens for it. The request must enter WAITING_FOR_REMOTE_KVS in
    that step. Flooring the 0 to a block boundary and breaking out first leaves it WAITING: it
    claims the same prefix every step, forever."""
    s = _async_claim(None)
    assert s.broken() == set()
    [claim] = s.claims("r0")  # asked once
    assert claim.outcome.value == "waiting_for_remote_kvs"
    assert s.scheduled("r0") == [(8, 1), (9, 1)]
    assert s.tokens("r0") == (expected_token("r0", 9), expected_token("r0", 10))

    broken = _async_claim(WedgeOnEmptyChunk)
    claims = broken.claims("r0")
    assert len(claims) == 8  # one claim per step, never a load
    assert {c.outcome.value for c in claims} == {"no_progress"}
    assert broken.status("r0") == "WAITING"
    assert broken.first("SC-2").event == "step 1"
    # Unfinished after 7 steps with a bound of 6: SC-3.
    assert broken.first("SC-3").event == "step 7"


# --------------------------------------------------------------------------------------------
# #45387 / #45388: permanent deadlock (Running=0, Waiting=N) without a reserve for async loads


def _two_async_loads(num_blocks: int, **kw: object) -> Script:
    cfg = config(
        FULL_MAMBA,
        [request("r0", P9), request("r1", Q9)],
        num_blocks=num_blocks,
        liveness_bound_steps=10,
        **kw,
    )
    s = Script(cfg)
    s.seed("r0", 8)
    s.seed("r1", 8)
    s.arrive("r0", "r1")
    _steps(s, 14)
    return s


def test_sc3_async_loads_reserve_what_in_flight_prefills_still_need() -> None:
    """Scenario (#45387/#45388, fixed by the reserve of #44560): 10 usable blocks; r0 and r1 both
    claim 8 host tokens. A claim of 8 takes 4 attention blocks and 1 state block; after its load
    each request needs 2 more (attention block 4 and the next state). Admitting both loads
    leaves 0 free blocks: both loads land, neither can allocate its last token, nothing runs,
    nothing can be preempted. With the reserve, r1 waits (NO_SPACE) until r0 finished."""
    s = _two_async_loads(11)
    assert s.broken() == set()
    assert [c.outcome.value for c in s.claims("r1")][:2] == ["no_space", "no_space"]
    assert s.claims("r1")[-1].outcome.value == "waiting_for_remote_kvs"
    for rid in ("r0", "r1"):
        assert s.status(rid) == "FINISHED_LENGTH"
        assert s.tokens(rid) == (expected_token(rid, 9), expected_token(rid, 10))

    broken = _two_async_loads(11, reserve_for_async_loads=False)
    assert [c.outcome.value for c in broken.claims("r1")] == ["waiting_for_remote_kvs"]
    sched = broken.engine.scheduler
    assert (sched.running, sorted(sched.kv_holding)) == ([], ["r0", "r1"])  # Running=0
    assert sched.kv.pool.get_num_free_blocks() == 0
    assert "SC-3" in broken.broken()
    assert broken.scheduled("r0") == broken.scheduled("r1") == []


def test_two_admitted_async_loads_finish_under_vllm_033_rules() -> None:
    """Scenario (the one below, under vLLM 0.33's rules, ``vllm_exact``): with 12 usable
    blocks both loads are admitted (r1's 5 blocks fit in 7 free minus r0's reserve of 2); r0's
    resumption is not gated by any reserve, so it takes the last 2 blocks, finishes, and r1
    follows."""
    exact = _two_async_loads(13, vllm_exact=True)
    assert exact.broken() == set()
    assert [c.outcome.value for c in exact.claims("r1")] == ["waiting_for_remote_kvs"]
    for rid in ("r0", "r1"):
        assert exact.tokens(rid) == (expected_token(rid, 9), expected_token(rid, 10))


class GatesResumption(Scheduler):
    """The first cut of our D4: every admission, a resumption after its own load included,
    leaves the other in-flight prefills' reserve alone."""

    def _reserves(self, r, plan):  # type: ignore[no-untyped-def]
        return bool(self.config.reserve_for_async_loads)


def _two_resuming_loads(scheduler: type[Scheduler] | None = None) -> Script:
    cfg = config(
        FULL_MAMBA, [request("r0", P9), request("r1", Q9)], num_blocks=13, liveness_bound_steps=10
    )
    s = Script(cfg, scheduler_cls=scheduler)
    s.seed("r0", 8)
    s.seed("r1", 8)
    s.arrive("r0", "r1")
    _steps(s, 14)
    return s


def test_sc3_two_admitted_async_loads_do_not_wait_for_each_others_reserve() -> None:
    """Scenario (found by the random engine search while building these tests): 12 usable
    blocks. r0 claims 8 (takes 5 blocks; needs 2 more later); r1's admission sees 7 free minus
    r0's reserve of 2 = 5, exactly its 5: both loads are admitted, 2 blocks stay free. When
    r0's load lands it needs those 2. Gating its resumption on r1's reserve (2) leaves 0, so
    r0 stops and r1 behind it never gets a turn: SC-3 after 10 steps. The reserve protects
    admitted prefills from NEW admissions; a request that already holds its computed KV is not
    gated (vLLM 0.33 gates async admissions only), so r0 resumes and both finish."""
    s = _two_resuming_loads()
    assert [c.outcome.value for c in s.claims("r1")] == ["waiting_for_remote_kvs"]
    assert s.broken() == set()
    assert {s.status("r0"), s.status("r1")} == {"FINISHED_LENGTH"}

    broken = _two_resuming_loads(GatesResumption)
    assert "SC-3" in broken.broken()
    assert broken.status("r0") == "WAITING"  # its load landed; it waits on r1's reserve


class StopsOnTheReserve(Scheduler):
    """The first cut of our D4, second flaw: a new admission the reserve turns away stops the
    step (FCFS), even when the prefill the reserve protects waits behind it."""

    def _refusal(self, got, reserved):  # type: ignore[no-untyped-def]
        return super()._refusal(got, 0)


def _restart_before_a_landed_load(scheduler: type[Scheduler] | None = None) -> Script:
    cfg = config(
        FULL_MAMBA,
        [request("r0", P9, 1), request("r1", P9, 1)],
        num_blocks=12,
        budget=8,
        store_capacity=4,
        liveness_bound_steps=10,
    )
    s = Script(cfg, scheduler_cls=scheduler)
    s.seed("r0", 2)
    s.arrive("r0")
    s.step()  # r0 claims the 2 host tokens and waits for its load
    s.arrive("r1")
    s.complete("r0", ok=False)  # r0's load fails: recompute restarts it from 0
    _steps(s, 12)
    return s


def test_sc3_a_request_the_reserve_turns_away_does_not_hold_back_the_prefill_it_protects() -> None:
    """Scenario (found by tests/stateful's liveness machine): full + mamba, 11 usable blocks.
    r0 claims 2 host tokens and waits; r1 (the same prompt) claims them too and waits. r0's load
    fails and it restarts from 0, at the head of the queue, now a NEW admission: the reserve
    for r1 (still to prefill 7 tokens) leaves it too little. Stopping the step there (FCFS) keeps
    r1 behind it; r1's landed load never resumes, r1's reserve never shrinks, and nothing runs
    again: SC-3. A request the reserve alone turned away keeps its place but lets requests that
    already hold their computed KV resume behind it; new admissions still wait (FCFS)."""
    s = _restart_before_a_landed_load()
    assert s.broken() == set()
    assert {s.status("r0"), s.status("r1")} == {"FINISHED_LENGTH"}

    broken = _restart_before_a_landed_load(StopsOnTheReserve)
    assert "SC-3" in broken.broken()
    assert broken.status("r1") == "WAITING_FOR_REMOTE_KVS"  # its load landed long ago


# --------------------------------------------------------------------------------------------
# #48433: other admissions ate the reserve


def _load_then_plain(**kw: object) -> Script:
    cfg = config(FULL_MAMBA, [request("r0", P9), request("r1", Q9)], num_blocks=11, **kw)
    s = Script(cfg)
    s.seed("r0", 8)  # r1 has no host hit: a plain (sync) admission
    s.arrive("r0", "r1")
    _steps(s, 16)
    return s


def test_plain_admission_leaves_the_async_reserve_alone() -> None:
    """Scenario (#48433): r0's async load of 8 tokens is in flight (it will need 2 more blocks);
    r1 has no host hit. vLLM 0.33 subtracts the reserve only when admitting ANOTHER async load,
    so r1 is admitted with r0's 2 blocks; when r1 needs its next block it is preempted and its
    work is lost (in vLLM a connector with pending block frees stops preemption, which can turn
    this into a deadlock; not modelled). Reserving for every admission (D4) keeps r1 waiting
    until r0 is done: no preemption. No safety invariant is at stake; the outcome is the
    evidence."""
    s = _load_then_plain()
    assert s.broken() == set()
    assert [c.outcome.value for c in s.claims("r1")][:2] == ["no_space", "no_space"]
    assert s.counter("num_preemptions") == 0
    assert {s.status("r0"), s.status("r1")} == {"FINISHED_LENGTH"}

    exact = _load_then_plain(vllm_exact=True)
    assert exact.claims("r1")[0].outcome.value == "scheduled"  # over r0's reserve
    assert exact.counter("num_preemptions") == 1
    assert {exact.status("r0"), exact.status("r1")} == {"FINISHED_LENGTH"}


# --------------------------------------------------------------------------------------------
# #45406: parked async-load requests stranded behind an unschedulable head of the queue


class OneWaitingQueue(Scheduler):
    """Before #45406's fix: requests whose load landed wait in the one FCFS queue, behind its
    head, instead of being scheduled before it."""

    def _schedule_waiting(self, budget, scheduled, claims):  # type: ignore[no-untyped-def]
        self.waiting.extend(self.kv_holding)
        self.kv_holding.clear()
        return super()._schedule_waiting(budget, scheduled, claims)


def _preempted_head(scheduler: type[Scheduler] | None) -> Script:
    # 10 usable blocks. r0 (5 prompt tokens, 8 outputs) decodes; r1 arrives at step 3 and loads
    # 8 host tokens (5 blocks), so r0's next block is not there: r0 is preempted to the head of
    # the waiting queue and needs more blocks than r1 leaves free.
    cfg = config(
        FULL_MAMBA,
        [request("r0", (1, 2, 3, 4, 5), max_tokens=8), request("r1", Q9, max_tokens=1)],
        num_blocks=11,
        liveness_bound_steps=12,
    )
    s = Script(cfg, scheduler_cls=scheduler)
    s.seed("r1", 8)
    s.arrive("r0")
    _steps(s, 2)
    s.arrive("r1")
    _steps(s, 14)
    return s


def test_sc3_requests_holding_kv_are_scheduled_before_the_waiting_head() -> None:
    """Scenario (#45406): r0 is preempted while r1's load is in flight. r1's blocks are loaded;
    r0, at the head of the waiting queue, cannot be admitted until r1 frees them. Requests that
    hold KV blocks must be scheduled first (vLLM's ``kv_holding_waiting`` queue): r1 runs, ends,
    and r0 is readmitted. In one FCFS queue r1 waits behind r0 forever."""
    s = _preempted_head(None)
    assert s.broken() == set()
    assert s.counter("num_preemptions") == 1
    assert s.scheduled("r1") == [(8, 1)]
    assert s.tokens("r1") == (expected_token("r1", 9),)
    assert s.status("r0") == "FINISHED_LENGTH"
    assert len(s.tokens("r0")) == 8

    broken = _preempted_head(OneWaitingQueue)
    assert broken.status("r0") == "PREEMPTED"
    assert broken.status("r1") == "WAITING_FOR_REMOTE_KVS"  # landed, never promoted
    assert broken.scheduled("r1") == []
    assert "SC-3" in broken.broken()


# --------------------------------------------------------------------------------------------
# #49829: a pending hit has no deadline; requests wait until the client times out


def _load_never_reports(**kw: object) -> Script:
    cfg = config(FULL_MAMBA, [request("r0", P9)], liveness_bound_steps=8, **kw)
    s = Script(cfg)
    s.seed("r0", 8)
    s.arrive("r0")
    s.step()  # r0 claims 8 and waits; its four load jobs hang
    s.step(5)
    return s


def test_sc3_a_pending_load_is_abandoned_at_its_deadline() -> None:
    """Scenario (#49829): r0's load never reports. With a deadline of 2 steps the load is
    abandoned at step 4 (age 3 > 2): its blocks are parked until the transfer reports, r0
    restarts from 0 and recomputes (no new claim while the old load is parked, D7). Without a
    deadline (vLLM 0.33) r0 waits for good."""
    s = _load_never_reports(load_deadline_steps=2)
    assert s.outputs[3].abandoned_ids == {"r0"}  # step 4
    s.complete("r0")  # the late report: the parked blocks are freed
    s.run()
    assert s.broken() == set()
    assert s.counter("num_abandoned_loads") == 1
    assert s.counter("tokens_discarded_by_deadline") == 8
    assert len(s.claims("r0")) == 1  # no re-claim while parked
    # From 0: [0, 8) (the split stops at 8), [8, 9), then the decode step.
    assert s.scheduled("r0") == [(0, 8), (8, 1), (9, 1)]
    assert s.tokens("r0") == (expected_token("r0", 9), expected_token("r0", 10))

    stuck = _load_never_reports()
    stuck.step(4)  # 10 steps: still waiting, past the bound of 8
    assert stuck.status("r0") == "WAITING_FOR_REMOTE_KVS"
    assert stuck.first("SC-3").event == "step 9"
