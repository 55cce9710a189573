"""Load job results reported together fold as they would one by one.

A long load is one job per alignment segment, and the worker usually reports all of them in the
same step. ``ConnectorCore.update_connector_output`` folds a run of successes of one request's
load at once (one unpin, one record update) instead of job by job. These tests hold that
shortcut to the one-by-one fold on everything observable (snapshot, counters, pins, failure
memory, resume point), with failures, stores and other requests' jobs interleaved in the same
output, and to its two promises: one store call per run, and a bad id that stops the fold only
after the results before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from hybridkv.connector import (
    ConnectorCore,
    JobId,
    JobResult,
    KVConnectorOutput,
    RequestId,
    RequestView,
    ScheduledRequest,
    StepView,
    TransferJob,
)
from hybridkv.errors import HybridKVConfigError
from hybridkv.kinds import GroupKind
from hybridkv.planner import HybridOffloadPlanner
from hybridkv.store import HostStore

FULL, SLIDING = GroupKind.FULL, GroupKind.SLIDING
TOKENS = 40  # ten 4-token units: a 40-token claim is ten load segments


class UnpinCountingStore(HostStore):
    """The optimized store, counting ``complete_load`` calls and the keys they unpin."""

    unpin_calls = 0
    unpinned = 0

    def complete_load(self, keys: Sequence[bytes]) -> None:
        self.unpin_calls += 1
        self.unpinned += len(keys)
        super().complete_load(keys)


def _view(rid: str, first_token: int = 1) -> RequestView:
    tokens = (*range(first_token, first_token + TOKENS), 7, 7, 7, 7)
    return RequestView(RequestId(rid), tokens, len(tokens))


def _table(base: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(base + g * 1_000 + i for i in range(1, 12)) for g in range(2))


def _loading_core() -> tuple[ConnectorCore, list[TransferJob]]:
    """A full + sliding core (4-token units, window reach 7) with two requests' loads built:
    A and B hold the same 40-token prefix, C another; all three claim 40 tokens."""
    planner = HybridOffloadPlanner(((FULL, 4), (SLIDING, 4)), 2, 4, 1 << 14)
    core = ConnectorCore(
        planner, UnpinCountingStore(256), (FULL, SLIDING), 2, 4, sliding_windows=(0, 7)
    )
    for seeded in (_view("seed-1"), _view("seed-2", first_token=500)):
        core.seed(seeded, TOKENS)
    jobs: list[TransferJob] = []
    for n, view in enumerate((_view("A"), _view("B"), _view("C", first_token=500))):
        claim = core.get_num_new_matched_tokens(view, 0)
        assert claim.num_tokens == TOKENS
        core.update_state_after_alloc(view, _table(10_000 * (n + 1)), TOKENS)
        jobs.extend(core.build_connector_meta(StepView(n, ())).load_jobs)
    return core, jobs


def _observed(core: ConnectorCore) -> tuple[object, ...]:
    views = [_view("A"), _view("B"), _view("C", first_token=500)]
    resume = tuple(core.first_invalid_token(view) for view in views)
    return core.snapshot(), tuple(core.stats()), core.failed_keys(), resume


def _results(jobs: list[TransferJob], failed: set[JobId]) -> list[JobResult]:
    return [JobResult(job.job_id, job.job_id not in failed) for job in jobs]


def _interleaved(jobs: list[TransferJob]) -> list[TransferJob]:
    return [jobs[i] for k in range(10) for i in (k, 10 + k, 20 + k)]


# Report orders: by request, interleaved across requests, reversed.
ORDERS: dict[str, Callable[[list[TransferJob]], list[TransferJob]]] = {
    "by request": list,
    "interleaved": _interleaved,
    "reversed": lambda jobs: jobs[::-1],
}


@pytest.mark.parametrize("failed_segments", [(), (3,), (0, 9), (4, 14, 25)])
@pytest.mark.parametrize("order", sorted(ORDERS))
def test_results_in_one_output_fold_as_one_output_per_result(
    order: str, failed_segments: tuple[int, ...]
) -> None:
    together, jobs = _loading_core()
    one_by_one, same_jobs = _loading_core()
    assert [job.job_id for job in jobs] == [job.job_id for job in same_jobs]
    assert len(jobs) == 30  # ten segments per load
    failed = {jobs[i].job_id for i in failed_segments}
    results = _results(ORDERS[order](jobs), failed)
    together.update_connector_output(KVConnectorOutput(completed_jobs=tuple(results)))
    for result in results:
        one_by_one.update_connector_output(KVConnectorOutput(completed_jobs=(result,)))
    assert _observed(together) == _observed(one_by_one)
    # Not true by construction: the folds did run (pins gone, failures remembered).
    assert all(pins == 0 for _, _, pins in together.snapshot()["store"]["entries"])
    assert together.stats().load_jobs_failed == len(failed_segments)


def test_a_run_of_successes_unpins_once() -> None:
    core, jobs = _loading_core()
    store = core.store
    assert isinstance(store, UnpinCountingStore)
    failed = {jobs[4].job_id}
    core.update_connector_output(KVConnectorOutput(completed_jobs=tuple(_results(jobs, failed))))
    # A: segments 0-3, then the failure, then 5-9: three calls; B and C one each.
    assert store.unpin_calls == 5
    assert store.unpinned == sum(len(job.items) for job in jobs)


def test_a_bad_id_stops_the_fold_after_the_results_before_it() -> None:
    core, jobs = _loading_core()
    good = _results(jobs[:10], set())
    bad = JobResult(JobId(10_000), True)
    with pytest.raises(HybridKVConfigError) as refused:
        core.update_connector_output(
            KVConnectorOutput(completed_jobs=(*good, bad, *_results(jobs[10:], set())))
        )
    assert refused.value.field == "completed_jobs"
    # A's whole load folded (it resumes at its claim's end); B's and C's jobs still in flight.
    assert core.first_invalid_token(_view("A")) == TOKENS
    assert not core.has_transfers(RequestId("A"))
    assert core.has_transfers(RequestId("B"))
    assert core.has_transfers(RequestId("C"))


def _full_core() -> ConnectorCore:
    planner = HybridOffloadPlanner(((FULL, 4),), 2, 4, 1 << 14)
    return ConnectorCore(planner, HostStore(64), (FULL,), 2, 4)


def _asked_load(core: ConnectorCore, view: RequestView, accepted: int) -> list[TransferJob]:
    core.get_num_new_matched_tokens(view, 0)
    core.update_state_after_alloc(view, _table(10_000), accepted)
    return list(core.build_connector_meta(StepView(0, ())).load_jobs)


def test_an_allocation_past_the_claim_skips_a_failed_key_another_load_still_pins() -> None:
    """A failed load's keys are remembered; one that another load still pins stays READY in the
    host. vLLM may allocate past the claim, and the load must then leave that key out."""
    core = _full_core()
    core.seed(_view("seed"), 16)
    pinning = _asked_load(core, _view("B"), 16)  # B's load pins units 0-3 until it reports
    failing = _asked_load(core, _view("C"), 16)
    core.update_connector_output(
        KVConnectorOutput(completed_jobs=(JobResult(failing[2].job_id, False),))
    )
    failed_key = failing[2].items[0].key
    assert core.failed_keys() == {failed_key}  # remembered, and still held: B pins it
    assert pinning[2].items[0].key == failed_key
    view = _view("D")
    assert core.get_num_new_matched_tokens(view, 0).num_tokens == 8  # stops before it
    core.update_state_after_alloc(view, _table(20_000), 16)  # 8 tokens past the claim
    loads = core.build_connector_meta(StepView(1, ())).load_jobs
    loaded = [item.key for job in loads for item in job.items]
    assert len(loaded) == 3
    assert failed_key not in loaded


def test_a_requests_jobs_in_flight_count_its_stores_and_its_load() -> None:
    """A request loads its stored prefix while a store of its later units is in flight: it has
    transfers until the last of both reports."""
    core = _full_core()
    view = _view("A")
    core.seed(view, 16)  # units 0-3 READY; 4 and 5 never stored
    row = ScheduledRequest(view, _table(10_000), 24, 8)
    (store,) = core.build_connector_meta(StepView(0, (row,))).store_jobs  # units 6 and 7
    loads = _asked_load(core, view, 16)
    assert len(loads) == 4
    core.update_connector_output(
        KVConnectorOutput(completed_jobs=tuple(JobResult(job.job_id, True) for job in loads))
    )
    assert core.has_transfers(view.request_id)  # its store is still in flight
    core.update_connector_output(KVConnectorOutput(completed_jobs=(JobResult(store.job_id, True),)))
    assert not core.has_transfers(view.request_id)
