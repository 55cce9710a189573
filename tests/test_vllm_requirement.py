"""tests/vllm/conftest.py: skip without vLLM, but fail with vLLM's import error when required.

``nox -s vllm`` sets ``HYBRIDKV_REQUIRE_VLLM=1``, so a broken vLLM install there must fail the
run, showing why vLLM did not import; a bare ``pytest`` on a machine without vLLM still skips
the tests that need it. Each case runs pytest in a subprocess on one vLLM test module, with a
fake ``vllm`` package first on PYTHONPATH whose import raises a known error.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULE = ROOT / "tests" / "vllm" / "test_hashing_vs_vllm.py"
BROKEN = "fake vLLM broken on purpose by test_vllm_requirement"


@pytest.fixture(scope="module")
def broken_vllm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("broken_vllm")
    (root / "vllm").mkdir()
    (root / "vllm" / "__init__.py").write_text(f"raise ImportError({BROKEN!r})\n")
    return root


def _pytest(path_first: Path, require: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDKV_REQUIRE_VLLM"}
    env["PYTHONPATH"] = os.pathsep.join([str(path_first), *filter(None, [env.get("PYTHONPATH")])])
    if require is not None:
        env["HYBRIDKV_REQUIRE_VLLM"] = require
    return subprocess.run(
        [sys.executable, "-m", "pytest", str(MODULE), "-q", "-p", "no:cacheprovider", "-rs"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_required_vllm_that_does_not_import_fails_with_its_error(broken_vllm: Path) -> None:
    run = _pytest(broken_vllm, "1")
    out = run.stdout + run.stderr
    assert run.returncode not in (0, 5), out  # 5: no tests collected would also read as green
    assert BROKEN in out, out
    assert "HYBRIDKV_REQUIRE_VLLM=1" in out, out
    assert "passed" not in out, out
    assert "skipped" not in out, out


def test_without_the_requirement_a_broken_vllm_skips(broken_vllm: Path) -> None:
    run = _pytest(broken_vllm, None)
    out = run.stdout + run.stderr
    # The module is skipped whole at import, so pytest reports 5 (no test ran), not a failure.
    assert run.returncode == 5, out
    assert "1 skipped" in out, out
    assert "needs vLLM 0.33" in out, out


def test_requirement_is_only_the_value_one(broken_vllm: Path) -> None:
    """``HYBRIDKV_REQUIRE_VLLM=0`` is not a requirement: the suite skips as without it."""
    run = _pytest(broken_vllm, "0")
    assert run.returncode == 5, run.stdout + run.stderr
