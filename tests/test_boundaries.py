"""The package boundaries of the design card, proven rather than promised.

- spec/ is standard library only: it imports with torch (and numpy, vllm, hybridkv) blocked.

The rules between packages (only hybridkv.simulator and hybridkv.cli import spec, only
hybridkv.vllm imports vllm, the layers, no import circle) are import-linter contracts in
pyproject.toml, checked by ``nox -s lint``: import-linter follows the import graph, so it also
sees a library module that reaches spec through another one, which a per-file scan cannot.
What it cannot check is here: that spec really runs on the standard library alone.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import spec.layout

# Located through a submodule: with an editable install and the bare ``pytest`` executable,
# tests/spec/ (no __init__.py) can shadow the package name as a namespace package whose
# ``__file__`` is None, while ``spec.layout`` still resolves to the real package.
SPEC_DIR = Path(spec.layout.__file__).parent


def _imported_roots(path: Path) -> set[str]:
    """Top-level package names a module imports (absolute imports; relative ones stay local)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_spec_imports_with_torch_numpy_vllm_and_hybridkv_blocked() -> None:
    blocked = ["torch", "numpy", "vllm", "hybridkv", "rich"]
    names = [m.name for m in pkgutil.walk_packages([str(SPEC_DIR)], prefix="spec.")]
    assert names, "found no spec modules to import"
    code = (
        "import sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None\n"
        "import importlib\n"
        f"for mod in {names!r}:\n"
        "    importlib.import_module(mod)\n"
        "print('ok', len(sys.modules))\n"
    )
    parent = str(SPEC_DIR.parent)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=parent, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")


def test_spec_imports_only_the_standard_library() -> None:
    stdlib = set(sys.stdlib_module_names) | {"spec", "__future__"}
    offenders = {
        str(path.relative_to(SPEC_DIR)): sorted(_imported_roots(path) - stdlib)
        for path in SPEC_DIR.rglob("*.py")
        if _imported_roots(path) - stdlib
    }
    assert offenders == {}
