"""No module of ``hybridkv/`` or ``tools/`` is over 600 lines unless the allow-list gives why.

One idea per module (/work/shared/STYLE.md's first habit) has a size a reader can hold: the
modules that grew past it (``connector/core.py`` at 794 lines) were split along their ideas.
``tests/module_sizes.txt`` names each module still over the limit with its reason; an entry
whose module is back under the limit, or gone, fails too, so the list never outlives its
reasons.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 600
ALLOW_LIST = ROOT / "tests" / "module_sizes.txt"


def _allowed() -> dict[str, str]:
    """The allow-list: path -> reason (comments and blank lines skipped)."""
    allowed: dict[str, str] = {}
    for number, line in enumerate(ALLOW_LIST.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        path, sep, reason = line.partition("\t")
        fix = f"{ALLOW_LIST.name}:{number}: write the path, a tab, then the reason"
        assert sep, fix
        assert reason.strip(), fix
        assert path not in allowed, f"{ALLOW_LIST.name}:{number}: {path} listed twice"
        allowed[path] = reason.strip()
    return allowed


def _sizes() -> dict[str, int]:
    """Every Python module under hybridkv/ and tools/, by its path, with its line count."""
    return {
        path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
        for folder in ("hybridkv", "tools")
        for path in sorted((ROOT / folder).rglob("*.py"))
    }


def test_no_module_over_the_limit_without_its_reason() -> None:
    allowed = _allowed()
    over = {path: n for path, n in _sizes().items() if n > LIMIT and path not in allowed}
    assert not over, (
        f"over {LIMIT} lines: {over}; split each along its ideas, or add it to "
        f"tests/{ALLOW_LIST.name} with the reason it stays whole"
    )


def test_every_allow_list_entry_is_still_needed() -> None:
    sizes = _sizes()
    stale = {path: sizes.get(path) for path in _allowed() if sizes.get(path, 0) <= LIMIT}
    assert not stale, (
        f"listed in tests/{ALLOW_LIST.name} but not over {LIMIT} lines (None: gone): {stale}; "
        "remove their entries"
    )
