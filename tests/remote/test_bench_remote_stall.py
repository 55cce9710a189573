"""tools/bench_remote_stall.py's arithmetic: the quantiles and the added p99 it prints.

The benchmark itself drives vLLM (docs/benchmarks/remote-stall.md); what it computes from the
times it observed is checked here on runs built by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm"))
from _inprocess import load_tool

bench = load_tool("bench_remote_stall")


def _run(state: str, path: str, schedule_ms: list[float], blocked_ms: float = 0.0) -> object:
    times = tuple(t / 1e3 for t in schedule_ms)
    return bench.Run(
        state=state,
        path=path,
        schedule_s=times,
        schedule_cpu_s=times,
        blocked_s=tuple(blocked_ms / 1e3 for _ in times),
        step_s=times,
        requests=1,
        finished=1,
        wrong_reads=0,
        promoted=0,
        waited=0,
        late=0,
        trips=0,
        skips=0,
    )


def test_quantiles_are_nearest_rank() -> None:
    run = _run("healthy", "async", [float(i) for i in range(1, 101)])
    assert run.p(0.5) == 0.050
    assert run.p(0.99) == 0.099
    assert run.p(1.0) == 0.100
    assert _run("dead", "sync", [7.0]).p(0.99) == 0.007


def test_added_p99_is_each_states_median_p99_less_healthy() -> None:
    runs = []
    for path in bench.PATHS:
        for state, base in (("healthy", 1.0), ("paused", 3.0), ("dead", 2.0)):
            for extra in (0.0, 1.0, 5.0):  # medians: base + 1
                blocked = 250.0 if (path, state) == ("sync", "paused") else 0.0
                runs.append(_run(state, path, [base + extra] * 100, blocked))
    lines = bench.added_p99(runs)
    assert len(lines) == 6
    assert lines[0].startswith("sync   schedule() p99 wall       2.000 ms healthy")
    assert lines[0].endswith("paused +2.000 ms, dead +1.000 ms")
    assert lines[2].endswith("paused +250.000 ms, dead +0.000 ms")  # sync, blocked
    assert lines[5].endswith("paused +0.000 ms, dead +0.000 ms")  # async, blocked
    row = bench.format_run(runs[0])
    assert row.split()[:3] == ["healthy", "sync", "100"]
