"""vLLM 0.33's native OffloadingConnector with hybridkv's plug-ins (``hybridkv.native``), beside
native alone and HybridKVConnector, at equal host bytes.

Each layout of tools/bench_vs_native.py (its chat traces, vLLM's real ``Scheduler`` in-process,
both connector roles on CPU tensors, every KV read content-checked) is served by fresh engines
under each engine loop, every host tier the same bytes (``--host`` times the trace's working
set, 0.5 by default, in native chunks; HybridKVConnector gets the same bytes):

- ``native lru`` / ``native arc``: native alone (``CPUOffloadingSpec``, vLLM's policies);
- ``native + hybridkv policy``: native's CPU tier ordered by ``HybridKVARCPolicy``
  (``eviction_policy`` + ``cache_policy_module_path``);
- ``native + hybridkv tier``: ``TieringOffloadingSpec`` with ``HybridKVRemoteTier`` on a
  ``redis-server`` this tool starts (``secondary_tiers``); engine A serves the trace, then a
  fresh engine B (a second replica, or A restarted) serves it on the same server;
- ``hybridkv``: ``HybridKVConnector`` alone, then with its own shared tier (``remote_url``) as
  engines A and B the same way.

Printed per row: prefill tokens computed and their ratio to the trace's floor (what no cache
can supply: bench_vs_native's ``floor_tokens``), tokens loaded by the connector, GPU prefix
hits, the shared tier's chunks written (A) or promoted (B), wrong reads, steps, and the
scheduler-side connector µs per step (wall, and the calling thread's CPU time). Every figure is
read off the engines' own reports and the tiers' own counters.

Usage: ``python tools/bench_native_plugins.py [--quick] [--host 0.5] [--loops async,sync]
[--layouts sliding+full,mamba+full]``; needs vLLM 0.33 and redis-server (or valkey-server).
Exit 1 when a run reads wrong KV or leaks blocks.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hybridkv
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the tools beside this one

import bench_vs_native as bench
from bench_remote import own_server
from vllm.config import KVTransferConfig

from hybridkv.vllm.harness.chat import run_trace
from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU
from hybridkv.vllm.harness.inprocess import InProcessEngine
from hybridkv.vllm.harness.native_cpu import NativeOffloadOnCPU
from hybridkv.vllm.harness.native_plugins import NativePluginsOnCPU
from hybridkv.vllm.harness.report import InProcessReport

POLICY = {"eviction_policy": "HybridKVARCPolicy", "cache_policy_module_path": "hybridkv.native"}


@dataclass(frozen=True, slots=True)
class Row:
    """One engine's run: its report and its shared tier's chunks written and promoted."""

    name: str
    report: InProcessReport
    written: int = 0
    promoted: int = 0


@dataclass(frozen=True, slots=True)
class Setup:
    """What every row of one layout and loop shares."""

    case: Any
    host_chunks: int
    chunk_bytes: int
    port: int
    namespace: str


def _native(setup: Setup, extra: dict[str, Any], tiers: list[dict[str, Any]] | None) -> Any:
    transfer = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
    )
    adapter = (
        NativeOffloadOnCPU(setup.host_chunks, 1)
        if tiers is None
        else NativePluginsOnCPU(setup.host_chunks, tiers)
    )
    return InProcessEngine(setup.case.config_json, setup.case.settings, transfer, adapter), adapter


def _hybridkv(setup: Setup, remote: bool) -> Any:
    extra: dict[str, Any] = {"eviction_policy": "lru"}
    if remote:
        extra |= {
            "remote_url": f"redis://127.0.0.1:{setup.port}/0",
            "remote_namespace": setup.namespace + "-connector",
        }
    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )
    adapter = HybridKVOnCPU(host_bytes=setup.host_chunks * setup.chunk_bytes, delay=1)
    return InProcessEngine(setup.case.config_json, setup.case.settings, transfer, adapter), None


def _served(name: str, built: tuple[Any, Any], trace: Any, counts: Any = None) -> Row:
    """Serve ``trace`` on a fresh engine and close it, reading
    ``counts(engine, adapter) -> (written, promoted)`` (its shared tier's) before."""
    engine, adapter = built
    try:
        report = run_trace(engine, trace)
        written, promoted = counts(engine, adapter) if counts else (0, 0)
    finally:
        engine.close()
        if adapter is not None and hasattr(adapter, "close"):
            adapter.close()
    return Row(name, report, written, promoted)


def _tier_counts(engine: Any, adapter: Any) -> tuple[int, int]:
    (tier,) = adapter.secondary_tiers(engine)
    tier.drain_jobs()
    tier.remote.flush(30.0)
    counters = tier.snapshot()["remote"]["counters"]
    return counters["written"], counters["promoted"]


def _connector_counts(engine: Any, adapter: Any) -> tuple[int, int]:
    remote = engine.worker.worker_remote
    remote.flush(30.0)
    return remote.counters()["remote_written"], engine.scheduler.connector.remote.count["promoted"]


def rows(setup: Setup) -> list[Row]:
    """Every variant of the module docstring on ``setup``, in order."""
    tier = {
        "type": "HybridKVRemoteTier",
        "module_path": "hybridkv.native",
        "remote_url": f"redis://127.0.0.1:{setup.port}",
        "remote_namespace": setup.namespace,
    }
    trace = setup.case.trace
    found = [
        _served("native lru", _native(setup, {"eviction_policy": "lru"}, None), trace),
        _served("native arc", _native(setup, {"eviction_policy": "arc"}, None), trace),
        _served("native + hybridkv policy", _native(setup, dict(POLICY), None), trace),
    ]
    for engine in ("A", "B"):
        built = _native(setup, {"eviction_policy": "lru"}, [tier])
        found.append(_served(f"native + hybridkv tier, {engine}", built, trace, _tier_counts))
    found.append(_served("hybridkv lru", _hybridkv(setup, remote=False), trace))
    for engine in ("A", "B"):
        built = _hybridkv(setup, remote=True)
        name = f"hybridkv + shared tier, {engine}"
        found.append(_served(name, built, trace, _connector_counts))
    return found


HEADER = (
    f"{'variant':<34} {'computed':>8} {'/floor':>6} {'loaded':>7} {'gpu hit':>7} "
    f"{'written':>7} {'promoted':>8} {'wrong':>5} {'steps':>5} {'us/step':>7} {'cpu us':>6}"
)


def format_row(row: Row, floor: int) -> str:
    r = row.report
    return (
        f"{row.name:<34} {r.prefill_computed:8d} {r.prefill_computed / floor:6.2f} "
        f"{r.external_loaded:7d} {r.gpu_prefix_hits:7d} {row.written:7d} {row.promoted:8d} "
        f"{r.wrong_reads:5d} {r.steps:5d} {r.connector_us:7.0f} {r.connector_cpu_us:6.0f}"
    )


def bench_case(case: Any, port: int, host: float, loop: str) -> tuple[list[str], bool]:
    """One layout under one loop: its lines and whether every run was clean."""
    case = bench.for_loop(case, loop == "async")
    probe = InProcessEngine(case.config_json, case.settings)
    probe.close()
    floor, working, words = bench._figures(case.trace, probe)
    chunk_bytes = bench.native_chunk_bytes(probe)
    setup = Setup(
        case, max(1, round(host * working)), chunk_bytes, port, f"native-{case.name}-{loop}"
    )
    found = rows(setup)
    lines = [
        f"== {case.name} ({loop} loop), {words}; floor {floor}; host tier {setup.host_chunks} "
        f"native chunks of {chunk_bytes} B = {setup.host_chunks * chunk_bytes} B ({host}x the "
        f"working set of {working} chunks) for every variant",
        HEADER,
        *(format_row(row, floor) for row in found),
    ]
    clean = all(r.report.wrong_reads == 0 and r.report.finished == r.report.requests for r in found)
    return lines, clean


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="bench_vs_native's quick traces")
    parser.add_argument("--host", type=float, default=0.5, help="host tier / working set")
    parser.add_argument("--loops", default="async,sync", help="engine loops, comma separated")
    parser.add_argument("--layouts", default="sliding+full,mamba+full,mamba+full-tight")
    args = parser.parse_args(argv)
    wanted = args.layouts.split(",")
    cases = [c for c in bench._cases(args.quick) if c.name in wanted]
    clean = True
    with own_server() as port:
        for case in cases:
            for loop in args.loops.split(","):
                lines, ok = bench_case(case, port, args.host, loop)
                print("\n".join(lines), flush=True)
                clean &= ok
    return 0 if clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
