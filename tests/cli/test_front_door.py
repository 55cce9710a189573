"""What a newcomer meets first: pipes closed early, piped listings, check's help and progress."""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys

import pytest

from hybridkv.cli.main import build_parser, main
from hybridkv.cli.progress_line import ProgressLine
from spec.presets import PRESETS

# Every kind of command: tables (rich), JSON, listings, argparse's own help and version.
CLOSED_EARLY = [
    ["plan", "--preset", "qwen3.5-27b", "--json"],
    ["plan", "--preset", "qwen3.5-27b"],
    ["plan", "--list-presets"],
    ["plan", "--list-presets", "--json"],
    ["check", "--requests", "1", "--depth", "3"],
    ["check", "--requests", "1", "--depth", "3", "--json"],
    ["simulate", "--preset", "gemma-3-1b", "--requests", "1", "--json"],
    ["simulate", "--preset", "gemma-3-1b", "--requests", "1"],
    ["--help"],
    ["plan", "--help"],
    ["--version"],
]


@pytest.mark.parametrize("argv", CLOSED_EARLY, ids=" ".join)
def test_a_reader_that_closes_stdout_gets_no_traceback(argv: list[str]) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridkv", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    # Closed before the interpreter has even started: every write to stdout fails (EPIPE).
    assert proc.stdout is not None
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert err.decode() == ""
    # 0 when nothing reached the pipe (argparse drops a failed help write), else 1 (Python's
    # recipe and rich's); never a crash's code, never the "Exception ignored" exit of 120.
    assert proc.returncode in (0, 1)


def test_head_of_a_json_plan_is_clean() -> None:
    shell = f"{sys.executable} -m hybridkv plan --preset qwen3.5-27b --json | head -1"
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", shell],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.stdout == "{\n"
    assert "Traceback" not in done.stderr
    assert done.stderr == ""


def test_piped_preset_listing_keeps_whole_urls() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hybridkv", "plan", "--list-presets"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = done.stdout.splitlines()
    assert len(lines) == len(PRESETS)
    for line, preset in zip(lines, PRESETS.values(), strict=True):
        assert line.split("\t")[-1] == preset.source  # whole, not cut to a table's width
        assert line.startswith(preset.name)
    assert "…" not in done.stdout
    assert "┃" not in done.stdout  # plain text, no table drawing


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            found: argparse.ArgumentParser = action.choices[name]
            return found
    raise AssertionError(name)


def test_check_help_documents_every_option_with_its_default() -> None:
    sub = _subparser(build_parser(), "check")
    text = " ".join(sub.format_help().split())
    options = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    assert {o.dest for o in options} >= {"start", "recovery", "depth", "max_states"}
    for option in options:
        assert option.help, option.option_strings
        assert f"{option.help} (default: {option.default})" in text, option.option_strings
    for words in ("'exhaustive: yes' =", "'complete: yes' =", "Verdict: pass (exit 0)", "cut"):
        assert words in text


def test_check_output_explains_its_verdict_words(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--requests", "1", "--depth", "3"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "exhaustive: yes = every state reachable within 3 actions was checked" in out
    assert "complete: no = some states at depth 3 can still act" in out
    assert "verdict: uncovered (no invariant broke, but the labels listed as uncovered" in out
    assert main(["check", "--requests", "1", "--depth", "3", "--max-states", "10"]) == 3
    out = " ".join(capsys.readouterr().out.split())
    assert "exhaustive: no = --max-states cut the search" in out
    assert "hybridkv check: not exhaustive: the state budget (--max-states 10)" in out


# States of the state budget, depth of the bound, speed, resident memory of the memory budget.
PROGRESS = r"hybridkv check: [\d,]+/100,000 states, depth \d+/4, [\d,]+ states/s, [\d,]+/[\d,]+ MiB"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Clock:
    """Advances one second per reading: every update is due."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_progress_line_draws_on_a_terminal_and_erases_itself() -> None:
    term = _Terminal()
    with ProgressLine(term, interval=1.0, clock=_Clock()) as line:
        line.update("10 states")
        line.update("20 states")
    text = term.getvalue()
    assert text == "\r\x1b[K10 states\r\x1b[K20 states\r\x1b[K"
    assert line.drawn == 2


def test_progress_line_is_silent_off_a_terminal_and_between_intervals() -> None:
    piped = io.StringIO()
    with ProgressLine(piped, clock=_Clock()) as line:
        line.update("10 states")
    assert piped.getvalue() == ""
    assert not line.enabled
    term = _Terminal()
    with ProgressLine(term, interval=60.0, clock=_Clock()) as line:
        line.update("10 states")  # one second in, the minute is not up
    assert term.getvalue() == ""


def test_check_shows_progress_on_a_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setenv("COLUMNS", "120")  # the line is cut to the terminal's width
    clock = _Clock()
    monkeypatch.setattr("hybridkv.cli.progress_line.time.monotonic", clock)
    assert main(["check", "--requests", "1", "--depth", "4"]) == 1
    drawn = term.getvalue()
    updates = re.findall(r"\r\x1b\[K([^\r]+)", drawn)
    assert updates, drawn
    assert all(re.fullmatch(PROGRESS + r", \d+s", u) for u in updates), updates
    assert drawn.endswith("\r\x1b[K")  # erased at the end
    assert "\x1b" not in capsys.readouterr().out  # the report itself has no control codes


def test_check_progress_stays_off_stderr_when_it_is_not_a_terminal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["check", "--requests", "1", "--depth", "4"]) == 1
    assert capsys.readouterr().err == ""


def test_check_progress_flag_writes_plain_lines_off_a_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A log (stderr redirected to a file) asks for the progress with --progress: it gets one
    # plain line per update, no control codes, and stdout keeps its JSON intact.
    monkeypatch.setattr("hybridkv.cli.progress_line.time.monotonic", _Clock())
    assert main(["check", "--requests", "1", "--depth", "4", "--progress", "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["verdict"] == "uncovered"
    lines = captured.err.splitlines()
    assert lines
    assert "\x1b" not in captured.err
    assert "\r" not in captured.err
    assert all(re.fullmatch(PROGRESS + r", \d+s", line) for line in lines), lines
