"""hybridkv.vllm.harness.delayed.DelayedCompletion: the report rule of the native simulated worker
(``delay`` polls, FIFO per direction, ``wait`` releases a job and the ones before it), loads
that land only when due and are cancelled when abandoned before, and the argument checks of the
adapter that uses it, :class:`hybridkv.vllm.harness.cpu_worker.HybridKVOnCPU` (its runs in the
engine: ``test_hybridkv_inprocess.py``, ``test_hybridkv_deadline.py``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from hybridkv.transfer import Direction, TransferEngine, TransferPair  # noqa: E402
from hybridkv.transfer.api import FinishedJob, JobId  # noqa: E402
from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.delayed import DelayedCompletion  # noqa: E402

PAIR = [TransferPair(0, 1, 0)]


class _Instant(TransferEngine):
    """Finishes every job at submission; its job 3 fails; ``refuse``: submit raises."""

    def __init__(self) -> None:
        self.next = 0
        self.done: list[FinishedJob] = []
        self.waited: list[JobId] = []
        self.submitted: list[Direction] = []
        self.refuse = False
        self.closed = False

    def submit(self, direction: Direction, pairs: Sequence[TransferPair]) -> JobId:
        if self.refuse:
            raise ValueError("refused")
        job = JobId(self.next)
        self.next += 1
        self.submitted.append(direction)
        self.done.append(FinishedJob(job, job != 3))
        return job

    def poll(self) -> list[FinishedJob]:
        out, self.done = self.done, []
        return out

    def wait(self, job_ids: Iterable[JobId]) -> None:
        self.waited += list(job_ids)

    def close(self) -> None:
        self.closed = True


def _ids(finished: list[FinishedJob]) -> list[int]:
    return [int(f.job_id) for f in finished]


@pytest.mark.parametrize("delay", [0, 1, 4])
def test_a_job_reports_after_delay_polls_and_never_twice(delay: int) -> None:
    engine = DelayedCompletion(_Instant(), delay)
    engine.submit(Direction.LOAD, PAIR)
    seen = []
    for poll in range(1, 7):
        got = _ids(engine.poll())
        seen += got
        assert got == ([1] if poll == max(delay, 1) else [])
    assert seen == [1]
    assert engine.pending() == 0


def test_wait_releases_the_job_and_those_before_it_in_its_direction() -> None:
    inner = _Instant()
    engine = DelayedCompletion(inner, 4)
    for direction in (Direction.STORE, Direction.STORE, Direction.STORE, Direction.LOAD):
        engine.submit(direction, PAIR)
    engine.wait([JobId(2)])
    assert engine.pending() == 4
    got = engine.poll()
    assert _ids(got) == [1, 2]
    assert all(f.success for f in got)
    assert 1 in inner.waited  # the inner engine's id of job 2
    for _ in range(3):
        got = engine.poll()
    assert sorted(_ids(got)) == [3, 4]
    # The load reached the inner engine last (its job 3, which fails there) and reports so.
    assert {int(f.job_id): f.success for f in got} == {3: True, 4: False}
    assert engine.pending() == 0


def test_a_load_lands_when_due_and_a_store_at_once() -> None:
    inner = _Instant()
    engine = DelayedCompletion(inner, 3)
    engine.submit(Direction.LOAD, PAIR)
    engine.submit(Direction.STORE, PAIR)
    assert inner.submitted == [Direction.STORE]
    assert engine.poll() == []
    assert engine.poll() == []
    assert inner.submitted == [Direction.STORE]  # two polls: the load is not due yet
    assert sorted(_ids(engine.poll())) == [1, 2]
    assert inner.submitted == [Direction.STORE, Direction.LOAD]


def test_a_waited_load_lands_inside_the_wait() -> None:
    inner = _Instant()
    engine = DelayedCompletion(inner, 5)
    job = engine.submit(Direction.LOAD, PAIR)
    engine.wait([job])
    assert inner.submitted == [Direction.LOAD]
    assert inner.waited == [0]
    assert _ids(engine.poll()) == [1]


def test_an_abandoned_load_not_due_is_cancelled_and_reports_failed_at_the_next_poll() -> None:
    inner = _Instant()
    engine = DelayedCompletion(inner, 4)
    first = engine.submit(Direction.LOAD, PAIR)
    second = engine.submit(Direction.LOAD, PAIR)
    store = engine.submit(Direction.STORE, PAIR)
    engine.abandon([second, store, JobId(99)])  # 99: unknown, ignored
    assert inner.submitted == [Direction.STORE]  # the abandoned load never reaches it
    assert inner.waited == [0]  # the store's copy: stopped by waiting (the default abandon)
    assert engine.cancelled == 1
    got = engine.poll()
    assert {int(f.job_id): f.success for f in got} == {int(second): False, int(store): True}
    for _ in range(3):
        got = engine.poll()
    assert [(int(f.job_id), f.success) for f in got] == [(int(first), True)]
    assert inner.submitted == [Direction.STORE, Direction.LOAD]
    assert engine.pending() == 0


def test_a_load_refused_when_due_reports_failed_and_close_lands_queued_loads() -> None:
    inner = _Instant()
    engine = DelayedCompletion(inner, 1)
    engine.submit(Direction.LOAD, PAIR)
    inner.refuse = True
    assert [(int(f.job_id), f.success) for f in engine.poll()] == [(1, False)]
    inner.refuse = False
    engine.submit(Direction.LOAD, PAIR)
    engine.close()
    assert inner.submitted == [Direction.LOAD]
    assert inner.closed


def test_a_negative_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="delay=-1"):
        DelayedCompletion(_Instant(), -1)


@pytest.mark.parametrize(
    ("kwargs", "field"), [({"delay": -1}, "delay=-1"), ({"host_bytes": 0}, "host_bytes=0")]
)
def test_the_adapter_refuses_a_negative_delay_and_an_empty_host_tier(
    kwargs: dict[str, int], field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        HybridKVOnCPU(**kwargs)


def test_the_adapter_takes_the_native_delays() -> None:
    for delay in (0, 1, 4):
        assert HybridKVOnCPU(host_bytes=1, delay=delay).delay == delay
