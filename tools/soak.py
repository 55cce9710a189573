"""The soak: thousands of seeded random fault traces inside vLLM 0.33's real scheduler, over
worker processes, with counts of what they observed and a replay command for every failure.

Trace families (``--layout``): the in-process random traces of
``tests/vllm/test_hybridkv_inprocess.py`` on mamba align + full (``mamba+full``), sliding window
+ full (``sliding+full``) and two windows + full (``2sliding+full``) (``tests/vllm/
_random_traces.py``: injected load and store failures before submission and inside the copy,
load deadlines of 1 or 2 steps, tight GPU pools that preempt, aborts of requests waiting for
their load, random aborts; the spec's invariants checked after every step), and the two-engine
remote tier of ``tests/vllm/test_remote_two_engines.py`` (``remote``: two engines sharing one
real redis-server, a server fault drawn for every fetch: chunk deleted or corrupted, every
connection killed, the server paused past the timeout, flushed or killed;
``tests/vllm/_two_engine_traces.py``). Each worker starts its own redis-server for the remote
traces.

Engine loops (``--loop``): every family's traces alternate between vLLM's async-scheduling loop
(``step_with_batch_queue``, the default on a GPU server) and the synchronous one, by seed: even
seeds under ``async``, odd ones under ``sync`` (the first one listed takes the even seeds). The
loop is set per trace through ``HYBRIDKV_ENGINE_LOOP``, which the in-process engine reads when
it is built; ``--loop`` once keeps one loop only. The summary counts each loop apart.

Trace ``seed`` of a family under a loop is a pure function of the seed, so one command replays
it::

    nox -s soak -- --layout sliding+full --loop async --seed 1234
    python tools/soak.py --layout sliding+full --loop async --seed 1234   # vLLM 0.33 installed

Every count is what the runs observed (none is read from a trace's plan): traces played, engine
steps, load jobs the connector cores ran (``loads``) and remote fetches resolved, failures (load
and store jobs that failed, remote lookups that failed and promotions that resolved missing,
fault, timeout or corrupt), recoveries (requests that met a failed load or promotion and still
finished), and the four that must be 0: wrong reads (KV slots or mamba states the forward read
holding other content, and promotions of a chunk no engine wrote under that tenant), wedges
(a trace past its ``max_steps``, a request unfinished, write-behind not drained, a trace that
hung past ``--hang-s``), leaks (traces that left transfers, jobs, pins or GPU blocks behind)
and violations (steps that broke a spec invariant; remote promotion counters that do not add
up). Errors (any other exception) count too. Exit 1 when any of those is nonzero.

Usage: ``python tools/soak.py [--traces 10000] [--workers N] [--layout L ...] [--loop L ...]
[--first-seed S] [--seed S] [--log PATH]``. Needs vLLM 0.33 (``nox -s soak`` installs it, with
redis-server).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import random
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# This checkout's hybridkv and spec; tests/vllm's and tests/remote's helper modules (tests/ itself
# stays off: tests/vllm would import as a package named vllm).
for _path in (ROOT / "tests" / "remote", ROOT / "tests" / "vllm", ROOT):
    sys.path.insert(0, str(_path))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/_vllm_tool.py

from _inprocess import set_cpu_env  # noqa: E402  (tests/vllm; imports no vLLM)

set_cpu_env()  # before vLLM is first imported

from _vllm_tool import require_vllm, torchvision_shim  # noqa: E402

_SHIM = torchvision_shim("soak")  # kept alive (tools/_vllm_tool.py)
require_vllm("soak")

import _random_traces  # noqa: E402
import _two_engine_traces  # noqa: E402
from _redis_server import RedisServer, find_binary  # noqa: E402
from _soak_report import (  # noqa: E402  (the counts, a task's replay, the report)
    COUNTS,
    EXERCISED,
    LOOPS,
    MUST_BE_ZERO,
    Played,
    Task,
    _append,
    _load,
    _print_failure,
    _print_summary,
    _progress,
    _summary,
    direct_command,
    replay_command,
)
from diffharness.layouts import Layout  # noqa: E402

from hybridkv.vllm.harness.engine_config import ENGINE_LOOP_ENV, WedgedError  # noqa: E402
from spec.errors import InvariantViolation  # noqa: E402

REMOTE = "remote"
FAMILIES = (*(layout.value for layout in _random_traces.SHAPES), REMOTE)
"""The trace families, in the order tasks interleave them."""

# The tool's names (tests/vllm/test_soak.py and a replaying reader use them), those of
# tools/_soak_report.py among them.
__all__ = [
    "COUNTS",
    "EXERCISED",
    "FAMILIES",
    "LOOPS",
    "MUST_BE_ZERO",
    "REMOTE",
    "Played",
    "Task",
    "direct_command",
    "main",
    "plan",
    "play_one",
    "replay_command",
    "run_tasks",
]


# ------------------------------------------------------------------ one trace


def _in_process(task: Task) -> Played:
    played = Played(task)
    out = _random_traces.play(_random_traces.SHAPES[Layout(task.family)], task.seed)
    r = out.report
    played.counts.update(
        traces=1,
        steps=r.steps,
        loads=out.load_jobs,
        failures=out.failed_jobs,
        recoveries=out.recovered,
        wrong_reads=r.wrong_reads,
        faults_injected=out.faults,
        failed_loads=len(out.failed_loads),
        deadlines_fired=out.deadlines,
        preemptions=r.preemptions,
        aborted=out.aborted,
        aborted_loading=out.aborted_loading,
        slots_checked=r.slots_checked,
        steps_checked=out.situations["steps_checked"],
    )
    if r.wrong_reads:
        played.failures.append(f"wrong reads: {r.wrong_reads} of {r.slots_checked} slots")
    if out.unfinished:
        played.counts["wedges"] += 1
        played.failures.append(f"wedge: {out.unfinished} requests unfinished")
    if out.residue:
        played.counts["leaks"] += 1
        played.failures.append(f"leak: {dict(out.residue)}")
    return played


def _remote(task: Task, server: RedisServer) -> Played:
    played = Played(task)
    trace = _two_engine_traces.random_two_engine_trace(random.Random(task.seed))
    out = _two_engine_traces.play(server, trace)
    wrong = sum(r.wrong_reads for r in out.reports.values())
    failed = sum(n for name, n in out.outcomes.items() if name != "promoted")
    played.counts.update(
        traces=1,
        steps=out.steps,
        loads=out.load_jobs,
        remote_fetches=sum(out.outcomes.values()),
        failures=out.failed_jobs + out.lookup_faults + failed,
        recoveries=out.recovered,
        wrong_reads=wrong + out.cross_tenant_hits,
        slots_checked=sum(r.slots_checked for r in out.reports.values()),
        steps_checked=out.situations["steps_checked"],
    )
    played.counts.update({f"injected_{k}": n for k, n in out.injected.items() if k != "none"})
    played.counts.update({f"remote_{k}": n for k, n in out.outcomes.items()})
    if wrong or out.cross_tenant_hits:
        played.failures.append(f"wrong reads: {wrong}, cross-tenant hits: {out.cross_tenant_hits}")
    if out.unfinished or out.unflushed:
        played.counts["wedges"] += 1
        played.failures.append(f"wedge: {out.unfinished} unfinished, {out.unflushed} unflushed")
    if out.residue:
        played.counts["leaks"] += 1
        played.failures.append(f"leak: {dict(out.residue)}")
    if out.counter_mismatches:
        played.counts["violations"] += 1
        played.failures.append(f"counters: {out.counter_mismatches}")
    return played


def play_one(task: Task, server: Callable[[], RedisServer]) -> Played:
    """Play ``task``; an exception becomes a counted failure (the next trace still runs)."""
    started = time.perf_counter()
    # Read when the trace builds its engines (hybridkv.vllm.harness.engine_config); put back
    # after, since one worker (or the caller's process, with --workers 1) plays both loops.
    before = os.environ.get(ENGINE_LOOP_ENV)
    os.environ[ENGINE_LOOP_ENV] = task.loop
    try:
        played = _play_or_fail(task, server)
    finally:
        if before is None:
            del os.environ[ENGINE_LOOP_ENV]
        else:
            os.environ[ENGINE_LOOP_ENV] = before
    played.counts["trace_ms"] += round(1000 * (time.perf_counter() - started))
    return played


def _play_or_fail(task: Task, server: Callable[[], RedisServer]) -> Played:
    try:
        if task.family == REMOTE:
            return _remote(task, server())
        return _in_process(task)
    except WedgedError as wedged:
        kind, detail = "wedges", f"wedge: {wedged}"
    except InvariantViolation as violation:
        kind, detail = "violations", f"violation: {violation}"
    except Exception as error:  # any other failure of the trace: counted, never swallowed
        kind = "errors"
        detail = f"error: {''.join(traceback.format_exception(error)).strip()}"
    return Played(task, Counter({"traces": 1, kind: 1}), [detail])


# ------------------------------------------------------------------ workers


class _Server:
    """A worker's redis-server, started at its first remote trace, stopped at the end."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.server: RedisServer | None = None

    def __call__(self) -> RedisServer:
        if self.server is None:
            binary = find_binary()
            if binary is None:
                raise RuntimeError(
                    "no redis-server or valkey-server on PATH: the remote traces need one "
                    "(`nox -s soak` installs it; or pass --layout without remote)"
                )
            self.server = RedisServer(binary, self.workdir)
            self.server.start()
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def _work(tasks: Sequence[Task], results: Any) -> None:
    """A worker process: play ``tasks`` in order, one message per trace."""
    import torch

    torch.set_num_threads(1)  # one core per worker: the workers are the parallelism
    with tempfile.TemporaryDirectory(prefix="hybridkv-soak-") as workdir:
        server = _Server(Path(workdir))
        try:
            for task in tasks:
                results.send(play_one(task, server))  # synchronous: a crash loses none
        finally:
            server.stop()


def _shards(tasks: Sequence[Task], workers: int) -> list[list[Task]]:
    return [list(tasks[i::workers]) for i in range(workers)]


def run_tasks(
    tasks: Sequence[Task], workers: int, hang_s: float, recycle: int = 500
) -> Iterator[Played]:
    """Every task's result as it comes, over ``workers`` forked processes (1: in this process;
    see :class:`_Workers`)."""
    if workers > 1:
        yield from _Workers(tasks, workers, hang_s, recycle).results()
        return
    with tempfile.TemporaryDirectory(prefix="hybridkv-soak-") as workdir:
        server = _Server(Path(workdir))
        try:
            for task in tasks:
                yield play_one(task, server)
        finally:
            server.stop()


class _Workers:
    """Forked workers, each playing its shard (every ``workers``-th task) ``recycle`` traces
    per process: a fresh fork takes the next ones, so whatever a process accumulates stays
    bounded. Each sends its results down its own pipe, one per trace as it ends. A worker
    silent for ``hang_s`` seconds is killed, and one that died is noticed; either way its
    current trace counts (a wedge, an error) and a fresh worker goes on after it."""

    def __init__(self, tasks: Sequence[Task], workers: int, hang_s: float, recycle: int) -> None:
        self.context = multiprocessing.get_context("fork")  # they inherit the imported vLLM
        self.shards = [s for s in _shards(tasks, workers) if s]
        self.done = [0] * len(self.shards)
        self.hang_s = hang_s
        self.recycle = recycle
        self.procs: dict[int, tuple[Any, int, Connection]] = {}
        self.last: dict[int, float] = {}
        self.ended: set[int] = set()  # workers whose pipe reached EOF (everything read)

    def _start(self, i: int) -> None:
        end = min(self.done[i] + self.recycle, len(self.shards[i]))
        tasks = self.shards[i][self.done[i] : end]
        reader, writer = self.context.Pipe(duplex=False)
        proc = self.context.Process(target=_work, args=(tasks, writer), daemon=True)
        proc.start()
        writer.close()  # the child's copy is the only writer: its exit reads as EOF here
        self.procs[i] = (proc, end, reader)
        self.last[i] = time.monotonic()
        self.ended.discard(i)

    def _busy(self) -> dict[Connection, int]:
        return {
            conn: i
            for i, (_p, end, conn) in self.procs.items()
            if self.done[i] < end and i not in self.ended
        }

    def results(self) -> Iterator[Played]:
        try:
            yield from self._results()
        finally:  # the run was cut short: stop every worker (its server stops with it)
            for proc, _end, conn in self.procs.values():
                if proc.is_alive():
                    proc.terminate()
                proc.join(timeout=30)
                conn.close()

    def _results(self) -> Iterator[Played]:
        for i in range(len(self.shards)):
            self._start(i)
        while any(d < len(shard) for d, shard in zip(self.done, self.shards, strict=True)):
            busy = self._busy()
            for conn in wait(list(busy), timeout=5):
                i = busy[conn]  # type: ignore[index]
                try:
                    played = conn.recv()  # type: ignore[union-attr]
                except EOFError:
                    self.ended.add(i)  # it exited with a trace unreported: _stalled counts it
                    continue
                self.done[i] += 1
                self.last[i] = time.monotonic()
                yield played
                proc, end, conn_ = self.procs[i]
                if self.done[i] == end:
                    proc.join()
                    conn_.close()
                    if end < len(self.shards[i]):
                        self._start(i)
            yield from self._stalled()

    def _stalled(self) -> Iterator[Played]:
        """Workers silent past ``hang_s`` or dead with traces left: count their trace, go on."""
        now = time.monotonic()
        for i, (proc, end, conn) in list(self.procs.items()):
            silent = now - self.last[i] > self.hang_s
            if self.done[i] == end or not (silent or i in self.ended):
                continue  # busy, or died with results still to read first
            proc.terminate()  # SIGTERM first: the worker stops its server on the way out
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
            conn.close()
            if silent:
                played = Played(self.shards[i][self.done[i]], Counter(traces=1, wedges=1))
                played.failures.append(f"wedge: the trace hung for {self.hang_s:.0f}s")
            else:
                played = Played(self.shards[i][self.done[i]], Counter(traces=1, errors=1))
                played.failures.append(f"error: its worker died (exit code {proc.exitcode})")
            yield played
            self.done[i] += 1
            if self.done[i] < len(self.shards[i]):
                self._start(i)


def plan(
    families: Sequence[str], traces: int, first_seed: int, loops: Sequence[str] = LOOPS
) -> list[Task]:
    """``traces`` tasks split evenly over ``families`` (the first ones take the remainder),
    seeds ``first_seed`` upward per family, seed ``s`` under ``loops[s % len(loops)]``. Round
    ``n`` lists the families rotated by ``n``, so every worker's shard (every ``workers``-th
    task) mixes all of them: without the rotation, 2 workers over 4 families would get 2
    families each, one shard twice as slow."""
    per, extra = divmod(traces, len(families))
    counts = {f: per + (i < extra) for i, f in enumerate(families)}
    tasks = []
    for n in range(max(counts.values(), default=0)):
        turn = n % len(families)
        rotated = (*families[turn:], *families[:turn])
        seed = first_seed + n
        loop = loops[seed % len(loops)]
        tasks += [Task(f, seed, loop) for f in rotated if n < counts[f]]
    return tasks


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=int, default=10_000, help="total traces (10,000)")
    parser.add_argument(
        "--layout",
        action="append",
        choices=FAMILIES,
        help=f"a trace family (repeatable; default all: {', '.join(FAMILIES)})",
    )
    parser.add_argument(
        "--loop",
        action="append",
        choices=LOOPS,
        help="an engine loop (repeatable; default both, alternating by seed)",
    )
    parser.add_argument("--seed", type=int, help="replay this one seed (with one --layout)")
    parser.add_argument("--first-seed", type=int, default=0, help="each family's first seed")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes")
    parser.add_argument("--hang-s", type=float, default=300.0, help="a silent worker's limit")
    parser.add_argument("--recycle", type=int, default=500, help="traces per worker process")
    parser.add_argument("--log", type=Path, help="also append the summary (JSON) to this file")
    args = parser.parse_args(argv)
    if args.seed is not None and (args.layout is None or len(args.layout) != 1):
        parser.error("--seed replays one trace: name its family with exactly one --layout")
    if min(args.traces, args.workers, args.recycle) < 1:
        parser.error("--traces, --workers and --recycle must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 when every trace ran clean, 1 on any wrong read, wedge, leak, violation or error,
    2 when stopped (SIGINT, SIGTERM) before the end without one: the summary then counts the
    traces that finished."""
    args = _parse(argv)
    families = tuple(args.layout or FAMILIES)
    loops = tuple(dict.fromkeys(args.loop or LOOPS))
    if args.seed is not None:
        tasks = [Task(families[0], args.seed, loops[args.seed % len(loops)])]
    else:
        tasks = plan(families, args.traces, args.first_seed, loops)
    workers = min(args.workers, len(tasks))
    print(
        f"soak: {len(tasks)} traces over {', '.join(families)}; "
        f"engine loops {', '.join(loops)}; {workers} workers; "
        f"{platform.node()} ({os.cpu_count()} cores), load average {_load()}",
        flush=True,
    )
    started = time.monotonic()
    total: Counter[str] = Counter()
    per_family: dict[str, Counter[str]] = {f: Counter() for f in families}
    per_loop: dict[str, Counter[str]] = {loop: Counter() for loop in loops}
    failed: list[Played] = []

    def summary(*, partial: bool) -> dict[str, Any]:
        found = _summary(
            args=args,
            families=families,
            workers=workers,
            total=total,
            per_family=per_family,
            per_loop=per_loop,
            failed=failed,
            elapsed=time.monotonic() - started,
        )
        return {**found, "planned": len(tasks), "partial": partial}

    next_note = started + 60
    results = run_tasks(tasks, workers, args.hang_s, args.recycle)
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        for played in results:
            total.update(played.counts)
            per_family[played.task.family].update(played.counts)
            per_loop[played.task.loop].update(played.counts)
            if played.failures:
                failed.append(played)
                _print_failure(played)
            if time.monotonic() >= next_note:
                next_note += 60
                _progress(total, len(tasks), started)
                _append(args.log, summary(partial=True))
    except KeyboardInterrupt:
        print("\nsoak: stopped; the summary counts the traces that finished", flush=True)
    finally:
        results.close()  # stops the workers (and their servers) if the run was cut short
        signal.signal(signal.SIGTERM, previous)
    final = summary(partial=total["traces"] < len(tasks))
    _print_summary(final, failed)
    _append(args.log, final)
    if any(total[name] for name in MUST_BE_ZERO):
        return 1
    return 2 if final["partial"] else 0


def _stop(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
