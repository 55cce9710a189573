"""hybridkv.vllm.delayed.DelayedCompletion: the report rule of the native simulated worker
(``delay`` polls, FIFO per direction, ``wait`` releases a job and the ones before it), and the
argument checks of the adapter that uses it, :class:`hybridkv.vllm.cpu_worker.HybridKVOnCPU`
(its runs in the engine: ``test_hybridkv_inprocess.py``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from hybridkv.transfer import Direction, TransferEngine, TransferPair  # noqa: E402
from hybridkv.transfer.api import FinishedJob, JobId  # noqa: E402
from hybridkv.vllm.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.delayed import DelayedCompletion  # noqa: E402

PAIR = [TransferPair(0, 1, 0)]


class _Instant(TransferEngine):
    """Finishes every job at submission; job 3 fails."""

    def __init__(self) -> None:
        self.next = 0
        self.done: list[FinishedJob] = []
        self.waited: list[JobId] = []

    def submit(self, direction: Direction, pairs: Sequence[TransferPair]) -> JobId:
        job = JobId(self.next)
        self.next += 1
        self.done.append(FinishedJob(job, job != 3))
        return job

    def poll(self) -> list[FinishedJob]:
        out, self.done = self.done, []
        return out

    def wait(self, job_ids: Iterable[JobId]) -> None:
        self.waited += list(job_ids)

    def close(self) -> None:
        """Holds no thread or memory to release."""


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
        assert got == ([0] if poll == max(delay, 1) else [])
    assert seen == [0]
    assert engine.pending() == 0


def test_wait_releases_the_job_and_those_before_it_in_its_direction() -> None:
    inner = _Instant()
    engine = DelayedCompletion(inner, 4)
    for direction in (Direction.STORE, Direction.STORE, Direction.STORE, Direction.LOAD):
        engine.submit(direction, PAIR)
    engine.wait([JobId(1)])
    assert engine.pending() == 4
    got = engine.poll()
    assert _ids(got) == [0, 1]
    assert all(f.success for f in got)
    assert 1 in inner.waited
    for _ in range(3):
        got = engine.poll()
    assert sorted(_ids(got)) == [2, 3]
    assert {int(f.job_id): f.success for f in got} == {2: True, 3: False}
    assert engine.pending() == 0


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
