"""What bench_vs_native prints and draws: the table's rows, the hybridkv / native ratios,
the identity checks, a trace's figures and the figure file.

A module of ``tools/bench_vs_native.py`` (its module docstring says what the bench measures);
imported after that tool has put this checkout and ``tools/`` on ``sys.path`` and loaded its
torchvision shim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from _vs_native_cases import floor_tokens, working_set_blocks
from _vs_native_runs import Result, Variant, block_bytes, native_chunk_bytes
from _vs_native_traffic import (
    TrafficTrace,
    over_floor,
    traffic_floor,
    traffic_identity,
    traffic_working_blocks,
)

from hybridkv.vllm.harness.chat import ChatTrace
from hybridkv.vllm.harness.inprocess import InProcessEngine

HEADER = (
    f"{'variant':<30} {'computed':>8} {'/floor':>6} {'loaded':>7} {'gpu hit':>7} "
    f"{'cont ld':>7} {'ld prev':>7} {'cont gpu':>8} {'steps':>5} {'conn us/step':>12} "
    f"{'share':>6} {'cpu us':>6} "
    f"{'evict':>6} {'dropped':>7} {'wrong':>5}"
)


def _row(name: str, result: Result, floor: int) -> str:
    r = result.report
    if r is None:
        return f"{name:<30} failed: {result.error}"
    us = f"{result.connector_us:12.0f}" if r.connector else f"{'-':>12}"
    share = f"{result.share:6.0%}" if r.connector else f"{'-':>6}"
    cpu = f"{result.connector_cpu_us:6.0f}" if r.connector else f"{'-':>6}"
    cont = result.continuation
    line = (
        f"{name:<30} {result.computed():8d} {result.computed() / floor:6.2f} "
        f"{r.external_loaded:7d} {r.gpu_prefix_hits:7d} {cont.loaded:7d} {cont.loaded_previous:7d} "
        f"{cont.gpu:8d} "
        f"{r.steps:5d} {us} {share} {cpu} "
        f"{result.evictions:6d} {result.dropped:7d} {r.wrong_reads:5d}"
    )
    return line + (f"  ({result.error})" if result.error else "")


def _ratio(ours: Result, theirs: Result, field: Callable[[Result], float]) -> str:
    if ours.report is None or theirs.report is None:
        return "  n/a"
    if not field(theirs):  # the count itself: a ratio to zero says nothing
        return f"{field(ours):.0f} vs 0"
    return f"{field(ours) / field(theirs):5.2f}"


def _ratios(results: dict[Variant, Result]) -> list[str]:
    lines = []
    for variant, ours in results.items():
        if variant.kind != "hybridkv":
            continue
        peer = results.get(replace(variant, kind="native", chunk_size=None))
        if peer is None:
            continue
        cost = _ratio(ours, peer, lambda x: x.connector_us)
        cpu = _ratio(ours, peer, lambda x: x.connector_cpu_us)
        computed = _ratio(ours, peer, lambda x: x.computed())
        hits = _ratio(ours, peer, lambda x: x.report.gpu_prefix_hits if x.report else 0)
        cont = _ratio(ours, peer, lambda x: x.continuation.total)
        lines.append(
            f"  hybridkv/native {variant.name().removeprefix('hybridkv ')}: "
            f"connector us/step {cost} (cpu {cpu}), prefill computed {computed}, "
            f"GPU prefix hits {hits}, "
            f"continuation hits {cont}"
        )
    return lines


def identity_breaks(results: dict[Variant, Result]) -> list[str]:
    """Variants where computed + loaded + gpu hit != prompt tokens, with what re-counts.

    Each prompt position is computed, loaded by the connector or a GPU prefix hit, once per
    admission; a preempted request is admitted again and a failed load is recomputed, so
    those runs count some positions twice.
    """
    broken = []
    for variant, result in results.items():
        r = result.report
        if r is None:
            continue
        if r.prefill_computed + r.external_loaded + r.gpu_prefix_hits != r.prompt_tokens:
            broken.append(
                f"{variant.name()} (preemptions {r.preemptions}, failed loads {r.failed_loads})"
            )
    return broken


def _bad(results: dict[Variant, Result]) -> list[str]:
    bad = []
    for variant, result in results.items():
        r = result.report
        if r is not None and (r.wrong_reads or r.leaked_blocks or r.finished != r.requests):
            bad.append(f"{variant.name()}: {r.wrong_reads} wrong reads, {r.leaked_blocks} leaked")
    return bad


@dataclass(frozen=True, slots=True)
class TraceOutcome:
    """One trace's results, its floor and the lines printed for it."""

    title: str
    floor: int
    results: dict[Variant, Result]
    lines: list[str]
    problems: list[str]


def _variants(working: int, delays: list[int], sweep: bool) -> list[Variant]:
    big = 2 * working
    variants = [Variant("none")]
    for kind in ("native", "hybridkv"):  # hybridkv at its default chunk (Variant)
        for delay in delays:
            variants.append(Variant(kind, "lru", delay, big))
        variants.append(Variant(kind, "arc", 1, big))
    if sweep:
        for factor in (0.5, 1.0):
            for kind in ("native", "hybridkv"):
                for policy in ("lru", "arc"):
                    chunks = max(1, round(factor * working))
                    variants.append(Variant(kind, policy, 1, chunks, f" host={factor}x"))
    return variants


def _figures(trace: ChatTrace | TrafficTrace, probe: InProcessEngine) -> tuple[int, int, str]:
    """The trace's floor, its working set in native chunks and its header's words."""
    block = probe.block_size
    if isinstance(trace, TrafficTrace):
        floor = sum(traffic_floor(trace, block).values())
        blocks = traffic_working_blocks(trace, block)
        words = trace.describe()
    else:
        floor = floor_tokens(trace, block)
        blocks = working_set_blocks(trace, block)
        words = (
            f"{trace.convs} conversations x {trace.turns} turns, system {trace.system_len}, "
            f"user {trace.user_min}-{trace.user_max}, answers {trace.output_len} tokens"
        )
    working = -(-blocks * block_bytes(probe) // native_chunk_bytes(probe))
    return floor, working, words


def _traffic_lines(trace: TrafficTrace, results: dict[Variant, Result], block: int) -> list[str]:
    """Per variant: aborts, preemptions, the per-request identity and, past 1.05x the floor,
    where the rest goes (:func:`over_floor`)."""
    floors = traffic_floor(trace, block)
    floor = sum(floors.values())
    lines = []
    for variant, result in results.items():
        ledger, r = result.ledger, result.report
        if ledger is None or r is None:
            continue
        aborted = ledger.aborted
        spent = sum(ledger.computed.get(rid, 0) for rid in aborted)
        lines.append(
            f"  {variant.name()}: aborted {len(aborted)} ({sum(aborted.values())} with a load "
            f"in flight; they computed {spent} prompt tokens, left out of /floor), "
            f"preemptions {r.preemptions}, failed loads {r.failed_loads}; computed + loaded + "
            f"gpu hit != prompt: {traffic_identity(ledger)}"
        )
        if result.computed() > floor:  # the requests themselves only past 1.05x
            lines += over_floor(ledger, floors, trace, 6 if result.computed() > 1.05 * floor else 0)
    return lines


# ------------------------------------------------------------------ the figure

_COLOURS = {"none": "0.6", "native": "tab:orange", "hybridkv": "tab:blue"}


def plot(outcomes: list[TraceOutcome], path: Path) -> None:
    """Per trace, a panel pair: prefill tokens computed per variant beside the floor, and the
    scheduler-side connector µs per step (median of the repeats). Failed variants are left
    blank and named failed."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on the machines that run the bench
    import matplotlib.pyplot as plt

    rows = len(outcomes)
    height = max(len(o.results) for o in outcomes) * 0.22 + 1.2
    figure, axes = plt.subplots(rows, 2, figsize=(13, height * rows), squeeze=False)
    for (computed_ax, cost_ax), outcome in zip(axes, outcomes, strict=True):
        variants = list(outcome.results)
        names = [v.name() + ("" if outcome.results[v].report else " (failed)") for v in variants]
        colours = [_COLOURS[v.kind] for v in variants]
        places = range(len(variants))
        computed = [r.report.prefill_computed if r.report else 0 for r in outcome.results.values()]
        cost = [
            r.connector_cpu_us if r.report and r.report.connector else 0
            for r in outcome.results.values()
        ]
        computed_ax.barh(places, computed, color=colours)
        computed_ax.axvline(
            outcome.floor,
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"floor {outcome.floor}",
        )
        computed_ax.legend(fontsize=7, loc="lower right")
        computed_ax.set_title(f"{outcome.title}: prefill tokens computed", fontsize=9)
        cost_ax.barh(places, cost, color=colours)
        cost_ax.set_title(f"{outcome.title}: connector CPU µs per step", fontsize=9)
        for ax in (computed_ax, cost_ax):
            ax.set_yticks(list(places), names, fontsize=7)
            ax.invert_yaxis()
            ax.tick_params(axis="x", labelsize=7)
        cost_ax.set_yticklabels([])
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
