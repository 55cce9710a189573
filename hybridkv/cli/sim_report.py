"""The table ``hybridkv simulate`` ends with (the JSON report, rendered for a terminal)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["render"]


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} B"


def rows(report: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(label, value)`` rows of the summary table, in reading order."""
    r = report
    finished = ", ".join(f"{name} {n}" for name, n in r["finished"].items())
    computed, loaded = r["prefill_tokens_computed"], r["prefill_tokens_loaded"]
    return [
        ("requests", f"{r['requests']} ({finished})"),
        ("steps", f"{r['steps']} in {r['seconds']:.1f} s"),
        ("prompt tokens", f"{r['prompt_tokens']:,}"),
        ("prefill tokens computed", f"{computed:,}"),
        ("prefill tokens loaded from host", f"{loaded:,}"),
        ("prefix tokens hit on GPU", f"{r['local_hit_tokens']:,}"),
        ("hit rate", f"{100 * r['hit_rate']:.1f}%"),
        (
            "continuation hits across turns",
            f"{r['continuation_hits']} of {r['continuation_turns']} turns, "
            f"{r['continuation_hit_tokens']:,} answer tokens",
        ),
        (
            "loaded (host -> GPU)",
            f"{_bytes(r['bytes_loaded'])} in {r['load_jobs']} jobs, {r['load_gbps']} GB/s",
        ),
        (
            "stored (GPU -> host)",
            f"{_bytes(r['bytes_stored'])} in {r['store_jobs']} jobs, {r['store_gbps']} GB/s",
        ),
        (
            "failures injected / recovered",
            f"{r['failures_injected']} / {r['failures_recovered']} "
            f"({r['tokens_discarded_by_recovery']:,} tokens recomputed)",
        ),
        ("blocks verified against recomputation", f"{r['blocks_verified']:,}"),
        ("wrong-content loads", str(r["wrong_content_loads"])),
        ("wrong-content reads", str(r["wrong_content_reads"])),
        ("invariant checks run", f"{r['invariant_checks']:,}"),
        ("invariant violations", str(r["invariant_violations"])),
    ]


def render(report: Mapping[str, Any]) -> None:
    """Print the setup line, the summary table, any violation and the verdict."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    s = report["setup"]
    console.print(
        f"[bold]hybridkv simulate[/]: {s['model']} ({'+'.join(s['groups'])}), "
        f"{s['layers_per_group']} of {s['model_layers_per_group']} layers per group, "
        f"chunk {s['chunk_size']} tokens, {s['gpu_blocks']} GPU blocks, "
        f"host {_bytes(s['host_bytes'])} ({s['host_entries']} entries, {s['policy']}), "
        f"{s['device']}, {s['connector']} connector, trace {s['trace']}"
    )
    table = Table(show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    from hybridkv.cli.sim_timing import rows as transfer_rows

    for label, value in (*rows(report), *transfer_rows(report)):
        table.add_row(label, value)
    console.print(table)
    for line in report["violations"]:
        console.print(f"[red]{line}[/]")
    colour = "green" if report["verdict"] == "pass" else "red"
    console.print(f"verdict: [{colour}]{report['verdict']}[/]")
