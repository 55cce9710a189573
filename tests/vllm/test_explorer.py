"""The configuration explorer (issue 28, item 2): Hypothesis draws whole vLLM configurations
(:mod:`_explorer_config`: the engine loop, speculative decoding, chunked prefill, hash units and
algorithms, the connector's options, host memory, failure policy, faults, deadlines, pool
pressure, pools of one to three whole requests sharing a long prefix, aborts, resets, pauses,
sleeps, tensor parallel) and plays each through the in-process vLLM 0.33 engine
(:mod:`_explorer`): every read content-checked, the spec's invariants after every step (SC-12's
no-progress window among them: a spin is a wedge), nothing left at the end. A failure shrinks
to a minimal configuration and prints the one command that replays it (``python
tools/explore.py --replay '<json>'``).

- At least 300 configurations (``max(300, the profile's max_examples)``). The explorer draws
  the engine loop itself, so it runs under ``HYBRIDKV_ENGINE_LOOP=async`` only (``nox -s
  vllm`` runs the suite once per loop; the second run would replay the same draws). Measured:
  300 in about 3 minutes on the shared 2-core machine (the whole file 3.5 minutes). With the
  ``pool_fit`` axis (2026-11-29), ``tools/explore.py --configs 200 --workers 1`` took 0.35 s
  of a core per configuration against 0.39 s without it, run back to back; this file took 7.6
  minutes that day with other sessions' tests on the same two cores.
- Every value of every axis (:data:`_explorer_config.AXES`) is played at least once, so the
  test fails if the strategy stops drawing one; configurations vLLM or hybridkv refuse at
  construction are rejected draws, counted, and must stay a minority.
- The negative control: loads that read poisoned host slots are caught as wrong reads, and
  Hypothesis shrinks that to the simplest configuration that loads at all.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _explorer import Refused, explore, require_clean  # noqa: E402
from _explorer_config import AXES, Config, axis_values, configs  # noqa: E402
from hypothesis import HealthCheck, find, given, reject, settings  # noqa: E402

from hybridkv.transfer.api import Direction, EngineWrapper, JobId, TransferPair  # noqa: E402
from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.engine_config import ENGINE_LOOP_ENV  # noqa: E402

EXAMPLES = max(300, settings.default.max_examples)
SLOW = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]


@pytest.mark.skipif(
    os.environ.get(ENGINE_LOOP_ENV, "async") == "sync",
    reason="the explorer draws the engine loop itself: it runs once, under the async pass",
)
def test_drawn_configurations_read_right_leave_nothing_and_break_no_invariant() -> None:
    played: dict[str, Counter[str]] = {axis: Counter() for axis in AXES}
    refused: Counter[str] = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW)
    @given(configs())
    def explored(config: Config) -> None:
        try:
            out = explore(config)
        except Refused as refusal:
            refused[refusal.who] += 1
            reject()
        for axis, value in axis_values(config).items():
            played[axis][value] += 1
        require_clean(out)

    explored()
    total = sum(played["layout"].values())
    print(f"\nexplorer: {total} configurations played, refused {dict(refused)}")
    missing = [f"{a}={v}" for a, values in AXES.items() for v in values if not played[a][v]]
    assert not missing, f"axis values never played: {missing}"
    assert total >= EXAMPLES
    assert sum(refused.values()) < total // 10, dict(refused)


# ------------------------------------------------------------------ the negative control


class _PoisonLoads(EngineWrapper):
    """Overwrites the host slots a load reads before it is queued: every load hands back
    bytes no store wrote, and reports success (tests/e2e/_corrupting_connector.py's idea)."""

    def __init__(self, inner: Any, adapter: HybridKVOnCPU) -> None:
        super().__init__(inner)
        self.adapter = adapter

    def submit(self, direction: Direction, pairs: Any) -> JobId:
        if direction is Direction.LOAD:
            host = self.adapter.connector._host
            for pair in pairs:
                assert isinstance(pair, TransferPair)
                host.slot(pair.slot).fill_(0xA5)
        return self.inner.submit(direction, pairs)


def _poison(adapter: HybridKVOnCPU) -> None:
    delayed = adapter._delayed
    adapter._delayed = lambda engine: delayed(_PoisonLoads(engine, adapter))  # type: ignore[method-assign]


def _reads_wrong(config: Config) -> bool:
    try:
        out = explore(config, _poison)
    except Refused:
        return False
    return out.failure is not None and out.failure.kind == "wrong_reads"


def test_the_explorer_finds_and_shrinks_a_connector_whose_loads_read_wrong_bytes() -> None:
    """A search over the same space with poisoned loads finds wrong reads and shrinks them to
    the simplest configuration on every axis that plays no part: a windowed layout, the sync
    loop, no events, no speculative decoding, one rank, no injected faults. The clean run of
    the same configuration reads right (the poison, not the configuration, did it)."""
    control = settings(max_examples=60, deadline=None, database=None, derandomize=True)
    found = find(configs(), _reads_wrong, settings=control)
    print(f"\nshrunk to: {found.replay}")
    assert found.layout in ("sliding+full", "2sliding+full")  # the first that loads at seed 0
    assert found.events == ()
    assert not found.async_scheduling
    assert (found.speculative, found.tensor_parallel) == ("none", 1)
    assert (found.load_rate, found.store_rate, found.abort_random) == (0.0, 0.0, 0.0)
    assert _reads_wrong(Config.from_json(found.to_json()))  # the replay line replays it
    clean = explore(found)
    assert clean.failure is None, clean.failure
    assert clean.counts["external_hits"] > 0


# ------------------------------------------------------------------ the soak's tool


def test_the_soak_tool_counts_every_axis_and_replays_a_printed_configuration(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``tools/explore.py`` (``nox -s soak``): a few seeds over two forked workers, per-axis
    counts and the totals that must be 0 printed, exit 0; a configuration's JSON replays."""
    from _inprocess import load_tool

    tool = load_tool("explore")
    assert tool.main(["--configs", "4", "--workers", "2", "--first-seed", "2"]) == 0
    out = capsys.readouterr().out
    assert "explore: 4 configurations played" in out or "refused at construction" in out
    assert "per axis (configurations played):" in out
    assert "must be 0: wrong_reads 0, wedge 0, leak 0, violation 0, crash 0" in out
    replay = Config(seed=3, events=((2, "reset_cache"),)).to_json()
    assert tool.main(["--replay", replay]) == 0
    assert capsys.readouterr().out.rstrip().endswith("clean")
