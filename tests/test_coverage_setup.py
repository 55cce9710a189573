"""The coverage figure covers what users run (issue 20 item 3): hybridkv/vllm/ is measured by
the sessions that run it, combined with the tests session, and the floor is on the combination.

These read noxfile.py (its literal settings, so nox need not be installed: `nox -s tests`
runs them) and pyproject.toml; the figure itself is printed by `nox -s coverage`
(docs/explanation/coverage.md).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib  # pytest itself needs tomli below 3.11

ROOT = Path(__file__).resolve().parents[1]
NOXFILE = ROOT / "noxfile.py"


def _nox_settings() -> dict[str, Any]:
    """The literal values noxfile.py assigns at its top level, by target name."""
    settings: dict[str, Any] = {}
    for node in ast.parse(NOXFILE.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            try:
                settings[ast.unparse(node.targets[0])] = ast.literal_eval(node.value)
            except ValueError:
                continue  # not a literal (a path, a call)
    return settings


def _coverage_config() -> dict[str, dict[str, object]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["coverage"]
    assert isinstance(config, dict)
    return config


def test_hybridkv_vllm_is_measured_and_the_cuda_modules_are_not() -> None:
    omit = _coverage_config()["run"]["omit"]
    assert isinstance(omit, list)
    assert not [pattern for pattern in omit if "hybridkv/vllm" in pattern]
    assert "*/hybridkv/transfer/cuda_engine.py" in omit
    assert "*/hybridkv/cuda_driver.py" in omit


def test_the_floor_is_checked_once_every_measured_session_ran() -> None:
    settings = _nox_settings()
    order = settings["nox.options.sessions"]
    # `nox` (the README's test command, .ci/run) runs its sessions in this order: the combining
    # session comes after every session it combines.
    assert order[-1] == "coverage"
    measured = settings["MEASURED_SESSIONS"]
    assert set(measured) >= {"tests", "vllm"}
    assert set(measured) <= set(order[:-1])
    # No session applies a floor to its own part, and each measured session measures.
    source = NOXFILE.read_text()
    assert '"--cov-fail-under=0"' in source
    for name in measured:
        after = source.split(f"def {name}(session: nox.Session)", 1)[1]
        body = after.split("\n@venv_session", 1)[0]
        assert "_cov_args(" in body, name
        assert "_coverage_file(session)" in body, name
    floor = _coverage_config()["report"]["fail_under"]
    assert isinstance(floor, float)
    assert floor > 90.0
