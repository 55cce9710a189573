"""The default ``hybridkv simulate`` report, field for field, against a recorded one.

``golden/simulate-default.json`` is ``python -m hybridkv simulate --json`` as commit 7b38394
printed it, before the simulator's modules moved (issue 19): a move, a split or a rename
changes no count, so the report must stay the same except for its timing fields (wall-clock
seconds and the GB/s derived from them). A change that is meant to change the default run
records a new file with that command and says why in its commit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hybridkv.cli.main import main

GOLDEN = Path(__file__).parent / "golden" / "simulate-default.json"
# Wall-clock figures: the run's seconds and the bandwidth measured over them.
TIMING = {"seconds", "load_gbps", "store_gbps"}


def _without_timing(report: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in report.items() if key not in TIMING}


def test_default_report_equals_the_recorded_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert set(report) == set(golden)  # no field appeared or went away
    assert _without_timing(report) == _without_timing(golden)
