"""``StepView.no_unit_ids``: a request whose step completes no unit may be named by id alone.

The vLLM adapter names such requests instead of building their views and block tables (most
decode steps). The core must answer exactly as if they were listed in ``scheduled`` with their
full view and table: same metadata, same state, same counts, and a request restarting with
salvage off stops restarting either way.
"""

from __future__ import annotations

import random

from small_core import mamba_full_core

from hybridkv.connector import (
    BlockTable,
    ClaimKind,
    ConnectorCore,
    ConnectorMeta,
    JobId,
    JobResult,
    KVConnectorOutput,
    RequestId,
    RequestView,
    ScheduledRequest,
    StepView,
)
from hybridkv.kinds import GroupKind

FULL, MAMBA = GroupKind.FULL, GroupKind.MAMBA
TOKENS = tuple(range(1, 66))  # 65 tokens: 16 units of 4


def _core() -> ConnectorCore:
    return mamba_full_core(48)


def _view(rid: str, tokens: int) -> RequestView:
    return RequestView(RequestId(rid), TOKENS[:tokens], min(tokens, 24))


def _table(base: int) -> BlockTable:
    return tuple(tuple(base + g * 1000 + i for i in range(17)) for g in range(2))


def _report(core: ConnectorCore, meta: ConnectorMeta, rng: random.Random) -> None:
    jobs = (*meta.load_jobs, *meta.store_jobs)
    results = tuple(JobResult(JobId(job.job_id), rng.random() < 0.9) for job in jobs)
    core.update_connector_output(KVConnectorOutput(completed_jobs=results))


def test_naming_unit_free_requests_by_id_answers_as_listing_them() -> None:
    """Two cores run the same steps: ``plain`` gets every scheduled request as a row, ``fast``
    names the rows that complete no unit in ``no_unit_ids`` (the adapter's fast path)."""
    plain, fast, free = _core(), _core(), _core()
    rng = random.Random(11)
    computed = {f"r{i}": 0 for i in range(4)}
    named = stored = unit_free = delayed = 0
    for step in range(1, 60):
        rows: list[ScheduledRequest] = []
        ids: list[RequestId] = []
        for rid, done in list(computed.items()):
            if done >= len(TOKENS) - 1 or rng.random() < 0.2:
                continue
            n = min(rng.choice((1, 1, 1, 2, 5)), len(TOKENS) - 1 - done)
            row = ScheduledRequest(_view(rid, done + n), _table(int(rid[1:]) * 100), done, n)
            rows.append(row)
            if not plain.geometry.completes_a_unit(done, done + n):
                ids.append(RequestId(rid))
            computed[rid] = done + n
        named += len(ids)
        full = plain.build_connector_meta(StepView(step, tuple(rows)))
        short = fast.build_connector_meta(
            StepView(
                step,
                tuple(r for r in rows if r.request.request_id not in ids),
                no_unit_ids=frozenset(ids),
            )
        )
        assert full == short
        # ``free`` takes build_unit_free_meta whenever no row completes a unit (the adapter's
        # path without a view of the step).
        if len(ids) == len(rows):
            third = free.build_unit_free_meta(ids)
            unit_free += 1
        else:
            third = free.build_connector_meta(
                StepView(
                    step,
                    tuple(r for r in rows if r.request.request_id not in ids),
                    no_unit_ids=frozenset(ids),
                )
            )
        assert third == full
        stored += len(full.store_jobs)
        delayed += len(full.delayed_free_ids)
        if full.store_jobs and step % 3 == 0:
            # Finish a request whose store is in flight: its free is delayed, and the next
            # metadata (unit free or not) announces it.
            rid = str(full.store_jobs[0].request_id)
            done = computed.pop(rid)
            for core in (plain, fast, free):
                assert core.request_finished_all_groups(_view(rid, done), ())
        _report(plain, full, random.Random(step))
        _report(fast, short, random.Random(step))
        _report(free, third, random.Random(step))
        assert plain.snapshot() == fast.snapshot() == free.snapshot()
        assert plain.stats() == fast.stats() == free.stats()
        if not computed:
            computed = {f"r{step}{i}": 0 for i in range(4)}
    assert named > 20
    assert stored > 10
    assert unit_free > 5
    assert delayed > 0


def test_a_restarting_request_named_by_id_is_scheduled() -> None:
    """Salvage off: a request whose load failed is answered NONE until it is scheduled; a step
    that names it in ``no_unit_ids`` counts as scheduling it, as a row would."""
    answers = []
    for by_id in (False, True, "free"):
        core = _core()
        core._set_salvage(False)
        core.seed(_view("S", 65), 32)
        b = _view("B", 33)
        claim = core.get_num_new_matched_tokens(b, 0)
        assert claim.kind is ClaimKind.ASYNC
        assert claim.num_tokens == 32
        core.update_state_after_alloc(b, _table(1), claim.num_tokens)
        meta = core.build_connector_meta(StepView(1, ()))
        results = tuple(JobResult(JobId(j.job_id), i != 2) for i, j in enumerate(meta.load_jobs))
        core.update_connector_output(KVConnectorOutput(completed_jobs=results))
        assert core.get_num_new_matched_tokens(b, 0).kind is ClaimKind.NONE  # restarting
        assert not core.geometry.completes_a_unit(0, 1)
        if by_id == "free":
            assert core.build_unit_free_meta([RequestId("B")]).store_jobs == ()
        else:
            if by_id:
                step = StepView(2, (), no_unit_ids=frozenset({RequestId("B")}))
            else:
                step = StepView(2, (ScheduledRequest(b, _table(1), 0, 1),))
            assert core.build_connector_meta(step).store_jobs == ()
        answers.append(core.get_num_new_matched_tokens(b, 0))
    assert answers[0] == answers[1] == answers[2]
    assert answers[0].kind is ClaimKind.ASYNC
    assert answers[0].num_tokens == 8


def test_a_unit_free_step_carries_the_loads_and_delayed_frees_once() -> None:
    """build_unit_free_meta hands over the loads built since the last metadata and the delayed
    frees not yet announced, once each, as build_connector_meta does."""
    metas = []
    for free in (False, True):
        core = _core()
        core.seed(_view("S", 65), 32)
        b = _view("B", 33)
        claim = core.get_num_new_matched_tokens(b, 0)
        core.update_state_after_alloc(b, _table(1), claim.num_tokens)
        # Other tokens than S's (whose units the host holds): A stores its first units, then
        # finishes with the store in flight.
        a = RequestView(RequestId("A"), tuple(range(100, 108)), 8)
        stored = core.build_connector_meta(StepView(1, (ScheduledRequest(a, _table(5), 0, 8),)))
        assert stored.store_jobs
        assert core.request_finished_all_groups(a, ())
        steps = []
        for _ in range(2):
            if free:
                steps.append(core.build_unit_free_meta([RequestId("B")]))
            else:
                steps.append(
                    core.build_connector_meta(StepView(2, (), no_unit_ids=frozenset({"B"})))
                )
        assert steps[1] == ConnectorMeta()
        metas.append((stored, *steps, core.snapshot(), core.stats()))
    assert metas[0] == metas[1]
    first = metas[1][1]
    assert first.load_jobs == ()  # taken by the store step's metadata already
    assert first.delayed_free_ids == {RequestId("A")}
