"""The table ``hybridkv simulate`` ends with (the JSON report, rendered for a terminal)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["identity_line", "render", "rows"]


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} B"


def identity_line(report: Mapping[str, Any]) -> str:
    """``prompt = computed + loaded + GPU hit`` with the run's figures, and whether it holds."""
    r = report
    terms = [r["prefill_tokens_computed"], r["prefill_tokens_loaded"], r["local_hit_tokens"]]
    names = "computed + loaded + GPU hit"
    if r["prompt_tokens_unserved"]:
        terms.append(r["prompt_tokens_unserved"])
        names += " + unserved"
    figures = " + ".join(f"{t:,}" for t in terms)
    verdict = "holds" if r["identity_holds"] else "DOES NOT HOLD"
    return f"prompt = {names}: {r['prompt_tokens']:,} = {figures} ({verdict})"


def _again(counts: Mapping[str, int]) -> str:
    return f"{counts['computed']:,} / {counts['loaded']:,} / {counts['hit']:,}"


def _token_rows(r: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The prompt tokens, the identity's terms (each token counted the first time it is
    served), and what was served again, apart."""
    again = r["served_again"]
    out = [
        ("prompt tokens", f"{r['prompt_tokens']:,}"),
        ("  computed (first time)", f"{r['prefill_tokens_computed']:,}"),
        ("  loaded from host (first time)", f"{r['prefill_tokens_loaded']:,}"),
        ("  hit on GPU (first time)", f"{r['local_hit_tokens']:,}"),
    ]
    if r["prompt_tokens_unserved"]:
        out.append(("  unserved (request aborted or failed)", f"{r['prompt_tokens_unserved']:,}"))
    out += [
        ("identity (below)", "holds" if r["identity_holds"] else "DOES NOT HOLD"),
        ("recomputed/reloaded/hit after failure", _again(again["failure"])),
        ("recomputed/reloaded/hit after preemption", _again(again["preemption"])),
    ]
    if any(again["replay"].values()):
        out.append(("recomputed/reloaded/hit while in place", _again(again["replay"])))
    out.append(("reads of tokens no event served", str(r["unaccounted_reads"])))
    return out


def rows(report: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(label, value)`` rows of the summary table, in reading order."""
    r = report
    finished = ", ".join(f"{name} {n}" for name, n in r["finished"].items())
    return [
        ("requests", f"{r['requests']} ({finished})"),
        ("steps", f"{r['steps']} in {r['seconds']:.1f} s"),
        *_token_rows(r),
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
        ("failures injected / recovered", f"{r['failures_injected']} / {r['failures_recovered']}"),
        ("failed jobs reported: loads / stores", f"{r['failed_loads']} / {r['failed_stores']}"),
        ("recovered: loads / stores", f"{r['recovered_loads']} / {r['recovered_stores']}"),
        ("failures ended with their request", str(r["failures_ended"])),
        ("tokens discarded by recovery", f"{r['tokens_discarded_by_recovery']:,}"),
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
    from hybridkv.simulator.timing import rows as transfer_rows

    for label, value in (*rows(report), *transfer_rows(report)):
        table.add_row(label, value)
    console.print(table)
    colour = "green" if report["identity_holds"] else "red"
    console.print(f"[{colour}]{identity_line(report)}[/]")
    for line in report["violations"]:
        console.print(f"[red]{line}[/]")
    colour = "green" if report["verdict"] == "pass" else "red"
    console.print(f"verdict: [{colour}]{report['verdict']}[/]")
