"""Human-readable rendering of a ``hybridkv plan`` result (the JSON dict) with rich tables."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["render", "render_presets"]


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def render(plan: Mapping[str, Any], console: Console | None = None) -> None:
    """Print the plan: settings, groups, block sizes, offload plan, options, warnings."""
    out = console or Console()
    model, settings = plan["model"], plan["settings"]
    out.print(f"[bold]{model['architecture']}[/bold] from {model['source']}")
    out.print(
        f"platform assumed: [bold]{plan['platform']['name']}[/bold] "
        f"({plan['platform']['description']})"
    )
    out.print(
        f"max_model_len={settings['max_model_len']}  cache_mode={settings['cache_mode']}  "
        f"dtype={settings['dtype']}  tp={settings['tp']}"
    )
    out.print(_groups_table(plan["groups"]))
    out.print(
        f"block_size={plan['block_size']}  mamba_block_size={plan['mamba_block_size']}  "
        f"scheduler_block_size={plan['scheduler_block_size']}  "
        f"hash_block_size={plan['hash_block_size']}  "
        f"cache_hit_alignment={plan['cache_hit_alignment_tokens']}"
    )
    offload = plan["offload"]
    if offload is not None:
        out.print(
            f"offload chunk: [bold]{offload['chunk_size']}[/bold] tokens "
            f"({offload['chunk_size_source']}); per-group units {offload['units']}; "
            f"claim-alignment unit [bold]{offload['claim_unit']}[/bold]; shortest prompt that "
            f"can hit: {offload['shortest_hit_prompt']} tokens; host bytes per chunk: "
            f"{_bytes(offload['host_bytes_per_chunk'])}"
        )
    if plan["chunk_options"]:
        out.print(_options_table(plan["chunk_options"], offload))
    for warning in plan["warnings"]:
        out.print(f"[yellow]warning:[/yellow] {warning}")
    for note in plan["notes"]:
        out.print(f"note: {note}")


def _groups_table(groups: Sequence[Mapping[str, Any]]) -> Table:
    table = Table(title="KV cache groups")
    for col in ("group", "kind", "layers", "block", "page", "padding", "window / state"):
        table.add_column(col, justify="right" if col not in ("kind", "window / state") else "left")
    for g in groups:
        if g["kind"] == "sliding":
            extra = f"window {g['sliding_window']}"
        elif g["kind"] == "mamba":
            extra = ", ".join(
                f"{tuple(s)} {d}" for s, d in zip(g["mamba_shapes"], g["mamba_dtypes"], strict=True)
            )
        else:
            extra = ""
        table.add_row(
            str(g["index"]),
            g["kind"],
            str(g["num_layers"]),
            str(g["block_size"]),
            _bytes(g["page_size_bytes"]),
            _bytes(g["padding_bytes"]),
            extra,
        )
    return table


def _options_table(
    options: Sequence[Mapping[str, Any]], offload: Mapping[str, Any] | None
) -> Table:
    chosen = offload["chunk_size"] if offload is not None else None
    table = Table(title="chunk options (whole blocks: what the vLLM connector accepts)")
    columns = ("chunk", "claim unit", "shortest hit", "host bytes/chunk", "keys/claim unit")
    for col in (*columns, "whole blocks"):
        table.add_column(col, justify="right")
    for o in options:
        mark = " *" if o["chunk_size"] == chosen else ""
        table.add_row(
            f"{o['chunk_size']}{mark}",
            str(o["claim_unit"]),
            str(o["shortest_hit_prompt"]),
            _bytes(o["host_bytes_per_chunk"]),
            str(o["keys_per_claim_unit"]),
            "yes" if o["whole_blocks"] else "no",
        )
    return table


def render_presets(
    rows: Sequence[Mapping[str, str]], default: str, console: Console | None = None
) -> None:
    """Print the built-in presets with their sources.

    On a terminal, a table; piped or redirected, one plain ``name  model  source`` line per
    preset, so no cell (a source URL above all) is cut to the table's width.
    """
    out = console or Console()
    if not out.is_terminal:
        for row in rows:
            name = f"{row['name']} (default)" if row["name"] == default else row["name"]
            print(f"{name}\t{row['description']}\t{row['source']}", file=out.file)
        return
    table = Table(title="presets")
    for col in ("name", "model", "source"):
        table.add_column(col)
    for row in rows:
        name = f"{row['name']} (default)" if row["name"] == default else row["name"]
        table.add_row(name, row["description"], row["source"])
    out.print(table)
