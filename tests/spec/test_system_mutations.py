"""Mutation evidence for TR-1, TR-2 and DATA-1 found by the explorer on the whole engine.

Each test runs one deliberately broken variant of the system model (the connector, the engine's
ordering, or a load) through :func:`spec.explorer.explore` from one of the scenarios that
``hybridkv check`` uses, and asserts that the search finds a counterexample naming the id, with
a readable trace; the same search over the correct model finds none (``hybridkv check`` runs
those in tests/cli). The snapshot-level cases live in test_system_invariants.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import pytest

import spec.system.parts as parts_module
import spec.system.scenarios as scenarios_module
from spec.block_pool import BlockId, BlockPool
from spec.connector import ReferenceConnector
from spec.explorer import ExploreResult, explore
from spec.invariants import check_all
from spec.kinds import GroupKind
from spec.system.engine import Engine
from spec.system.model import Action, EngineModel
from spec.system.scenarios import Recovery, Scenario, Start, build_engines

FULL_MAMBA = (GroupKind.FULL, GroupKind.MAMBA)


class UnpinnedStores(ReferenceConnector):
    """Blocks freed while a transfer still reads them: store sources are not pinned.

    The managers drop a running request's older mamba state and out-of-window blocks while a
    store of them may still be copying; nothing holds them, so the pool hands them out again.
    """

    def bind_gpu_block_pool(self, pool: BlockPool) -> None:
        return None  # never pins

    def held_blocks(self) -> tuple[BlockId, ...]:
        return ()


class StoreBeforeCompute(Engine):
    """vLLM #39306: the store copy is not ordered behind the forward that writes its blocks."""

    def _launch(self, output: object) -> None:
        self._start_jobs(output.meta)  # type: ignore[attr-defined]
        for request in output.scheduled:  # type: ignore[attr-defined]
            self._forward(request)


class AttentionOnlyLoad(ReferenceConnector):
    """LMCache #2863/#2845: the load restores attention KV and leaves the mamba state behind."""

    def _load_items(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        items = super()._load_items(*args, **kwargs)
        return tuple(i for i in items if self.geometry.kinds[i.group_idx] is not GroupKind.MAMBA)


class SystemOnly(EngineModel):
    """Checks only the whole-system family, so a finding is the end-to-end consequence and not
    the broken part's own invariant (MB-1 would name the attention-only load first)."""

    def violations(self, state: Engine) -> Mapping[str, list[str]]:
        return check_all("system", state.snapshot())


def _search(
    monkeypatch: pytest.MonkeyPatch,
    scenario: Scenario,
    depth: int,
    *,
    connector: type[ReferenceConnector] = ReferenceConnector,
    engine: type[Engine] = Engine,
    model: type[EngineModel] = EngineModel,
) -> ExploreResult[Action]:
    monkeypatch.setattr(parts_module, "ReferenceConnector", connector)
    monkeypatch.setattr(scenarios_module, "Engine", engine)
    return explore(model(build_engines(scenario)), depth)


def _ids(result: ExploreResult[Action]) -> set[str]:
    return {v.invariant_id for v in result.violations}


def _trace(result: ExploreResult[Action], inv_id: str) -> list[str]:
    found = [v for v in result.violations if v.invariant_id == inv_id]
    assert found, _ids(result)
    return [str(action) for action in found[0].trace]


def _steps(trace: Iterable[str]) -> int:
    return sum(1 for step in trace if step == "step")


def test_tr1_store_source_reallocated_without_a_pin(monkeypatch: pytest.MonkeyPatch) -> None:
    scenario = Scenario(groups=FULL_MAMBA, start=Start.EMPTY, recovery=Recovery.SHARED)
    assert _ids(_search(monkeypatch, scenario, 6)) == set()
    result = _search(monkeypatch, scenario, 6, connector=UnpinnedStores)
    trace = _trace(result, "TR-1")
    # A store is started by one step and the block is freed by a later one, before it reports.
    assert _steps(trace) >= 2
    assert not any(step.startswith("store job") for step in trace)
    messages = next(v.messages for v in result.violations if v.invariant_id == "TR-1")
    assert any("is free" in m or "now in group" in m for m in messages)


def test_tr2_store_reads_before_the_forward_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    scenario = Scenario(groups=FULL_MAMBA, start=Start.EMPTY, recovery=Recovery.SHARED)
    result = _search(monkeypatch, scenario, 4, engine=StoreBeforeCompute)
    trace = _trace(result, "TR-2")
    assert trace[-1] == "step"  # the step that started the store also rewrote its source
    messages = next(v.messages for v in result.violations if v.invariant_id == "TR-2")
    assert any("unwritten" in m for m in messages)


def test_data1_attention_restored_without_the_state(monkeypatch: pytest.MonkeyPatch) -> None:
    scenario = Scenario(num_requests=1, groups=FULL_MAMBA, start=Start.SEEDED)
    assert _ids(_search(monkeypatch, scenario, 4, model=SystemOnly)) == set()
    result = _search(monkeypatch, scenario, 4, connector=AttentionOnlyLoad, model=SystemOnly)
    trace = _trace(result, "DATA-1")
    # Claim and wait; the load lands; its report is folded; the promoted request's forward
    # reads the state slot the load never wrote.
    assert trace == ["step", "load job 1 of r0 completes", "step", "step"]
    messages = next(v.messages for v in result.violations if v.invariant_id == "DATA-1")
    assert any("group 1" in m and "state after" in m for m in messages)
