"""The two recovery models on the same failure scenarios (tools/bench_recovery.py).

Asserted: no run breaks an invariant; vLLM 0.33's recompute discards every claimed token;
shared truncation never discards, reloads, recomputes or waits more than recompute, and
discards strictly less exactly where a prefix is salvageable and recomputes strictly less
exactly where the host lost the prefix before the retry (both flags derived by hand in the
case list). A few cells are derived by hand below; the rest are relations, not copied numbers.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

_PATH = Path(__file__).resolve().parents[2] / "tools" / "bench_recovery.py"


def _load() -> ModuleType:
    loaded = importlib.util.spec_from_file_location("bench_recovery", _PATH)
    assert loaded is not None
    assert loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    sys.modules[loaded.name] = module  # dataclasses look their module up while it loads
    loaded.loader.exec_module(module)
    return module


bench = _load()
ROWS = bench.compare()
BY_NAME = {row.case.name: row for row in ROWS}


def test_the_cases_cover_layouts_segments_and_several_requests() -> None:
    names = " / ".join(BY_NAME)
    for layout in ("full+mamba", "full+sliding8", "full+sliding4", "full+sliding8+mamba"):
        assert f"{layout}," in names
    for segment in ("segment 1 of 4", "segment 3 of 4", "segment 4 of 4"):
        assert segment in names
    assert any(len(row.case.requests) > 1 and len(row.case.fail) > 1 for row in ROWS)


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.case.name)
def test_shared_truncation_never_costs_more_and_nothing_breaks(row: object) -> None:
    case, base, rc, sh = row.case, row.baseline, row.recompute, row.shared  # type: ignore[attr-defined]
    assert base.broken == rc.broken == sh.broken == ()
    # Whole-request recompute: every claimed token is thrown away.
    assert (rc.discarded, rc.kept) == (rc.claimed, 0)
    assert sh.claimed == rc.claimed
    assert sh.discarded <= rc.discarded
    assert (sh.discarded < rc.discarded) is case.salvageable
    assert sh.reloaded <= rc.reloaded
    assert sh.recomputed <= rc.recomputed
    assert (sh.recomputed < rc.recomputed) is case.host_lost
    assert sh.steps <= rc.steps
    if case.salvageable:
        assert sh.reloaded == 0  # the kept prefix stays in place: nothing is asked again


def test_hand_derived_cells() -> None:
    # full+sliding8, third segment [4, 6) fails: segments 1-2 landed, so shared truncation
    # keeps 4 tokens. Recompute restarts at 0; the failure memory holds the keys ending at 6,
    # so the re-ask claims 4 (8 and 6 both need the key at 6) and reloads 4 tokens.
    third = BY_NAME["full+sliding8, segment 3 of 4 fails (third)"]
    assert (third.shared.kept, third.recompute.reloaded) == (4, 4)
    # Both then compute tokens 4..8 beyond the baseline (which computes [8, 9) and one decode
    # token): 4 recomputed each; recompute spends two more steps (the second load's step
    # and the step that folds its report).
    assert third.baseline.computed == 2
    assert third.shared.recomputed == third.recompute.recomputed == 4
    assert third.recompute.steps - third.shared.steps == 2
    # full+mamba, last segment (attention 6..7 and the state at 8) fails: the claim's one
    # state is at 8, so shared truncation keeps nothing either; both re-ask and reload 6
    # (the seeded state at 6 is in the host), then compute [6, 8), [8, 9), one decode token.
    last = BY_NAME["full+mamba, segment 4 of 4 fails (last, with the state)"]
    assert (last.shared.kept, last.recompute.kept) == (0, 0)
    assert last.shared.reloaded == last.recompute.reloaded == 6
    assert last.shared.computed == last.recompute.computed == 4
    # Host evicted before the retry: recompute finds nothing and computes all 8 claimed
    # tokens again; shared truncation keeps 6 and computes 2.
    lost = BY_NAME["full+sliding8, last segment fails, host evicts before the retry"]
    assert (lost.recompute.reloaded, lost.recompute.recomputed) == (0, 8)
    assert (lost.shared.kept, lost.shared.recomputed) == (6, 2)


def test_totals_favour_shared_truncation() -> None:
    t = bench.totals(ROWS)
    assert t["shared"]["discarded"] < t["recompute"]["discarded"]
    assert t["shared"]["recomputed"] < t["recompute"]["recomputed"]
    assert t["shared"]["reloaded"] < t["recompute"]["reloaded"]
    assert t["shared"]["kept"] + t["shared"]["discarded"] == t["recompute"]["claimed"]


def test_the_tool_prints_the_table_and_totals(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main([]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:2] == ["case", "claimed"]
    assert "total" in out
    assert "invariants broken in any run: none" in out
    assert bench.main(["--json"]) == 0
    assert '"totals"' in capsys.readouterr().out
