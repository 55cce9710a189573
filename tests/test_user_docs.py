"""The user docs read as docs, not as a lab notebook.

A user who wants today's figures opens one page per subject in docs/benchmarks, short enough
to read whole; past rounds live in docs/benchmarks/history. How-tos, tutorials and benchmark
pages speak of what the software does, never of this project's issue that changed it (the
changelog and the history pages keep those). vLLM's own tracker is cited by its five-digit
numbers (``vLLM #49829``, a field note's ``#56972``): those are references a user can follow,
and the pattern leaves them alone.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
BENCHMARKS = DOCS / "benchmarks"
HISTORY = BENCHMARKS / "history"
PAGE_LIMIT = 300  # lines of a benchmarks page
ISSUE = re.compile(r"\bissues? #?\d{1,3}\b|(?<![\w&])#\d{1,3}\b", re.IGNORECASE)


def _pages(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.md")) if folder.is_dir() else []


def _user_pages() -> list[Path]:
    pages = [*_pages(DOCS / "howto"), *_pages(DOCS / "tutorial"), *_pages(DOCS / "tutorials")]
    pages += [page for page in _pages(BENCHMARKS) if HISTORY not in page.parents]
    return pages


def test_the_user_pages_are_found() -> None:
    names = {page.relative_to(DOCS).as_posix() for page in _user_pages()}
    assert {"howto/serve.md", "benchmarks/index.md", "benchmarks/vs-native.md"} <= names


@pytest.mark.parametrize("page", _pages(BENCHMARKS), ids=lambda p: p.relative_to(DOCS).as_posix())
def test_a_benchmarks_page_reads_in_one_sitting(page: Path) -> None:
    lines = len(page.read_text().splitlines())
    assert lines <= PAGE_LIMIT, (
        f"{page.relative_to(DOCS)} has {lines} lines (limit {PAGE_LIMIT}): keep today's figures "
        "on it and move past rounds to docs/benchmarks/history, or split it by subject"
    )


@pytest.mark.parametrize("page", _user_pages(), ids=lambda p: p.relative_to(DOCS).as_posix())
def test_a_user_page_names_no_issue(page: Path) -> None:
    found = [
        f"{number}: {line.strip()}"
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if ISSUE.search(line)
    ]
    assert not found, (
        f"{page.relative_to(DOCS)} names issues (say what the software does instead; the "
        f"changelog and docs/benchmarks/history keep the issues): {found}"
    )
