"""Assemble and run one simulation: options -> setup -> caches, store, connector, plane -> report.

The report is a JSON-ready dict (``hybridkv simulate --json``, schema
:data:`hybridkv.simulator.options.SCHEMA_VERSION`); :mod:`hybridkv.cli.sim_report` renders it as a
table and :mod:`hybridkv.cli.sim_plot` draws its timeline.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from hybridkv.canonical import build_canonical_caches
from hybridkv.errors import HybridKVConfigError
from hybridkv.simulator.engine import Simulation
from hybridkv.simulator.limits import (
    check_arrivals,
    check_flags,
    check_run_memory,
    check_trace_memory,
)
from hybridkv.simulator.model_config import load_model_config
from hybridkv.simulator.options import DEFAULT_REQUESTS, SCHEMA_VERSION, SimOptions
from hybridkv.simulator.plane import DataPlane
from hybridkv.simulator.result import SimResult
from hybridkv.simulator.setup import SimSetup, derive_setup
from hybridkv.simulator.threads import one_intra_op_thread
from hybridkv.simulator.timing import copy_time_model, transfer_report
from hybridkv.testbed.aborts import AbortPlan
from hybridkv.testbed.caches import build_sim_caches
from hybridkv.testbed.content import ContentCodec
from hybridkv.testbed.copy_time import CopyTimeModel
from hybridkv.testbed.faults import FaultPlan
from hybridkv.testbed.trace import TraceRequest, load_trace
from hybridkv.testbed.workloads import builtin_workload
from spec.connector_api import SchedulerConnector

__all__ = ["SimOptions", "simulate"]


def _trace(options: SimOptions) -> tuple[TraceRequest, ...]:
    if options.trace.endswith(".jsonl"):
        trace = load_trace(options.trace)
        if options.requests is not None:
            trace = trace[: options.requests]  # limits.check_flags refused < 1
        return trace
    count = DEFAULT_REQUESTS if options.requests is None else options.requests
    return builtin_workload(options.trace, count)


def _device(options: SimOptions) -> torch.device:
    if options.device == "cuda" and not torch.cuda.is_available():
        raise HybridKVConfigError(
            "--device",
            "cuda",
            "no CUDA device is visible to torch",
            "install the CUDA build of torch on a GPU machine, or pass --device cpu",
        )
    return torch.device(options.device)


def _check_trace_fits(trace: tuple[TraceRequest, ...], setup: SimSetup) -> None:
    longest = _longest_sequence(trace)
    if longest > setup.planner.max_model_len:
        raise HybridKVConfigError(
            "--max-model-len",
            setup.planner.max_model_len,
            f"is shorter than the trace's longest sequence ({longest} tokens)",
            f"pass --max-model-len {longest}",
        )
    needed = _blocks_for(setup, longest)
    if needed > setup.scheduler.num_blocks - 1:
        # A request that cannot fit alone would preempt itself forever (vLLM refuses it too).
        raise HybridKVConfigError(
            "--gpu-blocks",
            setup.scheduler.num_blocks - 1,
            f"cannot hold the trace's longest sequence ({longest} tokens needs {needed} blocks)",
            f"pass --gpu-blocks {needed} or more",
        )


def _blocks_for(setup: SimSetup, tokens: int) -> int:
    """Blocks one request of ``tokens`` tokens holds at most, over every group."""
    from spec.kinds import GroupKind

    total = 0
    for g in setup.scheduler.groups:
        if g.kind is GroupKind.FULL:
            total += -(-tokens // g.block_size)
        elif g.kind is GroupKind.SLIDING:
            total += min(-(-tokens // g.block_size), -(-g.sliding_window // g.block_size) + 1)
        else:
            total += 2  # align mode: the latest state and the one before it (GR-5)
    return total


def _longest_sequence(trace: tuple[TraceRequest, ...]) -> int:
    context: dict[str, int] = {}
    longest = 0
    for r in trace:
        base = context.get(r.conversation, 0) if r.conversation else 0
        total = base + len(r.prompt) + r.max_tokens
        if r.conversation:
            context[r.conversation] = total
        longest = max(longest, total)
    return longest


@one_intra_op_thread
def simulate(options: SimOptions, *, progress: bool = False) -> dict[str, Any]:
    """Run ``options`` and return the report (module docstring).

    Refusal: bad options raise :class:`HybridKVConfigError` (or the spec's ConfigError) naming
    the flag, before anything is allocated.
    """
    check_flags(options)
    source, config = load_model_config(options.preset, options.config)
    check_trace_memory(options)
    trace = _trace(options)
    max_steps = check_arrivals(trace)
    setup = _setup(options, config, 1 if options.gpu_blocks is None else options.gpu_blocks)
    if options.gpu_blocks is None:
        # Room for three of the longest sequences: the GPU prefix cache is under pressure, as
        # on a busy server, so what the host tier brings back shows.
        setup = _setup(options, config, 3 * _blocks_for(setup, _longest_sequence(trace)))
    _check_trace_fits(trace, setup)
    faults = FaultPlan(options.faults, options.seed)
    aborts = AbortPlan(options.aborts, options.seed)
    model = copy_time_model(options, setup)
    device = _device(options)
    check_run_memory(options, setup, trace)
    num_blocks = setup.scheduler.num_blocks
    caches = build_sim_caches(setup.sim_groups, num_blocks, options.layers_per_group, device)
    canonical = build_canonical_caches(caches.kv_caches, caches.groups, num_blocks)
    slot_bytes = max(canonical.group_bytes(g) for g in range(len(canonical.group_refs)))
    entries = options.host_bytes // slot_bytes
    if entries < 1:
        raise HybridKVConfigError(
            "--host-bytes",
            options.host_bytes,
            f"holds no entry: one block of the largest group takes {slot_bytes} bytes",
            f"pass at least {slot_bytes}",
        )
    connector, plane, snapshot = _build_connector(options, setup, canonical, entries, faults, model)
    try:
        sim = Simulation(
            setup.scheduler,
            connector,
            plane,
            ContentCodec(caches),
            trace,
            units=setup.planner.units,
            check=options.check,
            connector_snapshot=snapshot,
            aborts=aborts if options.aborts else None,
            max_steps=max_steps,
        )
        result = _run_with_progress(sim, len(trace)) if progress else sim.run()
    finally:
        plane.close()
    report = _report(options, source, setup, entries, slot_bytes, result)
    report["transfers"] = transfer_report(model, options, result.transfers)
    return report


def _setup(options: SimOptions, config: Mapping[str, Any], gpu_blocks: int) -> SimSetup:
    return derive_setup(
        config,
        max_model_len=options.max_model_len,
        gpu_blocks=gpu_blocks,
        max_num_batched_tokens=options.max_num_batched_tokens,
        max_num_running=options.max_num_running,
        layers_per_group=options.layers_per_group,
        load_deadline_steps=options.load_deadline_steps,
    )


def _build_connector(  # noqa: PLR0917 - every part of the plane
    options: SimOptions,
    setup: SimSetup,
    canonical: Any,
    entries: int,
    faults: FaultPlan,
    model: CopyTimeModel,
) -> tuple[SchedulerConnector, DataPlane, Callable[[], Mapping[str, Any]] | None]:
    if options.connector == "reference":
        from hybridkv.simulator.reference import ReferencePlane
        from spec.connector import ReferenceConnector
        from spec.planner import HybridOffloadPlanner
        from spec.store import HostStore

        planner = HybridOffloadPlanner(
            tuple((g.kind, g.block_size) for g in setup.scheduler.groups),
            setup.scheduler.hash_block_size,
            setup.chunk_size,
            setup.planner.max_model_len,
        )
        store = HostStore(entries, options.policy)
        connector = ReferenceConnector.from_groups(planner, store, setup.scheduler.groups)
        plane = ReferencePlane(connector, canonical, faults, model)
        return connector, plane, connector.snapshot
    from hybridkv.simulator.optimized import build_optimized

    return build_optimized(setup, canonical, entries, faults, options.policy, model=model)


def _run_with_progress(sim: Simulation, total: int) -> SimResult:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("[bold]serving"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("simulate", total=total)

        def advance(done: int, _total: int) -> None:
            bar.update(task, completed=done)

        sim.progress = advance
        return sim.run()


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def _verdict(r: SimResult) -> str:
    """pass: no wrong content (loads, reads, store sources), no broken invariant, the token
    identity holds, every read was served by a counted event, and every injected failure was
    observed to recover (or its request ended by design)."""
    wrong = r.wrong_content_loads + r.wrong_content_reads + r.transfers.wrong_content_stores
    recovered = r.failures_recovered + r.failures_ended == r.failures_injected
    clean = wrong == 0 and r.invariant_violations == 0 and r.unaccounted_reads == 0
    return "pass" if clean and r.identity_holds and recovered else "fail"


def _report(  # noqa: PLR0917 - the report reads every part of the run
    options: SimOptions,
    source: str,
    setup: SimSetup,
    entries: int,
    slot_bytes: int,
    r: SimResult,
) -> dict[str, Any]:

    return {
        "schema_version": SCHEMA_VERSION,
        "setup": {
            "model": source,
            "groups": list(setup.group_kinds),
            "block_size": setup.layout.block_size,
            "chunk_size": setup.chunk_size,
            "claim_unit": setup.planner.claim_unit,
            "layers_per_group": setup.layers_per_group,
            "model_layers_per_group": setup.layout_layers,
            "gpu_blocks": setup.scheduler.num_blocks - 1,
            "host_entries": entries,
            "host_bytes": entries * slot_bytes,
            "policy": options.policy,
            "device": options.device,
            "connector": options.connector,
            "trace": options.trace,
            "faults": options.faults,
            "seed": options.seed,
            "check": options.check,
        },
        "requests": r.requests,
        "finished": dict(sorted(r.finished.items())),
        "steps": r.steps,
        "seconds": round(r.seconds, 3),
        "prompt_tokens": r.prompt_tokens,
        "prefill_tokens_computed": r.prefill_tokens_computed,
        "prefill_tokens_loaded": r.prefill_tokens_loaded,
        "local_hit_tokens": r.local_hit_tokens,
        "prompt_tokens_unserved": r.prompt_tokens_unserved,
        "identity_holds": r.identity_holds,
        "served_again": r.served_again,
        "unaccounted_reads": r.unaccounted_reads,
        "hit_rate": round(r.hit_rate, 4),
        "continuation_turns": r.continuation_turns,
        "continuation_hits": r.continuation_hits,
        "continuation_hit_tokens": r.continuation_hit_tokens,
        "load_jobs": r.load_jobs,
        "store_jobs": r.store_jobs,
        "bytes_loaded": r.bytes_loaded,
        "bytes_stored": r.bytes_stored,
        "load_gbps": _gbps(r.bytes_loaded, r.load_seconds),
        "store_gbps": _gbps(r.bytes_stored, r.store_seconds),
        "failures_injected": r.failures_injected,
        "failed_loads": r.failed_loads,
        "failed_stores": r.failed_stores,
        "failures_recovered": r.failures_recovered,
        "recovered_loads": r.recovered_loads,
        "recovered_stores": r.recovered_stores,
        "failures_ended": r.failures_ended,
        "tokens_discarded_by_recovery": r.tokens_discarded_by_recovery,
        "blocks_verified": r.blocks_verified,
        "wrong_content_loads": r.wrong_content_loads,
        "wrong_content_reads": r.wrong_content_reads,
        "invariant_checks": r.invariant_checks,
        "invariant_violations": r.invariant_violations,
        "violations": r.violations[:20],
        "verdict": _verdict(r),
        "timeline": [
            {
                "step": s.step,
                "hit_tokens": s.hit_tokens,
                "loaded_tokens": s.loaded_tokens,
                "computed_tokens": s.computed_tokens,
                "failed_loads": s.failed_loads,
                "failed_stores": s.failed_stores,
                "bytes_loaded": s.bytes_loaded,
                "host_used": s.host_used,
                "host_capacity": s.host_capacity,
            }
            for s in r.timeline
        ],
    }
