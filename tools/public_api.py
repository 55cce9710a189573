"""hybridkv's public API as a checked-in list, and the check that an importer uses only it.

The list (docs/reference/api/public-names.txt) names every public name as ``module:name``,
one a line: each listed package's ``__all__``. Two checks read it:

- tests/test_public_api.py holds it equal to the live ``__all__``s, and fails when a name
  disappears without a line in docs/changelog.md naming it (the list keeps the name, marked
  ``removed``);
- the import-linter contract type ``public_api`` (tools/public_api_contract.py, run by
  ``lint-imports`` in ``nox -s lint``) holds an importer (``hybridkv.native``, ``examples``) to
  those names: :func:`check_source` below, over the importer's source.

Standard library only: ``nox -s lint`` reads source without installing torch or vLLM.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PUBLIC_NAMES = ROOT / "docs" / "reference" / "api" / "public-names.txt"
REMOVED = "removed "


@dataclass(frozen=True, slots=True)
class PublicNames:
    """The list as values: ``live`` names are in an ``__all__`` today, ``removed`` ones were."""

    live: frozenset[tuple[str, str]]
    removed: frozenset[tuple[str, str]]

    @property
    def modules(self) -> frozenset[str]:
        """The public modules: those with a live name."""
        return frozenset(module for module, _ in self.live)

    def names_of(self, module: str) -> frozenset[str]:
        return frozenset(name for owner, name in self.live if owner == module)


def dotted(module: str, name: str) -> str:
    """``hybridkv.store.HostStore``: how the changelog and the docs spell a public name."""
    return f"{module}.{name}"


def parse_public_names(text: str, where: str = "public-names.txt") -> PublicNames:
    """The list from its text; a malformed line raises ValueError naming the line and the fix."""
    live: set[tuple[str, str]] = set()
    removed: set[tuple[str, str]] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        into = removed if line.startswith(REMOVED) else live
        entry = line.removeprefix(REMOVED).strip()
        module, sep, name = entry.partition(":")
        if not sep or not module or not name.isidentifier():
            raise ValueError(
                f"{where}:{number}: {raw!r} is not 'module:name' (or 'removed module:name'): "
                "write one public name a line, e.g. 'hybridkv.store:HostStore'"
            )
        if (module, name) in live | removed:
            raise ValueError(f"{where}:{number}: {entry} is listed twice: keep one line")
        into.add((module, name))
    return PublicNames(frozenset(live), frozenset(removed))


def read_public_names(path: Path = PUBLIC_NAMES) -> PublicNames:
    return parse_public_names(path.read_text(encoding="utf-8"), where=str(path))


def drift(public: PublicNames, live: frozenset[tuple[str, str]], changelog: str) -> list[str]:
    """What keeps the list from being the record of ``live`` (the ``__all__``s read today), one
    line each with its fix; empty when the list, the code and the changelog agree.

    A name gone from ``live`` must be marked removed in the list and named in the changelog
    (``module.name``); a name new in ``live`` must be listed.
    """
    problems = [
        f"{dotted(*entry)} left {entry[0]}.__all__: mark its line 'removed {entry[0]}:{entry[1]}'"
        " in public-names.txt and add a docs/changelog.md line naming it"
        for entry in sorted(public.live - live)
    ]
    problems += [
        f"{dotted(*entry)} is in {entry[0]}.__all__ but not listed: add '{entry[0]}:{entry[1]}'"
        " to public-names.txt"
        + (" (and drop its 'removed' line)" if entry in public.removed else "")
        for entry in sorted(live - public.live)
    ]
    problems += [
        f"{dotted(*entry)} is marked removed but docs/changelog.md never names it: add a line"
        f" saying `{dotted(*entry)}` was removed and what to use instead"
        for entry in sorted(public.removed - live)
        if f"`{dotted(*entry)}`" not in changelog
    ]
    return problems


@dataclass(frozen=True, slots=True)
class Violation:
    """One use of a non-public name: where, what it reached, and what to do instead."""

    importer: str
    line: int
    imported: str
    why: str

    def __str__(self) -> str:
        return f"{self.importer} -> {self.imported} (l.{self.line}): {self.why}"


@dataclass(frozen=True, slots=True)
class _Scope:
    """What one importer may reach: the public list, the importer's own package (its imports
    inside itself are its business), and the root whose modules the list governs."""

    public: PublicNames
    own: str
    root: str
    is_module: Callable[[str], bool]

    def governs(self, module: str) -> bool:
        inside = module == self.root or module.startswith(self.root + ".")
        mine = module == self.own or module.startswith(self.own + ".")
        return inside and not mine

    def hint(self, module: str) -> str:
        """The nearest public package above ``module``, to import from instead."""
        parts = module.split(".")
        for cut in range(len(parts) - 1, 1, -1):
            ancestor = ".".join(parts[:cut])
            if ancestor in self.public.modules:
                return f"import its public names from {ancestor}"
        return (
            f"import the name from {self.root} if it re-exports it, or make {module} public "
            "(its __all__ in docs/reference/api/public-names.txt)"
        )


def _absolute(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module an ``ImportFrom`` names, relative imports resolved against the importer."""
    if node.level == 0:
        return node.module or ""
    parts = importer.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _chain(node: ast.Attribute) -> tuple[str, list[str]] | None:
    """``a.b.c`` as (``a``, [``b``, ``c``]); None when the base is not a plain name."""
    attrs: list[str] = []
    current: ast.expr = node
    while isinstance(current, ast.Attribute):
        attrs.append(current.attr)
        current = current.value
    if not isinstance(current, ast.Name):
        return None
    return current.id, attrs[::-1]


def check_source(
    importer: str,
    source: str,
    *,
    is_package: bool,
    public: PublicNames,
    own: str,
    root: str = "hybridkv",
    is_module: Callable[[str], bool],
) -> list[Violation]:
    """Every reach of ``importer``'s source into ``root`` outside ``own`` that is not public.

    Public means: a module of the list, a name in that module's list, or a public module reached
    through its parent (``from hybridkv import store``). Checked: ``import X``, ``from X import
    n`` (a star import is refused: it hides which names it takes), and attribute chains on a
    bound module (``hybridkv.store.manager.HostStore`` reaches a private module).
    """
    scope = _Scope(public, own, root, is_module)
    tree = ast.parse(source, filename=importer)
    bound: dict[str, str] = {}
    found = list(_imports(importer, is_package, tree, scope, bound))
    found += _attributes(importer, tree, scope, bound)
    return sorted(found, key=lambda v: (v.line, v.imported))


def _imports(
    importer: str, is_package: bool, tree: ast.Module, scope: _Scope, bound: dict[str, str]
) -> Iterator[Violation]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top == scope.root:  # `import hybridkv.x` binds `hybridkv`, checked by use
                    bound[alias.asname or top] = alias.name if alias.asname else top
                if not scope.governs(alias.name):
                    continue
                if alias.name not in scope.public.modules | {scope.root}:
                    why = f"not a public module: {scope.hint(alias.name)}"
                    yield Violation(importer, node.lineno, alias.name, why)
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(importer, is_package, node)
            if scope.governs(module):
                yield from _from_import(importer, node, module, scope, bound)


def _from_import(
    importer: str, node: ast.ImportFrom, module: str, scope: _Scope, bound: dict[str, str]
) -> Iterator[Violation]:
    if module not in scope.public.modules | {scope.root}:
        why = f"not a public module: {scope.hint(module)}"
        yield Violation(importer, node.lineno, module, why)
        return
    for alias in node.names:
        target = f"{module}.{alias.name}"
        if alias.name == "*":
            why = "a star import hides which names it takes: name them"
            yield Violation(importer, node.lineno, target, why)
        elif target in scope.public.modules:
            bound[alias.asname or alias.name] = target
        elif alias.name not in scope.public.names_of(module):
            if scope.is_module(target):
                why = f"not a public module: {scope.hint(target)}"
            else:
                why = f"{alias.name} is not in {module}.__all__ (docs/reference/api)"
            yield Violation(importer, node.lineno, target, why)


def _attributes(
    importer: str, tree: ast.Module, scope: _Scope, bound: dict[str, str]
) -> list[Violation]:
    inner = {
        id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
    }  # an Attribute that is the value of another is part of a longer chain, checked whole
    found: list[Violation] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        chain = _chain(node)
        if chain is None or chain[0] not in bound:
            continue
        module = bound[chain[0]]
        for attr in chain[1]:
            if attr in scope.public.names_of(module):
                break  # a public object: what follows is its own attributes
            nxt = f"{module}.{attr}"
            if not scope.governs(nxt):
                break  # the importer's own package
            if nxt not in scope.public.modules:
                why = (
                    f"not a public module: {scope.hint(nxt)}"
                    if scope.is_module(nxt)
                    else f"{attr} is not in {module}.__all__ (docs/reference/api)"
                )
                found.append(Violation(importer, node.lineno, nxt, why))
                break
            module = nxt
    return found
