"""Where the scheduler-side connector time of ``tools/bench_vs_native.py`` goes, per hook and
per function, for hybridkv and native on the same variant.

Each variant runs three times: a warm-up (one-time costs of the first run in a process), a
timed run with the profiler off (per-hook figures) and a run with the profiler on.

Runs one variant of bench_vs_native (layout, connector, policy, delay, host tier in equal
bytes: ``--host`` times the working set, 2 by default; hybridkv at its default chunk as the
bench gives it) through the same in-process engine and times exactly what the bench times:
the outermost scheduler-side connector hooks that
:class:`hybridkv.vllm.harness.report.ConnectorClock` wraps. Prints per hook: calls, total µs and µs
per engine step, and the CPU time of the cyclic garbage collector's passes that ran inside a
hook (charged to whichever side triggered them), and for hybridkv its work per engine step
(claim lookups, load and store jobs and their items, from the core's counters); then
cProfile's top functions by internal time, collected only inside those hooks, in the calling
thread's CPU time (``time.thread_time``; the profiler's own overhead inflates them; the
per-hook totals are taken with the profiler off, in a separate run).

Usage: ``python tools/profile_scheduler_side.py [--layout sliding+full] [--delay 1]
[--policy lru] [--host 2] [--answers 4] [--trace chat|traffic] [--top 25]``; needs vLLM 0.33 (as
bench_vs_native).
Not a benchmark (``nox -s bench`` runs ``bench_*.py`` only): a diagnosis aid.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.util
import pstats
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

TOOLS = Path(__file__).resolve().parent


def _bench() -> Any:
    found = importlib.util.spec_from_file_location("_profiled_bench", TOOLS / "bench_vs_native.py")
    if found is None or found.loader is None:
        raise SystemExit(f"cannot load {TOOLS / 'bench_vs_native.py'}")
    module = importlib.util.module_from_spec(found)
    sys.modules[found.name] = module  # dataclasses resolve the module by name
    found.loader.exec_module(module)
    return module


class _HookTimes:
    """Per-hook seconds and calls (outermost calls only, as the bench's clock)."""

    def __init__(self, profiler: cProfile.Profile | None) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.profiler = profiler
        # The cyclic garbage collector's passes that ran inside a hook: charged to that hook's
        # CPU time (a collection walks the young objects of the whole process, a full one every
        # tracked object), whichever connector's allocation triggered it.
        self.gc_cpu = 0.0
        self.work: dict[str, int] = {}  # a hybridkv run's work counters (_run)
        self.gc_runs = [0, 0, 0]  # per generation
        self._inside = False
        self._gc_start = 0.0

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        """A ``gc.callbacks`` entry: times the collections that run inside a hook."""
        if not self._inside:
            return
        if phase == "start":
            self._gc_start = time.thread_time()
        else:
            self.gc_cpu += time.thread_time() - self._gc_start
            self.gc_runs[info["generation"]] += 1

    def install(self, harness_report: Any) -> None:
        times = self

        def _wrap(clock: Any, name: str, method: Any) -> Any:
            def timed(*args: Any, **kwargs: Any) -> Any:
                if name == "update_state_after_alloc":
                    external = args[2] if len(args) > 2 else kwargs["num_external_tokens"]
                    clock.external += max(0, external)
                if clock._depth:
                    return method(*args, **kwargs)
                clock._depth += 1
                # The CPU clock reads outside the wall span (a thread-time read is a system
                # call, slow on a loaded machine) and outside the profile; the wall span is the
                # bench's own.
                start_cpu = time.thread_time()
                times._inside = True
                if times.profiler is not None:
                    times.profiler.enable()
                start = time.perf_counter()
                try:
                    return method(*args, **kwargs)
                finally:
                    spent = time.perf_counter() - start
                    times._inside = False
                    if times.profiler is not None:
                        times.profiler.disable()
                    times.cpu[name] += time.thread_time() - start_cpu
                    clock.seconds += spent
                    times.seconds[name] += spent
                    times.calls[name] += 1
                    clock._depth -= 1

            return timed

        harness_report.ConnectorClock._wrap = _wrap


# The hybridkv core's counters that count one piece of scheduler-side work each: a claim
# lookup, a load or store job built, an item (one group's unit) put in one.
WORK = ("lookups", "load_jobs", "load_items", "store_jobs", "store_items")


def _run(setup: tuple[Any, Any, Any, Any, int], variant: Any, times: _HookTimes) -> Any:
    """One run of ``variant`` with ``times`` on the clock; ``setup``: bench, the harness's report
    module (its clock), case, trace, chunk bytes. A hybridkv run leaves its core's counters of
    :data:`WORK` in ``times.work``."""
    bench, harness_report, case, trace, chunk_bytes = setup
    original = harness_report.ConnectorClock._wrap
    times.install(harness_report)
    gc.callbacks.append(times.on_gc)
    try:
        engine, _ = bench._engine(case, variant, chunk_bytes)
        report, _ = bench._play(engine, trace)
        core = getattr(engine.scheduler.connector, "core", None)
        if core is not None:
            counts = core.stats()
            times.work = {name: getattr(counts, name) for name in WORK}
        engine.close()
    finally:
        harness_report.ConnectorClock._wrap = original
        gc.callbacks.remove(times.on_gc)
    return report


def _print_top(stats: pstats.Stats, steps: int, sort: str, top: int) -> None:
    rows = []
    for (path, line, name), (_, calls, internal, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{Path(path).name}:{line}({name})" if line else name
        rows.append((internal, cumulative, calls, where))
    rows.sort(key=lambda r: -(r[0] if sort == "tottime" else r[1]))
    print(f"   {'calls/step':>10} {'own us':>8} {'cum us':>8}  function")
    for internal, cumulative, calls, where in rows[:top]:
        print(
            f"   {calls / steps:10.1f} {1e6 * internal / steps:8.1f} "
            f"{1e6 * cumulative / steps:8.1f}  {where}"
        )


def _print_kind(
    layout: str, variant: Any, trace: Any, found: list[tuple[Any, _HookTimes]]
) -> tuple[float, float]:
    """Print one kind's medians, its GC share and its hooks; returns (wall, CPU) us/step."""
    steps = found[0][0].steps
    wall = statistics.median(r.connector_us for r, _ in found)
    cpu = statistics.median(1e6 * sum(t.cpu.values()) / steps for _, t in found)
    print(
        f"== {layout} {variant.name()}, {trace.output_len}-token answers: {steps} "
        f"steps; connector us/step median of {len(found)}: wall {wall:.0f}, "
        f"thread CPU {cpu:.0f}; schedule "
        f"{statistics.median(r.schedule_us for r, _ in found):.0f} us/step (wall)"
    )
    gc_us = statistics.median(1e6 * t.gc_cpu / steps for _, t in found)
    gens = found[0][1].gc_runs
    print(
        f"   of which the cyclic GC inside hooks: {gc_us:.1f} us/step (thread CPU, median; "
        f"collections by generation in the first run: {gens[0]}, {gens[1]}, {gens[2]})"
    )
    work = found[0][1].work
    if work:
        per_step = ", ".join(f"{name} {work[name] / steps:.2f}" for name in WORK)
        print(f"   work per step: {per_step}; in all {sum(work.values()) / steps:.2f}")
        # The engine is deterministic, so every repeat should do the same work: say so if not.
        differing = [t.work for _, t in found[1:] if t.work != work]
        if differing:
            print(f"   work differs between repeats: first run {work}, others {differing}")
    names = found[0][1].seconds
    for name in sorted(names, key=lambda n: -statistics.median(t.cpu[n] for _, t in found)):
        calls = found[0][1].calls[name]
        per_step = statistics.median(1e6 * t.cpu[name] / steps for _, t in found)
        print(
            f"   {name:<32} {calls:6d} calls {per_step:8.1f} us/step "
            f"{per_step * steps / calls:8.1f} us/call (thread CPU, median)"
        )
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", default="sliding+full")
    parser.add_argument("--kinds", default="native,hybridkv")
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--delay", type=int, default=1)
    parser.add_argument("--answers", type=int, default=4, help="answer tokens (4 or 40)")
    parser.add_argument(
        "--trace", default="chat", choices=("chat", "traffic"), help="the bench's trace family"
    )
    parser.add_argument(
        "--host", type=float, default=2.0, help="host tier in working sets (0.5, 1, 2)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per kind, interleaved")
    parser.add_argument("--top", type=int, default=25, help="0: no profiled run")
    parser.add_argument("--sort", default="tottime", help="pstats key: tottime, cumulative")
    args = parser.parse_args(argv)
    bench = _bench()
    from hybridkv.vllm.harness import inprocess
    from hybridkv.vllm.harness import report as harness_report

    case = next(c for c in bench._cases(False) if c.name == args.layout)
    if args.trace == "traffic":  # the traffic trace plays on its own pool (bench_vs_native)
        case = replace(case, settings=case.traffic_settings)
    family = case.traffic if args.trace == "traffic" else case.trace
    trace = replace(family, output_len=args.answers)
    probe = inprocess.InProcessEngine(case.config_json, case.settings)
    # The bench's sizing: --host times the working set in native chunks, hybridkv the same
    # bytes, at its default chunk (bench_vs_native's module docstring).
    chunk_bytes = bench.native_chunk_bytes(probe)
    big = max(1, round(args.host * bench._figures(trace, probe)[1]))
    setup = (bench, harness_report, case, trace, chunk_bytes)
    variants = {}
    for kind in args.kinds.split(","):
        variants[kind] = bench.Variant(kind, args.policy, args.delay, big)
    for variant in variants.values():  # warm-up: one-time costs of a first run
        _run(setup, variant, _HookTimes(None))
    runs: dict[str, list[tuple[Any, _HookTimes]]] = {kind: [] for kind in variants}
    for _ in range(args.repeats):  # interleaved, so a load change on the machine hits both
        for kind, variant in variants.items():
            times = _HookTimes(None)
            report = _run(setup, variant, times)
            runs[kind].append((report, times))
    medians = {
        kind: _print_kind(case.name, variant, trace, runs[kind])
        for kind, variant in variants.items()
    }
    if "hybridkv" in medians and "native" in medians:
        ours, theirs = medians["hybridkv"], medians["native"]
        print(
            f"   hybridkv/native connector us/step: wall {ours[0] / theirs[0]:.2f}, "
            f"thread CPU {ours[1] / theirs[1]:.2f}"
        )
    for variant in variants.values() if args.top > 0 else ():
        # Timed by the thread's CPU clock, as the bench's ``cpu us``: on a shared machine a
        # wall-clock profile charges a function for every moment another job held the core.
        profiler = cProfile.Profile(time.thread_time)
        report = _run(setup, variant, _HookTimes(profiler))
        print(
            f"-- {variant.name()}: top {args.top} by {args.sort}, us per engine step "
            "(profiler on, inside the hooks; the profiler inflates calls)"
        )
        _print_top(pstats.Stats(profiler), report.steps, args.sort, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
