"""The invariant catalog in the docs equals the registry, id for id and word for word."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from spec.invariants import ALL_INVARIANTS

ROOT = Path(__file__).resolve().parents[1]


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "gen_invariant_catalog", ROOT / "tools" / "gen_invariant_catalog.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_catalog_equals_the_registry() -> None:
    gen = _generator()
    committed = gen.CATALOG.read_text(encoding="utf-8")
    assert committed == gen.render(), "run: python tools/gen_invariant_catalog.py --write"


def test_catalog_lists_every_id_exactly_once() -> None:
    committed = (ROOT / "docs" / "reference" / "invariants.md").read_text(encoding="utf-8")
    ids = re.findall(r"^\| ([A-Z]+-\d+) \|", committed, flags=re.MULTILINE)
    assert sorted(ids) == sorted(ALL_INVARIANTS)
    assert len(ids) == len(set(ids))


def test_every_registered_predicate_names_its_id_first() -> None:
    for inv_id, inv in ALL_INVARIANTS.items():
        first = (inv.predicate.__doc__ or "").strip().splitlines()[0]
        assert first.startswith(f"{inv_id}: "), inv.predicate.__qualname__
