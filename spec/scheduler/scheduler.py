"""The v1 scheduler of vLLM 0.33 with an external KV connector, as a small executable model.

``schedule()`` follows ``v1/core/sched/scheduler.py`` (file:line below): abandon loads past
their deadline (ours, D3); schedule the RUNNING requests in order (734-1040: chunked prefill
under the token budget, the mamba block-aligned split, ``allocate_slots`` preempting the last
running request until it fits); then, if nothing was preempted, the waiting queues (1047-1610):
requests holding KV blocks first, a request in WAITING_FOR_REMOTE_KVS skipped until its load
reported (3519-3554), the local prefix hit and the connector's claim on the scheduler-block
aligned hit (1102-1184), an async claim allocated without new tokens and parked in
WAITING_FOR_REMOTE_KVS (1286-1289, 1514-1543), a sync or empty claim chunked, split and
admitted; ``update_state_after_alloc`` after every successful allocation (1467-1487), so an
async request sees it twice: at allocation (its external count) and at admission after the
transfer (0). Skipped requests keep their order at the head of their queue (1605-1610).

See :mod:`spec.scheduler.config` for the catalogue of divergences and what is not modelled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

from spec.block_pool import NULL_BLOCK, Refused
from spec.connector_api import (
    Claim,
    ClaimKind,
    ConnectorMeta,
    RequestId,
    ScheduledRequest,
    StepView,
)
from spec.errors import ConfigError
from spec.managers import NO_HIT, CacheHit
from spec.scheduler.completion import SchedulerCompletion
from spec.scheduler.loads import LoadRecord, ParkedLoad
from spec.scheduler.output import ClaimOutcome, ClaimRecord, SchedulerOutput
from spec.scheduler.request import Request, RequestStatus, block_hashes
from spec.scheduler.split import mamba_block_aligned_split

__all__ = ["ConnectorContractError", "Scheduler"]

_WFR = RequestStatus.WAITING_FOR_REMOTE_KVS


class ConnectorContractError(RuntimeError):
    """A connector answer vLLM 0.33 asserts against (``scheduler.py:1217-1220``, 1288, 1331).

    Raised only under ``vllm_exact`` (elsewhere the claim is aligned down, D2): a claim past
    the request's tokens, or a sync claim of every token.
    """


class _Verdict(Enum):
    SKIP = "skip"  # leave it at the head of its queue, look at the next one
    STOP = "stop"  # stop admitting this step (FCFS)
    ADMIT = "admit"
    # Refused only by the in-flight prefills' reserve (D4): it keeps its place, new admissions
    # behind it wait too (FCFS among them), and requests already holding computed KV (the
    # prefills the reserve is for) may still resume behind it.
    RESERVE_WAIT = "reserve_wait"


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a waiting request brings to its allocation: a hit, external tokens, a load kind."""

    hit: CacheHit
    num_external: int
    is_async: bool
    claimed: bool


class Scheduler(SchedulerCompletion):
    """FCFS queues, a token budget, a running cap, claims, loads, recovery and deadlines."""

    # ------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queue a new request at the tail of the waiting queue.

        Pre: a new id; status WAITING, no output, nothing computed. Post: it is queued.
        Refusal: a known id or a request already under way raises :class:`ConfigError`;
        nothing changes.
        """
        if request.request_id in self.requests:
            raise ConfigError("request_id", request.request_id, "already added", _FIX_NEW)
        fresh = (RequestStatus.WAITING, (), 0, 0)
        state = (
            request.status,
            request.output_token_ids,
            request.num_computed_tokens,
            request.num_preemptions,
        )
        if state != fresh:
            raise ConfigError("request", request.request_id, "is already under way", _FIX_NEW)
        self.requests[request.request_id] = request
        self.waiting.append(request.request_id)

    # ------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        """Decide this step's work.

        Pre: none. Post: ``step`` advanced; the scheduled requests' computed counts advanced by
        their scheduled tokens; at most ``max_num_running`` running, at most
        ``max_num_batched_tokens`` scheduled; ``claims`` records every connector answer; the
        connector built this step's metadata. Never refuses (a connector answer vLLM would
        assert against raises :class:`ConnectorContractError` under ``vllm_exact``).
        """
        self.step += 1
        self.kv.new_step_starts()  # scheduler.py:746
        abandoned = self._expire_loads()
        claims: list[ClaimRecord] = []
        scheduled: list[tuple[RequestId, int, int]] = []
        preempted: list[RequestId] = []
        budget = self._schedule_running(self.config.max_num_batched_tokens, scheduled, preempted)
        if not preempted:
            budget = self._schedule_waiting(budget, scheduled, claims)
        views = self._after_schedule(scheduled)
        step_view = StepView(self.step, views, frozenset(self.finished_since), frozenset(preempted))
        meta = self.connector.build_connector_meta(step_view) if self.connector else ConnectorMeta()
        output = SchedulerOutput(
            self.step,
            views,
            meta,
            frozenset(preempted),
            frozenset(self.finished_since),
            tuple(claims),
            abandoned,
        )
        self.finished_since.clear()
        self.claims = tuple(claims)
        self.recoveries = ()
        self.last_scheduled = tuple((rid, n) for rid, _, n in scheduled)
        self.in_flight = dict(self.last_scheduled)
        self.last_budget_left = budget
        self.counters["tokens_scheduled"] += output.total_num_scheduled_tokens
        return output

    def _after_schedule(
        self, scheduled: list[tuple[RequestId, int, int]]
    ) -> tuple[ScheduledRequest, ...]:
        """vLLM ``_update_after_schedule`` (1845-1880): advance the computed counts."""
        views = []
        for rid, before, n in scheduled:
            r = self.requests[rid]
            views.append(ScheduledRequest(r.view(), self.kv.get_blocks(rid), before, n))
            self.requests[rid] = r.evolve(num_computed_tokens=before + n)
            if before + n >= r.num_tokens:
                self.inflight.discard(rid)
        return tuple(views)

    # ------------------------------------------------------------ running requests
    def _schedule_running(
        self, budget: int, scheduled: list[tuple[RequestId, int, int]], preempted: list[RequestId]
    ) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            rid = self.running[index]
            r = self.requests[rid]
            start = r.num_computed_tokens
            n = self._split(r, min(r.num_tokens - start, budget), start)
            if n <= 0:
                index += 1
                continue
            if not self._allocate_running(rid, n, preempted):
                break
            self._cache(rid, min(r.num_computed_tokens + n, r.num_tokens))
            scheduled.append((rid, r.num_computed_tokens, n))
            budget -= n
            index += 1
        return budget

    def _allocate_running(self, rid: RequestId, n: int, preempted: list[RequestId]) -> bool:
        """Allocate, preempting the last running request while it does not fit (FCFS)."""
        while True:
            got = self.kv.allocate_slots(
                rid, n, num_computed_tokens=self.requests[rid].num_computed_tokens
            )
            if not isinstance(got, Refused):
                return True
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim == rid:
                return False

    def _preempt(self, rid: RequestId) -> None:
        """vLLM ``_preempt_request`` (1799-1843): free, reset, back to the waiting head."""
        self.kv.free(rid)
        self.inflight.discard(rid)
        r = self.requests[rid]
        self._set_status(
            rid,
            RequestStatus.PREEMPTED,
            num_computed_tokens=0,
            num_preemptions=r.num_preemptions + 1,
        )
        self.waiting.insert(0, rid)
        self.counters["num_preemptions"] += 1

    # ------------------------------------------------------------ waiting requests
    def _schedule_waiting(
        self, budget: int, scheduled: list[tuple[RequestId, int, int]], claims: list[ClaimRecord]
    ) -> int:
        skipped_kv: list[RequestId] = []
        skipped_waiting: list[RequestId] = []
        reserve_wait = False
        while budget > 0:
            queue = self.kv_holding if self.kv_holding else self.waiting
            if not queue or len(self.running) >= self.config.max_num_running:
                break
            rid = queue[0]
            if reserve_wait and self._is_new_admission(self.requests[rid]):
                verdict, n = _Verdict.SKIP, 0  # FCFS: it waits behind the reserve's head too
            else:
                verdict, n = self._try_admit(rid, budget, claims)
            if verdict is _Verdict.STOP:
                break
            queue.pop(0)
            if verdict is _Verdict.RESERVE_WAIT:
                reserve_wait = True
                verdict = _Verdict.SKIP
            if verdict is _Verdict.SKIP:
                holds = self._holds_kv(self.requests[rid])
                (skipped_kv if holds else skipped_waiting).append(rid)
                continue
            self.running.append(rid)
            start = self.requests[rid].num_computed_tokens
            scheduled.append((rid, start, n))
            budget -= n
        self.kv_holding[:0] = skipped_kv
        self.waiting[:0] = skipped_waiting
        return budget

    @staticmethod
    def _holds_kv(r: Request) -> bool:
        """vLLM ``_holds_kv_blocks`` (2697-2707)."""
        return r.num_computed_tokens > 0 or r.status is _WFR

    @staticmethod
    def _is_new_admission(r: Request) -> bool:
        """A request the reserve gates: nothing computed, no load it waits for."""
        return r.num_computed_tokens == 0 and r.status is not _WFR

    def _try_admit(
        self, rid: RequestId, budget: int, claims: list[ClaimRecord]
    ) -> tuple[_Verdict, int]:
        r = self.requests[rid]
        if r.status is _WFR:
            if rid not in self.recv_done:
                return _Verdict.SKIP, 0
            r = self._promote(rid)
        plan = self._plan(r, claims)
        r = self.requests[rid]  # the look-up pinned its junction
        if plan is None:
            return _Verdict.SKIP, 0
        total = r.num_computed_tokens + plan.hit.num_tokens + plan.num_external
        n = 0 if plan.is_async else self._chunk(r, total, budget)
        if n == 0 and self._stops_on_empty_chunk(plan):
            self._outcome(claims, plan, ClaimOutcome.NO_PROGRESS)
            return _Verdict.STOP, 0
        reserved = self._reserved_for(rid) if self._reserves(r, plan) else 0
        got = self.kv.allocate_slots(
            rid,
            n,
            num_computed_tokens=r.num_computed_tokens,
            hit=plan.hit,
            num_external_computed_tokens=plan.num_external,
            reserved_blocks=reserved,
            full_sequence_tokens=self._full_sequence(r),
            admission_caps=tuple(self.config.admission_cap(g) for g in self.config.groups),
        )
        if isinstance(got, Refused):
            self._outcome(claims, plan, ClaimOutcome.NO_SPACE)
            return self._refusal(got, reserved), 0
        if self.connector is not None:
            self.connector.update_state_after_alloc(
                r.view(), self.kv.get_blocks(rid), plan.num_external
            )
        if plan.is_async:
            self._start_load(rid, r, plan, total)
            self._outcome(claims, plan, ClaimOutcome.WAITING_FOR_REMOTE_KVS)
            return _Verdict.SKIP, 0
        self._cache(rid, min(total + n, r.num_tokens))
        self._set_status(rid, RequestStatus.RUNNING, num_computed_tokens=total)
        if total + n < r.num_tokens:
            self.inflight.add(rid)
        self._outcome(claims, plan, ClaimOutcome.SCHEDULED)
        return _Verdict.ADMIT, n

    def _refusal(self, got: Refused, reserved: int) -> _Verdict:
        """STOP (FCFS), or RESERVE_WAIT when only our every-admission reserve (D4) refused it:
        the reserve's own prefills must not wait behind the request it turned away, or a
        prefill whose load landed never resumes (found by tests/stateful's liveness machine)."""
        fits_without_reserve = got.needed <= got.available + reserved
        if reserved and fits_without_reserve and self.config.reserve_every_admission:
            return _Verdict.RESERVE_WAIT
        return _Verdict.STOP

    def _full_sequence(self, r: Request) -> int | None:
        """The tokens a waiting admission must fit whole (``scheduler_reserve_full_isl``)."""
        if not self.config.full_sequence_must_fit:
            return None
        limit = self.config.max_model_len
        return r.num_tokens if limit is None else min(r.num_tokens, limit)

    def _stops_on_empty_chunk(self, plan: _Plan) -> bool:
        """An empty chunk ends admissions (FCFS), except an async load's, which by design
        schedules 0 new tokens (``scheduler.py:1286-1289``).

        The field's wedge applied the mamba split to the async path and broke out on its 0
        before the request reached WAITING_FOR_REMOTE_KVS, so it claimed again every step
        (``SC-2``).
        """
        return not plan.is_async

    def _chunk(self, r: Request, total: int, budget: int) -> int:
        """The sync chunk: the rest of the request under the budget, then the mamba split."""
        n = min(r.num_tokens - total, budget)
        if n <= 0:
            raise ConnectorContractError(
                f"{r.request_id}: {total} of {r.num_tokens} tokens computed before the chunk "
                "(vLLM asserts num_new_tokens > 0, scheduler.py:1331)"
            )
        return self._split(r, n, total)

    def _split(self, r: Request, n: int, start: int) -> int:
        if not self.config.needs_mamba_split or n <= 0:
            return n
        return mamba_block_aligned_split(
            start=start,
            num_new_tokens=n,
            num_prompt_tokens=r.num_prompt_tokens,
            num_tokens=r.num_tokens,
            block_size=self.config.mamba_block_size,
            max_prefill_tokens=self.config.max_num_batched_tokens,
            shared_prefix_boundary=r.shared_prefix_boundary,
        )

    def _outcome(self, claims: list[ClaimRecord], plan: _Plan, outcome: ClaimOutcome) -> None:
        if plan.claimed:
            claims[-1] = dataclasses.replace(claims[-1], outcome=outcome)

    # ------------------------------------------------------------ hits and claims
    def _plan(self, r: Request, claims: list[ClaimRecord]) -> _Plan | None:
        """Local hit and connector claim for a request with nothing computed (None: DEFER)."""
        if r.num_computed_tokens > 0:
            return _Plan(NO_HIT, 0, False, False)
        hashes = block_hashes(r, self.config.hash_block_size)
        hit = self.kv.find_longest_cache_hit(hashes, r.num_tokens - 1)
        # scheduler.py:1120-1126: every look-up pins the request's junction, admitted or not.
        r = r.evolve(shared_prefix_boundary=hit.shared_prefix_boundary)
        self.requests[r.request_id] = r
        if self.connector is None or r.request_id in self.parked:
            return _Plan(hit, 0, False, False)  # D7: no new load while one is parked
        unit = self.kv.scheduler_block_size
        local = hit.num_tokens - hit.num_tokens % unit
        claim = self.connector.get_num_new_matched_tokens(r.view(), local)
        if claim.kind is ClaimKind.DEFER:
            claims.append(_record(r, local, claim, 0, unit, ClaimOutcome.DEFERRED))
            return None
        accepted = self._accept(r, local, claim)
        claims.append(_record(r, local, claim, accepted, unit, ClaimOutcome.NO_PROGRESS))
        is_async = claim.kind is ClaimKind.ASYNC and accepted > 0
        return _Plan(hit, accepted, is_async, True)

    def _accept(self, r: Request, local: int, claim: Claim) -> int:
        """The tokens taken from a claim: as is (vLLM), or aligned down to the unit (D2)."""
        n = claim.num_tokens
        if not self.config.align_claims:
            if local + n > r.num_tokens:
                raise ConnectorContractError(
                    f"{r.request_id}: claim ends at {local + n} past {r.num_tokens} tokens "
                    "(vLLM asserts, scheduler.py:1217-1220)"
                )
            return n
        cap = r.num_tokens if claim.kind is ClaimKind.ASYNC else r.num_tokens - 1
        end = min(local + n, cap)
        end -= end % self.kv.scheduler_block_size
        return max(end - local, 0)

    # ------------------------------------------------------------ loads
    def _start_load(self, rid: RequestId, r: Request, plan: _Plan, total: int) -> None:
        self._set_status(rid, _WFR, num_computed_tokens=total)
        local = r.num_computed_tokens + plan.hit.num_tokens
        self.loads[rid] = LoadRecord(self.step, local, plan.num_external)
        self.inflight.add(rid)

    def _promote(self, rid: RequestId) -> Request:
        """vLLM ``_update_waiting_for_remote_kv`` (3467-3517) and the status change (3530-3533)."""
        r = self.requests[rid]
        if rid in self.failed and r.num_computed_tokens == 0:
            self.kv.free(rid)  # nothing valid: a fresh start, with a new local hit and claim
        else:
            self._cache(rid, r.num_computed_tokens)
        self.failed.discard(rid)
        self.recv_done.discard(rid)
        del self.loads[rid]
        computed = r.num_computed_tokens
        if computed == r.num_tokens:
            computed -= 1  # a full-prompt hit recomputes the last token to sample the next
        status = RequestStatus.PREEMPTED if r.num_preemptions else RequestStatus.WAITING
        self._set_status(rid, status, num_computed_tokens=computed)
        return self.requests[rid]

    def _expire_loads(self) -> frozenset[RequestId]:
        """D3: abandon every unreported load older than ``load_deadline_steps``."""
        deadline = self.config.load_deadline_steps
        if deadline is None:
            return frozenset()
        late = [
            rid
            for rid, rec in sorted(self.loads.items())
            if rid not in self.recv_done and self.step - rec.started_step > deadline
        ]
        for rid in late:
            self._abandon(rid)
        return frozenset(late)

    def _abandon(self, rid: RequestId) -> None:
        """Park the load's blocks (one extra reference each) and restart the request from 0."""
        record = self.loads.pop(rid)
        blocks = tuple(b for t in self.kv.get_blocks(rid) for b in t if b != NULL_BLOCK)
        self.kv.pool.touch(blocks)
        self.kv.free(rid)
        self.parked[rid] = ParkedLoad(record, blocks)
        self.failed.discard(rid)
        self.inflight.discard(rid)
        r = self.requests[rid]
        status = RequestStatus.PREEMPTED if r.num_preemptions else RequestStatus.WAITING
        self._set_status(rid, status, num_computed_tokens=0)
        self.kv_holding.remove(rid)
        self.waiting.insert(0, rid)
        self.counters["tokens_discarded_by_deadline"] += record.num_external_tokens
        self.counters["num_abandoned_loads"] += 1

    # ------------------------------------------------------------ reservation and caching
    def _reserves(self, r: Request, plan: _Plan) -> bool:
        """Whether this admission must leave the in-flight prefills' reserve alone.

        vLLM 0.33 gates async admissions only (``scheduler.py:1420-1430``). Ours (D4) gates
        every NEW admission, but not a request that already holds computed KV (resuming after
        its own load or a partial recovery): it is one of the prefills the reserve protects,
        and gating it on the others' reserve lets two admitted loads wait for each other
        forever (``tests/regressions/test_wedges.py``).
        """
        if not self.config.reserve_for_async_loads:
            return False
        if self.config.reserve_every_admission:
            return r.num_computed_tokens == 0
        return plan.is_async

    def _reserved_for(self, rid: RequestId) -> int:
        """Blocks the other in-flight prefills still need to hold their whole sequence
        (``scheduler.py:3404-3436``): ``min(num_tokens, max_model_len)`` tokens, a sliding
        window capped at its admission bound. Under ``vllm_exact`` the admitting request's own
        reservation counts too when it is still in the in-flight set (D9)."""
        inflight = (
            self.inflight - {rid} if self.config.reserve_excludes_admitting else self.inflight
        )
        limit = self.config.max_model_len
        total = 0
        for other in sorted(inflight):
            r = self.requests[other]
            num_tokens = r.num_tokens if limit is None else min(r.num_tokens, limit)
            for m in self.kv.managers:
                total += m.get_num_blocks_to_allocate(
                    other,
                    num_tokens,
                    (),
                    total_computed_tokens=r.num_computed_tokens,
                    num_local_computed_tokens=r.num_computed_tokens,
                    pool=self.kv.pool,
                    admission_cap=self.config.admission_cap(m.spec),
                )
        return total

    def _cache(self, rid: RequestId, num_tokens: int) -> None:
        """Cache the request's full blocks; under sparse retention the states a later request
        can resume at are kept: its replay boundary (the prompt's last token,
        ``kv_cache_coordinator.py:65-90``) and its junction (``single_type_kv_cache_manager.py
        :510-520``)."""
        r = self.requests[rid]
        boundaries: tuple[int, ...] = (r.num_prompt_tokens - 1,)
        if r.shared_prefix_boundary:
            boundaries += (r.shared_prefix_boundary,)
        hashes = block_hashes(r, self.config.hash_block_size)
        self.kv.cache_blocks(rid, hashes, num_tokens, boundaries)


_FIX_NEW = "add a fresh Request (WAITING, nothing computed) with a new id"


def _record(  # noqa: PLR0917 - one argument per record field
    r: Request, local: int, claim: Claim, accepted: int, unit: int, outcome: ClaimOutcome
) -> ClaimRecord:
    return ClaimRecord(r.request_id, local, claim.kind, claim.num_tokens, accepted, unit, outcome)
