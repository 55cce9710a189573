"""`hybridkv check`: JSON keys, exit codes (pass, violation, uncovered, bad input), human output."""

from __future__ import annotations

import json
from typing import Any

import pytest

import hybridkv.cli.check as check_cli
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
