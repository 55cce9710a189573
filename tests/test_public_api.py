"""hybridkv's public API: the checked-in list of public names (docs/reference/api/public-names.txt)
against the live ``__all__``s and docs/changelog.md, and the import-linter contract that holds an
importer (``hybridkv.native``, ``examples``) to those names (tools/public_api.py and
tools/public_api_contract.py)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The packages issue 32 names as hybridkv's public API; the list may hold more.
REQUIRED = (
    "hybridkv",
    "hybridkv.planner",
    "hybridkv.hashing",
    "hybridkv.canonical",
    "hybridkv.store",
    "hybridkv.transfer",
    "hybridkv.connector",
    "hybridkv.remote",
    "hybridkv.disk",
)


def _load_public_api() -> ModuleType:
    path = ROOT / "tools" / "public_api.py"
    spec = importlib.util.spec_from_file_location("public_api", path)
    assert spec is not None, path
    assert spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules["public_api"] = module  # its dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


api = _load_public_api()
LISTED = api.read_public_names()
CHANGELOG = (ROOT / "docs" / "changelog.md").read_text(encoding="utf-8")


def _live(modules: frozenset[str]) -> frozenset[tuple[str, str]]:
    names: set[tuple[str, str]] = set()
    for module in sorted(modules):
        exported = importlib.import_module(module).__all__
        assert len(set(exported)) == len(exported), f"{module}.__all__ names something twice"
        names |= {(module, name) for name in exported}
    return frozenset(names)


def test_every_required_package_is_public() -> None:
    assert set(REQUIRED) <= LISTED.modules, sorted(set(REQUIRED) - LISTED.modules)


def test_the_list_is_the_record_of_the_live_all_and_the_changelog() -> None:
    """The guard: a name that leaves an ``__all__`` fails here until the list marks it removed
    and the changelog names it; a new one fails until it is listed."""
    modules = LISTED.modules | {module for module, _ in LISTED.removed} | set(REQUIRED)
    assert api.drift(LISTED, _live(frozenset(modules)), CHANGELOG) == []


def test_every_public_package_has_its_reference_page() -> None:
    """docs/reference/api documents each public package's whole ``__all__`` with the
    ``public-api`` directive (docs/_ext/public_api_pages.py)."""
    pages = "".join(page.read_text() for page in (ROOT / "docs/reference/api").glob("*.md"))
    assert [m for m in sorted(LISTED.modules) if f".. public-api:: {m}\n" not in pages] == []


@pytest.mark.parametrize("module", REQUIRED)
def test_every_public_name_exists(module: str) -> None:
    """``__all__`` names only what the package has (a lazily loaded name loads)."""
    package = importlib.import_module(module)
    missing = [name for name in package.__all__ if not hasattr(package, name)]
    assert missing == []


def test_the_connector_core_stays_pure_python() -> None:
    """The worker side's names load on first use: importing the package loads no torch."""
    code = "import sys; sys.modules['torch'] = None; import hybridkv.connector; print('ok')"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# --- the guard's logic, on a list of its own ------------------------------------------------------

SMALL = api.parse_public_names("a.b:X\na.b:Y\nremoved a.b:Z\n")


def test_a_name_gone_without_a_changelog_line_is_reported() -> None:
    live = frozenset({("a.b", "X")})
    problems = api.drift(SMALL, live, "`a.b.Z` was removed")
    assert problems == [
        "a.b.Y left a.b.__all__: mark its line 'removed a.b:Y' in public-names.txt and add a "
        "docs/changelog.md line naming it"
    ]


def test_a_removed_name_needs_its_changelog_line() -> None:
    live = frozenset({("a.b", "X"), ("a.b", "Y")})
    assert api.drift(SMALL, live, "`a.b.Z` was removed: use a.b.X") == []
    (problem,) = api.drift(SMALL, live, "nothing about it")
    assert problem.startswith("a.b.Z is marked removed but docs/changelog.md never names it")


def test_a_new_or_returning_name_must_be_listed() -> None:
    live = frozenset({("a.b", "X"), ("a.b", "Y"), ("a.b", "Z"), ("a.c", "W")})
    assert api.drift(SMALL, live, "`a.b.Z`") == [
        "a.b.Z is in a.b.__all__ but not listed: add 'a.b:Z' to public-names.txt (and drop its "
        "'removed' line)",
        "a.c.W is in a.c.__all__ but not listed: add 'a.c:W' to public-names.txt",
    ]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("hybridkv.store HostStore\n", "is not 'module:name'"),
        ("hybridkv.store:Host-Store\n", "is not 'module:name'"),
        ("a:X\nremoved a:X\n", "is listed twice"),
    ],
)
def test_a_malformed_list_is_refused_with_its_line(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        api.parse_public_names(text)


# --- what an importer may reach -------------------------------------------------------------------

PUBLIC = api.parse_public_names(
    "hybridkv:HybridKVConfigError\nhybridkv.store:HostStore\nhybridkv.store:LRUPolicy\n"
)
MODULES = {"hybridkv", "hybridkv.store", "hybridkv.store.manager", "hybridkv.errors"}


def _reaches(source: str, importer: str = "ext.conn", *, own: str = "ext") -> list[str]:
    found = api.check_source(
        importer,
        textwrap.dedent(source),
        is_package=False,
        public=PUBLIC,
        own=own,
        is_module=MODULES.__contains__,
    )
    return [f"{v.line} {v.imported}" for v in found]


def test_public_names_pass() -> None:
    assert (
        _reaches(
            """
            import hybridkv
            import hybridkv.store
            import hybridkv.store as hs
            from hybridkv import HybridKVConfigError, store
            from hybridkv.store import HostStore, LRUPolicy
            hybridkv.store.HostStore(4).snapshot()
            hs.LRUPolicy()
            store.HostStore
            hybridkv.HybridKVConfigError
            """
        )
        == []
    )


def test_a_private_module_or_name_is_reported_with_its_line() -> None:
    assert _reaches(
        """
        from hybridkv.store.manager import HostStore
        import hybridkv.store.manager
        from hybridkv.store import manager, _helper, ARCPolicy
        from hybridkv import errors
        from hybridkv.store import *
        import hybridkv
        hybridkv.store.manager.HostStore
        hybridkv.store.Hidden
        """
    ) == [
        "2 hybridkv.store.manager",
        "3 hybridkv.store.manager",
        "4 hybridkv.store.ARCPolicy",
        "4 hybridkv.store._helper",
        "4 hybridkv.store.manager",
        "5 hybridkv.errors",
        "6 hybridkv.store.*",
        "8 hybridkv.store.manager",
        "9 hybridkv.store.Hidden",
    ]


def test_the_importers_own_package_and_other_roots_are_not_governed() -> None:
    source = """
        from . import sibling
        from .helpers import thing
        import vllm.config
        import hybridkv.native.tier
        hybridkv.native.tier.run()
        """
    assert _reaches(source, "hybridkv.native.plug", own="hybridkv.native") == []


# --- the contract through lint-imports ------------------------------------------------------------

CONFIG = """
[tool.importlinter]
root_packages = ["hybridkv", "probe_importer"]
include_external_packages = true
contract_types = ["public_api: tools.public_api_contract.PublicApiContract"]

[[tool.importlinter.contracts]]
name = "probe_importer imports hybridkv's public names only"
type = "public_api"
importers = ["probe_importer", "not_written_yet"]
public_names = "{names}"
"""


def _lint(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    package = tmp_path / "probe_importer"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "conn.py").write_text(textwrap.dedent(body))
    config = tmp_path / "importlinter.toml"
    config.write_text(CONFIG.format(names=api.PUBLIC_NAMES.as_posix()))
    code = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-c", code, "--config", str(config), "--no-cache"],
        capture_output=True,
        text=True,
        cwd=ROOT,  # lint-imports puts its directory on sys.path: `tools` imports from there
        env=env,
        check=False,
    )


def test_lint_imports_keeps_the_contract_for_public_imports(tmp_path: Path) -> None:
    pytest.importorskip("importlinter", reason="import-linter runs the contract (the test extra)")
    result = _lint(tmp_path, "from hybridkv.store import HostStore\nimport hybridkv.remote\n")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout
    assert "not_written_yet is not in the import graph" in result.stdout


def test_lint_imports_breaks_the_contract_on_a_private_module(tmp_path: Path) -> None:
    pytest.importorskip("importlinter", reason="import-linter runs the contract (the test extra)")
    result = _lint(tmp_path, "x = 1\nfrom hybridkv.store.manager import HostStore\n")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "0 kept, 1 broken" in result.stdout
    assert "probe_importer.conn -> hybridkv.store.manager (l.2)" in result.stdout
