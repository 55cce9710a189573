"""``hybridkv simulate``: serve a workload on a hybrid model's KV-cache layout, verify every byte.

The spec scheduler (vLLM 0.33's, with our contract's departures) drives the connector; the
connector claims, loads and stores through a host store and a transfer engine on real tensors,
laid out as vLLM lays out the model's caches. Every block a forward writes holds content that is
a function of its exact token prefix, so every loaded block (and every block a request reads
from a cache) is checked against what recomputation would write: ``wrong_content_loads`` must
be 0. ``--check`` also checks every registered invariant of the scheduler, block pool, groups,
host store and connector after every step.

Exit codes: 0 when no content was wrong and no invariant broke; 1 otherwise; 2 for bad input.
The JSON form (``--json``) is a stable schema (``schema_version``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping
from typing import Any

from hybridkv.errors import HybridKVConfigError
from hybridkv.simulator.options import SCHEMA_VERSION, SimOptions

__all__ = ["SCHEMA_VERSION", "add_parser", "options_from_args", "parse_bytes", "run"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """``"1GiB"`` -> 1073741824. Accepts an int with an optional unit (k, M, G, T; KiB...).

    Refusal: :class:`HybridKVConfigError` (field ``--host-bytes``).
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise HybridKVConfigError(
            "--host-bytes", text, "is not a byte size", "pass e.g. 1GiB, 512MiB or 2000000000"
        )
    value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise HybridKVConfigError("--host-bytes", text, "must be positive", "pass e.g. 1GiB")
    return value


def add_parser(sub: Any) -> None:
    """Register ``simulate`` on the subcommand set of the top-level parser."""
    from spec.presets import DEFAULT_PRESET

    p = sub.add_parser(
        "simulate",
        help="serve a workload through the offload connector and verify every loaded byte",
        description="Simulate KV-cache offload for a hybrid model on real tensors.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--preset", metavar="NAME", help=f"a built-in model (default {DEFAULT_PRESET})"
    )
    src.add_argument("--config", metavar="PATH", help="a Hugging Face config.json (or its folder)")
    p.add_argument(
        "--trace",
        default="multi-turn",
        help="multi-turn (default), shared-prefix, or a FILE.jsonl trace",
    )
    p.add_argument(
        "--requests",
        type=int,
        help="requests to serve (default 32, 48 with --engine vllm; a file: all)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the KV lives")
    p.add_argument("--host-bytes", default="1GiB", help="host store size (default 1GiB)")
    p.add_argument("--policy", choices=["lru", "arc"], default="lru", help="host eviction policy")
    p.add_argument("--faults", type=float, default=0.0, help="probability a transfer job fails")
    p.add_argument("--check", action="store_true", help="check every invariant every step")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw hits, loads and host occupancy")
    p.add_argument("--seed", type=int, default=0, help="seed of the faults (default 0)")
    p.add_argument(
        "--connector",
        choices=["optimized", "reference"],
        default="optimized",
        help="the optimized core (default) or the spec's reference connector",
    )
    p.add_argument(
        "--engine",
        choices=["spec", "vllm"],
        default="spec",
        help="the spec scheduler (default) or vLLM 0.33's own Scheduler (needs vllm)",
    )
    p.add_argument(
        "--gpu-blocks",
        type=int,
        help="GPU KV blocks (default: room for three of the trace's longest sequences)",
    )
    p.add_argument(
        "--layers-per-group", type=int, default=1, help="layers simulated per group (default 1)"
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget")
    p.add_argument("--max-num-running", type=int, default=8, help="running requests at most")
    p.add_argument("--max-model-len", type=int, default=32768, help="longest sequence")
    p.add_argument(
        "--load-deadline-steps", type=int, default=64, help="steps a load may pend (default 64)"
    )
    _add_timing_arguments(p)
    p.set_defaults(run=run)


def _add_timing_arguments(p: Any) -> None:
    """The copy-time model's flags (:mod:`hybridkv.testbed.copy_time`) and the client's aborts."""
    from hybridkv.testbed.aborts import ABORT_WINDOW_STEPS
    from hybridkv.testbed.copy_time import DEFAULT_GBPS, DEFAULT_LATENCY_US, DEFAULT_STEP_MS

    p.add_argument(
        "--transfer-gbps",
        type=float,
        default=DEFAULT_GBPS,
        metavar="GBPS",
        help=f"host link bandwidth per direction, GB/s (default {DEFAULT_GBPS:g})",
    )
    p.add_argument(
        "--transfer-latency-us",
        type=float,
        default=DEFAULT_LATENCY_US,
        metavar="US",
        help=f"fixed cost of each transfer job, microseconds (default {DEFAULT_LATENCY_US:g})",
    )
    p.add_argument(
        "--step-ms",
        type=float,
        default=DEFAULT_STEP_MS,
        metavar="MS",
        help=f"modelled length of one engine step, milliseconds (default {DEFAULT_STEP_MS:g})",
    )
    p.add_argument(
        "--aborts",
        type=float,
        default=0.0,
        metavar="RATE",
        help="probability a request's client cancels it when no first token came 1 to "
        f"{ABORT_WINDOW_STEPS} steps after it arrived (default 0)",
    )


def options_from_args(args: argparse.Namespace) -> SimOptions:
    """The :class:`~hybridkv.simulator.options.SimOptions` of a parsed command line."""
    return SimOptions(
        preset=args.preset,
        config=args.config,
        trace=args.trace,
        requests=args.requests,
        device=args.device,
        host_bytes=parse_bytes(args.host_bytes),
        policy=args.policy,
        faults=args.faults,
        check=args.check,
        seed=args.seed,
        connector=args.connector,
        gpu_blocks=args.gpu_blocks,
        layers_per_group=args.layers_per_group,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_running=args.max_num_running,
        max_model_len=args.max_model_len,
        load_deadline_steps=args.load_deadline_steps,
        transfer_gbps=args.transfer_gbps,
        transfer_latency_us=args.transfer_latency_us,
        step_ms=args.step_ms,
        aborts=args.aborts,
        engine=args.engine,
    )


def run(args: argparse.Namespace) -> int:
    """Execute ``hybridkv simulate``; returns the exit code (config errors propagate to main)."""
    from hybridkv.simulator.run import simulate

    options = options_from_args(args)
    if options.engine == "vllm":
        return _run_vllm(options, args)
    if args.plot:
        from hybridkv.cli.sim_plot import require_matplotlib

        require_matplotlib(args.plot)  # refuse before a long run, not after
    report = simulate(options, progress=not args.json)
    if args.plot:
        from hybridkv.cli.sim_plot import plot

        plot(report, args.plot)
    if args.json:
        print(json.dumps(_without_timeline(report), indent=2))
    else:
        from hybridkv.cli.sim_report import render

        render(report)
    sys.stdout.flush()
    return 0 if report["verdict"] == "pass" else 1


def _run_vllm(options: Any, args: argparse.Namespace) -> int:
    """``--engine vllm`` (:mod:`hybridkv.simulator.on_vllm`): vLLM is imported only on this path."""
    from hybridkv.cli.sim_vllm_report import render
    from hybridkv.simulator.on_vllm import simulate_vllm

    report = simulate_vllm(options, args.plot)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        render(report)
    sys.stdout.flush()
    return 0 if report["verdict"] == "pass" else 1


def _without_timeline(report: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k != "timeline"}
