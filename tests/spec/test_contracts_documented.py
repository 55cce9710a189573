"""Every public spec routine documents pre, post and what a refused call changes.

House style (STYLE.md, "Say what a failed call changes"): each operation's docstring gives pre,
post and frame; the default frame of a refusal is "nothing". This test reads every module of
spec/ with ``ast`` (nothing is imported or run) and asserts that each public function and
method has a docstring naming its contract with at least one of :data:`MARKERS`.

Out of scope: names starting with ``_`` (dunders included), methods of private classes,
functions nested in functions, properties (attribute reads), and predicates registered with
``@invariant(...)``: the registry documents their contract (pure functions of a plain snapshot
returning violation messages).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import spec.layout

# Located through a submodule, as in tests/test_boundaries.py: tests/spec/ can shadow the
# package name as a namespace package whose ``__file__`` is None.
SPEC_DIR = Path(spec.layout.__file__).parent
ROOT = SPEC_DIR.parent

MARKERS = (
    "Pre:",
    "Post:",
    "Pure",
    "Frame:",
    "Refusal:",
    "nothing changes",
    "changes nothing",
    "Never refuses",
)

_PROPERTY_DECORATORS = frozenset({"property", "cached_property"})
_PROPERTY_ACCESSORS = frozenset({"setter", "getter", "deleter"})

Routine = ast.FunctionDef | ast.AsyncFunctionDef


class Found(NamedTuple):
    """One public routine: where it is and its docstring (empty when it has none)."""

    path: str
    line: int
    name: str
    doc: str


def _decorator_name(node: ast.expr) -> str:
    """The dotted name a decorator is spelled with, its call stripped (``a.b`` of ``a.b(x)``)."""
    target = node.func if isinstance(node, ast.Call) else node
    return ast.unparse(target)


def _is_property(routine: Routine) -> bool:
    for decorator in routine.decorator_list:
        parts = _decorator_name(decorator).split(".")
        if parts[-1] in _PROPERTY_DECORATORS or (
            len(parts) > 1 and parts[-1] in _PROPERTY_ACCESSORS
        ):
            return True
    return False


def _is_invariant(routine: Routine) -> bool:
    return any(
        isinstance(d, ast.Call) and _decorator_name(d).split(".")[-1] == "invariant"
        for d in routine.decorator_list
    )


def _routines(body: list[ast.stmt], owner: str) -> Iterator[tuple[str, Routine]]:
    """Public routines of a module or class body, descending into public classes only."""
    for node in body:
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield from _routines(node.body, f"{owner}{node.name}.")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name.startswith("_") or _is_property(node) or _is_invariant(node):
                continue
            yield f"{owner}{node.name}", node


def _spec_files() -> list[Path]:
    return sorted(SPEC_DIR.rglob("*.py"))


def public_routines() -> list[Found]:
    """Every public routine of spec/."""
    found = []
    for path in _spec_files():
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
        for name, node in _routines(tree.body, ""):
            found.append(Found(rel, node.lineno, name, ast.get_docstring(node) or ""))
    return found


def test_every_public_routine_states_its_contract() -> None:
    missing = []
    for r in public_routines():
        if not r.doc:
            missing.append(f"{r.path}:{r.line} {r.name}: no docstring")
        elif not any(marker in r.doc for marker in MARKERS):
            missing.append(f"{r.path}:{r.line} {r.name}: docstring states no contract")
    assert not missing, (
        f"{len(missing)} public spec routine(s) lack a contract; say pre, post and what a "
        f"refused call changes, with one of {MARKERS}:\n" + "\n".join(missing)
    )


def test_the_scan_sees_what_it_should() -> None:
    """Guard: the check is not vacuous, and it applies exactly the documented exclusions."""
    names = {(r.path, r.name) for r in public_routines()}
    # Public routines of every shape: a method, a protocol method, a function, a classmethod.
    assert ("spec/store.py", "HostStore.prepare_store") in names
    assert ("spec/explorer.py", "Model.step") in names
    assert ("spec/hashing.py", "offload_key") in names
    assert ("spec/connector/geometry.py", "Geometry.build") in names
    assert ("spec/block_pool.py", "BlockPool.clone") in names
    assert ("spec/scheduler/scheduler.py", "Scheduler.schedule") in names
    # Excluded although defined: a property, an @invariant predicate, a helper, a dunder.
    excluded = [
        ("spec/store.py", "capacity"),
        ("spec/invariants/store.py", "st1_capacity"),
        ("spec/store.py", "_checked_keys"),
        ("spec/store.py", "__init__"),
    ]
    for path, name in excluded:
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in defined, f"{path} no longer defines {name}: pick another example"
        assert not any(p == path and n.split(".")[-1] == name for p, n in names), (path, name)
