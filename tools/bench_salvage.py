"""Failure salvage inside vLLM 0.33's real Scheduler: tokens recomputed after failed loads, with
HybridKVConnector's re-claim and with vLLM's whole-request recompute.

    python tools/bench_salvage.py            # three layouts, 6 seeds each
    python tools/bench_salvage.py --quick    # two layouts, 2 seeds each
    python tools/bench_salvage.py --tight    # sliding + full and mamba + full on tight pools

What happens to a failed load (vLLM 0.33, ``kv_load_failure_policy="recompute"``): the worker
reports the request in ``failed_recving``; ``_handle_failed_recving`` sets its
``num_computed_tokens`` to 0, ``_update_waiting_for_remote_kv`` frees its blocks (none was
cached: async loads delay caching), and the next ``schedule()`` starts it over: a local prefix
lookup, then ``get_num_new_matched_tokens(request, local hit)``. HybridKVConnector remembers the
failed keys (a failed job's keys are also evicted unless another load pins them), so that re-ask
claims the longest aligned prefix that avoids them, loaded again; the rest is recomputed. vLLM's
native ``OffloadingConnector`` has no failure path (its worker asserts success,
``offloading/worker.py:299-301``), so the baseline is the same connector with the re-claim
switched off (``ConnectorCore._set_salvage(False)``, a benchmark control): the re-ask after a
failure claims nothing, the request recomputes everything past its local hit. Only that differs.

Each case plays a multi-turn chat (:class:`hybridkv.vllm.harness.chat.ChatTrace`) on the in-process
engine (both connector roles, CPU tensors, every KV slot and mamba state read is checked), twice per
seed: salvage on and off. Load jobs fail by a keyed draw (request, first key, how often that request
has loaded from that key), so both runs fail the same loads while they make the same ones; faults
fire before submission (the job's blocks stay unwritten, so a read of them before recompute would be
a wrong read).

Counted from observed events (:class:`SalvageWatch`): a *failed load* is a request in the
worker's ``failed_recving``; its claim is what vLLM handed ``update_state_after_alloc`` and
where the request's ``num_computed_tokens`` stood then (the load's end ``e``). From the failure
the request is in a window until its computed tokens reach ``e`` again; in it, every position
below ``e`` the scheduler schedules counts as *recomputed*; a re-claim's load that succeeds
counts as *reloaded* (the salvage). At each window's close, for the last restart (the admission
after the last failure or preemption): local hit + reloaded + recomputed since == ``e``.

Exit 1 on a wrong read, a leaked block, a broken identity, an unfinished request or a wedged
run (its seed is left out of both sums). On a tight GPU pool, vLLM 0.33 refuses a request
restarted by a failed load and, at the head of ``kv_holding_waiting``, stops the loop before a
request whose load finished behind it. Two refusals do this: the re-claim reserves the request's
own stale ``_inflight_prefills`` entry on top of its allocation, and the full-sequence admission
refuses even a claim of nothing. The facade's guard (:mod:`hybridkv.vllm.reclaim`) defers such
a request when the step that refused it ran nothing, and then answers nothing if deferring ran
nothing either. Each layout line counts what the guard did. ``--no-guard`` switches it off to
show the wedges (docs/benchmarks/failure-recovery.md). The guard acts in both runs, so they
still differ only by the re-claim.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's hybridkv and spec, not another install's

from spec.presets import tiny_config  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/_vllm_tool.py
from _vllm_tool import require_vllm, torchvision_shim  # noqa: E402

_SHIM = torchvision_shim("bench_salvage")  # kept alive (tools/_vllm_tool.py)
require_vllm("bench_salvage")

from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.connector.api import TransferJob, TransferKind  # noqa: E402
from hybridkv.vllm.harness.chat import ChatTrace, run_trace  # noqa: E402
from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.delayed import DelayedCompletion  # noqa: E402
from hybridkv.vllm.harness.engine_config import EngineSettings, WedgedError  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402

HOST_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class Case:
    """One layout: config.json, engine knobs, chunk (tokens), the trace's shape, fault rate."""

    name: str
    config_json: dict[str, Any]
    settings: EngineSettings
    chunk: int
    trace: ChatTrace
    load_rate: float


def cases(quick: bool) -> list[Case]:
    """mamba align + full, sliding + full and (unless quick) two windows + full."""
    sliding = EngineSettings(
        num_gpu_blocks=48,
        max_model_len=768,
        block_size=32,
        max_num_seqs=3,
        max_num_batched_tokens=128,
    )
    found = [
        Case(
            "mamba+full",
            tiny_config("qwen3-next-80b-a3b", 4),
            EngineSettings(
                num_gpu_blocks=12, max_model_len=2560, max_num_seqs=2, max_num_batched_tokens=640
            ),
            640,
            ChatTrace(convs=4, turns=3, system_len=1500, user_min=100, user_max=200),
            0.3,
        ),
        Case(
            "sliding+full",
            tiny_config("gpt-oss-20b", 2),
            sliding,
            32,
            ChatTrace(convs=4, turns=3, system_len=160),
            0.1,
        ),
    ]
    if not quick:
        found.append(
            Case(
                "2sliding+full",
                tiny_config("gpt-oss-20b", 3),
                replace(sliding, num_gpu_blocks=56),
                32,
                ChatTrace(convs=4, turns=3, system_len=160),
                0.1,
            )
        )
    return found


# GPU pools below the cases' own, as blocks above the smallest that serves max_model_len
# (smallest_pool): vLLM 0.33 refuses restarted requests there, and the facade's guard
# (hybridkv.vllm.reclaim) acts.
TIGHT_POOLS = {"sliding+full": (0, 2, 4, 6, 8), "mamba+full": (0,)}


def smallest_pool(case: Case) -> int:
    """The smallest GPU pool vLLM's start-up check accepts for ``case`` under the engine loop
    in use, asked of vLLM itself: a sliding window reserves its admission cap over every step
    in flight, so async scheduling (two) needs more blocks than sync (sliding + full: 38 and
    34); ``case``'s own pool if none below it is accepted."""
    for pool in range(1, case.settings.num_gpu_blocks):
        try:
            engine = InProcessEngine(
                case.config_json, replace(case.settings, num_gpu_blocks=pool), _transfer(case.chunk)
            )
        except ValueError:
            continue  # "To serve at least one request with the model's max seq len ..."
        engine.close()
        return pool
    return case.settings.num_gpu_blocks


def tight_cases() -> list[Case]:
    """Each of ``TIGHT_POOLS``' layouts on each of its pools (``max_steps`` 400)."""
    found = []
    for case in cases(quick=True):
        smallest = smallest_pool(case)
        for extra in TIGHT_POOLS[case.name]:
            settings = replace(case.settings, num_gpu_blocks=smallest + extra, max_steps=400)
            found.append(replace(case, settings=settings))
    return found


# ------------------------------------------------------------------ keyed load faults


class KeyedLoadFaults(HybridKVOnCPU):
    """HybridKVOnCPU whose load jobs fail by a keyed draw: ``sha256(seed, request, the job's
    first key, n)`` below ``rate``, ``n`` counting that request's earlier jobs from that key
    (a fault is transient: the re-claim's first job draws again). Stores never fail."""

    def __init__(self, seed: int, rate: float, delay: int = 1) -> None:
        super().__init__(host_bytes=HOST_BYTES, delay=delay)
        self.seed, self.rate = seed, rate
        self._seen: Counter[tuple[str, bytes]] = Counter()
        self.load_faults = 0

    def fails(self, job: TransferJob) -> bool:
        """The worker's job hook: True fails ``job`` before submission."""
        if job.kind is not TransferKind.LOAD or not job.items:
            return False
        first = (job.request_id, job.items[0].key)
        n = self._seen[first]
        self._seen[first] += 1
        digest = hashlib.sha256(b"%d|%s|%d|" % (self.seed, job.request_id.encode(), n))
        digest.update(first[1])
        failed = int.from_bytes(digest.digest()[:8], "big") < self.rate * 2**64
        self.load_faults += failed
        return failed

    def attach(self, connector: Any, kv_caches: dict[str, Any]) -> None:
        connector._register(
            kv_caches, self.fails, None, lambda engine: DelayedCompletion(engine, self.delay)
        )
        self.connector = connector

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "load_faults": self.load_faults}


# ------------------------------------------------------------------ the observer


@dataclass(slots=True)
class Window:
    """One request from its (first) failed load until its computed tokens reach ``end``."""

    end: int
    failures: int = 1
    restarted: bool = True  # no admission seen since the last failure or preemption
    local: int = 0  # the last admission's local prefix hit (below ``end``)
    claim: int = 0  # the last admission's external claim (below ``end``)
    claim_loaded: bool = False  # that claim's load reported success
    recomputed: int = 0  # every position below ``end`` scheduled in the window
    recomputed_last: int = 0  # those since the last admission
    reloaded: int = 0  # re-claimed tokens (below ``end``) whose load succeeded


@dataclass(slots=True)
class Tally:
    """One run's figures (module docstring)."""

    failed_loads: int = 0
    failed_claimed: int = 0  # tokens the failed loads claimed
    windows: int = 0
    restored: int = 0  # sum of the closed windows' ends
    local: int = 0
    reloaded: int = 0
    recomputed: int = 0
    recomputed_last: int = 0
    preempted_in_window: int = 0
    broken: list[str] = field(default_factory=list)  # windows whose identity did not hold


class SalvageWatch:
    """Observes one in-process engine: the scheduler's output, the scheduler-side connector's
    ``update_state_after_alloc`` and the worker's transfer results (module docstring)."""

    def __init__(self, engine: InProcessEngine) -> None:
        self.engine = engine
        self.tally = Tally()
        self.windows: dict[str, Window] = {}
        self._loads: dict[str, tuple[int, int]] = {}  # rid -> (start, end) of its load
        self._admitted: dict[str, int] = {}  # this schedule's num_external_tokens > 0
        connector, worker, scheduler = engine.scheduler.connector, engine.worker, engine.scheduler
        after_alloc, results, schedule = (
            connector.update_state_after_alloc,
            worker.get_transfer_results,
            scheduler.schedule,
        )

        def update_state_after_alloc(request: Any, blocks: Any, num_external: int) -> Any:
            if num_external > 0:
                self._admitted[request.request_id] = num_external
            return after_alloc(request, blocks, num_external)

        def get_transfer_results(finished: Any) -> Any:
            out = results(finished)
            self._results(set(out.finished_recving), set(out.failed_recving))
            return out

        def observed_schedule(*args: Any, **kwargs: Any) -> Any:
            self._admitted = {}
            output = schedule(*args, **kwargs)
            self._scheduled(output)
            return output

        connector.update_state_after_alloc = update_state_after_alloc
        worker.get_transfer_results = get_transfer_results
        scheduler.schedule = observed_schedule

    def _scheduled(self, output: Any) -> None:
        requests = self.engine.requests
        for rid in output.preempted_req_ids or ():
            if rid in self.windows:
                self.windows[rid].restarted = True
                self.tally.preempted_in_window += 1
        for rid, external in self._admitted.items():
            end = requests[rid].num_computed_tokens  # local hit + claim, set by vLLM
            self._loads[rid] = (end - external, end)
            window = self.windows.get(rid)
            if window is not None and window.restarted:
                self._admit(rid, window, end - external, external)
        for rid, n in output.num_scheduled_tokens.items():
            window = self.windows.get(rid)
            if window is None:
                continue
            c1 = requests[rid].num_computed_tokens
            c0 = c1 - n
            if window.restarted:
                self._admit(rid, window, c0, 0)
            again = max(0, min(c1, window.end) - c0)
            window.recomputed += again
            window.recomputed_last += again
            if c1 >= window.end:
                self._close(rid, window)

    def _admit(self, rid: str, window: Window, local: int, claim: int) -> None:
        window.restarted = False
        window.local = min(local, window.end)
        window.claim = min(local + claim, window.end) - window.local
        window.claim_loaded = False
        window.recomputed_last = 0

    def _results(self, finished: set[str], failed: set[str]) -> None:
        for rid in finished | failed:
            load = self._loads.pop(rid, None)
            if load is None or self.engine.requests[rid].is_finished():
                continue  # not a load of a live request (aborted ones are not failures here)
            start, end = load
            window = self.windows.get(rid)
            if rid in failed:
                self.tally.failed_loads += 1
                self.tally.failed_claimed += end - start
                if window is None:
                    self.windows[rid] = Window(end)
                else:
                    window.end = max(window.end, end)
                    window.failures += 1
                    window.restarted = True
            elif window is not None and not window.restarted:
                window.claim_loaded = True
                window.reloaded += max(0, min(end, window.end) - start)
                if end >= window.end:
                    self._close(rid, window)

    def _close(self, rid: str, window: Window) -> None:
        del self.windows[rid]
        t = self.tally
        t.windows += 1
        t.restored += window.end
        t.local += window.local
        t.reloaded += window.reloaded
        t.recomputed += window.recomputed
        t.recomputed_last += window.recomputed_last
        loaded = window.claim if window.claim_loaded else 0
        if window.local + loaded + window.recomputed_last != window.end:
            t.broken.append(f"{rid}: {window}")

    def finish(self) -> Tally:
        """The tally, every window still open counted as broken."""
        for rid, window in self.windows.items():
            self.tally.broken.append(f"{rid} never reached {window.end}: {window}")
        self.windows = {}
        return self.tally


# ------------------------------------------------------------------ runs


@dataclass(frozen=True, slots=True)
class Run:
    """One trace played once: the watch's tally and the engine's checks."""

    tally: Tally
    wrong_reads: int
    slots_checked: int
    leaked_blocks: int
    unfinished: int
    load_faults: int
    deferred: int = 0  # restarts the facade's guard deferred (hybridkv.vllm.reclaim)
    whole: int = 0  # restarts it moved to whole-request recompute
    traces: int = 1


def _transfer(chunk: int) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"host_memory_bytes": HOST_BYTES, "chunk_size": chunk},
    )


def play(case: Case, seed: int, *, salvage: bool, guard: bool = True) -> Run:
    """``case``'s trace with ``seed`` (tokens and faults), salvage on or off; ``guard=False``
    switches the facade's re-claim guard off (:mod:`hybridkv.vllm.reclaim`: it then never
    turns a refused re-claim into whole-request recompute, and vLLM can wedge)."""
    adapter = KeyedLoadFaults(seed, case.load_rate)
    engine = InProcessEngine(case.config_json, case.settings, _transfer(case.chunk), adapter)
    connector = engine.scheduler.connector
    connector.core._set_salvage(salvage)
    connector._reclaim.enabled = guard
    watch = SalvageWatch(engine)
    report = run_trace(engine, replace(case.trace, seed=seed))
    return Run(
        watch.finish(),
        report.wrong_reads,
        report.slots_checked,
        report.leaked_blocks,
        report.requests - report.finished,
        adapter.load_faults,
        connector._reclaim.deferred,
        connector._reclaim.whole,
    )


def total(runs: list[Run]) -> Run:
    """The runs' figures summed (broken windows concatenated)."""
    t = Tally()
    for run in runs:  # summed by field, so a field added to Tally is summed too
        for name in Tally.__dataclass_fields__:
            if name != "broken":
                setattr(t, name, getattr(t, name) + getattr(run.tally, name))
        t.broken += run.tally.broken
    sums = {name: sum(getattr(r, name) for r in runs) for name in Run.__slots__[1:]}
    return Run(t, **sums)


def bench_case(case: Case, seeds: range, *, guard: bool = True) -> tuple[Run, Run, list[str]]:
    """Every seed with salvage on and off; the sums over the seeds where neither run wedged,
    and a line per wedged run (those seeds are left out of both sums)."""
    on, off, wedged = [], [], []
    for seed in seeds:
        pair = []
        for salvage in (True, False):
            try:
                pair.append(play(case, seed, salvage=salvage, guard=guard))
            except WedgedError as error:
                wedged.append(f"{case.name} seed {seed} salvage={salvage}: {error}")
        if len(pair) == 2:
            on.append(pair[0])
            off.append(pair[1])
    return total(on), total(off), wedged


HEADER = (
    f"{'layout':<14} {'run':<8} {'faults':>6} {'failed':>6} {'claimed':>7} {'windows':>7} "
    f"{'restore':>7} {'local':>6} {'reload':>6} {'recomp':>6} {'preempt':>7} {'wrong':>5} "
    f"{'checked':>8}"
)


def row(name: str, label: str, run: Run) -> str:
    t = run.tally
    return (
        f"{name:<14} {label:<8} {run.load_faults:6d} {t.failed_loads:6d} {t.failed_claimed:7d} "
        f"{t.windows:7d} {t.restored:7d} {t.local:6d} {t.reloaded:6d} {t.recomputed:6d} "
        f"{t.preempted_in_window:7d} {run.wrong_reads:5d} {run.slots_checked:8d}"
    )


def problems(name: str, label: str, run: Run) -> list[str]:
    found = [f"{name} {label}: identity broken for {b}" for b in run.tally.broken]
    if run.wrong_reads or run.leaked_blocks or run.unfinished:
        found.append(
            f"{name} {label}: {run.wrong_reads} wrong reads, {run.leaked_blocks} leaked "
            f"blocks, {run.unfinished} unfinished"
        )
    return found


def _ratio(part: int, whole: int) -> str:
    return f"{part / whole:.2f}" if whole else "n/a"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two layouts, two seeds each")
    parser.add_argument("--seeds", type=int, default=None, help="traces per layout")
    parser.add_argument(
        "--tight", action="store_true", help="tight GPU pools (TIGHT_POOLS) instead"
    )
    parser.add_argument(
        "--no-guard",
        action="store_true",
        help="switch the facade's restart guard off (hybridkv.vllm.reclaim): vLLM can wedge",
    )
    args = parser.parse_args(argv)
    seeds = range(args.seeds or (2 if args.quick else 6))
    print(
        "faults: failed loads (keyed, before submission); claimed: their tokens; windows: "
        "failures recovered; restore: the failed loads' ends; local / reload / recomp: "
        "positions below them restored by vLLM's prefix cache, by the re-claim, by compute"
    )
    print(HEADER)
    bad: list[str] = []
    for case in tight_cases() if args.tight else cases(args.quick):
        on, off, wedged = bench_case(case, seeds, guard=not args.no_guard)
        print(row(case.name, "salvage", on))
        print(row(case.name, "whole", off))
        print(
            f"  {case.name}, {case.settings.num_gpu_blocks} GPU blocks: restarts the guard "
            f"deferred {on.deferred} / {off.deferred}, moved to whole-request {on.whole} / "
            f"{off.whole} (salvage / whole runs); {len(wedged)} wedged runs"
        )
        print(
            f"  {case.name}: {on.traces} traces, load fault rate {case.load_rate}: tokens "
            f"recomputed after failed loads, salvage / whole-request = {on.tally.recomputed} / "
            f"{off.tally.recomputed} = {_ratio(on.tally.recomputed, off.tally.recomputed)}; "
            f"per token to restore {_ratio(on.tally.recomputed, on.tally.restored)} / "
            f"{_ratio(off.tally.recomputed, off.tally.restored)}",
            flush=True,
        )
        bad += problems(case.name, "salvage", on) + problems(case.name, "whole", off) + wedged
    for line in bad:
        print(f"ERROR {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
