"""``hybridkv simulate`` runs torch on one intra-op thread and gives the caller its own back."""

from __future__ import annotations

import pytest
import torch

from hybridkv.simulator import run as sim_run
from hybridkv.simulator.threads import one_intra_op_thread


@pytest.fixture
def two_threads() -> object:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("two_threads")
def test_the_run_sees_one_thread_and_the_caller_gets_its_count_back() -> None:
    seen: list[int] = []

    @one_intra_op_thread
    def run(x: int) -> int:
        seen.append(torch.get_num_threads())
        return x + 1

    assert run(1) == 2
    assert seen == [1]
    assert torch.get_num_threads() == 2


@pytest.mark.usefixtures("two_threads")
def test_a_run_that_raises_still_gives_the_count_back() -> None:
    @one_intra_op_thread
    def run() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run()
    assert torch.get_num_threads() == 2


@pytest.mark.usefixtures("two_threads")
def test_simulate_steps_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    original = sim_run.Simulation.run

    def run(self: sim_run.Simulation) -> sim_run.SimResult:
        seen.append(torch.get_num_threads())
        return original(self)

    monkeypatch.setattr(sim_run.Simulation, "run", run)
    report = sim_run.simulate(sim_run.SimOptions(requests=2))
    assert report["verdict"] == "pass"
    assert seen == [1]
    assert torch.get_num_threads() == 2
