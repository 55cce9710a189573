"""``ConnectorCore.counts()``: the counts of ``stats()`` without building it (the facade's stats
hook compares them every step). They must equal ``stats()``'s first 14 fields, in order, as
claims, loads, stores, failures and delayed frees move them."""

from __future__ import annotations

from small_core import mamba_full_core

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
from hybridkv.connector.core import ConnectorStats
from hybridkv.kinds import GroupKind

FULL, MAMBA = GroupKind.FULL, GroupKind.MAMBA
TOKENS = tuple(range(1, 34))
TABLE = tuple(tuple(1 + g * 1000 + i for i in range(9)) for g in range(2))


def _check(core: ConnectorCore) -> None:
    assert core.counts() == tuple(core.stats())[:14]


def test_counts_equal_the_stats_counts_as_they_move() -> None:
    core = mamba_full_core(64)
    core.seed(RequestView(RequestId("S"), TOKENS, len(TOKENS)), 16)
    _check(core)
    b = RequestView(RequestId("B"), TOKENS, len(TOKENS))
    claim = core.get_num_new_matched_tokens(b, 0)
    assert claim.kind is ClaimKind.ASYNC
    core.update_state_after_alloc(b, TABLE, claim.num_tokens)
    _check(core)
    meta = core.build_connector_meta(StepView(1, (ScheduledRequest(b, TABLE, 16, 16),)))
    _check(core)
    jobs = (*meta.load_jobs, *meta.store_jobs)
    assert len(meta.load_jobs) > 1
    assert meta.store_jobs
    failed = {1, len(jobs) - 1}  # the second load and the store
    results = tuple(JobResult(JobId(j.job_id), i not in failed) for i, j in enumerate(jobs))
    loads, stores = results[: len(meta.load_jobs)], results[len(meta.load_jobs) :]
    core.update_connector_output(KVConnectorOutput(completed_jobs=loads))
    _check(core)
    assert core.request_finished_all_groups(b, TABLE) is True  # its store is in flight
    core.update_connector_output(KVConnectorOutput(completed_jobs=stores))
    _check(core)
    moved = ConnectorStats._fields[:14]
    zero = {name for name, value in zip(moved, core.counts(), strict=True) if not value}
    assert zero <= {"stores_refused", "deferred"}, zero  # every other count moved


def test_a_request_finished_while_its_load_is_in_flight_is_never_delayed() -> None:
    """Issue 17, 2j: vLLM holds such a request until its load reports and deletes it at the
    first report; a delayed free on top would bring a second report (``finished_sending``) for
    a request vLLM has deleted. Its store still runs and reports by job."""
    core = mamba_full_core(64)
    core.seed(RequestView(RequestId("S"), TOKENS, len(TOKENS)), 16)
    b = RequestView(RequestId("B"), TOKENS, len(TOKENS))
    claim = core.get_num_new_matched_tokens(b, 0)
    core.update_state_after_alloc(b, TABLE, claim.num_tokens)
    meta = core.build_connector_meta(StepView(1, (ScheduledRequest(b, TABLE, 16, 16),)))
    assert meta.load_jobs
    assert meta.store_jobs
    assert core.request_finished_all_groups(b, TABLE) is False
    assert core.build_connector_meta(StepView(2, ())).delayed_free_ids == frozenset()
    jobs = (*meta.load_jobs, *meta.store_jobs)
    core.update_connector_output(
        KVConnectorOutput(completed_jobs=tuple(JobResult(JobId(j.job_id), True) for j in jobs))
    )
    stats = core.stats()
    assert (stats.jobs_in_flight, stats.requests, stats.delayed_frees) == (0, 0, 0), stats


def test_each_count_adds_every_event_over_two_requests() -> None:
    """Two requests, each with two or more load jobs that all fail and a store that fails:
    every count is the number of its events, not the last one."""
    core = mamba_full_core(64)
    load_jobs = store_jobs = 0
    for step, rid in enumerate(("B", "C"), start=1):
        tokens = tuple(t + 100 * step for t in TOKENS)  # a prefix of its own, seeded
        core.seed(RequestView(RequestId(f"seed-{rid}"), tokens, len(tokens)), 16)
        view = RequestView(RequestId(rid), tokens, len(tokens))
        claim = core.get_num_new_matched_tokens(view, 0)
        core.update_state_after_alloc(view, TABLE, claim.num_tokens)
        meta = core.build_connector_meta(StepView(step, (ScheduledRequest(view, TABLE, 16, 16),)))
        assert len(meta.load_jobs) > 1
        assert meta.store_jobs
        load_jobs += len(meta.load_jobs)
        store_jobs += len(meta.store_jobs)
        jobs = (*meta.load_jobs, *meta.store_jobs)
        core.update_connector_output(
            KVConnectorOutput(completed_jobs=tuple(JobResult(JobId(j.job_id), False) for j in jobs))
        )
        _check(core)
    stats = core.stats()
    assert stats.claims == 2
    assert (stats.load_jobs, stats.load_jobs_failed) == (load_jobs, load_jobs)
    assert (stats.store_jobs, stats.store_jobs_failed) == (store_jobs, store_jobs)
