"""Every registered invariant has mutation evidence: a test that breaks the model on purpose.

Two levels, both found by reading the test sources (``ast``), so adding an invariant without the
tests that break it fails here:

- any test: one whose name starts with ``test_<family><number>_`` (the house convention:
  ``test_sc2_...``, ``test_bp1_...``, ``test_data1_...``) or that carries
  ``@pytest.mark.mutation("<ID>", ...)`` counts as evidence for the id;
- through the explorer or a state machine: every id needs a test of
  tests/spec/test_explorer_mutations.py marked ``mutation("<ID>")`` that runs the explorer on
  that id (``caught("<ID>", ...)``) and states the trace it finds (``assert found.trace ==
  "..."``), or a state-machine test listed in that file's ``STATE_MACHINE_EVIDENCE``, marked
  the same way and running the machine (``....runTest()``). docs/explanation/mutations.md
  tabulates them; its depths and traces must be the tests'.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from spec.invariants import ALL_INVARIANTS

TESTS = Path(__file__).parent
EXPLORER_TESTS = TESTS / "spec" / "test_explorer_mutations.py"
# The two-tier model (TT-*) and the disk tier (DK-*) have their own explorers and files.
EXPLORER_FILES = (
    EXPLORER_TESTS,
    TESTS / "spec" / "test_tier_mutations.py",
    TESTS / "spec" / "test_disk_mutations.py",
)
TABLE = TESTS.parent / "docs" / "explanation" / "mutations.md"
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
def _tests(path: Path) -> dict[str, ast.FunctionDef]:
    """The test functions of one file, by name."""
    tree = ast.parse(path.read_text())
    return {
        node.name: node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }


@cache
def evidence() -> dict[str, list[str]]:
    """Invariant id -> the tests that claim to break it."""
    found: dict[str, list[str]] = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        for node in _tests(path).values():
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


# ----------------------------------------------------------------- through the explorer


def _calls(node: ast.FunctionDef, name: str) -> list[ast.Call]:
    """Calls in ``node`` of a function or method called ``name``."""
    found = []
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            target = call.func
            called = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")
            if called == name:
                found.append(call)
    return found


def _asserted_trace(node: ast.FunctionDef) -> str | None:
    """The constant of ``assert found.trace == "..."`` in ``node``, if there is one."""
    for statement in ast.walk(node):
        if not isinstance(statement, ast.Assert) or not isinstance(statement.test, ast.Compare):
            continue
        left, right = statement.test.left, statement.test.comparators
        is_trace = isinstance(left, ast.Attribute) and left.attr == "trace" and len(right) == 1
        if is_trace and isinstance(right[0], ast.Constant) and isinstance(right[0].value, str):
            return right[0].value
    return None


class ExplorerTest:
    """One marked test of test_explorer_mutations.py as the checks read it."""

    def __init__(self, node: ast.FunctionDef, inv_id: str) -> None:
        self.name = node.name
        searches = [c for c in _calls(node, "caught") if _constant(c.args[:1]) == inv_id]
        self.depth = _constant(searches[0].args[2:3]) if searches else None
        self.trace = _asserted_trace(node)


def _constant(args: list[ast.expr]) -> object:
    return args[0].value if args and isinstance(args[0], ast.Constant) else None


@cache
def explorer_evidence() -> dict[str, list[ExplorerTest]]:
    """Invariant id -> the tests of EXPLORER_FILES marked ``mutation(id)``."""
    found: dict[str, list[ExplorerTest]] = {}
    for path in EXPLORER_FILES:
        for node in _tests(path).values():
            for inv_id in _marker_ids(node):
                found.setdefault(inv_id, []).append(ExplorerTest(node, inv_id))
    return found


@cache
def state_machine_evidence() -> dict[str, str]:
    """``STATE_MACHINE_EVIDENCE`` of test_explorer_mutations.py: id -> ``path::test``."""
    tree = ast.parse(EXPLORER_TESTS.read_text())
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id == "STATE_MACHINE_EVIDENCE":
            assert node.value is not None  # type: ignore[union-attr]
            listed: dict[str, str] = ast.literal_eval(node.value)  # type: ignore[union-attr]
            return listed
    return {}


@pytest.mark.parametrize("inv_id", sorted(ALL_INVARIANTS))
def test_every_invariant_is_caught_by_the_explorer_or_a_state_machine(inv_id: str) -> None:
    assert explorer_evidence().get(inv_id) or inv_id in state_machine_evidence(), (
        f"no test of {EXPLORER_TESTS.name} marked mutation({inv_id!r}), and no state-machine "
        "test listed in its STATE_MACHINE_EVIDENCE"
    )


def test_each_explorer_test_searches_for_its_id_and_states_the_trace() -> None:
    for inv_id, tests in sorted(explorer_evidence().items()):
        for test in tests:
            assert test.depth is not None, f"{test.name} never calls caught({inv_id!r}, ...)"
            assert test.trace is not None, f"{test.name} does not assert found.trace"


@pytest.mark.parametrize("inv_id", sorted(state_machine_evidence()))
def test_listed_state_machine_tests_exist_and_break_their_id(inv_id: str) -> None:
    assert inv_id in ALL_INVARIANTS
    path, _, name = state_machine_evidence()[inv_id].partition("::")
    node = _tests(TESTS / path).get(name)
    assert node is not None, f"{path} has no test {name}"
    assert inv_id in _marker_ids(node), f"{name} is not marked mutation({inv_id!r})"
    assert _calls(node, "runTest"), f"{name} does not run a state machine"


# ----------------------------------------------------------------- the table in the docs


def _table() -> dict[str, list[str]]:
    """docs/explanation/mutations.md: id -> cells (variant, field, scenario, depth, actions,
    trace)."""
    rows: dict[str, list[str]] = {}
    for line in TABLE.read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] in ALL_INVARIANTS:
            assert cells[0] not in rows, f"{cells[0]} listed twice"
            rows[cells[0]] = cells[1:]
    return rows


def test_the_docs_table_lists_every_id() -> None:
    assert sorted(_table()) == sorted(ALL_INVARIANTS)


@pytest.mark.parametrize("inv_id", sorted(ALL_INVARIANTS))
def test_the_docs_table_gives_the_tests_depth_and_trace(inv_id: str) -> None:
    row = _table().get(inv_id)
    assert row is not None, f"{inv_id}: no row in {TABLE.name}"
    assert len(row) == 6, f"{inv_id}: {len(row) + 1} cells, not 7"
    depth, actions, trace = row[3:]
    if inv_id in state_machine_evidence():
        name = state_machine_evidence()[inv_id].partition("::")[2]
        assert name in trace
        return
    test = explorer_evidence()[inv_id][0]
    assert test.trace is not None
    steps = [] if test.trace == "(initial state)" else test.trace.split(" | ")
    assert (depth, actions) == (str(test.depth), str(len(steps))), test.name
    assert trace == test.trace.replace(" | ", " → "), test.name
