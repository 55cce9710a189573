"""The soak's vocabulary and report: the counts a trace returns (which must be 0, which a full
run must reach), a trace's task and its one-line replay, the progress lines, the failures, the
JSON summary appended to ``--log`` and the summary printed at the end.

A module of ``tools/soak.py`` (its module docstring says what the soak plays and counts);
imported after that tool has put tests/vllm and tests/remote on ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _two_engine_traces

SOAK = Path(__file__).resolve().parent / "soak.py"
LOOPS = ("async", "sync")
"""vLLM's engine loops (``HYBRIDKV_ENGINE_LOOP``): a family's seeds alternate between them."""
MUST_BE_ZERO = ("wrong_reads", "wedges", "leaks", "violations", "errors")
COUNTS = ("traces", "steps", "loads", "remote_fetches", "failures", "recoveries", *MUST_BE_ZERO)
EXERCISED = (
    "faults_injected",
    "failed_loads",
    "deadlines_fired",
    "preemptions",
    "aborted",
    "aborted_loading",
    *(f"injected_{kind}" for kind in _two_engine_traces.FAULT_KINDS if kind != "none"),
)
"""Fault kinds a full run must reach (printed; a run that misses one says so)."""


@dataclass(frozen=True, slots=True)
class Task:
    family: str
    seed: int
    loop: str = LOOPS[0]


@dataclass(slots=True)
class Played:
    """One trace's counts and, if it failed, why."""

    task: Task
    counts: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)


def replay_command(task: Task) -> str:
    """The one command that replays ``task`` (nox installs vLLM and redis-server)."""
    return f"nox -s soak -- --layout {task.family} --loop {task.loop} --seed {task.seed}"


def direct_command(task: Task) -> str:
    """The same replay with this interpreter, where vLLM 0.33 is installed."""
    return f"{sys.executable} {SOAK} --layout {task.family} --loop {task.loop} --seed {task.seed}"


def _append(log: Path | None, summary: dict[str, Any]) -> None:
    if log is not None:
        with log.open("a") as out:
            out.write(json.dumps(summary) + "\n")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _progress(total: Counter[str], planned: int, started: float) -> None:
    elapsed = time.monotonic() - started
    rate = total["traces"] / elapsed
    eta = (planned - total["traces"]) / rate if rate else float("inf")
    bad = ", ".join(f"{n} {total[n]}" for n in MUST_BE_ZERO if total[n]) or "no failure"
    print(
        f"  {total['traces']}/{planned} traces, {rate:.1f}/s, {elapsed / 60:.1f} min, "
        f"about {eta / 60:.1f} min left; {bad}; load average {_load()}",
        flush=True,
    )


def _print_failure(played: Played) -> None:
    task = played.task
    print(f"FAILED {task.family} loop {task.loop} seed {task.seed}:", file=sys.stderr)
    for line in played.failures:
        print(f"  {line}", file=sys.stderr)
    print(f"  replay: {replay_command(task)}", file=sys.stderr)
    print(f"      or: {direct_command(task)}", file=sys.stderr, flush=True)


def _summary(
    *,
    args: argparse.Namespace,
    families: Sequence[str],
    workers: int,
    total: Counter[str],
    per_family: dict[str, Counter[str]],
    per_loop: dict[str, Counter[str]],
    failed: list[Played],
    elapsed: float,
) -> dict[str, Any]:
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": sys.argv[1:],
        "host": platform.node(),
        "cores": os.cpu_count(),
        "workers": workers,
        "load_average_end": _load(),
        "seconds": round(elapsed, 1),
        "families": list(families),
        "first_seed": args.first_seed,
        "counts": {name: total[name] for name in COUNTS},
        "exercised": {name: total[name] for name in EXERCISED},
        "checked": {name: total[name] for name in ("steps_checked", "slots_checked")},
        "per_family": {f: dict(sorted(c.items())) for f, c in per_family.items()},
        "per_loop": {loop: dict(sorted(c.items())) for loop, c in per_loop.items()},
        "failed": [f"{p.task.family}:{p.task.loop}:{p.task.seed}" for p in failed],
    }


def _print_summary(summary: dict[str, Any], failed: list[Played]) -> None:
    counts = summary["counts"]
    cut = f" (stopped: {summary['planned']} planned)" if summary["partial"] else ""
    print(f"\nsoak: {counts['traces']} traces in {summary['seconds'] / 60:.1f} min{cut}")
    for family, c in summary["per_family"].items():
        figures = ", ".join(f"{n} {c.get(n, 0)}" for n in COUNTS if n != "traces")
        each = c.get("trace_ms", 0) / max(1, c.get("traces", 0))
        print(f"  {family}: {c.get('traces', 0)} traces ({each:.0f} ms each); {figures}")
    for loop, c in summary["per_loop"].items():
        figures = ", ".join(f"{n} {c.get(n, 0)}" for n in COUNTS if n != "traces")
        print(f"  loop {loop}: {c.get('traces', 0)} traces; {figures}")
    width = max(map(len, counts))
    for name, value in counts.items():
        print(f"  {name:<{width}}  {value}")
    missed = [n for n, v in summary["exercised"].items() if not v]
    exercised = ", ".join(f"{n} {v}" for n, v in summary["exercised"].items())
    print(f"exercised: {exercised}")
    checked = summary["checked"]
    print(
        f"checked: the spec's invariants after {checked['steps_checked']} steps, "
        f"{checked['slots_checked']} KV slots and mamba states read"
    )
    if missed:
        print(f"not exercised in this run: {', '.join(missed)}")
    print(f"load average at the end: {summary['load_average_end']}")
    if failed:
        print(f"\nFAILED: {len(failed)} traces; replay each with one command:")
        for played in failed:
            print(f"  {replay_command(played.task)}")
    else:
        print("0 wrong reads, 0 wedges, 0 leaks, 0 violations, 0 errors")
