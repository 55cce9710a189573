"""Every registered invariant has mutation evidence: a test that breaks the model on purpose.

A test counts as evidence for an id when its name starts with ``test_<family><number>_`` (the
house convention: ``test_sc2_...``, ``test_bp1_...``, ``test_data1_...``) or when it carries
``@pytest.mark.mutation("<ID>", ...)``. Found by reading the test sources (``ast``), so adding an
invariant without a test that breaks it fails here.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from spec.invariants import ALL_INVARIANTS

TESTS = Path(__file__).parent
_NAME = re.compile(r"^test_(?P<family>[a-z]+)(?P<number>\d+)_")
_FAMILIES = {inv_id.split("-")[0] for inv_id in ALL_INVARIANTS}


def _marker_ids(node: ast.FunctionDef) -> set[str]:
    found: set[str] = set()
    for decorator in node.decorator_list:
        if not isinstance(decorator, ast.Call):
            continue
        target = decorator.func
        if isinstance(target, ast.Attribute) and target.attr == "mutation":
            found |= {a.value for a in decorator.args if isinstance(a, ast.Constant)}
    return found


@cache
def evidence() -> dict[str, list[str]]:
    """Invariant id -> the tests that claim to break it."""
    found: dict[str, list[str]] = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef):
                continue
            ids = _marker_ids(node)
            match = _NAME.match(node.name)
            if match and match["family"].upper() in _FAMILIES:
                ids.add(f"{match['family'].upper()}-{match['number']}")
            for inv_id in ids:
                found.setdefault(inv_id, []).append(f"{path.relative_to(TESTS)}::{node.name}")
    return found


@pytest.mark.parametrize("inv_id", sorted(ALL_INVARIANTS))
def test_every_invariant_has_a_mutation_test(inv_id: str) -> None:
    assert evidence().get(inv_id), f"no test breaks the model so that {inv_id} catches it"


def test_no_evidence_for_an_unknown_id() -> None:
    unknown = sorted(set(evidence()) - set(ALL_INVARIANTS))
    assert unknown == [], f"tests name invariants that are not registered: {unknown}"
