"""hybridkv.connector.deadlines.LoadDeadlines: the step count of each pending load job.

The rule is checked against a report that arrives ``delay`` steps late (the in-process engine's
copy latency: a job emitted at step ``s`` reports in step ``s + max(delay, 1) - 1``'s output): a
deadline fires exactly when ``delay > deadline``, at step ``s + deadline``, once.
"""

from __future__ import annotations

import pytest

from hybridkv.connector import JobId, RequestId, TransferItem, TransferJob, TransferKind
from hybridkv.connector.deadlines import LoadDeadlines
from hybridkv.errors import HybridKVConfigError

ITEM = (TransferItem(0, 1, b"k", 16),)


def load(job_id: int, rid: str = "r", *, sync: bool = False) -> TransferJob:
    return TransferJob(JobId(job_id), TransferKind.LOAD, RequestId(rid), ITEM, sync)


def run(deadline: int, delay: int, steps: int = 12) -> list[tuple[int, tuple[JobId, ...]]]:
    """One job emitted at step 0 and reported in step ``max(delay, 1) - 1``'s output; returns
    (step, jobs named) for every step that named one."""
    deadlines = LoadDeadlines(deadline)
    named = []
    for step in range(steps):
        late = deadlines.step([load(1)] if step == 0 else [])
        if late:
            named.append((step, late))
        if step == max(delay, 1) - 1:  # the output of this step carries the report
            deadlines.reported([JobId(1)])
    assert deadlines.pending() == 0
    return named


@pytest.mark.parametrize("deadline", [1, 2, 3])
@pytest.mark.parametrize("delay", [0, 1, 2, 3, 4])
def test_a_deadline_fires_once_exactly_when_the_delay_exceeds_it(deadline: int, delay: int) -> None:
    named = run(deadline, delay)
    if delay > deadline:
        assert named == [(deadline, (JobId(1),))]
    else:
        assert named == []


def run_batched(deadline: int, delay: int, steps: int = 12) -> list[tuple[int, tuple[JobId, ...]]]:
    """:func:`run` under async scheduling's batch queue of 2: step ``s``'s output is applied
    after step ``s + 1``'s metadata was built (vLLM's ``step_with_batch_queue``)."""
    deadlines = LoadDeadlines(deadline, batches_in_flight=2)
    named = []
    reported_in = max(delay, 1) - 1
    for step in range(steps):
        late = deadlines.step([load(1)] if step == 0 else [])
        if late:
            named.append((step, late))
        if step == reported_in + 1:  # step reported_in's output lands after this metadata
            deadlines.reported([JobId(1)])
    assert deadlines.pending() == 0
    return named


@pytest.mark.parametrize("deadline", [1, 2, 3])
@pytest.mark.parametrize("delay", [0, 1, 2, 3, 4])
def test_under_a_batch_queue_a_load_reported_in_time_is_never_named(
    deadline: int, delay: int
) -> None:
    """The same rule with two batches in flight: counted in metadata alone, a load reported in
    step ``s + deadline - 1``'s output would be named at step ``s + deadline``'s metadata, which
    is built before that output lands."""
    named = run_batched(deadline, delay)
    if delay > deadline:
        assert named == [(deadline + 1, (JobId(1),))]
    else:
        assert named == []


def test_a_batch_count_below_one_is_refused() -> None:
    with pytest.raises(HybridKVConfigError) as caught:
        LoadDeadlines(2, batches_in_flight=0)
    assert caught.value.field == "batches_in_flight"


def test_jobs_age_from_their_own_step_and_the_count_is_kept() -> None:
    deadlines = LoadDeadlines(2)
    assert deadlines.step([load(1, "a"), load(2, "a")]) == ()
    assert deadlines.step([load(3, "b"), load(4, "c", sync=True)]) == ()
    assert deadlines.pending() == 3  # the sync load is not counted: it finishes in its step
    assert deadlines.step([]) == (JobId(1), JobId(2))
    assert deadlines.abandoned() == (JobId(1), JobId(2))
    assert deadlines.recomputing(RequestId("a"))
    assert not deadlines.recomputing(RequestId("b"))
    deadlines.reported([JobId(1), JobId(2), JobId(99)])  # 99: never pending, ignored
    assert deadlines.step([]) == (JobId(3),)
    assert deadlines.step([]) == ()  # named once, however long its report takes
    assert deadlines.fired == 3
    assert deadlines.abandoned() == (JobId(3),)
    deadlines.reported([JobId(3)])
    assert deadlines.pending() == 0
    assert deadlines.abandoned() == ()
    deadlines.finished(RequestId("a"))
    assert not deadlines.recomputing(RequestId("a"))
    assert deadlines.recomputing(RequestId("b"))  # until it finishes


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, None])
def test_a_deadline_below_one_step_is_refused(bad: object) -> None:
    with pytest.raises(HybridKVConfigError) as caught:
        LoadDeadlines(bad)  # type: ignore[arg-type]
    assert caught.value.field == "load_deadline_steps"


def test_a_job_seen_twice_or_a_store_is_refused_and_nothing_changes() -> None:
    deadlines = LoadDeadlines(1)
    deadlines.step([load(1)])
    store = TransferJob(JobId(2), TransferKind.STORE, RequestId("r"), ITEM)
    for wrong in ([load(1)], [store]):
        with pytest.raises(HybridKVConfigError) as caught:
            deadlines.step(wrong)
        assert caught.value.field == "load_jobs"
    assert deadlines.pending() == 1
    assert deadlines.step([]) == (JobId(1),)  # the refused calls did not age it
