"""What a slow or dead shared tier costs vLLM's scheduler: step times, healthy, paused and dead.

vLLM 0.33's real ``Scheduler`` runs in-process (:class:`hybridkv.vllm.harness.inprocess.
InProcessEngine`, both connector roles on CPU tensors, every KV read content-checked) with
HybridKVConnector's remote tier on a ``redis-server`` this tool starts. Per server state:

- healthy: engine A serves a chat trace and writes its chunks behind; engine B serves the same
  prompts and promotes them;
- paused: the same, but the server is stopped with SIGSTOP (a hung server: connections are
  accepted by the kernel, nothing answers) after A wrote and before B starts;
- dead: the server is killed (SIGKILL) after A wrote (connections refused).

B runs each state twice, side by side in one run: ``sync``, the path before issue 30 (EXISTS
inside ``schedule()``, fetches one after another, no circuit breaker), and ``async`` (lookups
on the lookup threads with a bounded wait, fetches side by side, the breaker). Every
``Scheduler.schedule`` call of B is timed (``time.perf_counter``); printed per state and path:
steps, p50 / p99 / max of those times, p99 of B's whole engine step (schedule, the stand-in
worker with its fetches, output), the remote hits B took (chunks promoted), its lookups that
waited and went on late, the breaker's trips and skips, requests finished and wrong reads.
The last lines give, per path, what a paused and a dead server add to the healthy p99 (the
goal for ``async``: at most 1 ms).

A module-level tool, not a timed test. Usage: ``python tools/bench_remote_stall.py [--quick]
[--layout sliding+full|mamba+full] [--timeout-ms N] [--repeats N]``. Needs vLLM 0.33 (``nox -s
bench`` installs it; exits 2 where it does not import) and redis-server (or valkey-server).
Exit 1 on a wrong read or an unfinished request.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_remote, _shared_tier, ...

STATES = ("healthy", "paused", "dead")
PATHS = ("sync", "async")


@dataclass(frozen=True, slots=True)
class Run:
    """Engine B's run in one server state on one path."""

    state: str
    path: str
    schedule_s: tuple[float, ...]
    schedule_cpu_s: tuple[float, ...]
    blocked_s: tuple[float, ...]
    step_s: tuple[float, ...]
    requests: int
    finished: int
    wrong_reads: int
    promoted: int
    waited: int
    late: int
    trips: int
    skips: int

    def p(self, q: float, times: Sequence[float] | None = None) -> float:
        """The ``q`` quantile (0..1, nearest rank) of ``times`` (default: schedule times)."""
        ordered = sorted(self.schedule_s if times is None else times)
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


class Server:
    """A redis-server on a free loopback port (no persistence) that can be paused or killed."""

    def __init__(self, workdir: str) -> None:
        import bench_remote

        self.port = bench_remote._free_port()
        args = [
            bench_remote.find_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", workdir, "--daemonize", "no",
        ]  # fmt: skip
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        bench_remote._wait_ready(self.process, self.port, 10.0)

    def apply(self, state: str) -> None:
        if state == "paused":
            os.kill(self.process.pid, signal.SIGSTOP)
        elif state == "dead":
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
            self.process.wait()


def use_synchronous_path(engine: Any) -> None:
    """Give ``engine`` the remote tier's path before issue 30: EXISTS on the scheduler
    thread, fetches one after another, no breaker on either side."""
    from hybridkv.remote import LookupMode, LookupPolicy
    from hybridkv.vllm.remote import SchedulerRemote, WorkerRemote

    connector = engine.scheduler.connector
    now = connector.remote
    connector.remote = SchedulerRemote(
        now.core,
        now.config,
        identity=now.identity,
        lookups=LookupPolicy(mode=LookupMode.SYNC),
        breaker=None,
    )
    now.close()
    worker = engine.worker
    was = worker.worker_remote
    worker.worker_remote = WorkerRemote(was.config, was.host, breaker=None, fetch_workers=1)
    was.close()


@dataclass(slots=True)
class Timings:
    """Per ``schedule()`` call: wall seconds, the calling thread's CPU seconds, and the wall
    seconds it spent inside server calls (EXISTS) on that thread; per engine step: wall."""

    schedule_s: list[float] = field(default_factory=list)
    schedule_cpu_s: list[float] = field(default_factory=list)
    blocked_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    _blocked_now: float = 0.0


def _timed_steps(engine: Any) -> Timings:
    """Time every ``schedule()`` call and every engine step of ``engine`` from now on, and the
    server calls its scheduler side makes on the scheduler's own thread."""
    found = Timings()
    scheduler = engine.scheduler
    schedule, step = scheduler.schedule, engine.step
    client = scheduler.connector.remote._client  # the server client under any breaker
    exists = client.exists
    caller = threading.get_ident()

    def timed_exists(keys: Any) -> Any:
        start = time.perf_counter()
        try:
            return exists(keys)
        finally:
            if threading.get_ident() == caller:  # on the scheduler's thread: it waited
                found._blocked_now += time.perf_counter() - start

    def timed_schedule(*args: Any, **kwargs: Any) -> Any:
        found._blocked_now = 0.0
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            return schedule(*args, **kwargs)
        finally:
            found.schedule_s.append(time.perf_counter() - start)
            found.schedule_cpu_s.append(time.thread_time() - start_cpu)
            found.blocked_s.append(found._blocked_now)

    def timed_step() -> Any:
        start = time.perf_counter()
        try:
            return step()
        finally:
            found.step_s.append(time.perf_counter() - start)

    client.exists = timed_exists
    scheduler.schedule = timed_schedule
    engine.step = timed_step
    return found


def one_run(case: Any, state: str, path: str, timeout_ms: int) -> Run:
    """A serves and writes on a fresh server; the server goes ``state``; B serves on ``path``."""
    import _shared_tier
    import bench_vs_native as bench
    from vllm.config import KVTransferConfig

    from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU
    from hybridkv.vllm.harness.inprocess import InProcessEngine

    probe = InProcessEngine(case.config_json, case.settings)
    probe.close()
    host_bytes = (
        2 * bench.working_set_blocks(case.trace, probe.block_size) * bench.block_bytes(probe)
    )
    prompts = _shared_tier._prompts(case.trace)
    with tempfile.TemporaryDirectory(prefix="bench_stall_") as workdir:
        server = Server(workdir)

        def engine() -> Any:
            extra = {
                "chunk_size": probe.block_size,
                "remote_url": f"redis://127.0.0.1:{server.port}/0",
                "remote_timeout_ms": timeout_ms,
            }
            transfer = KVTransferConfig(
                kv_connector="HybridKVConnector",
                kv_connector_module_path="hybridkv.vllm",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config=extra,
            )
            return InProcessEngine(
                case.config_json, case.settings, transfer, HybridKVOnCPU(host_bytes=host_bytes)
            )

        a = engine()
        try:
            _shared_tier._serve(a, prompts, "a-")
            if not a.worker.worker_remote.flush(30.0):
                raise RuntimeError("engine A's writes did not reach the server within 30 s")
        finally:
            a.close()
        b = engine()
        if path == "sync":
            use_synchronous_path(b)
        timings = _timed_steps(b)
        server.apply(state)
        try:
            report = _serve_all(b, prompts)
            remote = b.scheduler.connector.remote.count
            worker = b.worker.worker_remote.counters()
            return Run(
                state=state,
                path=path,
                schedule_s=tuple(timings.schedule_s),
                schedule_cpu_s=tuple(timings.schedule_cpu_s),
                blocked_s=tuple(timings.blocked_s),
                step_s=tuple(timings.step_s),
                requests=report.requests,
                finished=report.finished,
                wrong_reads=report.wrong_reads,
                promoted=remote["promoted"],
                waited=remote["remote_lookups_waited"],
                late=remote["remote_lookups_late"],
                trips=remote.get("remote_lookup_breaker_trips", 0)
                + worker.get("remote_breaker_trips", 0),
                skips=remote.get("remote_lookup_breaker_skips", 0)
                + worker.get("remote_breaker_skips", 0),
            )
        finally:
            server.stop()  # first: B's close then finds the server gone, not hung
            b.close()


def _serve_all(engine: Any, prompts: list[tuple[str, list[int]]]) -> Any:
    """Every prompt added at once (the scheduler sees new requests while others run)."""
    finished = 0
    for rid, tokens in prompts:
        engine.add("b-" + rid, tokens, 4)
    while engine.busy():
        if engine.tally.steps >= engine.settings.max_steps:
            raise RuntimeError(f"engine B wedged: {finished} requests finished")
        finished += sum(1 for out in engine.step() if out.finish_reason is not None)
    return engine.report(finished)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f}"


def format_run(run: Run) -> str:
    return (
        f"{run.state:<8} {run.path:<6} {len(run.schedule_s):5d} {_ms(run.p(0.5))} "
        f"{_ms(run.p(0.99))} {_ms(max(run.schedule_s))} {_ms(run.p(0.99, run.schedule_cpu_s))} "
        f"{_ms(run.p(0.99, run.blocked_s))} {_ms(max(run.blocked_s))} "
        f"{_ms(run.p(0.99, run.step_s))} {run.promoted:5d} {run.waited:5d} {run.late:4d} "
        f"{run.trips:4d} {run.skips:5d} {run.finished:3d}/{run.requests:<3d} {run.wrong_reads:3d}"
    )


HEADER = (
    "                     ---------- schedule() wall --------  sched cpu ---- blocked ----- "
    " step wall\n"
    "state    path   steps      p50      p99      max      p99      p99      max      p99 "
    "promo  wait late trip  skip done    wrong"
)


def added_p99(runs: Sequence[Run]) -> list[str]:
    """Per path, what a paused and a dead server add to the healthy p99 of ``schedule()``:
    wall, the thread's CPU time and the time blocked on the server (medians over repeats)."""
    lines = []
    for path in PATHS:
        for label, pick in (
            ("wall", lambda r: r.schedule_s),
            ("cpu", lambda r: r.schedule_cpu_s),
            ("blocked", lambda r: r.blocked_s),
        ):
            p99 = {
                state: statistics.median(
                    r.p(0.99, pick(r)) for r in runs if (r.state, r.path) == (state, path)
                )
                for state in STATES
            }
            added = ", ".join(
                f"{state} {(p99[state] - p99['healthy']) * 1e3:+.3f} ms" for state in STATES[1:]
            )
            lines.append(
                f"{path:<6} schedule() p99 {label:<7} {p99['healthy'] * 1e3:8.3f} ms healthy; "
                f"{added}"
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="sliding+full", help="a bench_vs_native layout")
    parser.add_argument("--timeout-ms", type=int, default=200, help="remote_timeout_ms")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each state and path")
    parser.add_argument("--quick", action="store_true", help="the short trace (default: long)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.timeout_ms < 1:
        parser.error("--repeats and --timeout-ms must be >= 1")
    from _vllm_tool import require_vllm, torchvision_shim

    shim = torchvision_shim("bench_remote_stall")  # kept alive while vLLM imports
    require_vllm("bench_remote_stall")
    import bench_vs_native as bench

    cases = {c.name: c for c in bench._cases(args.quick)}
    if args.layout not in cases:
        parser.error(f"--layout: one of {', '.join(cases)}")
    case = cases[args.layout]
    print(
        f"bench_remote_stall: {case.name}, {len(_prompts_of(case))} prompts added at once, "
        f"remote_timeout_ms {args.timeout_ms}, remote_lookup_wait_ms 20 (default), "
        f"{os.cpu_count()} CPUs; times in ms"
    )
    print(HEADER)
    runs = []
    for _ in range(args.repeats):
        for state in STATES:
            for path in PATHS:
                run = one_run(case, state, path, args.timeout_ms)
                runs.append(run)
                print(format_run(run), flush=True)
    for line in added_p99(runs):
        print(line)
    del shim
    bad = any(r.wrong_reads or r.finished != r.requests for r in runs)
    return 1 if bad else 0


def _prompts_of(case: Any) -> list[Any]:
    import _shared_tier

    return list(_shared_tier._prompts(case.trace))


if __name__ == "__main__":
    sys.exit(main())
