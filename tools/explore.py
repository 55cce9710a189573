"""The configuration explorer's soak: thousands of vLLM configurations drawn by seed over the axes
of ``tests/vllm/_explorer_config.py`` (issue 28, item 2), each played through the in-process vLLM
0.33 engine with every read content-checked and the spec's invariants after every step
(``tests/vllm/_explorer.py``), over worker processes.

It prints how often each axis value was played, the totals that must be 0 (wrong reads, wedges:
SC-12's no-progress window or the step cap, leaks, violations, crashes) and, for every failing
configuration, the one command that replays it. ``tests/vllm/test_explorer.py`` runs the same
space under Hypothesis, which shrinks a failure.

Usage::

    python tools/explore.py [--configs 10000] [--workers N] [--first-seed S] [--log PATH]
    python tools/explore.py --seed 1234            # the configuration seed 1234 draws
    python tools/explore.py --replay '<json>'      # a configuration as a failure printed it
    nox -s soak -- explore --configs 300           # the same under nox (vLLM installed)

Exit 0 when every configuration ran clean, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT / "tests" / "vllm", ROOT):
    sys.path.insert(0, str(_path))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/_vllm_tool.py

from _inprocess import set_cpu_env  # noqa: E402  (tests/vllm; imports no vLLM)

set_cpu_env()  # before vLLM is first imported
# vLLM inspects a speculative draft's model in a subprocess: it needs the shim too.
_SHIM_DIR = str(ROOT / "tests" / "vllm" / "_torchvision_shim")
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (_SHIM_DIR, os.environ.get("PYTHONPATH", "")) if p
)

from _vllm_tool import require_vllm, torchvision_shim  # noqa: E402

_SHIM = torchvision_shim("explore")  # kept alive (tools/_vllm_tool.py)
require_vllm("explore")

from _explorer import FAILURE_KINDS, Refused, explore  # noqa: E402
from _explorer_config import AXES, Config, axis_values, config_from_seed  # noqa: E402

MUST_BE_ZERO = FAILURE_KINDS
SUMS = ("steps", "slots_checked", "preemptions", "external_hits", "failed_loads", "aborted")


@dataclass(slots=True)
class Result:
    """One configuration's outcome: played (counts, axes) or refused, and its failure."""

    seed: int | None
    config: Config
    counts: Counter[str] = field(default_factory=Counter)
    refused: str = ""
    failure: str = ""
    seconds: float = 0.0


def play(seed: int | None, config: Config) -> Result:
    """Play one configuration; never raises (a refusal or a failure is recorded)."""
    started = time.perf_counter()
    result = Result(seed, config)
    try:
        explored = explore(config)
    except Refused as refused:
        result.refused = refused.who
    else:
        result.counts = explored.counts
        if explored.failure is not None:
            result.counts[explored.failure.kind] += 1
            result.failure = f"{explored.failure.kind}: {explored.failure.detail}"
    result.seconds = time.perf_counter() - started
    return result


def _by_seed(seed: int) -> Result:
    import torch

    torch.set_num_threads(1)  # one core per worker: the workers are the parallelism
    return play(seed, config_from_seed(seed))


def results(seeds: Sequence[int], workers: int) -> Iterator[Result]:
    """Each seed's result as it comes, over ``workers`` forked processes (1: this process)."""
    if workers <= 1:
        yield from map(_by_seed, seeds)
        return
    context = multiprocessing.get_context("fork")  # the workers inherit the imported vLLM
    with context.Pool(workers, maxtasksperchild=200) as pool:
        yield from pool.imap_unordered(_by_seed, seeds)


@dataclass(slots=True)
class Totals:
    played: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    counts: Counter[str] = field(default_factory=Counter)
    axes: dict[str, Counter[str]] = field(default_factory=lambda: {a: Counter() for a in AXES})
    failed: list[Result] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, result: Result) -> None:
        self.seconds += result.seconds
        if result.refused:
            self.refused[result.refused] += 1
            return
        self.played += 1
        self.counts.update(result.counts)
        for axis, value in axis_values(result.config).items():
            self.axes[axis][value] += 1
        if result.failure:
            self.failed.append(result)

    def summary(self) -> dict[str, Any]:
        return {
            "played": self.played,
            "refused": dict(self.refused),
            "must_be_zero": {k: self.counts[k] for k in MUST_BE_ZERO},
            "sums": {k: self.counts[k] for k in SUMS},
            "axes": {a: dict(c) for a, c in self.axes.items()},
            "never_played": [
                f"{a}={v}" for a, vs in AXES.items() for v in vs if not self.axes[a][v]
            ],
            "failed": [r.config.to_json() for r in self.failed],
            "cpu_seconds": round(self.seconds, 1),
        }


def _print_failure(result: Result) -> None:
    print(f"FAILED {result.failure}", file=sys.stderr)
    print(f"  replay: {result.config.replay}", file=sys.stderr, flush=True)


def _print_summary(totals: Totals, elapsed: float, workers: int) -> None:
    s = totals.summary()
    each = totals.seconds / max(1, totals.played + sum(totals.refused.values()))
    print(
        f"\nexplore: {totals.played} configurations played, {sum(totals.refused.values())} "
        f"refused at construction {s['refused']}, in {elapsed / 60:.1f} min on {workers} "
        f"workers ({each:.2f} s of worker time each)"
    )
    print("per axis (configurations played):")
    for axis, counts in s["axes"].items():
        print(f"  {axis}: " + ", ".join(f"{v} {n}" for v, n in sorted(counts.items())))
    print("sums: " + ", ".join(f"{k} {v}" for k, v in s["sums"].items()))
    print("must be 0: " + ", ".join(f"{k} {v}" for k, v in s["must_be_zero"].items()))
    if s["never_played"]:
        print(f"never played in this run: {', '.join(s['never_played'])}")
    for result in totals.failed:
        print(f"  replay: {result.config.replay}")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", type=int, default=10_000, help="configurations (10,000)")
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed")
    parser.add_argument("--seed", type=int, help="play the configuration of this one seed")
    parser.add_argument("--replay", help="play this configuration (JSON, as a failure prints)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes")
    parser.add_argument("--log", type=Path, help="also append the summary (JSON) to this file")
    args = parser.parse_args(argv)
    if min(args.configs, args.workers) < 1:
        parser.error("--configs and --workers must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if args.replay is not None:
        result = play(None, Config.from_json(args.replay))
        print(f"{result.config}\nrefused: {result.refused or 'no'}; counts {dict(result.counts)}")
        print(result.failure or "clean")
        return 1 if result.failure else 0
    seeds = (
        [args.seed]
        if args.seed is not None
        else list(range(args.first_seed, args.first_seed + args.configs))
    )
    workers = min(args.workers, len(seeds))
    print(
        f"explore: {len(seeds)} configurations from seed {seeds[0]}; {workers} workers; "
        f"{platform.node()} ({os.cpu_count()} cores)",
        flush=True,
    )
    started = time.monotonic()
    totals = Totals()
    for result in results(seeds, workers):
        totals.add(result)
        if result.failure:
            _print_failure(result)
    elapsed = time.monotonic() - started
    _print_summary(totals, elapsed, workers)
    if args.log is not None:
        with args.log.open("a") as out:
            out.write(json.dumps({**totals.summary(), "seconds": round(elapsed, 1)}) + "\n")
    return 1 if any(totals.counts[k] for k in MUST_BE_ZERO) else 0


if __name__ == "__main__":
    sys.exit(main())
