"""`hybridkv check`: JSON keys, exit codes (pass, violation, uncovered, bad input), human output."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

import hybridkv.cli.check as check_cli
from hybridkv.cli.check_budget import DEFAULT_MAX_STATES, available_memory_bytes
from hybridkv.cli.main import main
from spec.system.content import Garbage
from spec.system.engine import Engine

KEYS = {
    "scenario",
    "exhaustive",
    "complete",
    "states",
    "transitions",
    "states_per_second",
    "seconds",
    "depth",
    "max_depth",
    "violations",
    "coverage",
    "uncovered",
    "verdict",
}
SMALL = ["check", "--requests", "1", "--depth", "3"]


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_shallow_search_is_uncovered_and_exits_non_zero(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, report = _json(capsys, *SMALL)
    assert code == 1
    assert set(report) >= KEYS
    assert report["verdict"] == "uncovered"
    assert report["violations"] == []
    assert report["exhaustive"] is True  # every state within 3 actions was checked
    assert report["depth"] <= 3
    # Finishing by length takes a claim step, the load's report, a prefill step and a decode
    # step: four actions, one more than the bound.
    assert "status:FINISHED_LENGTH" in report["uncovered"]
    # ...while a failed load and its recovery fit in three (step, load fails, step).
    assert report["coverage"]["recovery"]["vllm_recompute"] >= 1
    assert set(report["coverage"]) >= {"events", "statuses", "recovery", "claims"}
    assert report["coverage"]["events"]["step"] >= 1


def test_everything_covered_and_sound_exits_zero(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(check_cli, "required_labels", lambda scenario: [])
    code, report = _json(capsys, *SMALL)
    assert (code, report["verdict"], report["uncovered"]) == (0, "pass", [])


def test_a_broken_engine_is_a_violation_with_a_readable_trace(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Loads write garbage: the first forward that reads a loaded block breaks DATA-1.
    monkeypatch.setattr(Engine, "_loaded", lambda self, item: Garbage("broken load"))
    code, report = _json(capsys, "check", "--requests", "1", "--depth", "8")
    assert code == 1
    assert report["verdict"] == "violation"
    # One violation per engine that reaches it (vllm explores recompute and fail).
    found = [v for v in report["violations"] if v["invariant"] == "DATA-1"]
    assert found
    violation = found[0]
    assert violation["messages"]
    assert all(isinstance(step, str) for step in violation["trace"])
    assert "step" in violation["trace"]
    assert any(step.startswith("load job") for step in violation["trace"])


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--requests", "5"], "--requests=5"),
        (["--groups", "mamba,full"], "--groups='mamba,full'"),
        (["--groups", "full,lstm"], "--groups='full,lstm'"),
        (["--depth", "-1"], "--depth=-1"),
        (["--max-states", "0"], "--max-states=0"),
    ],
)
def test_bad_arguments_exit_2_naming_the_field(
    capsys: pytest.CaptureFixture[str], argv: list[str], field: str
) -> None:
    assert main(["check", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridkv check: error:")
    assert field in err


def test_human_output_reports_the_numbers_and_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(SMALL) == 1
    out = capsys.readouterr().out
    for phrase in ("states explored:", "states/s:", "depth reached:", "exhaustive:", "verdict:"):
        assert phrase in out
    assert "uncovered" in out


# The bound of a search: issue 20 item 5 (`--depth 1000000000` ran 30 minutes without a word
# and grew to 8 GB). Small budgets keep these fast; the defaults are checked by value.
ABSURD = ["check", "--requests", "2", "--groups", "full,mamba", "--depth", "1000000000"]


def test_an_absurd_depth_stops_at_the_state_budget_with_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*ABSURD, "--max-states", "400"]) == 3  # neither a pass (0) nor a violation (1)
    out = capsys.readouterr().out
    last = out.splitlines()[-1]
    assert last.startswith("hybridkv check: not exhaustive: the state budget (--max-states 400)")
    assert "after 400 states" in last
    assert re.search(r"every state within \d+ actions checked \(depth \d+ of 1000000000", last)
    assert last.endswith("raise --max-states to explore further")
    assert "verdict:" not in out  # the line replaces the verdict: nothing follows it


def test_json_says_the_search_was_cut_by_the_memory_budget(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Any process holds more than 1 MiB, so the first new state finds the budget spent.
    code, report = _json(capsys, *ABSURD, "--max-memory", "1")
    assert code == 3
    assert report["verdict"] == "cut"
    assert report["exhaustive"] is False
    assert report["budget"] == {"max_states": DEFAULT_MAX_STATES, "max_memory_mib": 1}
    assert report["memory_mib"] >= 1
    bound = report["bound"]
    assert (bound["cut_by"], bound["flag"]) == ("max_memory", "--max-memory")
    assert bound["checked_depth"] <= report["depth"]
    assert bound["message"].startswith(
        "hybridkv check: not exhaustive: the memory budget (--max-memory 1 MiB)"
    )
    assert f"after {report['states']:,} states" in bound["message"]


def test_json_of_a_state_cut_names_its_flag_and_what_was_checked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, report = _json(capsys, *ABSURD, "--max-states", "400")
    assert (code, report["states"], report["exhaustive"]) == (3, 400, False)
    assert report["bound"]["flag"] == "--max-states"
    assert 0 < report["bound"]["checked_depth"] <= report["depth"]


def test_the_default_budget_fits_the_machine(capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _json(capsys, *SMALL)
    assert code == 1
    assert report["bound"] is None
    assert report["budget"]["max_states"] == DEFAULT_MAX_STATES
    # Half of what the machine had available when the command started (it moves a little).
    half = available_memory_bytes() // 2 // (1 << 20)
    assert 0.8 * half <= report["budget"]["max_memory_mib"] <= 1.2 * half


@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_memory_budget_below_one_mib_is_bad_input(
    capsys: pytest.CaptureFixture[str], value: str
) -> None:
    assert main([*SMALL, "--max-memory", value]) == 2
    assert f"--max-memory={value}" in capsys.readouterr().err
