"""Generate docs/reference/invariants.md from the invariant registry.

    python tools/gen_invariant_catalog.py           # print the catalog
    python tools/gen_invariant_catalog.py --write   # rewrite docs/reference/invariants.md
    python tools/gen_invariant_catalog.py --check   # exit 1 if the file is stale

The catalog is generated, never hand-edited, so the ids and statements the docs cite are the
ones the code checks; tests/test_invariant_catalog.py fails when the two differ.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spec.invariants import ALL_INVARIANTS, Invariant

CATALOG = Path(__file__).resolve().parents[1] / "docs" / "reference" / "invariants.md"

FAMILIES = {
    "PL": "Planner: hybrid offload units, hash factors and claim alignment",
    "BP": "Block pool: one pool shared by every KV cache group",
    "GR": "Per-group managers: full attention, sliding window, mamba align",
    "SC": "Scheduler: claims, async loads, recovery and liveness",
    "MB": "Mamba state: recurrent state and attention KV restored together",
    "TR": "Transfers: blocks under an in-flight load or store",
    "ST": "Host store: capacity, lifecycle, pins and eviction",
    "SEC": "Isolation between cache_salt domains",
    "DATA": "Content: every block a request reads holds the right data",
    "TT": "Two tiers: the host store over a shared remote tier (Redis / Valkey)",
    "DK": "Disk tier: a bounded, crash-safe directory of chunk files below the host",
}


def _family(inv: Invariant) -> str:
    return inv.id.split("-")[0]


def render() -> str:
    """The catalog as Markdown, families in FAMILIES order, ids in numeric order."""
    lines = [
        "# Invariant catalog",
        "",
        "Generated from `spec.invariants.ALL_INVARIANTS` by `tools/gen_invariant_catalog.py`;",
        "do not edit by hand. Each id is a predicate over a plain snapshot that the reference",
        "models and the optimized library both export.",
        "",
    ]
    by_family: dict[str, list[Invariant]] = {}
    for inv in ALL_INVARIANTS.values():
        by_family.setdefault(_family(inv), []).append(inv)
    unknown = sorted(set(by_family) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"invariant families without a catalog heading: {unknown}")
    for family, title in FAMILIES.items():
        members = sorted(by_family.get(family, []), key=lambda inv: int(inv.id.split("-")[1]))
        if not members:
            continue
        lines += [f"## {family}: {title}", "", "| id | statement | checks |", "|---|---|---|"]
        for inv in members:
            where = f"`{inv.predicate.__module__}.{inv.predicate.__name__}`"
            statement = inv.statement.replace("|", "\\|")
            lines.append(f"| {inv.id} | {statement} | {where} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the catalog file")
    mode.add_argument("--check", action="store_true", help="exit 1 if the catalog is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        CATALOG.parent.mkdir(parents=True, exist_ok=True)
        CATALOG.write_text(text, encoding="utf-8")
        return 0
    if args.check:
        current = CATALOG.read_text(encoding="utf-8") if CATALOG.exists() else ""
        if current != text:
            print(f"{CATALOG} is stale: run python tools/gen_invariant_catalog.py --write")
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
