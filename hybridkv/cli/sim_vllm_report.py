"""The table ``hybridkv simulate --engine vllm`` ends with: the report of
:mod:`hybridkv.simulator.vllm_report`, rendered for a terminal."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.cli.sim_report import identity_line
from hybridkv.simulator.vllm_report import NOT_OBSERVED

__all__ = ["render", "rows"]


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover - the loop returns at GiB


def _trio(counts: Mapping[str, int]) -> str:
    return f"{counts['computed']:,} / {counts['loaded']:,} / {counts['hit']:,}"


def _agree(value: bool | None, v: Mapping[str, Any], failed: int) -> str:
    if value is None:
        return f"not comparable ({v['preemptions']} preemptions, {failed} requests' loads failed)"
    figures = f"local {v['prefill_stats_local']:,}, external {v['prefill_stats_external']:,}"
    return f"{'agree' if value else 'DISAGREE'} ({figures})"


def rows(report: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(label, value)`` rows, the spec engine's labels where the figure is the same."""
    r, v = report, report["vllm"]
    finished = ", ".join(f"{name} {n}" for name, n in r["finished"].items())
    again = r["served_again"]
    return [
        ("requests", f"{r['requests']} ({finished})"),
        ("steps", f"{r['steps']} vLLM engine steps in {r['seconds']:.1f} s"),
        ("prompt tokens", f"{r['prompt_tokens']:,}"),
        ("  computed (first time)", f"{r['prefill_tokens_computed']:,}"),
        ("  loaded from host (first time)", f"{r['prefill_tokens_loaded']:,}"),
        ("  hit on GPU (first time)", f"{r['local_hit_tokens']:,}"),
        ("identity (below)", "holds" if r["identity_holds"] else "DOES NOT HOLD"),
        (
            "vLLM PrefillStats vs the ledger",
            _agree(v["prefill_stats_agree"], v, r["failed_load_requests"]),
        ),
        ("recomputed/reloaded/hit after failure", _trio(again["failure"])),
        ("recomputed/reloaded/hit after preemption", _trio(again["preemption"])),
        *(
            [("recomputed/reloaded/hit while in place", _trio(again["replay"]))]
            if any(again["replay"].values())
            else []
        ),
        ("preemptions (vLLM)", str(v["preemptions"])),
        ("reads of tokens no event served", str(r["unaccounted_reads"])),
        ("hit rate", f"{100 * r['hit_rate']:.1f}%"),
        (
            "continuation hits across turns",
            f"{r['continuation_hits']} of {r['continuation_turns']} turns, "
            f"{r['continuation_hit_tokens']:,} answer tokens",
        ),
        ("loaded (host -> GPU)", f"{_bytes(r['bytes_loaded'])} in {r['load_jobs']} jobs"),
        ("stored (GPU -> host)", f"{_bytes(r['bytes_stored'])} in {r['store_jobs']} jobs"),
        ("copy bandwidth", NOT_OBSERVED + " (copies report one poll after submission)"),
        ("failures injected / recovered", f"{r['failures_injected']} / {r['failures_recovered']}"),
        ("failed jobs reported: loads / stores", f"{r['failed_loads']} / {r['failed_stores']}"),
        ("recovered: loads / stores", f"{r['recovered_loads']} / {r['recovered_stores']}"),
        ("failures ended with their request", str(r["failures_ended"])),
        (
            "requests whose load failed / finished after recompute",
            f"{r['failed_load_requests']} / {r['failed_load_requests_finished']}",
        ),
        ("tokens discarded by recovery", f"{r['tokens_discarded_by_recovery']:,}"),
        ("KV slots and states verified on read", f"{r['slots_verified']:,}"),
        ("wrong-content loads", NOT_OBSERVED + " apart (loaded slots are checked on read)"),
        ("wrong-content reads", str(r["wrong_content_reads"])),
        ("invariant checks run", NOT_OBSERVED + " (nox -s vllm checks them)"),
        (
            "left at the end: leaked GPU blocks / jobs / held blocks",
            f"{v['leaked_blocks']} / {v['jobs_in_flight']} / {v['held_blocks']}",
        ),
        (
            "scheduler step / connector share",
            f"{v['schedule_us']:.0f} us / {v['connector_us']:.0f} us",
        ),
    ]


def render(report: Mapping[str, Any]) -> None:
    """Print the setup line, the table, the identity and the verdict."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    s = report["setup"]
    console.print(
        f"[bold]hybridkv simulate --engine vllm[/]: {s['model']} ({s['model_changed']}; "
        f"{'+'.join(s['groups'])}), vLLM 0.33 Scheduler on CPU, block {s['block_size']}, "
        f"chunk {s['chunk_size']} tokens, {s['gpu_blocks']} GPU blocks, max-model-len "
        f"{s['max_model_len']}, host {_bytes(s['host_bytes'])} ({s['host_entries']} entries, "
        f"{s['policy']}), {s['connector']}, trace {s['trace']}, engine built in "
        f"{s['build_seconds']:.1f} s"
    )
    table = Table(show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    for label, value in rows(report):
        table.add_row(label, value)
    console.print(table)
    colour = "green" if report["identity_holds"] else "red"
    console.print(f"[{colour}]{identity_line(report)}[/]")
    colour = "green" if report["verdict"] == "pass" else "red"
    console.print(f"verdict: [{colour}]{report['verdict']}[/]")
