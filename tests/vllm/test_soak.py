"""The soak runner (``tools/soak.py``, ``nox -s soak``) on a handful of traces.

- Over two forked workers, a few traces of each in-process layout: every trace counted once,
  the counts observed (steps, loads, failures, steps checked) nonzero, exit 0.
- Its failure path: a checker that reports a violation on one seed (injected into the real
  :class:`_invariants_on_vllm.InvariantChecker`, the workers inherit it) is counted as a
  violation of that trace only, the run exits 1, and the printed replay command names the
  family and the seed; replaying that seed alone fails again, a neighbour passes.
- A worker that dies mid-trace or hangs: its trace counted, the rest played by fresh workers.
- The two-engine remote family on a real redis-server (marked ``remote``: ``nox -s remote``).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

import _invariants_on_vllm  # noqa: E402
import _random_traces  # noqa: E402
from _inprocess import load_tool  # noqa: E402
from _two_engines import redis_binary_or_skip  # noqa: E402

IN_PROCESS = ("sliding+full", "2sliding+full", "mamba+full")


@pytest.fixture(scope="module")
def soak() -> Any:
    return load_tool("soak")


def _counts(out: str, name: str) -> int:
    found = re.search(rf"^  {name}\s+(\d+)$", out, re.MULTILINE)
    assert found, (name, out)
    return int(found.group(1))


def test_a_handful_of_traces_over_two_workers(soak: Any, capsys: Any) -> None:
    args = [a for layout in IN_PROCESS for a in ("--layout", layout)]
    assert soak.main([*args, "--traces", "6", "--workers", "2", "--first-seed", "7"]) == 0
    out = capsys.readouterr().out
    assert (
        "6 traces over sliding+full, 2sliding+full, mamba+full; engine loops async, sync; "
        "2 workers" in out
    )
    assert _counts(out, "traces") == 6
    for name in ("steps", "loads", "failures"):
        assert _counts(out, name) > 0, name
    for name in soak.MUST_BE_ZERO:
        assert _counts(out, name) == 0, name
    for layout in IN_PROCESS:
        assert re.search(rf"^  {re.escape(layout)}: 2 traces ", out, re.MULTILINE), layout
    checked = re.search(r"the spec's invariants after (\d+) steps", out)
    assert checked
    assert int(checked.group(1)) == _counts(out, "steps")
    assert "0 wrong reads, 0 wedges, 0 leaks, 0 violations, 0 errors" in out


@pytest.fixture
def violation_on_seed_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker reports BP-1 after every step of trace seed 1 (and only that trace)."""
    playing: list[int] = []
    real_play = _random_traces.play
    real_violations = _invariants_on_vllm.InvariantChecker.violations

    def play(shape: Any, seed: int) -> Any:
        playing[:] = [seed]
        return real_play(shape, seed)

    def violations(self: Any) -> dict[str, list[str]]:
        found = real_violations(self)
        return {**found, "BP-1": ["injected by the test"]} if playing == [1] else found

    monkeypatch.setattr(_random_traces, "play", play)
    monkeypatch.setattr(_invariants_on_vllm.InvariantChecker, "violations", violations)


@pytest.mark.usefixtures("violation_on_seed_1")
def test_a_failing_trace_prints_the_command_that_replays_it(soak: Any, capsys: Any) -> None:
    assert soak.main(["--layout", "sliding+full", "--traces", "3", "--workers", "2"]) == 1
    captured = capsys.readouterr()
    assert _counts(captured.out, "traces") == 3
    assert _counts(captured.out, "violations") == 1
    assert "FAILED sliding+full loop sync seed 1:" in captured.err
    assert "violation: BP-1: step 1: BP-1: injected by the test" in captured.err
    replay = "nox -s soak -- --layout sliding+full --loop sync --seed 1"
    assert f"replay: {replay}" in captured.err
    assert "tools/soak.py --layout sliding+full --loop sync --seed 1" in captured.err
    assert f"FAILED: 1 traces; replay each with one command:\n  {replay}" in captured.out
    # The replay command's arguments replay that trace alone, and it fails again.
    assert soak.main(replay.split(" -- ")[1].split()) == 1
    again = capsys.readouterr()
    assert "1 traces over sliding+full; engine loops sync; 1 workers" in again.out
    assert _counts(again.out, "violations") == 1
    assert soak.main(["--layout", "sliding+full", "--seed", "0"]) == 0


def test_seeds_alternate_between_the_engine_loops(
    soak: Any, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even seeds play under vLLM's async-scheduling loop, odd ones under the synchronous one:
    the loop each trace's engine is built with (what the harness reads then), and the summary's
    per-loop counts; ``--loop`` once keeps that loop for every seed."""
    from hybridkv.vllm.harness.engine_config import ENGINE_LOOP_ENV, default_async_scheduling

    loop_before = os.environ.get(ENGINE_LOOP_ENV)
    built: dict[int, bool] = {}
    real_play = _random_traces.play

    def play(shape: Any, seed: int) -> Any:
        built[seed] = default_async_scheduling()
        return real_play(shape, seed)

    monkeypatch.setattr(_random_traces, "play", play)
    args = ["--layout", "sliding+full", "--traces", "4", "--workers", "1"]
    assert soak.main(args) == 0
    assert built == {0: True, 1: False, 2: True, 3: False}
    out = capsys.readouterr().out
    for loop in ("async", "sync"):
        line = re.search(rf"^  loop {loop}: (\d+) traces; steps (\d+),", out, re.MULTILINE)
        assert line, (loop, out)
        assert (int(line.group(1)), int(line.group(2)) > 0) == (2, True)
    built.clear()
    assert soak.main([*args, "--loop", "sync"]) == 0
    assert built == dict.fromkeys(range(4), False)
    assert "engine loops sync;" in capsys.readouterr().out
    # Each trace's loop was its own: the process's setting is as the run found it.
    assert os.environ.get(ENGINE_LOOP_ENV) == loop_before


def test_seed_needs_exactly_one_layout(soak: Any) -> None:
    with pytest.raises(SystemExit):
        soak.main(["--seed", "3"])


@pytest.mark.remote
def test_the_two_engine_family_on_a_real_server(soak: Any, capsys: Any) -> None:
    redis_binary_or_skip()
    assert soak.main(["--layout", "remote", "--traces", "3", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert _counts(out, "traces") == 3
    assert _counts(out, "remote_fetches") > 0
    assert _counts(out, "steps") > 0


@pytest.mark.parametrize(
    ("fault", "counted"),
    [("exit", "errors"), ("hang", "wedges")],
    ids=["worker-dies", "trace-hangs"],
)
def test_a_dead_or_hung_worker_counts_its_trace_and_the_rest_run(
    soak: Any, capsys: Any, monkeypatch: pytest.MonkeyPatch, fault: str, counted: str
) -> None:
    """Seed 1's worker exits mid-trace or hangs past ``--hang-s``: that trace is counted (an
    error, a wedge) with its replay command, a fresh worker plays the rest of its shard
    (recycled every 2 traces, so the restarts and the recycling meet)."""
    real_play = _random_traces.play

    def play(shape: Any, seed: int) -> Any:
        if seed == 1 and fault == "exit":
            os._exit(3)
        if seed == 1:
            time.sleep(60)
        return real_play(shape, seed)

    monkeypatch.setattr(_random_traces, "play", play)
    args = ["--layout", "2sliding+full", "--traces", "6", "--workers", "2", "--recycle", "2"]
    assert soak.main([*args, "--hang-s", "8"]) == 1
    captured = capsys.readouterr()
    assert _counts(captured.out, "traces") == 6
    assert _counts(captured.out, counted) == 1
    assert _counts(captured.out, "steps") > 0
    assert "FAILED 2sliding+full loop sync seed 1:" in captured.err
    assert "replay: nox -s soak -- --layout 2sliding+full --loop sync --seed 1" in captured.err


def test_every_worker_shard_mixes_every_family(soak: Any) -> None:
    """Two workers over four families: each shard gets each family's share (a shard of two
    families would run twice as long as the other), and every family its seeds 0.. once."""
    tasks = soak.plan(soak.FAMILIES, 400, 0)
    for shard in soak._shards(tasks, 2):
        assert {f: sum(t.family == f for t in shard) for f in soak.FAMILIES} == dict.fromkeys(
            soak.FAMILIES, 50
        )
    for family in soak.FAMILIES:
        assert sorted(t.seed for t in tasks if t.family == family) == list(range(100))
